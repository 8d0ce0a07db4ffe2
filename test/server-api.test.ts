/**
 * `kvl serve` end to end (port of tests/test_server_live.py, plus Ollama): the real server — the
 * compiled CLI in a child process on 127.0.0.1, port 0 — over the real engine on a tiny
 * synthesized pack, driven by the official `openai` and `@anthropic-ai/sdk` clients and raw fetch
 * (SSE and NDJSON parsed here).
 *
 *   - on both backends (native and WebAssembly): models, text and images, streamed and not, in
 *     all three APIs; KV prefix reuse reported as cached tokens; count_tokens; greedy replies equal
 *     to `kvl chat --json --temperature 0` on the same prompt;
 *   - on one backend (native where built): keys, multi-turn reuse, the exact Anthropic event
 *     order, bad input of every kind (a 4xx in the API's shape, the server still serving), a full
 *     queue (429 + Retry-After), clients that disconnect (their generation is cancelled, the next
 *     request is normal), SIGTERM with an open stream, and 20 concurrent clients x 5 requests.
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";

import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";
import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";
import { nativeBuilt } from "./helpers.js";
import { KVL, type LiveServer, childEnv, runKvl, startServer as startLive } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const MODEL = "kimi-vl-a3b-instruct-q8";
const KEY = "live-test-key";
const CTX = 8192;
/** max_tokens of requests meant to still be running when their client leaves. */
const SLOW = 8000;

let tmp: { dir: string; cleanup: () => void };
let pack: string;

beforeAll(async () => {
  tmp = tempDir("serve");
  ({ pack } = await tinyPack(tmp.dir, 0));
}, 300_000);

afterAll(() => tmp?.cleanup());

// -- the server process ---------------------------------------------------------------------

/** The real server on the tiny pack (its clients send the --api-key given in args). */
function startServer(args: string[], env: Record<string, string>): Promise<LiveServer> {
  return startLive(pack, args, env);
}

// -- inputs ---------------------------------------------------------------------------------

/** A PNG with a pattern (so different seeds are different images), made by sharp. */
async function png(width = 56, height = 56, seed = 0): Promise<Buffer> {
  const data = Buffer.alloc(width * height * 3);
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      const i = (y * width + x) * 3;
      data[i] = (x * 7 + seed) % 256;
      data[i + 1] = (y * 5) % 256;
      data[i + 2] = (x * y + seed) % 256;
    }
  }
  return sharp(data, { raw: { width, height, channels: 3 } }).png().toBuffer();
}

const b64 = (data: Uint8Array): string => Buffer.from(data).toString("base64");
const dataUrl = (data: Uint8Array): string => `data:image/png;base64,${b64(data)}`;

/** `kvl chat PROMPT --json --temperature 0` on the same pack and backend. */
async function chatJson(prompt: string, maxNew: number, env: Record<string, string>): Promise<{ reply: string; usage: { prompt_tokens: number; completion_tokens: number } }> {
  const r = await runKvl(["chat", pack, prompt, "--json", "--temperature", "0", "--max-new", String(maxNew),
    "--max-context", String(CTX), "--threads", "1"], env);
  expect(r.status, r.stderr).toBe(0);
  return JSON.parse(r.stdout.trim().split("\n").at(-1)!);
}

/** SSE text → [event name | null, parsed data | "[DONE]"] records (comments dropped). */
function parseSse(text: string): Array<[string | null, any]> {
  const out: Array<[string | null, any]> = [];
  for (const record of text.split("\n\n")) {
    if (!record.trim()) continue;
    let name: string | null = null;
    let data: string | null = null;
    for (const line of record.split("\n")) {
      if (line.startsWith("event: ")) name = line.slice(7);
      else if (line.startsWith("data: ")) data = line.slice(6);
    }
    if (data !== null) out.push([name, data === "[DONE]" ? data : JSON.parse(data)]);
  }
  return out;
}

function parseNdjson(text: string): any[] {
  expect(text.endsWith("\n")).toBe(true);
  return text.trim().split("\n").map((line) => JSON.parse(line));
}

function logLines(server: LiveServer, what: string): string[] {
  return server.log().split("\n").filter((l) => l.includes(what));
}

/** The log line of the n-th request matching `what` (the server's stderr reaches us on its own
 * schedule, a little after the reply: wait for it). */
async function logLine(server: LiveServer, what: string, n: number): Promise<string> {
  await expect.poll(() => logLines(server, what).length, { timeout: 10_000 }).toBeGreaterThanOrEqual(n);
  return logLines(server, what)[n - 1]!;
}

// -- on both backends -------------------------------------------------------------------------

const BACKENDS = [
  ...(nativeBuilt ? [{ label: "native", env: { KVL_BACKEND: "native" } }] : []),
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
  { label: "wasm, 2 instances", env: { KVL_BACKEND: "wasm", KVL_INSTANCES: "2" } },
];

