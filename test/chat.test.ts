/**
 * `kvl chat` as a user runs it (the compiled CLI in a child process) on a tiny synthesized pack,
 * on both backends and on forced splits, against independent expectations:
 *   - prompt ids: the official tokenizer + template's ids for the same messages (the committed
 *     goldens of test/fixtures/goldens/tokenizer.json, made by Python from the official code);
 *   - reply ids: the float64 reference decoder's greedy continuation (test/reference/text.ts,
 *     which reads the checkpoint, never the pack or the core), cut at the first stop id;
 *   - interactive: /stats, /reset, prefix reuse across turns, a stop string, Ctrl-C stopping a
 *     reply while the chat goes on, bad images that do not end the chat;
 *   - refusals: a source checkpoint, a broken config.json, a missing image;
 *   - memory: a chat turn with an 8000x8000 PNG or a 12 MP JPEG peaks (VmHWM, as the OS counts
 *     it) within the RAM plan, whose image decode line admits it, on both backends; a budget
 *     too small for the PNG lowers the plan's image limit, the PNG is refused from its header
 *     (its size, the limit, what to do) and the chat goes on with the JPEG.
 */
import { type ChildProcessWithoutNullStreams, spawn, spawnSync } from "node:child_process";
import { cpSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import sharp from "sharp";

import { escapeControls } from "../cli/chat.js";
import { roundToBf16 } from "../host/core/core-api.js";
import { packageRoot } from "../host/system/paths.js";
import { type RgbImage, loadPreprocessorConfig, preprocess } from "./reference/preprocess.js";
import { TextReference } from "./reference/text.js";
import { VisionReference } from "./reference/vision.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const KVL = join(packageRoot, "dist", "cli", "kvl.js");
const N_NEW = 8;
const COMMON = ["--temperature", "0", "--max-new", String(N_NEW), "--ram-mib", "1024", "--threads", "2", "--max-context", "512"];

interface GoldenConversation {
  name: string;
  add_generation_prompt: boolean;
  messages: Array<{ role: string; parts: unknown[] }>;
  tokens: number[];
}
const GOLDENS = JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "goldens", "tokenizer.json"), "utf8")) as {
  conversations: GoldenConversation[];
  stop_ids: number[];
};
function golden(name: string): number[] {
  const c = GOLDENS.conversations.find((g) => g.name === name && g.add_generation_prompt);
  if (!c) throw new Error(`no golden conversation ${name}`);
  return c.tokens;
}

/** Backends and splits every engine-level test runs on. */
const RUNS: Array<{ label: string; env: Record<string, string> }> = [
  { label: "native", env: { KVL_BACKEND: "native" } },
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
  { label: "native, 2 instances", env: { KVL_BACKEND: "native", KVL_INSTANCES: "2" } },
  { label: "wasm, 3 instances", env: { KVL_BACKEND: "wasm", KVL_INSTANCES: "3" } },
];

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let ckpt: string;
let reference: TextReference;
let vision: VisionReference;
/** Two RGB images written as PNG files: A gives a 4x6 patch grid (the goldens' image-a), B 2x2. */
const images: Array<{ path: string; rgb: RgbImage }> = [];

function env(extra: Record<string, string>): NodeJS.ProcessEnv {
  const base = { ...process.env };
  delete base.KVL_BACKEND;
  delete base.KVL_INSTANCES;
  return { ...base, ...extra };
}

