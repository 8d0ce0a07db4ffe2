/**
 * The web chat page of `kvl serve` (server/web.ts, server/web/) driven in headless Chromium —
 * Debian's chromium package through playwright-core; no browser is downloaded. The server is the
 * real `kvl serve` on a tiny synthesized pack, on both backends.
 *
 * What the page must do, each checked against what the API itself answers (the API is checked
 * against `kvl chat` and the float64 reference in test/server-api.test.ts):
 *   - ask for the API key once (a wrong key asked again, saying so; the key kept over a reload);
 *   - a text turn streamed into the page, equal to the API's greedy reply; a second turn resends
 *     the conversation and the server reports the reused prefix as cached tokens;
 *   - an image dropped on the page is sent as a data URL and answered like the API answers it;
 *   - Stop ends a long reply mid-way (the server logs the disconnect), keeps what came, and the
 *     next turn is normal;
 *   - a request the server refuses shows the server's message and gives the turn back (text and
 *     images in the composer again), losing nothing.
 * And its layout at phone (390 px) and desktop (1280 px) width, asserted by element boxes: the open
 * settings inside the window and clear of the messages and the composer, the composer's placeholder
 * whole, Escape closing the settings; screenshots of both are left in SCREENSHOTS for a person. The
 * icon: /favicon.ico and the SVG the page links.
 */
import { existsSync, mkdirSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import sharp from "sharp";
import { type Browser, type Page, type ViewportSize, chromium } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { nativeBuilt } from "./helpers.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";
import { type LiveServer, startServer } from "./support/live-server.js";

const KEY = "web-page-key";
const MODEL = "kimi-vl-a3b-instruct-q8";
const CTX = 8192;
/** Where Debian's chromium package puts the browser (KVL_CHROMIUM overrides it). */
const CHROMIUM = process.env.KVL_CHROMIUM ?? "/usr/bin/chromium";

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let browser: Browser;

beforeAll(async () => {
  if (!existsSync(CHROMIUM)) {
    throw new Error(`no Chromium at ${CHROMIUM}: install Debian's chromium (apt-get install chromium) or set KVL_CHROMIUM`);
  }
  tmp = tempDir("web");
  ({ pack } = await tinyPack(tmp.dir, 0));
  // --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
  browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: ["--no-sandbox"] });
}, 300_000);

afterAll(async () => {
  await browser?.close();
  tmp?.cleanup();
});

/** A PNG with a pattern, made by sharp. */
async function png(width: number, height: number, seed: number): Promise<Buffer> {
  const data = Buffer.alloc(width * height * 3);
  for (let i = 0; i < data.length; i++) data[i] = (i * 7 + seed * 13) % 256;
  return sharp(data, { raw: { width, height, channels: 3 } }).png().toBuffer();
}

interface ApiReply {
  reply: string;
  promptTokens: number;
}

/** The non-streamed API's answer to the same conversation with the page's parameters. */
async function apiReply(server: LiveServer, messages: unknown[], maxTokens: number): Promise<ApiReply> {
  const response = await fetch(`${server.url}/v1/chat/completions`, {
    method: "POST", headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
    body: JSON.stringify({ model: MODEL, messages, max_tokens: maxTokens, temperature: 0 }),
  });
  expect(response.status).toBe(200);
  const body = (await response.json()) as { choices: Array<{ message: { content: string } }>; usage: { prompt_tokens: number } };
  return { reply: body.choices[0]!.message.content, promptTokens: body.usage.prompt_tokens };
}

/** Request bodies the page sent to /v1/chat/completions, in order. */
function captureRequests(page: Page): any[] {
  const bodies: any[] = [];
  page.on("request", (request) => {
    if (request.method() === "POST" && request.url().endsWith("/v1/chat/completions")) bodies.push(request.postDataJSON());
  });
  return bodies;
}

async function openPage(server: LiveServer): Promise<{ page: Page; requests: any[] }> {
  const page = await browser.newPage();
  const requests = captureRequests(page);
  await page.goto(`${server.url}/`);
  return { page, requests };
}

async function enterKey(page: Page, key: string): Promise<void> {
  await page.locator("#key-dialog").waitFor({ state: "visible" });
  await page.fill("#key-input", key);
  await page.click("#key-submit");
}

/** Waits for the page to say the server is ready. */
async function ready(page: Page): Promise<void> {
  await expect.poll(() => page.locator("#status").getAttribute("data-state")).toBe("ready");
}

/** The page opened, the key given when it asks, the server ready. */
async function signedInPage(server: LiveServer): Promise<{ page: Page; requests: any[] }> {
  const opened = await openPage(server);
  await enterKey(opened.page, KEY);
  await ready(opened.page);
  return opened;
}

