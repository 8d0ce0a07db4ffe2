/**
 * Images as `kvl chat` users see them (the compiled CLI in a child process, tiny synthesized pack)
 * on both backends and forced splits:
 *   - the embedding cache: the same image sent again (after /reset, so the KV holds nothing of
 *     it) is not encoded — the --json report says images_encoded 0 and cached — and the reply's
 *     tokens are identical to the first (encoded) turn's and to the float64 reference's;
 *   - --max-image-tokens: the grid and media tokens are the official in_token_limit rule's for the
 *     smaller limit, computed by hand below and by the independent reference preprocessing
 *     (test/reference/preprocess.ts), and the reply is the reference's over the reference's
 *     embeddings of the image so resized; a budget over the model's own is refused in one line.
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import sharp from "sharp";

import { roundToBf16 } from "../host/core/core-api.js";
import { EmbeddingCache, imageContentKey } from "../host/image/embedding-cache.js";
import { packageRoot } from "../host/system/paths.js";
import { type RgbImage, loadPreprocessorConfig, numMediaTokens, preprocess } from "./reference/preprocess.js";
import { TextReference } from "./reference/text.js";
import { VisionReference } from "./reference/vision.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");
const N_NEW = 6;
const COMMON = ["--temperature", "0", "--max-new", String(N_NEW), "--ram-mib", "1024", "--threads", "2", "--max-context", "512"];
const STOP_IDS: number[] = [];

const RUNS: Array<{ label: string; env: Record<string, string> }> = [
  { label: "native", env: { KVL_BACKEND: "native" } },
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
  { label: "native, 2 instances", env: { KVL_BACKEND: "native", KVL_INSTANCES: "2" } },
  { label: "wasm, 3 instances", env: { KVL_BACKEND: "wasm", KVL_INSTANCES: "3" } },
];

interface Reply {
  event?: string;
  prompt_token_ids: number[];
  output_token_ids: number[];
  usage: { images_encoded: number };
  images: Array<{ sha256: string; grid: number[]; media_tokens: number; in_token_limit: number; cached: boolean; encode_s: number }>;
}

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let ckpt: string;
let reference: TextReference;
let vision: VisionReference;
let image: { path: string; rgb: RgbImage };

function chat(args: string[], extra: Record<string, string>, input?: string) {
  const env = { ...process.env };
  delete env.KVL_BACKEND;
  delete env.KVL_INSTANCES;
  const r = spawnSync(process.execPath, [KVL, "chat", ...args], { encoding: "utf8", env: { ...env, ...extra }, input, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

beforeAll(async () => {
  tmp = tempDir("image-cache");
  ({ ckpt, pack } = await tinyPack(tmp.dir, 0));
  reference = TextReference.load(ckpt, { q8Experts: true });
  vision = VisionReference.load(ckpt);
  const [width, height] = [84, 56]; // 6 x 4 patches of 14
  const data = new Uint8Array(width * height * 3);
  for (let i = 0; i < data.length; i++) data[i] = (i * 37 + ((i / 3) | 0) * 11) & 0xff;
  const path = join(tmp.dir, "a.png");
  await sharp(data, { raw: { width, height, channels: 3 } }).png().toFile(path);
  image = { path, rgb: { width, height, data } };
  const goldens = JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "goldens", "tokenizer.json"), "utf8")) as { stop_ids: number[] };
  STOP_IDS.push(...goldens.stop_ids);
}, 300_000);

afterAll(() => tmp?.cleanup());

/** The reference's media rows for the image preprocessed with in_token_limit `limit` (default: the pack's). */
function referenceMedia(limit?: number): { media: Float64Array; grid: [number, number] } {
  const config = loadPreprocessorConfig(ckpt);
  const { pixelValues, grids } = preprocess([image.rgb], limit === undefined ? config : { ...config, in_token_limit: limit });
  return { media: Float64Array.from(roundToBf16(Float32Array.from(vision.encode(pixelValues, grids)))), grid: grids[0]! };
}

function referenceReply(ids: number[], media: Float64Array): number[] {
  const out = reference.greedy(ids, N_NEW, media);
  const stop = out.findIndex((t) => STOP_IDS.includes(t));
  return stop < 0 ? out : out.slice(0, stop);
}