function chat(args: string[], extra: Record<string, string>, input?: string) {
  const r = spawnSync(process.execPath, [KVL, "chat", ...args], { encoding: "utf8", env: env(extra), input, timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** The reference's greedy continuation of ids, cut at the first stop id (which is not emitted). */
function referenceReply(ids: number[], n = N_NEW, media?: Float64Array): number[] {
  const out = reference.greedy(ids, n, media);
  const stop = out.findIndex((t) => GOLDENS.stop_ids.includes(t));
  return stop < 0 ? out : out.slice(0, stop);
}

interface Reply {
  event?: string;
  reply: string;
  finish_reason: string;
  stop_sequence: string | null;
  prompt_token_ids: number[];
  output_token_ids: number[];
  usage: { prompt_tokens: number; completion_tokens: number; reused_prompt_tokens: number; images_encoded: number };
  timings: Record<string, number>;
  cache: Record<string, number>;
  io: Record<string, unknown>;
  peak_rss_bytes: number | null;
  plan_bytes: number;
  plan_image_decode_bytes: number | null;
  plan_image_max_pixels: number | null;
}

beforeAll(async () => {
  tmp = tempDir("chat");
  ({ ckpt, pack } = await tinyPack(tmp.dir, 0));
  reference = TextReference.load(ckpt, { q8Experts: true });
  vision = VisionReference.load(ckpt);
  for (const [name, width, height] of [["a", 84, 56], ["b", 28, 28]] as const) {
    const data = new Uint8Array(width * height * 3);
    for (let i = 0; i < data.length; i++) data[i] = (i * 37 + ((i / 3) | 0) * 11 + (name === "a" ? 0 : 91)) & 0xff;
    const path = join(tmp.dir, `${name}.png`);
    await sharp(data, { raw: { width, height, channels: 3 } }).png().toFile(path);
    images.push({ path, rgb: { width, height, data } });
  }
}, 300_000);

/** The reference's media rows for these images (float64 preprocessing and encoder, rounded to
 * BF16 as the official model feeds the text decoder), concatenated in order. */
function referenceMedia(list: RgbImage[]): Float64Array {
  const { pixelValues, grids } = preprocess(list, loadPreprocessorConfig(ckpt));
  return Float64Array.from(roundToBf16(Float32Array.from(vision.encode(pixelValues, grids))));
}

afterAll(() => tmp?.cleanup());

describe.each(RUNS)("kvl chat on $label", ({ label, env: runEnv }) => {
  it("one-shot --json: the official prompt ids and the reference's greedy reply", () => {
    const r = chat([pack, "What is 2+2?", "--json", ...COMMON], runEnv);
    expect(r.stderr).toBe("");
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    const ids = golden("text");
    expect(report.prompt_token_ids).toEqual(ids);
    const want = referenceReply(ids);
    expect(report.output_token_ids).toEqual(want);
    expect(report.finish_reason).toBe(want.length < N_NEW ? "stop" : "length");
    expect(report.usage).toEqual({ prompt_tokens: ids.length, completion_tokens: want.length, reused_prompt_tokens: 0, images_encoded: 0 });
    expect(report.cache.tokens_prefilled).toBe(ids.length);
    expect(Object.keys(report.timings).sort()).toEqual(["decode_s_per_token", "first_token_s", "prefill_s", "vision_s"]);
    expect(report.io.backend).toBe(runEnv.KVL_BACKEND);
    expect(report.io.instances).toBe(Number(runEnv.KVL_INSTANCES ?? 1));
    // the RAM plan is a contract: a real chat process (VmHWM, as the OS counts it) stays inside it
    expect(report.peak_rss_bytes).toBeGreaterThan(0);
    expect(report.peak_rss_bytes!).toBeLessThanOrEqual(report.plan_bytes);
    console.log(`[chat ${label}] reply ${JSON.stringify(report.reply)} ids ${report.output_token_ids.join(" ")}`);
  });

  it.each(["i16x1", "i8"])("--act-dtype %s runs the one-term integer mode inside the RAM plan", (act) => {
    const r = chat([pack, "What is 2+2?", "--json", ...COMMON, "--act-dtype", act], runEnv);
    expect(r.stderr).toBe("");
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    expect(report.io.act_dtype).toBe(act);
    expect(report.prompt_token_ids).toEqual(golden("text"));
    expect(report.output_token_ids.length).toBeGreaterThan(0);
    expect(report.peak_rss_bytes!).toBeLessThanOrEqual(report.plan_bytes);
  });

  it("interactive --json: /stats, prefix reuse on the next turn, /reset repeats the first turn", () => {
    const script = "What is 2+2?\n/stats\nTell me more\n/reset\nWhat is 2+2?\n/quit\n";
    const r = chat([pack, "--json", ...COMMON], runEnv, script);
    expect(r.status).toBe(0);
    const events = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as Reply & { stats: Record<string, number> });
    expect(events.map((e) => e.event)).toEqual(["reply", "stats", "reply", "reset", "reply"]);
    const [first, stats, second, , third] = events as [Reply, { stats: Record<string, number> }, Reply, unknown, Reply];
    expect(first.output_token_ids).toEqual(referenceReply(golden("text")));
    expect(stats.stats.session_tokens).toBeGreaterThan(first.usage.prompt_tokens);
    expect(stats.stats.tokens_prefilled).toBe(first.usage.prompt_tokens);
    // the second turn reuses the first turn's KV and prefills only the rest
    expect(second.usage.reused_prompt_tokens).toBeGreaterThanOrEqual(first.usage.prompt_tokens);
    expect(second.cache.tokens_prefilled).toBe(second.usage.prompt_tokens - second.usage.reused_prompt_tokens);
    // ... and continues exactly as the reference does on the whole conversation
    expect(second.prompt_token_ids.slice(0, first.usage.prompt_tokens)).toEqual(first.prompt_token_ids);
    expect(second.output_token_ids).toEqual(referenceReply(second.prompt_token_ids));
    expect(third.usage.reused_prompt_tokens).toBe(0);
    expect(third.output_token_ids).toEqual(first.output_token_ids);
  });

  it("an image prompt: the official ids and the reference's greedy reply over the reference's image embeddings", () => {
    const r = chat([pack, "Describe this.", "--image", images[0]!.path, "--json", ...COMMON], runEnv);
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as Reply & { images: Array<{ grid: number[]; media_tokens: number }> };
    expect(report.prompt_token_ids).toEqual(golden("image_text"));
    expect(report.images.map((i) => [i.grid, i.media_tokens])).toEqual([[[4, 6], 6]]);
    expect(report.usage.images_encoded).toBe(1);
    expect(report.output_token_ids).toEqual(referenceReply(report.prompt_token_ids, N_NEW, referenceMedia([images[0]!.rgb])));
  });

  it("images in two turns: each encoded once, the second turn's reply is the reference's on both images", () => {
    const script = `/image ${images[0]!.path}\nDescribe this.\n/image ${images[1]!.path}\nWhat is in it?\n/quit\n`;
    const r = chat([pack, "--json", ...COMMON], runEnv, script);
    expect(r.status).toBe(0);
    const events = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as Reply);
    expect(events.map((e) => e.event)).toEqual(["image", "reply", "image", "reply"]);
    const [, first, , second] = events as [unknown, Reply, unknown, Reply];
    expect(first.usage.images_encoded).toBe(1);
    expect(second.usage.images_encoded).toBe(1); // the first image's embeddings are kept
    expect(second.usage.reused_prompt_tokens).toBeGreaterThanOrEqual(first.usage.prompt_tokens);
    const media = referenceMedia([images[0]!.rgb, images[1]!.rgb]);
    expect(second.output_token_ids).toEqual(referenceReply(second.prompt_token_ids, N_NEW, media));
  });
});

describe("kvl chat, the terminal side", () => {
  it("with no --act-dtype runs the auto mode, i16x1 on WebAssembly's simd128, and plans with it: load line, --json, plan", () => {
    const args = [pack, "What is 2+2?", "--backend", "wasm", "--temperature", "0", "--max-new", "2", "--ram-mib", "1024", "--threads", "2",
      "--max-context", "512"];
    const loud = chat([...args, "--verbose"], {});
    expect(loud.status, loud.stderr).toBe(0);
    expect(loud.stderr).toMatch(/^kvl chat: wasm \(--backend\), 1 instance, kernels simd128, Linear inputs i16x1 \(auto: [^)]+\); RAM plan /m);
    // the plan was made with the resolved mode: its KV cache is the int16 one that goes with i16x1
    expect(loud.stderr).toMatch(/^KV cache +[\d.,]+ +512 tokens, i16$/m);
    const json = (extra: string[]): Reply => JSON.parse(chat([...args, "--json", ...extra], {}).stdout) as Reply;
    const auto = json([]);
    expect(auto.io.kernels).toBe("simd128");
    expect(auto.io.act_dtype).toBe("i16x1");
    expect(auto.io.act_mode).toMatchObject({ act_dtype: "i16x1", kv_dtype: "i16", chosen_by: "auto", kernels: "simd128" });
    expect(auto.plan_bytes).toBe(json(["--act-dtype", "i16x1"]).plan_bytes);
    // a named mode wins: f32, the exact mode, in the load line, --json and the plan
    const exact = chat([...args, "--verbose", "--act-dtype", "f32"], {});
    expect(exact.stderr).toMatch(/^kvl chat: wasm \(--backend\), 1 instance, kernels simd128, Linear inputs f32 \(--act-dtype\); RAM plan /m);
    expect(exact.stderr).toMatch(/^KV cache +[\d.,]+ +512 tokens, f32$/m);
    expect(json(["--act-dtype", "f32"]).io.act_mode).toMatchObject({ act_dtype: "f32", kv_dtype: "f32", chosen_by: "option" });
  });

  it("streams the reply text, prints one load line (no plan table), and --show-tokens diagnostics", () => {
    const json = JSON.parse(chat([pack, "What is 2+2?", "--json", ...COMMON], {}).stdout) as Reply;
    const r = chat([pack, "What is 2+2?", "--show-tokens", ...COMMON], {});
    expect(r.status).toBe(0);
    expect(r.stdout).toBe(`${escapeControls(json.reply)}\n`);
    expect(r.stderr).toMatch(/^kvl chat: (native|wasm)\b.*RAM plan \d+ MiB of --ram-mib 1024; loaded in/m);
    expect(r.stderr).not.toContain("component");
    expect(r.stderr).toContain(`[tokens] prompt ${json.usage.prompt_tokens} (reused 0): ${json.prompt_token_ids.join(" ")}`);
    expect(r.stderr).toMatch(/\[memory\] peak RSS [\d.]+ MiB \(plan [\d.]+ MiB\)/);
  });

  it("--quiet prints only the reply; --verbose adds the plan's table", () => {
    const quiet = chat([pack, "What is 2+2?", "--quiet", ...COMMON], {});
    expect(quiet.status).toBe(0);
    expect(quiet.stderr).toBe("");
    const verbose = chat([pack, "What is 2+2?", "--verbose", ...COMMON], {});
    expect(verbose.status).toBe(0);
    expect(verbose.stderr).toMatch(/component\s+MiB/);
    // a one-shot prompt without --image can take no image, so it plans (and loads) no vision;
    // the interactive chat can take /image and keeps it
    const visionLine = /^vision working memory \(largest image\) +([\d,.]+)(.*)$/m;
    expect(visionLine.exec(verbose.stderr)?.[1]).toBe("0.0");
    expect(verbose.stderr).toMatch(/^image decode \(file, pixels, resize passes\) +0\.0$/m);
    const interactive = chat([pack, "--verbose", ...COMMON], {}, "/quit\n");
    expect(interactive.status, interactive.stderr).toBe(0);
    expect(visionLine.exec(interactive.stderr)?.[2]).toMatch(/\d+x\d+ patches/);
  });

  it("reads the prompt from stdin with '-', and --system takes the system turn", () => {
    const r = chat([pack, "-", "--json", "--system", "Be terse.", ...COMMON], {}, "Hi");
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    expect(report.prompt_token_ids).toEqual(golden("system"));
    expect(report.output_token_ids).toEqual(referenceReply(golden("system")));
  });

  it("a stop string ends the reply before it and is never printed", () => {
    const full = JSON.parse(chat([pack, "What is 2+2?", "--json", ...COMMON, "--max-new", "16"], {}).stdout) as Reply;
    // a stop string that starts inside the reply (not at its start), so text before it exists
    const at = Math.max(1, Math.floor(full.reply.length / 2));
    const stop = full.reply.slice(at, at + 2);
    expect(stop.length).toBe(2);
    const r = chat([pack, "What is 2+2?", "--json", ...COMMON, "--max-new", "16", "--stop", stop], {});
    expect(r.status).toBe(0);
    const report = JSON.parse(r.stdout) as Reply;
    expect(report.finish_reason).toBe("stop");
    expect(report.stop_sequence).toBe(stop);
    expect(report.reply).toBe(full.reply.slice(0, full.reply.indexOf(stop)));
    expect(report.output_token_ids).toEqual(full.output_token_ids.slice(0, report.output_token_ids.length));
    expect(report.output_token_ids.length).toBeLessThan(full.output_token_ids.length);
  });

  it("makes control characters visible on a terminal (not in --json)", () => {
    expect(escapeControls("a\u001b[2Jb\r\u0007c\n\td\u009be\u2028")).toBe("a\\x1b[2Jb\\x0d\\x07c\n\td\\x9be\\u2028");
    expect(escapeControls("plain ünïcödé 中文 😀")).toBe("plain ünïcödé 中文 😀");
  });

  it("Ctrl-C stops the reply, keeps the conversation, and the chat goes on", async () => {
    const limit = (JSON.parse(readFileSync(join(pack, "config.json"), "utf8")) as { text_config: { max_position_embeddings: number } })
      .text_config.max_position_embeddings;
    const child = spawn(process.execPath, [KVL, "chat", pack, "--temperature", "0", "--max-new", String(limit), "--max-context",
      String(limit), "--ram-mib", "2048", "--threads", "2"], { env: env({}) }) as ChildProcessWithoutNullStreams;
    let out = "";
    let err = "";
    child.stdout.on("data", (d: Buffer) => (out += d.toString()));
    child.stderr.on("data", (d: Buffer) => (err += d.toString()));
    const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
    child.stdin.write("Count forever\n");
    const deadline = Date.now() + 120_000;
    while (out.length < 8 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    expect(out.length).toBeGreaterThanOrEqual(8);
    child.kill("SIGINT");
    child.stdin.end("/stats\n/quit\n");
    expect(await exited).toBe(0);
    expect(out).toContain(" [stopped]\n");
    expect(err).toMatch(/session_tokens=\d+/);
    expect(err).not.toContain("internal error");
  }, 180_000);
});

describe("kvl chat keeps its memory contract with large images", () => {
  const MIB = 2 ** 20;
  const large: Record<string, string> = {};
  beforeAll(async () => {
    for (const [name, width, height, format] of [["8000x8000.png", 8000, 8000, "png"], ["12mp.jpg", 4000, 3000, "jpeg"]] as const) {
      const data = Buffer.alloc(width * height * 3);
      for (let i = 0; i < data.length; i++) data[i] = ((i * 2654435761) >>> 24) ^ ((i / 3000) | 0);
      const path = join(tmp.dir, name);
      const image = sharp(data, { raw: { width, height, channels: 3 } });
      await (format === "png" ? image.png({ compressionLevel: 1 }) : image.jpeg({ quality: 90 })).toFile(path);
      large[name] = path;
    }
  }, 120_000);

  it.each([
    ["8000x8000.png", "native"], ["8000x8000.png", "wasm"], ["12mp.jpg", "native"], ["12mp.jpg", "wasm"],
  ])("%s on %s: peak RSS within the plan (its image decode line included)", (name, backend) => {
    const r = chat([pack, "Describe this.", "--image", large[name]!, "--json", ...COMMON, "--max-new", "1", "--max-context", "4096"], { KVL_BACKEND: backend });
    expect(r.stderr).toBe("");
    const report = JSON.parse(r.stdout) as Reply & { images: Array<{ grid: number[] }> };
    expect(report.usage.images_encoded).toBe(1);
    // --ram-mib 1024 leaves room for the decoder's whole 64 MP: the image was planned for, not refused
    expect(report.plan_image_max_pixels).toBe(64_000_000);
    expect(report.plan_image_decode_bytes!).toBeGreaterThan(64_000_000 * 4); // at least the largest image's RGBA pixels
    console.log(`[chat memory] ${name} on ${backend}: peak ${(report.peak_rss_bytes! / MIB).toFixed(0)} MiB, plan ${(report.plan_bytes / MIB).toFixed(0)} MiB ` +
      `(image decode line ${(report.plan_image_decode_bytes! / MIB).toFixed(0)} MiB)`);
    // no margin on top: the plan's own lines (decode, margin) must hold the peak
    expect(report.peak_rss_bytes!).toBeLessThanOrEqual(report.plan_bytes);
    // and what the image added over the same chat without it fits its decode line plus the vision
    // working memory (19.4 MiB in the tiny model's plan; 32 MiB allowed)
    const text = chat([pack, "Describe this.", "--json", ...COMMON, "--max-new", "1", "--max-context", "4096"], { KVL_BACKEND: backend });
    const textPeak = (JSON.parse(text.stdout) as Reply).peak_rss_bytes!;
    expect(report.peak_rss_bytes! - textPeak).toBeLessThanOrEqual(report.plan_image_decode_bytes! + 32 * MIB);
  }, 120_000);

  it("a budget too small for the PNG: the plan lowers its image limit, the PNG is refused, the JPEG is answered", () => {
    const script = `/image ${large["8000x8000.png"]}\n/image ${large["12mp.jpg"]}\nDescribe this.\n/quit\n`;
    const r = chat([pack, "--json", ...COMMON, "--max-new", "1", "--max-context", "4096", "--ram-mib", "600"], {}, script);
    expect(r.status, r.stderr).toBe(0);
    const events = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as { event: string; error?: string } & Reply);
    expect(events.map((e) => e.event)).toEqual(["error", "image", "reply"]);
    const error = events[0]!.error!;
    expect(error).toContain(`image file '${large["8000x8000.png"]}' is 8000x8000 = 64.0 MP`);
    expect(error).toMatch(/over the [\d.]+ MP the RAM plan admits for a JPEG or PNG; downscale it to at most [\d.]+ MP, or raise --ram-mib/);
    const reply = events[2]!;
    expect(reply.usage.images_encoded).toBe(1);
    // the limit shrank to fit 600 MiB, but not below a 12 MP photo
    expect(reply.plan_image_max_pixels!).toBeLessThan(64_000_000);
    expect(reply.plan_image_max_pixels!).toBeGreaterThanOrEqual(4000 * 3000);
    expect(reply.plan_bytes).toBeLessThanOrEqual(600 * MIB);
    expect(reply.peak_rss_bytes!).toBeLessThanOrEqual(reply.plan_bytes);
  }, 120_000);

  it("--max-image-mp sets the image limit: the plan shrinks by the decode memory it no longer reserves, the PNG is refused", () => {
    const script = `/image ${large["8000x8000.png"]}\n/image ${large["12mp.jpg"]}\nDescribe this.\n/quit\n`;
    const run = (extra: string[]) => chat([pack, "--json", ...COMMON, "--max-new", "1", "--max-context", "4096", "--ram-mib", "1024", ...extra], {}, script);
    const auto = run([]);
    const limited = run(["--max-image-mp", "12"]);
    for (const r of [auto, limited]) expect(r.status, r.stderr).toBe(0);
    const events = (r: { stdout: string }) => r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as { event: string; error?: string } & Reply);
    expect(events(auto).map((e) => e.event)).toEqual(["image", "image", "reply"]);
    expect(events(limited).map((e) => e.event)).toEqual(["error", "image", "reply"]);
    expect(events(limited)[0]!.error).toContain("8000x8000 = 64.0 MP, over the 12.0 MP the RAM plan admits");
    const [a, l] = [events(auto)[2]!, events(limited)[2]!];
    expect(a.plan_image_max_pixels).toBe(64_000_000);
    expect(l.plan_image_max_pixels).toBe(12_000_000);
    // 52 MP less to decode: at least 4 bytes a pixel of RGBA output less in the plan
    expect(a.plan_bytes - l.plan_bytes).toBeGreaterThanOrEqual(4 * 52_000_000);
    expect(l.peak_rss_bytes!).toBeLessThanOrEqual(l.plan_bytes);
    expect(chat([pack, "hi", "--max-image-mp", "0"], {}).stderr).toContain("expected a positive number of megapixels");
  }, 180_000);
});

