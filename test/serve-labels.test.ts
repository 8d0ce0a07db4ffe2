/**
 * What `kvl serve` says the model is: every place that names the quantisation says what the pack
 * holds. A pack made with `kvl pack --expert-dtype q4 --trunk-dtype q8` is served as
 * `kimi-vl-a3b-instruct-q4` (unless --model-id says otherwise), with Ollama's quantization_level
 * Q4_0 and kvl's own expert and trunk dtypes in /api/show; the default pack stays `-q8` / Q8_0.
 */
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { tagsBody, showBody } from "../server/ollama.js";
import { type LiveServer, runKvl, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

let tmp: { dir: string; cleanup: () => void };
let server: LiveServer;

beforeAll(async () => {
  tmp = tempDir("serve-labels");
  const { ckpt } = await tinyPack(tmp.dir, 0);
  const q4 = join(tmp.dir, "pack-q4");
  const packed = await runKvl(["pack", ckpt, q4, "--expert-dtype", "q4", "--trunk-dtype", "q8", "--allow-revision", "--quiet"], {});
  expect(packed.status, packed.stderr).toBe(0);
  server = await startServer(q4, [], {});
}, 300_000);

afterAll(async () => {
  await server?.stop();
  tmp?.cleanup();
});

describe("kvl serve names what a pack holds", () => {
  it("a Q4 pack: the model id, /v1/models, /api/tags and /api/show say q4, never q8", async () => {
    expect(server.log()).toContain("model ready as 'kimi-vl-a3b-instruct-q4'");
    const models = await (await fetch(`${server.url}/v1/models`)).json() as { data: Array<{ id: string }> };
    expect(models.data.map((m) => m.id)).toEqual(["kimi-vl-a3b-instruct-q4"]);
    const tags = await (await fetch(`${server.url}/api/tags`)).json() as { models: Array<{ name: string; details: { quantization_level: string } }> };
    expect(tags.models.map((m) => [m.name, m.details.quantization_level])).toEqual([["kimi-vl-a3b-instruct-q4:latest", "Q4_0"]]);
    const show = await server.post("/api/show", { model: "kimi-vl-a3b-instruct-q4" });
    expect(show.status).toBe(200);
    expect(show.json.details.quantization_level).toBe("Q4_0");
    expect(show.json.model_info).toMatchObject({ "kvl.expert_dtype": "q4", "kvl.trunk_dtype": "q8" });
    expect(JSON.stringify([models, tags, show.json])).not.toMatch(/q8_0|-q8/i);
    // the id it serves is the one it answers to
    const reply = await server.post("/v1/chat/completions", { model: "kimi-vl-a3b-instruct-q4", max_tokens: 1, messages: [{ role: "user", content: "Hi" }] });
    expect(reply.status, reply.text).toBe(200);
    expect((await server.post("/v1/chat/completions", { model: "kimi-vl-a3b-instruct-q8", max_tokens: 1, messages: [{ role: "user", content: "Hi" }] })).status).toBe(404);
  });

  it("the default pack's facts (no dtypes in its marker) stay Q8_0 with a BF16 trunk", () => {
    const facts = { modelId: "kimi-vl-a3b-instruct-q8", created: 0, maxContext: 4096, vision: true, sizeBytes: 1, digest: "d", modifiedAt: "x" };
    expect((tagsBody(facts).models as Array<{ details: { quantization_level: string } }>)[0]!.details.quantization_level).toBe("Q8_0");
    expect(showBody(facts).model_info).toMatchObject({ "kvl.expert_dtype": "q8", "kvl.trunk_dtype": "bf16" });
  });
});