async function settings(page: Page, maxTokens: number, temperature: number): Promise<void> {
  await page.click("#settings-toggle");
  await page.fill("#max-tokens", String(maxTokens));
  await page.fill("#temperature", String(temperature));
  await page.click("#settings-toggle");
}

/** Sends `text` with Enter and waits for the n-th reply (1-based) to leave the streaming state. */
async function turn(page: Page, text: string, n: number): Promise<{ state: string; text: string; stats: Record<string, string> }> {
  await page.fill("#input", text);
  await page.press("#input", "Enter");
  const reply = page.locator(".msg.assistant").nth(n - 1);
  await expect.poll(() => reply.getAttribute("data-state"), { timeout: 120_000 }).not.toBe("streaming");
  const stats = await reply.locator(".stats").evaluate((el) => ({ ...(el as HTMLElement).dataset }) as Record<string, string>).catch(() => ({}));
  return { state: (await reply.getAttribute("data-state"))!, text: await reply.locator(".text").innerText(), stats };
}

async function dropFile(page: Page, bytes: Buffer, name: string, type: string): Promise<void> {
  await page.evaluate(({ b64, name, type }) => {
    const data = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const transfer = new DataTransfer();
    transfer.items.add(new File([data], name, { type }));
    for (const kind of ["dragenter", "dragover", "drop"]) {
      document.getElementById("log")!.dispatchEvent(new DragEvent(kind, { bubbles: true, cancelable: true, dataTransfer: transfer }));
    }
  }, { b64: bytes.toString("base64"), name, type });
}

const BACKENDS = [
  ...(nativeBuilt ? [{ label: "native", env: { KVL_BACKEND: "native" } }] : []),
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
];

