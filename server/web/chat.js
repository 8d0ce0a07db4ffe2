// chat.js — the web chat page's behaviour (served by server/web.ts; plain ES module, no build).
//
// Owns: the conversation as the page keeps it (resent whole every turn, so the server reuses its KV
// prefix and reports the reused tokens as cached), streaming a reply over the OpenAI-compatible
// /v1/chat/completions (SSE, usage in the final chunk), stop (aborting the request: the server
// cancels the generation when its client leaves), images attached by button, drop or paste (sent
// as data URLs, as any OpenAI client sends them), the API key (asked when the server answers 401,
// kept in localStorage), per-reply statistics, showing every error the server sends, the settings
// panel (opened and closed by its button or Escape, focus moved in and back), and the composer's
// placeholder (its short form when the long one does not fit the box on one line).
// Text from the model and the user goes into the page with textContent only, never as HTML.

const KEY_STORAGE = "kvl.apiKey";
const $ = (id) => document.getElementById(id);

const ui = {
  log: $("log"), hint: $("empty-hint"), status: $("status"), model: $("model"),
  form: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
  attach: $("attach"), file: $("file"), attachments: $("attachments"), overlay: $("drop-overlay"),
  newChat: $("new-chat"), settings: $("settings"), settingsToggle: $("settings-toggle"), system: $("system"), maxTokens: $("max-tokens"), temperature: $("temperature"),
  forgetKey: $("forget-key"), keyDialog: $("key-dialog"), keyForm: $("key-form"), keyInput: $("key-input"),
  keyError: $("key-error"),
};

/** @type {{role: "user" | "assistant", content: string | object[]}[]} what the next request resends */
let history = [];
/** @type {{dataUrl: string, name: string}[]} images waiting for the next message */
let pending = [];
/** @type {AbortController | null} the reply being streamed */
let running = null;
let modelId = null;

// -- the API key ----------------------------------------------------------------------------

let apiKey = localStorage.getItem(KEY_STORAGE);

/** Shows the key dialog and resolves with the key typed (the dialog cannot be dismissed empty). */
function askForKey(message) {
  ui.keyError.textContent = message;
  ui.keyInput.value = "";
  ui.keyDialog.showModal();
  return new Promise((resolve) => {
    ui.keyForm.onsubmit = (event) => {
      event.preventDefault();
      const key = ui.keyInput.value.trim();
      if (!key) return;
      ui.keyDialog.close();
      resolve(key);
    };
    ui.keyDialog.oncancel = (event) => event.preventDefault();
  });
}