describe("kvl chat refuses what it cannot run, saying what to do", () => {
  it("a source checkpoint is told to run kvl pack", () => {
    const r = chat([ckpt, "hi"], {});
    expect(r.status).toBe(1);
    expect(r.stderr).toContain("it is a source checkpoint, not a pack");
    expect(r.stderr).toContain(`run kvl pack ${ckpt} DST`);
  });

  it("a pack whose config.json disagrees with its tensors does not start", () => {
    const broken = join(tmp.dir, "broken-config");
    cpSync(pack, broken, { recursive: true });
    const config = JSON.parse(readFileSync(join(broken, "config.json"), "utf8")) as { text_config: { hidden_size: number } };
    config.text_config.hidden_size *= 2;
    writeFileSync(join(broken, "config.json"), JSON.stringify(config));
    const r = chat([broken, "hi", ...COMMON], {});
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/the pack does not match its config\.json: .*hidden_size/);
    expect(r.stderr).toContain("kvl chat: error:");
    expect(r.stderr).not.toContain("internal error");
  });

  it("a missing image file is a clear error", () => {
    const r = chat([pack, "hi", "--image", "/nonexistent/cat.png", ...COMMON], {});
    expect(r.status).toBe(1);
    expect(r.stderr).toContain("image file '/nonexistent/cat.png' not found");
  });

  it("bad images in an interactive chat are errors and the chat continues", () => {
    const dir = join(tmp.dir, "bad-images");
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, "notes.png"), "this is text, not a PNG");
    writeFileSync(join(dir, "empty.jpg"), "");
    const script = `/image ${join(dir, "notes.png")}\n/image ${dir}\n/image ${join(dir, "empty.jpg")}\nWhat is 2+2?\n/quit\n`;
    const r = chat([pack, "--json", ...COMMON], {}, script);
    expect(r.status).toBe(0);
    const events = r.stdout.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l) as { event: string; error?: string } & Reply);
    expect(events.map((e) => e.event)).toEqual(["error", "error", "error", "reply"]);
    expect(events[0]!.error).toMatch(/is not a supported image/);
    expect(events[1]!.error).toMatch(/is a directory/);
    expect(events[2]!.error).toMatch(/empty/);
    expect(events[3]!.output_token_ids).toEqual(referenceReply(golden("text")));
  });
});
