/**
 * `kvl serve` and images across requests (the compiled CLI in a child process on the tiny
 * synthesized pack, real engine) on both backends and forced splits:
 *   - a client that resends an image in a new request — after another request took the KV, in
 *     another API — is answered from the embedding cache (the request log says images=0) with the
 *     same greedy reply as the request that encoded it, in OpenAI, Anthropic and Ollama;
 *   - max_image_tokens in a request: the image is sized by the official in_token_limit rule for
 *     that budget (84x56 at 1 token = in_token_limit 4: a 2x4 grid, 2 media tokens, by hand in
 *     test/image-cache.test.ts), so the prompt is 4 tokens shorter than at the default (6 tokens),
 *     and it is other media: encoded, not taken from the cache.
 */
import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { nativeBuilt } from "./helpers.js";
import { type LiveServer, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const MODEL = "kimi-vl-a3b-instruct-q8";
const KEY = "images-test-key";

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let png: string;

beforeAll(async () => {
  tmp = tempDir("serve-images");
  ({ pack } = await tinyPack(tmp.dir, 0));
  const [width, height] = [84, 56];
  const data = Buffer.alloc(width * height * 3);
  for (let i = 0; i < data.length; i++) data[i] = (i * 37 + ((i / 3) | 0) * 11) & 0xff;
  png = (await sharp(data, { raw: { width, height, channels: 3 } }).png().toBuffer()).toString("base64");
}, 300_000);

afterAll(() => tmp?.cleanup());

const RUNS = [
  ...(nativeBuilt ? [{ label: "native", env: { KVL_BACKEND: "native" } }, { label: "native, 2 instances", env: { KVL_BACKEND: "native", KVL_INSTANCES: "2" } }] : []),
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
  { label: "wasm, 2 instances", env: { KVL_BACKEND: "wasm", KVL_INSTANCES: "2" } },
];

function logLines(server: LiveServer, what: string): string[] {
  return server.log().split("\n").filter((l) => l.includes(what));
}

/** The log line of the n-th request matching `what` (stderr arrives a little after the reply). */
async function logLine(server: LiveServer, what: string, n: number): Promise<string> {
  await expect.poll(() => logLines(server, what).length, { timeout: 10_000 }).toBeGreaterThanOrEqual(n);
  return logLines(server, what)[n - 1]!;
}

describe.each(RUNS)("kvl serve images on $label", ({ env }) => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(pack, ["--api-key", KEY, "--max-context", "1024"], env);
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  const openaiBody = (extra: Record<string, unknown> = {}): Record<string, unknown> => ({
    model: MODEL, max_tokens: 6, temperature: 0, ...extra,
    messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: `data:image/png;base64,${png}` } }, { type: "text", text: "Describe this." }] }],
  });

  it("an image resent in later requests, in every API, is not encoded again and gives the same reply", async () => {
    const first = await server.post("/v1/chat/completions", openaiBody());
    expect(first.status, first.text).toBe(200);
    expect(await logLine(server, "POST /v1/chat/completions 200", 1)).toContain("images=1");
    const text = first.json.choices[0].message.content as string;
    // another request takes the KV (nothing of the image stays there)
    expect((await server.post("/v1/messages", { model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "Hello there." }] })).status).toBe(200);
    const again = await server.post("/v1/chat/completions", openaiBody());
    expect(again.status).toBe(200);
    expect(await logLine(server, "POST /v1/chat/completions 200", 2)).toContain("images=0");
    expect(again.json.choices[0].message.content).toBe(text);
    expect(again.json.usage.prompt_tokens).toBe(first.json.usage.prompt_tokens);
    const anthropic = await server.post("/v1/messages", { model: MODEL, max_tokens: 6, temperature: 0,
      messages: [{ role: "user", content: [{ type: "image", source: { type: "base64", media_type: "image/png", data: png } }, { type: "text", text: "Describe this." }] }] });
    expect(anthropic.status, anthropic.text).toBe(200);
    expect(await logLine(server, "POST /v1/messages 200", 2)).toContain("images=0");
    expect(anthropic.json.content[0]?.text ?? "").toBe(text);
    const ollama = await server.post("/api/chat", { model: MODEL, stream: false, options: { temperature: 0, num_predict: 6 },
      messages: [{ role: "user", content: "Describe this.", images: [png] }] });
    expect(ollama.status, ollama.text).toBe(200);
    expect(await logLine(server, "POST /api/chat 200", 1)).toContain("images=0");
    expect(ollama.json.message.content).toBe(text);
  });

  it("max_image_tokens 1: the official rule's 2 media tokens instead of 6, encoded as other media", async () => {
    const before = logLines(server, "POST /v1/chat/completions 200").length;
    const full = await server.post("/v1/chat/completions", openaiBody());
    const small = await server.post("/v1/chat/completions", openaiBody({ max_image_tokens: 1 }));
    expect(small.status, small.text).toBe(200);
    expect(small.json.usage.prompt_tokens).toBe(full.json.usage.prompt_tokens - 4);
    expect(await logLine(server, "POST /v1/chat/completions 200", before + 2)).toContain("images=1");
    const bad = await server.post("/v1/chat/completions", openaiBody({ max_image_tokens: 100_000 }));
    expect(bad.status).toBe(400);
    expect(bad.json.error.param).toBe("max_image_tokens");
  });
});