describe("EmbeddingCache", () => {
  const rows = (n: number, v = 1): Float32Array => new Float32Array(n).fill(v);

  it("evicts the least recently used by bytes, never holds more than its capacity, and counts lookups", () => {
    const cache = new EmbeddingCache(100); // 25 floats
    cache.set("a", rows(10));
    cache.set("b", rows(10));
    expect(cache.get("a")).toBeDefined(); // a is now the most recent
    cache.set("c", rows(10)); // 120 bytes > 100: b (least recent) goes
    expect([cache.get("b"), cache.get("a") !== undefined, cache.get("c") !== undefined]).toEqual([undefined, true, true]);
    expect(cache.bytes).toBe(80);
    cache.touch("a"); // c is now the oldest
    cache.set("d", rows(6)); // 104 bytes > 100: c goes
    expect(cache.get("c")).toBeUndefined();
    expect(cache.bytes).toBe(64);
    cache.set("huge", rows(26)); // larger than the whole cache: not kept, nothing evicted for it
    expect(cache.get("huge")).toBeUndefined();
    expect(cache.size).toBe(2);
    expect(cache.counts).toEqual({ hits: 3, misses: 3 });
  });

  it("the content key is the pixels' and the grid's: equal pixels agree, another grid or one changed value does not", () => {
    const pixels = Float32Array.from({ length: 48 }, (_, i) => i / 7);
    const key = imageContentKey(pixels, [2, 2]);
    expect(imageContentKey(Float32Array.from(pixels), [2, 2])).toBe(key);
    expect(imageContentKey(pixels, [1, 4])).not.toBe(key);
    const changed = Float32Array.from(pixels);
    changed[47] = changed[47]! + 1e-6;
    expect(imageContentKey(changed, [2, 2])).not.toBe(key);
    const cache = new EmbeddingCache(1000);
    cache.rememberFile("f", 4096, key);
    expect(cache.keyOfFile("f", 4096)).toBe(key);
    expect(cache.keyOfFile("f", 1024)).toBeUndefined(); // the same file at another budget is other media
  });
});

describe("the official rule for a smaller in_token_limit, by hand", () => {
  it("84x56 with in_token_limit 4 (--max-image-tokens 1 at a 2x2 merge) is resized to 34x22, padded to 56x28: a 2x4 grid, 2 tokens", () => {
    // patches (84/14)*(56/14) = 24 > 4: scale = sqrt(4/24) = 0.4082; int(84*0.4082) = 34, int(56*0.4082) = 22;
    // padded to multiples of 28: 56 x 28 -> 4 x 2 patches (width x height), 2 x 1 merged tokens
    const config = loadPreprocessorConfig(ckpt);
    expect(config.patch_size).toBe(14);
    expect(config.merge_kernel_size).toEqual([2, 2]);
    const { grids } = preprocess([image.rgb], { ...config, in_token_limit: 4 });
    expect(grids[0]).toEqual([2, 4]);
    expect(numMediaTokens(grids[0]!, [2, 2])).toBe(2);
  });
});

describe.each(RUNS)("images in kvl chat on $label", ({ env }) => {
  it("the same image after /reset comes from the cache: nothing encoded, the same tokens as the encoded turn and the reference", () => {
    const script = `/image ${image.path}\nDescribe this.\n/reset\n/image ${image.path}\nDescribe this.\n/quit\n`;
    const r = chat([pack, "--json", ...COMMON], env, script);
    expect(r.status, r.stderr).toBe(0);
    const replies = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as Reply).filter((e) => e.event === "reply");
    expect(replies).toHaveLength(2);
    const [first, second] = replies as [Reply, Reply];
    expect(first.usage.images_encoded).toBe(1);
    expect(first.images.map((i) => [i.grid, i.media_tokens, i.cached])).toEqual([[[4, 6], 6, false]]);
    expect(first.images[0]!.encode_s).toBeGreaterThan(0);
    expect(second.usage.images_encoded).toBe(0);
    expect(second.images.map((i) => [i.grid, i.media_tokens, i.cached, i.encode_s])).toEqual([[[4, 6], 6, true, 0]]);
    expect(second.prompt_token_ids).toEqual(first.prompt_token_ids);
    expect(second.output_token_ids).toEqual(first.output_token_ids);
    expect(first.output_token_ids).toEqual(referenceReply(first.prompt_token_ids, referenceMedia().media));
  });

  it("one image twice in a message is encoded once, its second showing reported cached; the reply is the reference's", () => {
    const r = chat([pack, "Compare.", "--image", image.path, "--image", image.path, "--json", ...COMMON], env);
    expect(r.status, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    expect(report.usage.images_encoded).toBe(1);
    expect(report.images.map((i) => i.cached)).toEqual([false, true]);
    const { media } = referenceMedia();
    const both = new Float64Array(media.length * 2);
    both.set(media);
    both.set(media, media.length);
    expect(report.output_token_ids).toEqual(referenceReply(report.prompt_token_ids, both));
  });

  it("--max-image-tokens 1: the reference's grid for in_token_limit 4 and its reply over those embeddings", () => {
    const r = chat([pack, "Describe this.", "--image", image.path, "--json", "--max-image-tokens", "1", ...COMMON], env);
    expect(r.status, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    const want = referenceMedia(4);
    expect(want.grid).toEqual([2, 4]);
    expect(report.images.map((i) => [i.grid, i.media_tokens, i.in_token_limit])).toEqual([[[2, 4], 2, 4]]);
    expect(report.output_token_ids).toEqual(referenceReply(report.prompt_token_ids, want.media));
  });
});

describe("kvl chat --max-image-tokens refusals", () => {
  it("a budget over the model's own limit is one line naming the option", () => {
    const config = loadPreprocessorConfig(ckpt);
    const most = config.in_token_limit / 4;
    const r = chat([pack, "hi", "--max-image-tokens", String(most + 1), ...COMMON], { KVL_BACKEND: "native" });
    expect(r.status).not.toBe(0);
    expect(r.stderr.trim().split("\n")).toHaveLength(1);
    expect(r.stderr).toContain(`--max-image-tokens must be a whole number from 1 to ${most}`);
  });
});
