/**
 * Web pages against the real `kvl serve` (server/guard.ts), as issue 27 found the hole: the server
 * started without --api-key on 127.0.0.1 (the documented default), pages in headless Chromium —
 * Debian's chromium through playwright-core, as test/web-chat.test.ts — and curl.
 *
 *   - a page on another origin: its no-cors POSTs (JSON sent as text/plain to
 *     /v1/chat/completions and /api/generate) are refused with 403 and generate nothing;
 *   - DNS rebinding: a name that resolves to the server (Chromium's --host-resolver-rules) sends
 *     that name as Host; the server refuses it, so the page cannot read the API;
 *   - a page on an origin listed with --allow-origin: its preflighted JSON POST gets the reply;
 *   - the server's own page still works;
 *   - curl: a forged Host or a foreign Origin is 403; without Origin, `-d` (curl's form content
 *     type) to /api/generate still generates.
 */
import { execFile } from "node:child_process";
import { existsSync } from "node:fs";
import { type Server, createServer } from "node:http";
import type { AddressInfo } from "node:net";

import { type Browser, chromium } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { nativeBuilt } from "./helpers.js";
import { type LiveServer, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const MODEL = "kimi-vl-a3b-instruct-q8";
/** Where Debian's chromium package puts the browser (KVL_CHROMIUM overrides it). */
const CHROMIUM = process.env.KVL_CHROMIUM ?? "/usr/bin/chromium";
/** A name the browser resolves to 127.0.0.1, as a rebinding attacker's DNS would. */
const REBOUND = "rebound.example";

let tmp: { dir: string; cleanup: () => void };
let browser: Browser;
let server: LiveServer;
/** Two other sites: one listed with --allow-origin, one not. */
let allowedSite: Server;
let otherSite: Server;

/** A site that serves one blank page, on 127.0.0.1 (another port: another origin). */
async function site(): Promise<Server> {
  const s = createServer((_req, res) => {
    res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    res.end("<!doctype html><title>another site</title><p>another site</p>");
  });
  await new Promise<void>((resolve) => s.listen(0, "127.0.0.1", resolve));
  return s;
}

const siteUrl = (s: Server): string => `http://127.0.0.1:${(s.address() as AddressInfo).port}`;

/** curl ARGS: its exit status, and the body and status code it printed. */
function curl(args: string[]): Promise<{ code: number; body: string }> {
  return new Promise((resolve, reject) => {
    execFile("curl", ["-s", "-S", "-w", "\n%{http_code}", ...args], { timeout: 60_000 }, (err, stdout, stderr) => {
      if (err) {
        reject(new Error(`curl ${args.join(" ")} failed: ${stderr || err.message}`));
        return;
      }
      const at = stdout.lastIndexOf("\n");
      resolve({ code: Number(stdout.slice(at + 1)), body: stdout.slice(0, at) });
    });
  });
}

beforeAll(async () => {
  if (!existsSync(CHROMIUM)) {
    throw new Error(`no Chromium at ${CHROMIUM}: install Debian's chromium (apt-get install chromium) or set KVL_CHROMIUM`);
  }
  tmp = tempDir("origins");
  const { pack } = await tinyPack(tmp.dir, 0);
  allowedSite = await site();
  otherSite = await site();
  server = await startServer(pack, ["--max-context", "2048", "--allow-origin", siteUrl(allowedSite)],
    { KVL_BACKEND: nativeBuilt ? "native" : "wasm" });
  // --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
  browser = await chromium.launch({
    executablePath: CHROMIUM, headless: true, args: ["--no-sandbox", `--host-resolver-rules=MAP ${REBOUND} 127.0.0.1`],
  });
}, 300_000);

afterAll(async () => {
  await browser?.close();
  expect(await server?.stop()).toBe(0);
  allowedSite?.close();
  otherSite?.close();
  tmp?.cleanup();
});

const chatBody = (maxTokens: number): string => JSON.stringify({ model: MODEL, max_tokens: maxTokens, messages: [{ role: "user", content: "Tell me a story." }] });

describe("kvl serve without --api-key, and web pages of other sites", () => {
  it("says on its startup line which web pages it allows", () => {
    expect(server.log()).toContain(`web pages of ${siteUrl(allowedSite)} allowed`);
  });

  it("a page on another origin cannot make it generate: its no-cors POSTs are refused with 403", async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${siteUrl(otherSite)}/`);
      const before = server.log().length;
      const opaque = await page.evaluate(async ({ kvl, chat, generate }) => {
        const statuses: number[] = [];
        // what the issue saw: JSON sent as text/plain (no-cors cannot send application/json)
        statuses.push((await fetch(`${kvl}/v1/chat/completions`, { method: "POST", mode: "no-cors", body: chat })).status);
        statuses.push((await fetch(`${kvl}/api/generate`, { method: "POST", mode: "no-cors", headers: { "content-type": "text/plain" }, body: generate })).status);
        return statuses;
      }, { kvl: server.url, chat: chatBody(50), generate: JSON.stringify({ model: MODEL, prompt: "Tell me a story.", stream: false, options: { num_predict: 50 } }) });
      expect(opaque).toEqual([0, 0]); // no-cors: the page never sees the answer, whatever it was
      const refused = (path: string): RegExp => new RegExp(`POST ${path} 403 .*requests from web pages at ${siteUrl(otherSite)} are refused.*--allow-origin`);
      await expect.poll(() => server.log().slice(before), { timeout: 20_000 }).toMatch(refused("/v1/chat/completions"));
      await expect.poll(() => server.log().slice(before), { timeout: 20_000 }).toMatch(refused("/api/generate"));
      expect(server.log().slice(before)).not.toMatch(/ 200 prompt=\d/); // nothing generated
    } finally {
      await page.close();
    }
  });

  it("DNS rebinding: a page whose name resolves to the server is refused by its Host, so it reads nothing", async () => {
    const page = await browser.newPage();
    try {
      const rebound = server.url.replace("127.0.0.1", REBOUND);
      const response = await page.goto(`${rebound}/`);
      expect(response!.status()).toBe(403);
      // the page's own origin is now rebound.example: same-origin reads are allowed by the browser, not by the server
      const read = await page.evaluate(async () => {
        const r = await fetch("/v1/models");
        return { status: r.status, body: await r.text() };
      });
      expect(read.status).toBe(403);
      expect(read.body).not.toContain(MODEL);
      expect(JSON.parse(read.body).error.message).toContain(`--allow-host ${REBOUND}`);
    } finally {
      await page.close();
    }
  });

  it("a page on an origin listed with --allow-origin gets its preflighted JSON request answered", async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${siteUrl(allowedSite)}/`);
      const before = server.log().length;
      const answer = await page.evaluate(async ({ kvl, chat }) => {
        const r = await fetch(`${kvl}/v1/chat/completions`, { method: "POST", headers: { "content-type": "application/json" }, body: chat });
        return { status: r.status, json: await r.json() };
      }, { kvl: server.url, chat: chatBody(3) });
      expect(answer.status).toBe(200);
      expect(answer.json.object).toBe("chat.completion");
      expect(answer.json.usage.completion_tokens).toBeGreaterThanOrEqual(1);
      expect(answer.json.usage.completion_tokens).toBeLessThanOrEqual(3);
      await expect.poll(() => server.log().slice(before), { timeout: 20_000 }).toMatch(/POST \/v1\/chat\/completions 200 /);
    } finally {
      await page.close();
    }
  });

  it("the server's own page still loads and uses the API", async () => {
    const page = await browser.newPage();
    try {
      await page.goto(`${server.url}/`);
      await expect.poll(() => page.locator("#status").getAttribute("data-state")).toBe("ready"); // no key: it never asks
      const answer = await page.evaluate(async (chat) => {
        const r = await fetch("/v1/chat/completions", { method: "POST", headers: { "content-type": "application/json" }, body: chat });
        return { status: r.status, json: await r.json() };
      }, chatBody(2));
      expect(answer.status).toBe(200);
      expect(answer.json.choices[0].message.role).toBe("assistant");
    } finally {
      await page.close();
    }
  });

  it("curl: a forged Host or a foreign Origin is 403; without Origin, -d (a form content type) to /api/generate works", async () => {
    const forged = await curl(["-H", "Host: evil.example", `${server.url}/v1/models`]);
    expect(forged.code).toBe(403);
    expect(JSON.parse(forged.body).error.message).toContain("--allow-host evil.example");
    const forgedOllama = await curl(["-H", "Host: evil.example:8000", "-d", JSON.stringify({ model: MODEL, prompt: "hi", stream: false }), `${server.url}/api/generate`]);
    expect(forgedOllama.code).toBe(403);
    expect(typeof JSON.parse(forgedOllama.body).error).toBe("string");
    const foreign = await curl(["-H", "Origin: http://evil.example", "-d", chatBody(2), `${server.url}/v1/chat/completions`]);
    expect(foreign.code).toBe(403);
    expect(JSON.parse(foreign.body).error.code).toBe("forbidden");
    // what every Ollama client and script does: no Origin; curl -d says application/x-www-form-urlencoded
    const generated = await curl(["-d", JSON.stringify({ model: MODEL, prompt: "hi", stream: false, options: { num_predict: 2 } }), `${server.url}/api/generate`]);
    expect(generated.code).toBe(200);
    const reply = JSON.parse(generated.body);
    expect(reply.done).toBe(true);
    expect(reply.eval_count).toBeGreaterThanOrEqual(1);
    expect(reply.eval_count).toBeLessThanOrEqual(2);
    const preflight = await curl(["-X", "OPTIONS", "-D", "-", "-o", "/dev/null", "-H", `Origin: ${siteUrl(allowedSite)}`,
      "-H", "Access-Control-Request-Method: POST", "-H", "Access-Control-Request-Headers: content-type", `${server.url}/v1/chat/completions`]);
    expect(preflight.code).toBe(204);
    expect(preflight.body.toLowerCase()).toContain(`access-control-allow-origin: ${siteUrl(allowedSite)}`);
    expect(preflight.body.toLowerCase()).toContain("access-control-allow-headers: content-type");
  });
});