describe.each(BACKENDS)("kvl serve on $label", ({ env }) => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(["--api-key", KEY, "--max-context", String(CTX)], env);
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  it("health and models", async () => {
    expect(await (await fetch(`${server.url}/healthz`)).json()).toEqual({ status: "ready" });
    expect((await server.openai().models.list()).data.map((m) => m.id)).toEqual([MODEL]);
    const raw = await (await fetch(`${server.url}/v1/models`, { headers: { authorization: `Bearer ${KEY}` } })).json() as any;
    expect(raw.data[0].capabilities.vision).toBe(true);
    expect(raw.data[0].context_length).toBe(CTX);
    expect(server.log()).toContain(`kvl serve: ${env.KVL_BACKEND} (KVL_BACKEND), ${env.KVL_INSTANCES ?? 1} `);
  });

  it("OpenAI: streamed and not agree; a repeat reuses all but the last prompt token", async () => {
    const api = server.openai();
    const messages: OpenAI.ChatCompletionMessageParam[] = [{ role: "user", content: "Name three colours." }];
    const reply = await api.chat.completions.create({ model: MODEL, messages, max_tokens: 8, temperature: 0 });
    const choice = reply.choices[0]!;
    expect(typeof choice.message.content).toBe("string");
    expect(choice.message.role).toBe("assistant");
    expect(["stop", "length"]).toContain(choice.finish_reason);
    expect(reply.usage!.completion_tokens).toBeGreaterThanOrEqual(1);
    expect(reply.usage!.completion_tokens).toBeLessThanOrEqual(8);
    expect(reply.usage!.total_tokens).toBe(reply.usage!.prompt_tokens + reply.usage!.completion_tokens);
    const pieces: string[] = [];
    const reasons: Array<string | null> = [];
    let usage: OpenAI.CompletionUsage | null | undefined;
    const stream = await api.chat.completions.create({ model: MODEL, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } });
    for await (const chunk of stream) {
      if (chunk.choices.length) {
        pieces.push(chunk.choices[0]!.delta.content ?? "");
        reasons.push(chunk.choices[0]!.finish_reason);
      } else {
        usage = chunk.usage;
      }
    }
    expect(pieces.join("")).toBe(choice.message.content);
    expect(reasons.at(-1)).toBe(choice.finish_reason);
    expect(reasons.slice(0, -1).every((r) => r === null)).toBe(true);
    expect(usage!.completion_tokens).toBe(reply.usage!.completion_tokens);
    expect(usage!.prompt_tokens).toBe(reply.usage!.prompt_tokens);
    expect(usage!.prompt_tokens_details!.cached_tokens).toBe(usage!.prompt_tokens - 1);
  });

  it("OpenAI: an image as a data URL, encoded once and reused", async () => {
    const api = server.openai();
    const image = await png(56, 56, 3);
    const withImage: OpenAI.ChatCompletionMessageParam[] = [{ role: "user", content: [
      { type: "image_url", image_url: { url: dataUrl(image) } }, { type: "text", text: "Describe the picture." }] }];
    const plain = await api.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "Describe the picture." }], max_tokens: 3, temperature: 0 });
    const done = logLines(server, "POST /v1/chat/completions 200").length;
    const pictured = await api.chat.completions.create({ model: MODEL, messages: withImage, max_tokens: 3, temperature: 0 });
    expect(pictured.usage!.prompt_tokens).toBeGreaterThan(plain.usage!.prompt_tokens);
    expect(await logLine(server, "POST /v1/chat/completions 200", done + 1)).toContain("images=1");
    const again = await api.chat.completions.create({ model: MODEL, messages: withImage, max_tokens: 3, temperature: 0 });
    expect(again.choices[0]!.message.content).toBe(pictured.choices[0]!.message.content);
    expect(again.usage!.prompt_tokens_details!.cached_tokens).toBe(again.usage!.prompt_tokens - 1);
    expect(await logLine(server, "POST /v1/chat/completions 200", done + 2)).toContain("images=0");
  });

  it("Anthropic: streamed and not agree; count_tokens is the prompt; usage splits cached and new", async () => {
    const api = server.anthropic();
    const params = {
      model: MODEL, max_tokens: 7, temperature: 0, system: [{ type: "text" as const, text: "Be terse." }],
      messages: [{ role: "user" as const, content: "Count to five." }],
    } as Anthropic.MessageCreateParamsNonStreaming;
    const reply = await api.messages.create(params);
    expect(reply.role).toBe("assistant");
    expect(reply.content[0]!.type).toBe("text");
    expect(["end_turn", "max_tokens", "stop_sequence"]).toContain(reply.stop_reason);
    expect(reply.usage.output_tokens).toBeGreaterThanOrEqual(1);
    expect(reply.usage.output_tokens).toBeLessThanOrEqual(7);
    const stream = api.messages.stream(params);
    let text = "";
    stream.on("text", (t) => {
      text += t;
    });
    const final = await stream.finalMessage();
    expect(text).toBe((reply.content[0] as Anthropic.TextBlock).text);
    expect(final.stop_reason).toBe(reply.stop_reason);
    expect(final.usage.output_tokens).toBe(reply.usage.output_tokens);
    const counted = (await api.messages.countTokens({ model: MODEL, system: params.system!, messages: params.messages })).input_tokens;
    expect(reply.usage.input_tokens + (reply.usage.cache_read_input_tokens ?? 0)).toBe(counted);
    expect(final.usage.input_tokens + (final.usage.cache_read_input_tokens ?? 0)).toBe(counted);
    expect(final.usage.cache_read_input_tokens).toBe(counted - 1);
  });

  it("Anthropic: an image, and a second turn that reuses the first", async () => {
    const api = server.anthropic();
    const image = { type: "image" as const, source: { type: "base64" as const, media_type: "image/png" as const, data: b64(await png(84, 56, 9)) } };
    const turn: Anthropic.MessageParam[] = [{ role: "user", content: [image, { type: "text", text: "What is this?" }] }];
    const first = await api.messages.create({ model: MODEL, max_tokens: 5, messages: turn, temperature: 0 } as Anthropic.MessageCreateParamsNonStreaming);
    const firstPrompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens ?? 0);
    const counted = (await api.messages.countTokens({ model: MODEL, messages: turn })).input_tokens;
    const without = (await api.messages.countTokens({ model: MODEL, messages: [{ role: "user", content: [{ type: "text", text: "What is this?" }] }] })).input_tokens;
    expect(counted).toBe(firstPrompt);
    expect(counted).toBeGreaterThan(without);
    turn.push({ role: "assistant", content: (first.content[0] as Anthropic.TextBlock).text }, { role: "user", content: "Are you sure?" });
    const second = await api.messages.create({ model: MODEL, max_tokens: 5, messages: turn, temperature: 0 } as Anthropic.MessageCreateParamsNonStreaming);
    expect(second.usage.cache_read_input_tokens).toBeGreaterThanOrEqual(firstPrompt);
    expect(second.usage.input_tokens).toBeGreaterThan(0);
  });

  it("Ollama: /api/chat streams NDJSON, /api/generate takes images; tags, show, version", async () => {
    const chat = await fetch(`${server.url}/api/chat`, {
      method: "POST", headers: { authorization: `Bearer ${KEY}` },
      body: JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "Name three colours." }], options: { temperature: 0, num_predict: 8 } }),
    });
    expect(chat.status).toBe(200);
    expect(chat.headers.get("content-type")).toContain("application/x-ndjson");
    const lines = parseNdjson(await chat.text());
    const last = lines.at(-1);
    expect(lines.slice(0, -1).every((l) => l.done === false && l.message.role === "assistant" && l.model === MODEL)).toBe(true);
    expect(last).toMatchObject({ done: true, message: { role: "assistant", content: "" } });
    expect(["stop", "length"]).toContain(last.done_reason);
    expect(last.eval_count).toBeLessThanOrEqual(8);
    const streamed = lines.map((l) => l.message.content).join("");
    const whole = await server.post("/api/chat", { model: `${MODEL}:latest`, stream: false, messages: [{ role: "user", content: "Name three colours." }], options: { temperature: 0, num_predict: 8 } });
    expect(whole.status).toBe(200);
    expect(whole.json.message.content).toBe(streamed);
    expect(whole.json.prompt_eval_count).toBe(last.prompt_eval_count);
    const generatedBefore = logLines(server, "POST /api/generate 200").length;
    const generated = await server.post("/api/generate", { model: MODEL, prompt: "What is this?", images: [b64(await png(56, 84, 4))], stream: false, options: { num_predict: 3 } });
    expect(generated.status).toBe(200);
    expect(generated.json).toMatchObject({ model: MODEL, done: true });
    expect(typeof generated.json.response).toBe("string");
    expect(await logLine(server, "POST /api/generate 200", generatedBefore + 1)).toContain("images=1");
    const tags = await (await fetch(`${server.url}/api/tags`, { headers: { "x-api-key": KEY } })).json() as any;
    expect(tags.models.map((m: { name: string }) => m.name)).toEqual([`${MODEL}:latest`]);
    expect(tags.models[0].size).toBeGreaterThan(0);
    const show = await server.post("/api/show", { model: MODEL });
    expect(show.json.capabilities).toEqual(["completion", "vision", "tools"]);
    expect(show.json.model_info["kimi-vl.context_length"]).toBe(CTX);
    const version = await (await fetch(`${server.url}/api/version`, { headers: { "x-api-key": KEY } })).json() as any;
    expect(typeof version.version).toBe("string");
  });

  it("greedy replies equal kvl chat --json on the same prompt, in every API", async () => {
    const prompt = "Tell me about the sea, briefly.";
    const expected = await chatJson(prompt, 12, env);
    const messages = [{ role: "user" as const, content: prompt }];
    const viaOpenai = await server.openai().chat.completions.create({ model: MODEL, messages, max_tokens: 12, temperature: 0 });
    expect(viaOpenai.choices[0]!.message.content).toBe(expected.reply);
    expect(viaOpenai.usage!.prompt_tokens).toBe(expected.usage.prompt_tokens);
    expect(viaOpenai.usage!.completion_tokens).toBe(expected.usage.completion_tokens);
    const viaAnthropic = await server.anthropic().messages.create({ model: MODEL, messages, max_tokens: 12, temperature: 0 } as Anthropic.MessageCreateParamsNonStreaming);
    expect((viaAnthropic.content[0] as Anthropic.TextBlock).text).toBe(expected.reply);
    const viaOllama = await server.post("/api/chat", { model: MODEL, messages, stream: false, options: { temperature: 0, num_predict: 12 } });
    expect(viaOllama.json.message.content).toBe(expected.reply);
    expect(viaOllama.json.eval_count).toBe(expected.usage.completion_tokens);
  });
});