describe.each(BACKENDS)("the web chat page on $label", ({ env }) => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(pack, ["--api-key", KEY, "--max-context", String(CTX)], env);
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  it("serves the page without a key, with its own files only, revalidated by ETag; the API still needs the key", async () => {
    const page = await fetch(`${server.url}/`);
    expect(page.status).toBe(200);
    expect(page.headers.get("content-type")).toMatch(/^text\/html/);
    expect(page.headers.get("content-security-policy")).toContain("connect-src 'self'");
    const html = await page.text();
    expect(html).toContain('<script type="module" src="/chat.js">');
    for (const [path, type] of [["/chat.js", /^text\/javascript/], ["/chat.css", /^text\/css/]] as const) {
      const asset = await fetch(`${server.url}${path}`);
      expect(asset.status).toBe(200);
      expect(asset.headers.get("content-type")).toMatch(type);
      const again = await fetch(`${server.url}${path}`, { headers: { "if-none-match": asset.headers.get("etag")! } });
      expect(again.status).toBe(304);
    }
    expect((await fetch(`${server.url}/chat.js/../../package.json`)).status).toBe(404);
    expect((await fetch(`${server.url}/v1/models`)).status).toBe(401);
  });

  it("asks for the key once: a wrong key is asked again, the right one is kept over a reload", async () => {
    const { page } = await openPage(server);
    try {
      await enterKey(page, "not-the-key");
      await expect.poll(() => page.locator("#key-error").innerText()).toMatch(/refused this key/);
      await page.fill("#key-input", KEY);
      await page.click("#key-submit");
      await ready(page);
      expect(await page.locator("#model").innerText()).toBe(MODEL);
      await page.reload();
      await ready(page);
      expect(await page.locator("#key-dialog").isVisible()).toBe(false);
    } finally {
      await page.close();
    }
  });

  it("streams a text turn equal to the API's reply; the next turn resends the conversation and reuses its prefix", async () => {
    const { page, requests } = await signedInPage(server);
    try {
      await settings(page, 24, 0);
      const first = await turn(page, "Hello, who are you?", 1);
      expect(first.state).toBe("done");
      const expected1 = await apiReply(server, [{ role: "user", content: "Hello, who are you?" }], 24);
      expect(first.text).toBe(expected1.reply);
      expect(Number(first.stats.promptTokens)).toBe(expected1.promptTokens);
      expect(Number(first.stats.completionTokens)).toBeGreaterThan(0);

      const second = await turn(page, "Say more.", 2);
      expect(second.state).toBe("done");
      const conversation = [
        { role: "user", content: "Hello, who are you?" }, { role: "assistant", content: expected1.reply }, { role: "user", content: "Say more." },
      ];
      expect(requests.at(-1).messages).toEqual(conversation);
      expect(requests.at(-1)).toMatchObject({ model: MODEL, stream: true, max_tokens: 24, temperature: 0 });
      // the server still held the first turn's tokens: at least the first prompt is reused
      expect(Number(second.stats.cachedTokens)).toBeGreaterThanOrEqual(expected1.promptTokens);
      const expected2 = await apiReply(server, conversation, 24);
      expect(second.text).toBe(expected2.reply);
      expect(Number(second.stats.promptTokens)).toBe(expected2.promptTokens);
    } finally {
      await page.close();
    }
  });

  it("sends an image dropped on the page as a data URL and shows the API's reply to it", async () => {
    const { page, requests } = await signedInPage(server);
    try {
      await settings(page, 16, 0);
      const image = await png(60, 44, 3);
      await dropFile(page, image, "pattern.png", "image/png");
      await expect.poll(() => page.locator("#attachments img").count()).toBe(1);
      const reply = await turn(page, "What is in this picture?", 1);
      expect(reply.state).toBe("done");
      const url = `data:image/png;base64,${image.toString("base64")}`;
      const content = [{ type: "text", text: "What is in this picture?" }, { type: "image_url", image_url: { url } }];
      expect(requests.at(-1).messages).toEqual([{ role: "user", content }]);
      expect(await page.locator(".msg.user img").count()).toBe(1);
      expect(await page.locator("#attachments img").count()).toBe(0);
      const expected = await apiReply(server, [{ role: "user", content }], 16);
      expect(reply.text).toBe(expected.reply);
      expect(Number(reply.stats.promptTokens)).toBe(expected.promptTokens);
    } finally {
      await page.close();
    }
  });

  it("Stop ends a long reply, keeps what came, and the next turn is normal", async () => {
    const { page, requests } = await signedInPage(server);
    try {
      await settings(page, 8000, 0);
      const before = server.log().length;
      await page.fill("#input", "Write a very long story.");
      await page.press("#input", "Enter");
      const reply = page.locator(".msg.assistant").first();
      await expect.poll(() => reply.locator(".text").innerText(), { timeout: 60_000 }).not.toBe("");
      await page.click("#stop");
      await expect.poll(() => reply.getAttribute("data-state")).toBe("stopped");
      const kept = await reply.locator(".text").innerText();
      expect(kept.length).toBeGreaterThan(0);
      await expect.poll(() => server.log().slice(before), { timeout: 20_000 }).toMatch(/POST \/v1\/chat\/completions 499 .*\(client disconnected\)/);
      expect(await page.locator("#send").isVisible()).toBe(true);

      await settings(page, 8, 0);
      const next = await turn(page, "Thanks.", 2);
      expect(next.state).toBe("done");
      // what came before Stop stays in the conversation
      expect(requests.at(-1).messages).toEqual([
        { role: "user", content: "Write a very long story." }, { role: "assistant", content: kept }, { role: "user", content: "Thanks." },
      ]);
    } finally {
      await page.close();
    }
  });

  it("shows the server's error for an image it cannot read and gives the turn back", async () => {
    const { page } = await signedInPage(server);
    try {
      await dropFile(page, Buffer.from("this is not a PNG at all"), "broken.png", "image/png");
      await expect.poll(() => page.locator("#attachments img").count()).toBe(1);
      await page.fill("#input", "Look at this.");
      await page.press("#input", "Enter");
      const reply = page.locator(".msg.assistant").first();
      await expect.poll(() => reply.getAttribute("data-state"), { timeout: 60_000 }).toBe("error");
      expect(await reply.locator("[role=alert]").innerText()).toMatch(/image.*\(HTTP 400\)/s);
      // nothing lost: the text and the image are back in the composer, no user bubble remains
      expect(await page.inputValue("#input")).toBe("Look at this.");
      expect(await page.locator("#attachments img").count()).toBe(1);
      expect(await page.locator(".msg.user").count()).toBe(0);
    } finally {
      await page.close();
    }
  });
});

/** Where the layout tests leave their screenshots, for a person to look at (the tests assert
 * element boxes, never pixels); kept after the run, overwritten by the next one. */
const SCREENSHOTS = join(tmpdir(), "kvl-web-screenshots");


interface Box { x: number; y: number; width: number; height: number }

function intersects(a: Box, b: Box): boolean {
  return a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
}

async function box(page: Page, selector: string): Promise<Box> {
  const found = await page.locator(selector).boundingBox();
  if (!found) throw new Error(`${selector} is not visible`);
  return found;
}

/** The composer's placeholder against the room it has: the text's width in the box's own font
 * (measured on a canvas, as the browser draws it) and the width inside the box's padding. */
async function placeholderFit(page: Page): Promise<{ placeholder: string; textWidth: number; room: number }> {
  return page.locator("#input").evaluate((el) => {
    const input = el as HTMLTextAreaElement;
    const style = getComputedStyle(input);
    const context = document.createElement("canvas").getContext("2d")!;
    context.font = style.font;
    return {
      placeholder: input.placeholder,
      textWidth: context.measureText(input.placeholder).width,
      room: input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
    };
  });
}