/** fetch with the key; on 401 asks for a key (saying why) and tries again with it. */
async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers);
    if (apiKey) headers.set("authorization", `Bearer ${apiKey}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const reason = apiKey ? "The server refused this key: check it and try again." : "";
    const key = await askForKey(reason);
    apiKey = key;
    localStorage.setItem(KEY_STORAGE, key);
  }
}

ui.forgetKey.addEventListener("click", () => {
  localStorage.removeItem(KEY_STORAGE);
  apiKey = null;
  setStatus("idle", "API key forgotten");
});

// -- the settings panel and the composer's placeholder -------------------------------------

function showSettings(open) {
  ui.settings.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
  if (open) ui.system.focus();
}

ui.settingsToggle.addEventListener("click", () => showSettings(ui.settings.hidden));
// Escape in the panel (or on its button) closes it, and the keyboard goes back to the button
document.addEventListener("keydown", (event) => {
  if (event.key !== "Escape" || ui.settings.hidden) return;
  const focus = document.activeElement;
  if (focus !== ui.settingsToggle && !ui.settings.contains(focus)) return;
  showSettings(false);
  ui.settingsToggle.focus();
});

// The long placeholder (with the keys) where it fits on one line, the short one where it would be
// cut: measured in the box's own font, again whenever the box changes width.
const longPlaceholder = ui.input.placeholder;
const measure = document.createElement("canvas").getContext("2d");
new ResizeObserver(() => {
  const style = getComputedStyle(ui.input);
  measure.font = style.font;
  const room = ui.input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  ui.input.placeholder = measure.measureText(longPlaceholder).width <= room ? longPlaceholder : ui.input.dataset.shortPlaceholder;
}).observe(ui.input);

// -- server status --------------------------------------------------------------------------

function setStatus(state, text) {
  ui.status.dataset.state = state;
  ui.status.textContent = text;
}

/** Waits for /healthz to say ready (the model may still be loading), then names the model. */
async function connect() {
  for (;;) {
    try {
      const health = await (await fetch("/healthz")).json();
      if (health.status === "ready") break;
      if (health.status === "failed") {
        setStatus("failed", `the model failed to load: ${health.error ?? "see the server's log"}`);
        return;
      }
      setStatus("loading", "loading the model…");
    } catch {
      setStatus("error", "cannot reach the server; retrying…");
    }
    await new Promise((r) => setTimeout(r, 1500));
  }
  const response = await api("/v1/models");
  if (!response.ok) {
    setStatus("error", await errorText(response));
    return;
  }
  const models = await response.json();
  modelId = models.data?.[0]?.id ?? null;
  ui.model.textContent = modelId ?? "";
  setStatus("ready", "ready");
  ui.send.disabled = false;
}

// -- rendering ------------------------------------------------------------------------------

function scrollToEnd() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

/** A message bubble: images (if any) above its text. Returns the parts later code fills in. */
function bubble(role, text, images = []) {
  ui.hint.hidden = true;
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  if (images.length) {
    const strip = document.createElement("div");
    strip.className = "images";
    for (const image of images) {
      const img = document.createElement("img");
      img.src = image.dataUrl;
      img.alt = image.name;
      strip.append(img);
    }
    box.append(strip);
  }
  const body = document.createElement("pre");
  body.className = "text";
  body.textContent = text;
  box.append(body);
  ui.log.append(box);
  scrollToEnd();
  return { box, body };
}

function showError(box, message) {
  const line = document.createElement("div");
  line.className = "error";
  line.setAttribute("role", "alert");
  line.textContent = message;
  box.append(line);
  scrollToEnd();
}

/** One line of figures under a reply, also kept as data attributes (for scripts and tests). */
function showStats(box, s) {
  const parts = [`${s.completionTokens} tokens`];
  if (s.tokensPerSecond !== null) parts.push(`${s.tokensPerSecond.toFixed(1)} tok/s`);
  if (s.firstTokenSeconds !== null) parts.push(`first token ${s.firstTokenSeconds.toFixed(2)} s`);
  if (s.promptTokens !== null) parts.push(`prompt ${s.promptTokens} tokens, ${s.cachedTokens} cached`);
  if (s.finishReason === "length") parts.push("stopped at the token limit");
  if (s.stopped) parts.push("stopped");
  const line = document.createElement("div");
  line.className = "stats";
  line.textContent = parts.join(" · ");
  line.dataset.completionTokens = String(s.completionTokens);
  line.dataset.promptTokens = String(s.promptTokens ?? "");
  line.dataset.cachedTokens = String(s.cachedTokens ?? "");
  box.append(line);
  // the line comes after the last scroll of the reply: without this, a phone showed it half
  // hidden at the bottom of the log, under the composer's edge
  scrollToEnd();
}

/** The message of an error response in any of the server's shapes. */
async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const message = body?.error?.message ?? body?.error ?? body?.message;
    if (typeof message === "string") return `${message} (HTTP ${response.status})`;
  } catch {
    // not JSON: show the text itself
  }
  return `HTTP ${response.status}: ${text.slice(0, 500)}`;
}

// -- attachments ----------------------------------------------------------------------------

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      setStatus("error", `${file.name} is not an image (${file.type || "unknown type"}); attach PNG, JPEG, WebP or GIF`);
      continue;
    }
    pending.push({ dataUrl: await readAsDataUrl(file), name: file.name });
  }
  renderAttachments();
}

function renderAttachments() {
  ui.attachments.replaceChildren(...pending.map((image, index) => {
    const item = document.createElement("div");
    item.className = "attachment";
    const img = document.createElement("img");
    img.src = image.dataUrl;
    img.alt = image.name;
    img.title = image.name;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = `remove ${image.name}`;
    remove.addEventListener("click", () => {
      pending.splice(index, 1);
      renderAttachments();
    });
    item.append(img, remove);
    return item;
  }));
}

ui.attach.addEventListener("click", () => ui.file.click());
ui.file.addEventListener("change", () => {
  attachFiles([...ui.file.files]);
  ui.file.value = "";
});

const hasFiles = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
let dragDepth = 0;
document.addEventListener("dragenter", (event) => {
  if (!hasFiles(event)) return;
  dragDepth++;
  ui.overlay.hidden = false;
});
document.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (dragDepth === 0) ui.overlay.hidden = true;
});
document.addEventListener("dragover", (event) => {
  if (hasFiles(event)) event.preventDefault(); // lets the drop happen
});
document.addEventListener("drop", (event) => {
  event.preventDefault(); // never navigate away to the dropped file
  dragDepth = 0;
  ui.overlay.hidden = true;
  attachFiles([...(event.dataTransfer?.files ?? [])]);
});
ui.input.addEventListener("paste", (event) => {
  const files = [...(event.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
  if (files.length) {
    event.preventDefault();
    attachFiles(files);
  }
});

// -- one turn -------------------------------------------------------------------------------

/** The parameters from Settings, checked here so a typo is a message, not a 400. */
function replyParams() {
  const maxTokens = Number(ui.maxTokens.value);
  const temperature = Number(ui.temperature.value);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) throw new Error("Max new tokens must be a whole number of at least 1");
  if (!Number.isFinite(temperature) || temperature < 0) throw new Error("Temperature must be a number of at least 0");
  return { max_tokens: maxTokens, temperature };
}

function setRunning(controller) {
  running = controller;
  ui.send.hidden = controller !== null;
  ui.stop.hidden = controller === null;
  ui.newChat.disabled = controller !== null;
}

/** Reads an SSE body and calls onEvent with each data payload (parsed JSON, or "[DONE]"). */
async function readSse(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const record = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of record.split("\n")) {
        if (!line.startsWith("data: ")) continue; // comments are keep-alives
        const data = line.slice(6);
        onEvent(data === "[DONE]" ? data : JSON.parse(data));
      }
    }
  }
}

async function send() {
  const text = ui.input.value.trim();
  if (running || !modelId || (!text && pending.length === 0)) return;
  let params;
  try {
    params = replyParams();
  } catch (err) {
    setStatus("error", err.message);
    return;
  }
  const images = pending;
  const content = images.length
    ? [...(text ? [{ type: "text", text }] : []), ...images.map((image) => ({ type: "image_url", image_url: { url: image.dataUrl } }))]
    : text;
  const userTurn = { role: "user", content };
  const user = bubble("user", text, images);
  history.push(userTurn);
  ui.input.value = "";
  pending = [];
  renderAttachments();

  const reply = bubble("assistant", "");
  reply.box.dataset.state = "streaming";
  const controller = new AbortController();
  setRunning(controller);
  const system = ui.system.value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history];
  const started = performance.now();
  let firstAt = null;
  let lastAt = null;
  let deltas = 0;
  let replyText = "";
  // The reply is drawn at most once per frame, appending only what is new: setting the whole
  // text and scrolling on every delta made a fast long reply (thousands of tokens a second on
  // a small model) quadratic, and the page stopped answering clicks, Stop included.
  let drawn = 0;
  let frame = 0;
  const draw = () => {
    frame = 0;
    if (drawn === replyText.length) return;
    reply.body.append(replyText.slice(drawn));
    drawn = replyText.length;
    scrollToEnd();
  };
  let usage = null;
  let finishReason = null;
  let failure = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json" }, signal: controller.signal,
      body: JSON.stringify({ model: modelId, messages, stream: true, stream_options: { include_usage: true }, ...params }),
    });
    if (!response.ok) {
      failure = await errorText(response);
    } else {
      await readSse(response, (event) => {
        if (event === "[DONE]") return;
        if (event.error) {
          failure = event.error.message ?? JSON.stringify(event.error);
          return;
        }
        if (event.usage) usage = event.usage;
        const choice = event.choices?.[0];
        if (choice?.finish_reason) finishReason = choice.finish_reason;
        const piece = choice?.delta?.content;
        if (piece) {
          const now = performance.now();
          firstAt ??= now;
          lastAt = now;
          deltas++;
          replyText += piece;
          frame ||= requestAnimationFrame(draw);
        }
      });
    }
  } catch (err) {
    if (!controller.signal.aborted) failure = `the connection failed: ${err.message}`;
  }
  if (frame) cancelAnimationFrame(frame);
  draw(); // all of it, before the state says the reply is over
  const stopped = controller.signal.aborted;
  setRunning(null);

  if (failure && !replyText) {
    // nothing came back: take the turn back so the user can change it and send again
    history.pop();
    user.box.remove();
    reply.box.dataset.state = "error";
    reply.body.remove();
    showError(reply.box, failure);
    ui.input.value = text;
    pending = images;
    renderAttachments();
    return;
  }
  if (failure) showError(reply.box, failure);
  reply.box.dataset.state = stopped ? "stopped" : failure ? "error" : "done";
  // the reply as far as it went stays in the conversation (as `kvl chat` keeps it after Ctrl-C)
  if (replyText) history.push({ role: "assistant", content: replyText });
  const completionTokens = usage?.completion_tokens ?? deltas;
  const decodeSeconds = firstAt !== null && lastAt > firstAt ? (lastAt - firstAt) / 1000 : null;
  showStats(reply.box, {
    completionTokens,
    tokensPerSecond: decodeSeconds && completionTokens > 1 ? (completionTokens - 1) / decodeSeconds : null,
    firstTokenSeconds: firstAt !== null ? (firstAt - started) / 1000 : null,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? 0,
    finishReason,
    stopped,
  });
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => running?.abort());
ui.newChat.addEventListener("click", () => {
  if (running) return;
  history = [];
  ui.log.replaceChildren(ui.hint);
  ui.hint.hidden = false;
  ui.input.focus();
});

ui.send.disabled = true;
connect();