// -- everything else, on one backend -------------------------------------------------------------

const MAIN = BACKENDS[0]!;

describe(`kvl serve on ${MAIN.label}: keys, bad input, queueing, disconnects`, () => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(["--api-key", KEY, "--max-queue", "1", "--max-context", String(CTX)], MAIN.env);
  }, 180_000);
  afterAll(async () => {
    await server?.stop();
  });

  it("a wrong or missing key is 401 in each API's shape; /healthz needs none", async () => {
    await expect(server.openai("not-the-key").chat.completions.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "hi" }] }))
      .rejects.toBeInstanceOf(OpenAI.AuthenticationError);
    await expect(server.anthropic("not-the-key").messages.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "hi" }] }))
      .rejects.toBeInstanceOf(Anthropic.AuthenticationError);
    const missing = await server.post("/v1/messages/count_tokens", { model: MODEL, messages: [{ role: "user", content: "hi" }] }, {});
    expect(missing.status).toBe(401);
    expect(missing.json).toMatchObject({ type: "error", error: { type: "authentication_error" } });
    const ollamaMissing = await server.post("/api/chat", { model: MODEL, messages: [{ role: "user", content: "hi" }] }, { authorization: "Bearer nope" });
    expect(ollamaMissing.status).toBe(401);
    expect(typeof ollamaMissing.json.error).toBe("string");
    const tags = await fetch(`${server.url}/api/tags`);
    expect(tags.status).toBe(401);
    expect((await fetch(`${server.url}/v1/models`, { headers: { authorization: `Bearer ${KEY}` } })).status).toBe(200);
    expect((await fetch(`${server.url}/healthz`)).status).toBe(200);
  });

  it("OpenAI: a multi-turn conversation only prefills its new turn", async () => {
    const api = server.openai();
    const history: OpenAI.ChatCompletionMessageParam[] = [
      { role: "system", content: "You answer in one word." }, { role: "user", content: "What is the capital of a made-up country?" }];
    const first = await api.chat.completions.create({ model: MODEL, messages: history, max_tokens: 6, temperature: 0.7, seed: 11 });
    history.push({ role: "assistant", content: first.choices[0]!.message.content ?? "" }, { role: "user", content: "And its largest river?" });
    const second = await api.chat.completions.create({ model: MODEL, messages: history, max_tokens: 6, temperature: 0.7, seed: 11 });
    const cached = second.usage!.prompt_tokens_details!.cached_tokens!;
    expect(cached).toBeGreaterThanOrEqual(first.usage!.prompt_tokens);
    expect(cached).toBeLessThan(second.usage!.prompt_tokens);
  });

  it("Anthropic: the raw event sequence", async () => {
    const response = await fetch(`${server.url}/v1/messages`, {
      method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" },
      body: JSON.stringify({ model: MODEL, max_tokens: 5, temperature: 0, stream: true, messages: [{ role: "user", content: "Say something." }] }),
    });
    expect(response.status).toBe(200);
    expect(response.headers.get("content-type")).toMatch(/^text\/event-stream/);
    const events = parseSse(await response.text());
    for (const [name, data] of events) expect(data.type).toBe(name);
    const names = events.map(([n]) => n).join(" ");
    expect(names).toMatch(/^message_start content_block_start( ping| content_block_delta)* content_block_stop message_delta message_stop$/);
    expect(names).toContain("ping");
    const delta = events.find(([n]) => n === "message_delta")![1];
    expect(["end_turn", "max_tokens", "stop_sequence"]).toContain(delta.delta.stop_reason);
    const outputs = events.filter(([n]) => n === "content_block_delta").length;
    expect(delta.usage.output_tokens).toBeGreaterThanOrEqual(1);
    expect(delta.usage.output_tokens).toBeLessThanOrEqual(5);
    expect(outputs).toBeLessThanOrEqual(delta.usage.output_tokens);
  });

  it("count_tokens equals the prompt tokens of the same conversation in a chat", async () => {
    const image = await png(70, 42, 5);
    const counted = (await server.anthropic().messages.countTokens({
      model: MODEL, system: "Look carefully.",
      messages: [{ role: "user", content: [{ type: "text", text: "First:" }, { type: "image", source: { type: "base64", media_type: "image/png", data: b64(image) } },
        { type: "text", text: "what colour dominates?" }] }],
    })).input_tokens;
    const reply = await server.openai().chat.completions.create({
      model: MODEL, max_tokens: 2, messages: [{ role: "system", content: "Look carefully." }, { role: "user", content: [
        { type: "text", text: "First:" }, { type: "image_url", image_url: { url: dataUrl(image) } }, { type: "text", text: "what colour dominates?" }] }],
    });
    expect(reply.usage!.prompt_tokens).toBe(counted);
  });

  it("bad input gets a 4xx in the API's shape, and the server keeps serving", async () => {
    const oai = (extra: Record<string, unknown> = {}): Record<string, unknown> => ({ model: MODEL, messages: [{ role: "user", content: "hi" }], ...extra });
    const ant = (content: unknown = "hi", extra: Record<string, unknown> = {}): Record<string, unknown> =>
      ({ model: MODEL, max_tokens: 4, messages: [{ role: "user", content }], ...extra });
    const oaiImage = (url: string): Record<string, unknown> => oai({ messages: [{ role: "user", content: [{ type: "image_url", image_url: { url } }, { type: "text", text: "?" }] }] });
    const antImage = (data: string, mediaType = "image/png"): Record<string, unknown> =>
      ant([{ type: "image", source: { type: "base64", media_type: mediaType, data } }]);
    const oll = (extra: Record<string, unknown> = {}): Record<string, unknown> => ({ model: MODEL, stream: false, messages: [{ role: "user", content: "hi" }], ...extra });
    const huge = await sharp({ create: { width: 8100, height: 8000, channels: 3, background: "white" } }).png({ compressionLevel: 9 }).toBuffer();
    const truncated = (await png()).subarray(0, 60);
    const deep = (n: number): string => `${"[".repeat(n)}${"]".repeat(n)}`;
    const BAD: Array<[string, unknown, number, string]> = [
      ["/v1/chat/completions", "{not json", 400, "invalid_request_error"],
      ["/v1/messages", "[1, 2]", 400, "invalid_request_error"],
      ["/v1/messages", "", 400, "invalid_request_error"],
      ["/v1/chat/completions", { messages: [{ role: "user", content: "hi" }] }, 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: "hi" }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: [] }), 400, "invalid_request_error"],
      ["/v1/messages", ant("hi", { messages: [] }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ max_tokens: 0 }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ max_tokens: -5 }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ max_tokens: CTX * 10 }), 400, "invalid_request_error"],
      ["/v1/messages", ant("hi", { max_tokens: 10 ** 9 }), 400, "invalid_request_error"],
      ["/v1/messages", ant("hi", { max_tokens: -1 }), 400, "invalid_request_error"],
      ["/v1/messages", { model: MODEL, messages: [{ role: "user", content: "hi" }] }, 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ temperature: "warm" }), 400, "invalid_request_error"],
      ["/v1/chat/completions", `{"model": "${MODEL}", "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}`, 400, "invalid_request_error"],
      ["/v1/messages", `{"model": "${MODEL}", "max_tokens": 4, "temperature": Infinity, "messages": [{"role": "user", "content": "hi"}]}`, 400, "invalid_request_error"],
      ["/v1/chat/completions", `{"model": "${MODEL}", "temperature": 1e999, "messages": [{"role": "user", "content": "hi"}]}`, 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: [{ role: "narrator", content: "x" }] }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: [{ role: "user", content: 42 }] }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: [{ role: "user", content: [{ type: "input_audio", input_audio: { data: "AAAA", format: "wav" } }] }] }), 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ messages: [{ role: "user", content: [{ type: "file", file: { file_id: "f" } }] }] }), 400, "invalid_request_error"],
      ["/v1/messages", ant([{ type: "tool_use", id: "t1", name: "f", input: {} }]), 400, "invalid_request_error"],
      ["/v1/chat/completions", oaiImage("https://example.com/cat.png"), 400, "invalid_request_error"],
      ["/v1/chat/completions", oaiImage("data:image/png;base64,%%%notbase64"), 400, "invalid_request_error"],
      ["/v1/messages", antImage(b64(Buffer.from("just some text, not an image"))), 400, "invalid_request_error"],
      ["/v1/messages", antImage(b64(truncated)), 400, "invalid_request_error"],
      ["/v1/messages", antImage(b64(huge)), 400, "invalid_request_error"],
      ["/v1/messages/count_tokens", { model: MODEL, messages: [{ role: "user", content: [{ type: "image", source: { type: "base64", media_type: "image/png", data: b64(Buffer.from("\x89PNG\r\n\x1a\nxx", "latin1")) } }] }] }, 400, "invalid_request_error"],
      ["/v1/chat/completions", oai({ model: "gpt-4o" }), 404, "invalid_request_error"],
      ["/v1/messages", ant("hi", { model: "claude-3-5-sonnet-latest" }), 404, "not_found_error"],
      ["/v1/messages", ant("x".repeat(CTX * 8)), 400, "invalid_request_error"], // over the context
      ["/v1/chat/completions", `{"model": "${MODEL}", "messages": ${deep(100_000)}}`, 400, "invalid_request_error"],
      ["/v1/messages", `{"model": "${MODEL}", "max_tokens": 1, "metadata": ${deep(5000)}, "messages": []}`, 400, "invalid_request_error"],
      ["/api/chat", "{not json", 400, "ollama"],
      ["/api/chat", oll({ model: "llama3:8b" }), 404, "ollama"],
      ["/api/chat", oll({ messages: "hi" }), 400, "ollama"],
      ["/api/chat", oll({ options: { num_predict: CTX * 10 } }), 400, "ollama"],
      ["/api/chat", oll({ options: { temperature: "hot" } }), 400, "ollama"],
      ["/api/chat", `{"model": "${MODEL}", "messages": [], "options": {"temperature": NaN}}`, 400, "ollama"],
      ["/api/chat", oll({ messages: [{ role: "user", content: "x", images: ["!!!"] }] }), 400, "ollama"],
      ["/api/chat", oll({ messages: [{ role: "user", content: "x", images: [b64(huge)] }] }), 400, "ollama"],
      ["/api/chat", oll({ tools: [{ type: "function", function: { name: "not a name" } }] }), 400, "ollama"],
      ["/api/generate", { model: MODEL, prompt: "x", raw: true }, 400, "ollama"],
      ["/api/generate", `{"model": "${MODEL}", "prompt": ${deep(1000)}}`, 400, "ollama"],
    ];
    for (const [path, body, status, kind] of BAD) {
      const response = await server.post(path, body);
      const what = `${path} ${typeof body === "string" ? body.slice(0, 80) : JSON.stringify(body).slice(0, 200)}: ${response.text.slice(0, 300)}`;
      expect(response.status, what).toBe(status);
      if (kind === "ollama") {
        expect(typeof response.json?.error, what).toBe("string");
      } else if (path.startsWith("/v1/messages")) {
        expect(response.json, what).toMatchObject({ type: "error", error: { type: kind } });
      } else {
        expect(response.json?.error?.type, what).toBe(kind);
        expect(response.json.error.message, what).toBeTruthy();
      }
    }
    const nan = await server.post("/v1/chat/completions", `{"model": "${MODEL}", "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}`);
    expect(nan.json.error.message).toMatch(/'temperature' is NaN.*finite number/);
    expect(nan.json.error.param).toBe("temperature");
    const big = new Uint8Array((21 << 20) + 2).fill(0x20);
    big[0] = 0x7b;
    big[big.length - 1] = 0x7d;
    for (const path of ["/v1/messages", "/v1/chat/completions", "/api/chat"]) {
      const tooLarge = await server.post(path, big);
      expect(tooLarge.status, path).toBe(413);
      if (path === "/v1/messages") expect(tooLarge.json.error.type).toBe("request_too_large");
      else if (path === "/api/chat") expect(tooLarge.json.error).toMatch(/limit/);
      else expect(tooLarge.json.error.code).toBe("request_too_large");
    }
    expect(await (await fetch(`${server.url}/healthz`)).json()).toEqual({ status: "ready" });
    const reply = await server.openai().chat.completions.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "Hello again" }] });
    expect(reply.usage!.completion_tokens).toBeGreaterThanOrEqual(1);
    expect(reply.usage!.completion_tokens).toBeLessThanOrEqual(2);
    expect(server.child.exitCode).toBeNull();
  });

  it("a streamed request whose image does not decode is a 400 in the API's shape before any 200, in every API", async () => {
    const whole = await png(64, 48, 9);
    const cut = whole.subarray(0, whole.length - 40); // the header whole, the pixel data cut short
    const image = (data: Uint8Array): Record<string, unknown> => ({ type: "image", source: { type: "base64", media_type: "image/png", data: b64(data) } });
    // [path, body, the field the error names]
    const requests = (data: Uint8Array): Array<[string, unknown, string]> => [
      ["/v1/chat/completions", { model: MODEL, max_tokens: 2, stream: true,
        messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: dataUrl(data) } }, { type: "text", text: "What is this?" }] }] }, "messages[0].content[0]"],
      ["/v1/messages", { model: MODEL, max_tokens: 2, stream: true, messages: [{ role: "user", content: [image(data), { type: "text", text: "What is this?" }] }] },
        "messages[0].content[0].source.data"],
      ["/api/chat", { model: MODEL, stream: true, messages: [{ role: "user", content: "What is this?", images: [b64(data)] }], options: { num_predict: 2 } },
        "messages[0].images[0]"],
      ["/api/generate", { model: MODEL, stream: true, prompt: "What is this?", images: [b64(data)], options: { num_predict: 2 } }, "images[0]"],
    ];
    const start = server.log().length;
    for (const [path, body, field] of requests(cut)) {
      const response = await server.post(path, body);
      const what = `${path}: ${response.text.slice(0, 300)}`;
      expect(response.status, what).toBe(400);
      expect(response.headers.get("content-type"), what).toMatch(/^application\/json/);
      let message: string;
      if (path.startsWith("/api/")) {
        message = response.json.error;
      } else if (path === "/v1/messages") {
        expect(response.json, what).toMatchObject({ type: "error", error: { type: "invalid_request_error" } });
        message = response.json.error.message;
      } else {
        expect(response.json.error.type, what).toBe("invalid_request_error");
        message = response.json.error.message;
      }
      expect(message.startsWith(`${field}: image data (${cut.length} bytes) is corrupt or truncated and cannot be decoded (`), what).toBe(true);
      expect(message.endsWith("); re-export the image"), what).toBe(true);
    }
    expect(server.log().slice(start)).not.toMatch(/ 200 /);
    // the same requests with the whole image stream as usual
    for (const [path, body] of requests(whole)) {
      const response = await server.post(path, body);
      expect(response.status, `${path}: ${response.text.slice(0, 300)}`).toBe(200);
    }
  });

  it("a full queue is 429 with Retry-After; clients that leave are cancelled or skipped; the next request is normal", async () => {
    const start = server.log().length;
    const slow = { model: MODEL, max_tokens: SLOW, temperature: 0, stream: true, messages: [{ role: "user", content: "Write a very long story." }] };
    const runningAbort = new AbortController();
    const running = await fetch(`${server.url}/v1/chat/completions`, {
      method: "POST", headers: { "x-api-key": KEY }, body: JSON.stringify(slow), signal: runningAbort.signal,
    });
    expect(running.status).toBe(200);
    const reader = running.body!.getReader();
    let seen = "";
    while (!/"content":"[^"]/.test(seen.split("\n\n").slice(1).join(""))) { // a generated token: the engine is busy with it
      const { value, done } = await reader.read();
      if (done) throw new Error(`the stream ended early: ${seen}`);
      seen += Buffer.from(value).toString();
    }
    const waitingAbort = new AbortController();
    const waiting = await fetch(`${server.url}/v1/messages`, {
      method: "POST", headers: { "x-api-key": KEY }, body: JSON.stringify(slow), signal: waitingAbort.signal,
    });
    expect(waiting.status).toBe(200); // queued, its head already sent
    const waitingReader = waiting.body!.getReader();
    expect(Buffer.from((await waitingReader.read()).value!).toString()).toMatch(/^event: message_start/);
    await expect(server.openai().chat.completions.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "hi" }] }))
      .rejects.toBeInstanceOf(OpenAI.RateLimitError);
    const busy = await server.post("/v1/messages", { model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "hi" }] });
    expect(busy.status).toBe(429);
    expect(busy.json.error.type).toBe("rate_limit_error");
    expect(Number(busy.headers.get("retry-after"))).toBeGreaterThan(0);
    const ollamaBusy = await server.post("/api/chat", { model: MODEL, messages: [{ role: "user", content: "hi" }] });
    expect(ollamaBusy.status).toBe(429);
    expect(typeof ollamaBusy.json.error).toBe("string");
    waitingAbort.abort();
    runningAbort.abort();
    // both requests end on the server (the disconnects reach it asynchronously)
    await expect.poll(() => server.log().slice(start).split("\n").filter((l) => / 499 .*\(client disconnected\)$/.test(l)).length, { timeout: 20_000 }).toBe(2);
    const after = await server.openai().chat.completions.create({ model: MODEL, max_tokens: 3, messages: [{ role: "user", content: "Still there?" }] });
    expect(["stop", "length"]).toContain(after.choices[0]!.finish_reason);
    expect(after.usage!.completion_tokens).toBeGreaterThanOrEqual(1);
    expect(after.usage!.completion_tokens).toBeLessThanOrEqual(3);
    const log = server.log().slice(start);
    const cancelled = [...log.matchAll(/generation cancelled after (\d+) token/g)].map((m) => Number(m[1]));
    expect(cancelled.length, log).toBeGreaterThan(0);
    expect(Math.min(...cancelled)).toBeLessThan(SLOW);
    // both connections closed together: the waiting one was skipped, or (when the disconnect
    // reached it just after the running one ended) started and cancelled at once
    const skipped = log.includes("skipped a queued request whose client disconnected");
    expect(skipped || cancelled.length >= 2, log).toBe(true);
  });

  it("a non-streaming client that gives up cancels its generation; the next request is normal", async () => {
    const before = (server.log().match(/generation cancelled after/g) ?? []).length;
    const body = { model: MODEL, max_tokens: SLOW, temperature: 0, messages: [{ role: "user", content: "Another long story, please." }] };
    await expect(fetch(`${server.url}/v1/chat/completions`, {
      method: "POST", headers: { "x-api-key": KEY }, body: JSON.stringify(body), signal: AbortSignal.timeout(1000),
    })).rejects.toThrow();
    await expect.poll(() => (server.log().match(/generation cancelled after/g) ?? []).length, { timeout: 20_000 }).toBe(before + 1);
    const reply = await server.anthropic().messages.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "ok?" }] });
    expect(reply.usage.output_tokens).toBeGreaterThanOrEqual(1);
    expect(reply.usage.output_tokens).toBeLessThanOrEqual(2);
    expect(server.log()).toMatch(/POST \/v1\/chat\/completions 499 .*\(client disconnected\)/);
  });

  it("an Ollama client that leaves mid-stream cancels too", async () => {
    const before = (server.log().match(/generation cancelled after/g) ?? []).length;
    const abort = new AbortController();
    const response = await fetch(`${server.url}/api/generate`, {
      method: "POST", headers: { "x-api-key": KEY }, signal: abort.signal,
      body: JSON.stringify({ model: MODEL, prompt: "A long tale.", options: { num_predict: SLOW } }),
    });
    const reader = response.body!.getReader();
    const first = JSON.parse(Buffer.from((await reader.read()).value!).toString().split("\n")[0]!);
    expect(first).toMatchObject({ model: MODEL, done: false });
    abort.abort();
    await expect.poll(() => (server.log().match(/generation cancelled after/g) ?? []).length, { timeout: 10_000 }).toBe(before + 1);
    const after = await server.post("/api/generate", { model: MODEL, prompt: "hi", stream: false, options: { num_predict: 2 } });
    expect(after.status).toBe(200);
    expect(after.json.done).toBe(true);
  });
});