describe("the web chat page's layout, at phone and desktop width", () => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(pack, ["--api-key", KEY, "--max-context", String(CTX)], { KVL_BACKEND: "wasm" });
    mkdirSync(SCREENSHOTS, { recursive: true });
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  it("serves an icon: /favicon.ico and the SVG icon the page links", async () => {
    const ico = await fetch(`${server.url}/favicon.ico`);
    expect(ico.status).toBe(200);
    expect(ico.headers.get("content-type")).toMatch(/^image\//);
    const bytes = Buffer.from(await ico.arrayBuffer());
    expect([...bytes.subarray(0, 4)]).toEqual([0, 0, 1, 0]); // an ICO file's header: reserved 0, type 1 (icon)
    const html = await (await fetch(`${server.url}/`)).text();
    const href = /<link rel="icon" href="([^"]+)" type="image\/svg\+xml">/.exec(html)?.[1];
    expect(href).toBeDefined();
    const svg = await fetch(`${server.url}${href}`);
    expect(svg.status).toBe(200);
    expect(svg.headers.get("content-type")).toMatch(/^image\/svg\+xml/);
    expect(await svg.text()).toMatch(/^<svg /);
  });

  const SIZES: Array<{ label: string; viewport: ViewportSize }> = [
    { label: "phone", viewport: { width: 390, height: 844 } },
    { label: "desktop", viewport: { width: 1280, height: 800 } },
  ];

  it("at phone width a finished reply's stats line is in view above the composer, not under it", async () => {
    const viewport = { width: 390, height: 844 };
    const page = await browser.newPage({ viewport });
    try {
      await page.goto(`${server.url}/`);
      await enterKey(page, KEY);
      await ready(page);
      await settings(page, 160, 0);
      // replies long enough that the conversation scrolls (greedy: the same every run)
      await turn(page, "Tell me a long story.", 1);
      const last = await turn(page, "And another one, please.", 2);
      expect(last.state).not.toBe("error");
      const log = await box(page, "#log");
      const composer = await box(page, "#composer");
      const overflow = await page.locator("#log").evaluate((el) => el.scrollHeight - el.clientHeight);
      expect(overflow).toBeGreaterThan(0); // the case where it matters: the log scrolls
      const stats = await box(page, ".msg.assistant:last-child .stats");
      await page.screenshot({ path: join(SCREENSHOTS, "stats-phone.png") });
      expect(stats.y).toBeGreaterThanOrEqual(log.y);
      expect(stats.y + stats.height).toBeLessThanOrEqual(log.y + log.height);
      expect(intersects(stats, composer)).toBe(false);
    } finally {
      await page.close();
    }
  });

  it.each(SIZES)("at $label width ($viewport.width px) the open settings lie inside the window, beside the messages, and the placeholder is whole", async ({ label, viewport }) => {
    const page = await browser.newPage({ viewport });
    try {
      await page.goto(`${server.url}/`);
      await enterKey(page, KEY);
      await ready(page);
      await settings(page, 12, 0);
      await turn(page, "Hello, who are you?", 1);

      const fit = await placeholderFit(page);
      expect(fit.placeholder).toMatch(/^Message/);
      expect(fit.textWidth).toBeLessThanOrEqual(fit.room);

      await page.click("#settings-toggle");
      // taken before the checks, so a failing layout can be seen too
      await page.screenshot({ path: join(SCREENSHOTS, `settings-${label}.png`) });
      const panel = await box(page, "#settings");
      expect(panel.x).toBeGreaterThanOrEqual(0);
      expect(panel.x + panel.width).toBeLessThanOrEqual(viewport.width);
      expect(panel.y).toBeGreaterThanOrEqual(0);
      expect(panel.y + panel.height).toBeLessThanOrEqual(viewport.height);
      // the messages and the composer stay in view and uncovered while the settings are open
      const log = await box(page, "#log");
      const composer = await box(page, "#composer");
      expect(log.height).toBeGreaterThan(100);
      expect(intersects(panel, log)).toBe(false);
      expect(intersects(panel, composer)).toBe(false);
      // nothing is wider than the window (no sideways scrolling)
      expect(await page.evaluate(() => document.documentElement.scrollWidth)).toBeLessThanOrEqual(viewport.width);

      // the keyboard: opening moves into the panel, Escape closes it and goes back to its button
      expect(await page.getAttribute("#settings-toggle", "aria-expanded")).toBe("true");
      expect(await page.evaluate(() => document.activeElement?.id)).toBe("system");
      await page.keyboard.press("Escape");
      expect(await page.locator("#settings").isVisible()).toBe(false);
      expect(await page.getAttribute("#settings-toggle", "aria-expanded")).toBe("false");
      expect(await page.evaluate(() => document.activeElement?.id)).toBe("settings-toggle");
    } finally {
      await page.close();
    }
  });
});