describe(`kvl serve on ${MAIN.label}: 20 concurrent clients x 5 requests`, () => {
  const prompts = [0, 1, 2, 3, 4].map((j) => `Question number ${j}: what is ${j} + ${j}?`);

  async function client(server: LiveServer, maxQueue: number, i: number, expected: string[] | null, statuses: number[]): Promise<string[]> {
    const replies: string[] = [];
    for (let j = 0; j < prompts.length; j++) {
      const api = i % 3 === 0 ? "anthropic" : i % 3 === 1 ? "openai" : "ollama";
      for (;;) {
        const stream = (i + j) % 2 === 0;
        const path = api === "anthropic" ? "/v1/messages" : api === "openai" ? "/v1/chat/completions" : "/api/chat";
        const body = api === "ollama"
          ? { model: MODEL, stream, messages: [{ role: "user", content: prompts[j] }], options: { temperature: 0, num_predict: 4 } }
          : { model: MODEL, max_tokens: 4, temperature: 0, stream, messages: [{ role: "user", content: prompts[j] }] };
        const r = await server.post(path, body);
        statuses.push(r.status);
        if (r.status === 429) { // only when the queue is full, or every body slot (queue + running + one being read) is held
          expect(Number(r.headers.get("retry-after"))).toBeGreaterThan(0);
          expect(r.text).toMatch(new RegExp(`${maxQueue} request\\(s\\) are already waiting|it already holds ${maxQueue + 2} requests`));
          await new Promise((res) => setTimeout(res, 50 + Math.random() * 200));
          continue;
        }
        expect(r.status, r.text).toBe(200);
        let text: string;
        if (api === "ollama") {
          text = stream ? parseNdjson(r.text).map((l) => l.message.content).join("") : r.json.message.content;
        } else if (!stream) {
          text = api === "openai" ? r.json.choices[0].message.content : r.json.content[0].text;
        } else {
          const events = parseSse(r.text);
          text = api === "openai"
            ? events.filter(([, d]) => d !== "[DONE]" && d.choices?.length).map(([, d]) => d.choices[0].delta.content ?? "").join("")
            : events.filter(([n]) => n === "content_block_delta").map(([, d]) => d.delta.text).join("");
          expect(events.at(-1)![api === "openai" ? 1 : 0]).toBe(api === "openai" ? "[DONE]" : "message_stop");
        }
        if (expected) expect(text, `client ${i} request ${j} (${api}, stream ${stream})`).toBe(expected[j]);
        replies.push(text);
        break;
      }
    }
    return replies;
  }

  it.each([
    { maxQueue: 19, label: "a queue that holds them all: no 429" },
    { maxQueue: 3, label: "a queue of 3: 429 past it, retried until done" },
  ])("$label", async ({ maxQueue }) => {
    const server = await startServer(["--api-key", KEY, "--max-queue", String(maxQueue), "--max-context", "1024"], MAIN.env);
    try {
      const expected: string[] = [];
      for (const prompt of prompts) {
        expected.push((await server.openai().chat.completions.create({ model: MODEL, max_tokens: 4, temperature: 0, messages: [{ role: "user", content: prompt }] }))
          .choices[0]!.message.content ?? "");
      }
      const statuses: number[] = [];
      const results = await Promise.all(Array.from({ length: 20 }, (_, i) => client(server, maxQueue, i, expected, statuses)));
      expect(results.flat()).toHaveLength(100);
      const ok = statuses.filter((s) => s === 200).length;
      const limited = statuses.filter((s) => s === 429).length;
      expect(ok).toBe(100);
      expect(ok + limited).toBe(statuses.length);
      if (maxQueue >= 19) expect(limited).toBe(0);
      else expect(limited).toBeGreaterThan(0);
      // one log line per request (a stream's line follows its last byte: poll)
      const logged = (status: number): number => server.log().split("\n").filter((l) => new RegExp(`^kvl serve: POST \\S+ ${status} `).test(l)).length;
      await expect.poll(() => logged(200), { timeout: 10_000 }).toBe(100 + prompts.length);
      await expect.poll(() => logged(429), { timeout: 10_000 }).toBe(limited);
      expect(server.child.exitCode).toBeNull();
    } finally {
      expect(await server.stop()).toBe(0);
    }
  }, 600_000);
});

describe(`kvl serve on ${MAIN.label}: request bodies within the RAM plan`, () => {
  const MIB = 2 ** 20;
  /** Peak resident set of a process as the OS counts it. */
  const vmHwm = (pid: number): number => Number(/VmHWM:\s+(\d+) kB/.exec(readFileSync(`/proc/${pid}/status`, "latin1"))![1]) * 1024;

  it("concurrent bodies up to the derived limit stay inside the plan; over-limit bodies get 413; the server keeps serving", async () => {
    // 600 MiB: too little for 20 MiB bodies x 4 slots next to the tiny model, so the plan derives a smaller limit
    const server = await startServer(["--api-key", KEY, "--max-queue", "2", "--max-context", "4096", "--ram-mib", "600", "--verbose"], MAIN.env);
    try {
      const log = server.log();
      const total = Number(/^total\s+([\d,.]+)\s+budget/m.exec(log)![1]!.replace(/,/g, "")) * MIB;
      const [, slotsText, limitText] = /request bodies \(raw and parsed\)\s+[\d,.]+\s+(\d+) bodies of up to ([\d,.]+) MiB/.exec(log)!;
      const slots = Number(slotsText);
      const limit = Math.floor(Number(limitText!.replace(/,/g, "")) * MIB);
      expect(slots).toBe(2 + 1 + 1); // --max-queue, the running request, one being read
      expect(total).toBeLessThanOrEqual(600 * MIB);
      expect(limit).toBeLessThan(20 * MIB); // the limit was lowered to fit, not refused
      expect(limit).toBeGreaterThanOrEqual(4 * MIB); // still room for a photo
      const pid = server.child.pid!;
      const idle = vmHwm(pid);

      const post = async (path: string, body: string): Promise<{ status: number; json: any }> => {
        const r = await fetch(`${server.url}${path}`, { method: "POST", headers: { "content-type": "application/json", "x-api-key": KEY }, body });
        const text = await r.text();
        return { status: r.status, json: JSON.parse(text) };
      };
      // a body of exactly n bytes: one long text of character ch (1, 2 or 3 UTF-8 bytes), padded with spaces
      const textBody = (n: number, ch: string): string => {
        const head = `{"model":"${MODEL}","max_tokens":1,"messages":[{"role":"user","content":"`;
        const tail = `"}]}`;
        const room = n - head.length - tail.length;
        const text = ch.repeat(Math.floor(room / Buffer.byteLength(ch)));
        return head + text + tail + " ".repeat(room - Buffer.byteLength(text));
      };
      // a real photo-sized PNG whose base64 body is just under the limit
      const side = Math.floor(Math.sqrt(((limit - 4096) * 3) / 4 / 1.8 / 1.5)); // random pixels: ~1.65 PNG bytes each
      const raw = Buffer.alloc(Math.floor(side * 1.5) * side * 3);
      for (let i = 0; i < raw.length; i++) raw[i] = ((i * 2654435761) >>> 24) ^ ((i / 3000) | 0);
      const photo = await sharp(raw, { raw: { width: Math.floor(side * 1.5), height: side, channels: 3 } }).png({ compressionLevel: 1 }).toBuffer();
      const imageBody = JSON.stringify({ model: MODEL, max_tokens: 1, messages: [{ role: "user", content: [
        { type: "image_url", image_url: { url: `data:image/png;base64,${b64(photo)}` } }, { type: "text", text: "What is this?" }] }] });
      expect(imageBody.length).toBeLessThanOrEqual(limit);
      expect(imageBody.length).toBeGreaterThan(limit / 2);

      for (let round = 0; round < 3; round++) {
        const bodies: Array<[string, string]> = [
          ["/v1/chat/completions", textBody(limit, "a")], ["/v1/messages", textBody(limit, "é")],
          ["/v1/chat/completions", imageBody], ["/v1/chat/completions", textBody(limit, "€")],
        ];
        const answers = await Promise.all(bodies.map(([path, body]) => post(path, body)));
        // text that long cannot fit the context: refused before tokenizing; the image is answered
        expect(answers.map((a) => a.status)).toEqual([400, 400, 200, 400]);
        expect(answers[0]!.json.error.message).toMatch(/at least \d+ tokens, but the context holds 4096/);
        expect(answers[2]!.json.usage.prompt_tokens).toBeGreaterThan(100);
      }
      // one byte over the limit: 413 in each API's shape, the body never parsed
      const over = textBody(limit + 1, "a");
      const oai = await post("/v1/chat/completions", over);
      expect(oai.status).toBe(413);
      expect(oai.json.error).toMatchObject({ type: "invalid_request_error", code: "request_too_large" });
      expect(oai.json.error.message).toContain(`over the ${limit}-byte limit`);
      const ant = await post("/v1/messages", over);
      expect(ant.status).toBe(413);
      expect(ant.json).toMatchObject({ type: "error", error: { type: "request_too_large" } });
      const after = await server.openai().chat.completions.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "Still there?" }] });
      expect(after.usage!.completion_tokens).toBeGreaterThanOrEqual(1);

      const peak = vmHwm(pid);
      console.log(`[serve memory] bodies of up to ${(limit / MIB).toFixed(1)} MiB x ${slots}: idle ${(idle / MIB).toFixed(0)} MiB, ` +
        `peak ${(peak / MIB).toFixed(0)} MiB, plan ${(total / MIB).toFixed(0)} MiB; growth ${((peak - idle) / (slots * limit)).toFixed(2)} x slots x limit`);
      expect(peak).toBeLessThanOrEqual(total);
      expect(server.child.exitCode).toBeNull();
    } finally {
      expect(await server.stop()).toBe(0);
    }
  }, 300_000);

  it("an explicit --max-body-mib the plan cannot hold is refused with advice that fits", async () => {
    const r = spawnSync(process.execPath, [KVL, "serve", pack, "--port", "0", "--threads", "1", "--ram-mib", "600", "--max-queue", "2",
      "--max-body-mib", "64"], { cwd: packageRoot, env: childEnv(MAIN.env), encoding: "utf8", timeout: 120_000 });
    expect(r.status).toBe(1);
    const advice = /lower --max-body-mib to (\d+)/.exec(r.stderr);
    expect(advice, r.stderr).not.toBeNull();
    const fits = await startServer(["--ram-mib", "600", "--max-queue", "2", "--max-body-mib", advice![1]!], MAIN.env);
    try {
      expect(fits.log()).toContain(`bodies up to ${advice![1]} MiB`);
    } finally {
      expect(await fits.stop()).toBe(0);
    }
  }, 300_000);
});

describe(`kvl serve on ${MAIN.label}: start and stop`, () => {
  it("SIGTERM ends an open stream with an error event and exits 0", async () => {
    const server = await startServer(["--max-context", String(CTX)], MAIN.env); // no key: every request passes
    try {
      const response = await fetch(`${server.url}/v1/messages`, {
        method: "POST", body: JSON.stringify({ model: MODEL, max_tokens: SLOW, stream: true, messages: [{ role: "user", content: "Go on and on." }] }),
      });
      const reader = response.body!.getReader();
      let text = "";
      while (!text.includes("content_block_delta")) {
        const { value, done } = await reader.read();
        if (done) throw new Error(`the stream ended before any text: ${text}`);
        text += Buffer.from(value).toString();
      }
      server.child.kill("SIGTERM");
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        text += Buffer.from(value).toString();
      }
      const events = parseSse(text);
      expect(events.at(-1)![0]).toBe("error");
      expect(events.at(-1)![1].error.type).toBe("overloaded_error");
      expect(await server.exited).toBe(0);
      expect(server.log()).toContain("generation cancelled after");
    } finally {
      if (server.child.exitCode === null) server.child.kill("SIGKILL"); // never left behind
    }
  });

  it("a pack that cannot load stops the server with status 1 and the reason", async () => {
    const r = spawnSync(process.execPath, [KVL, "serve", tmp.dir, "--port", "0"], { cwd: packageRoot, env: childEnv(MAIN.env), encoding: "utf8", timeout: 60_000 });
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/kvl serve: error: cannot load the model: /);
  });

  it("refuses bad options before binding", () => {
    const missing = spawnSync(process.execPath, [KVL, "serve", join(tmp.dir, "nope")], { cwd: packageRoot, env: childEnv(MAIN.env), encoding: "utf8" });
    expect(missing.status).toBe(1);
    expect(missing.stderr).toContain("model directory");
    const empty = spawnSync(process.execPath, [KVL, "serve", pack, "--api-key", ""], { cwd: packageRoot, env: childEnv(MAIN.env), encoding: "utf8" });
    expect(empty.status).toBe(1);
    expect(empty.stderr).toContain("--api-key must not be empty");
  });
});
