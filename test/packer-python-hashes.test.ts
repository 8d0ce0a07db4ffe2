/**
 * The acceptance test of the TypeScript packer: for every preset recorded in
 * test/fixtures/python-packer-sha256.json (made by the Python synthesizer and packer,
 * test/fixtures/make-python-packer-hashes.sh), the TypeScript synthesizer must write the same
 * checkpoint files and the TypeScript packer the same pack files, byte for byte (sha256 of
 * every file, and no other files). Packs are made on both cores.
 *
 * The JSON files (config.json, tokenizer_config.json, generation_config.json,
 * preprocessor_config.json, model.safetensors.index.json, the safetensors headers and
 * PACK_COMPLETE.json) are now the platform JSON's bytes (JSON.stringify; docs/FORMAT.md "JSON
 * files"), not a copy of Python's json.dumps. Recomputed with it, every recorded sha256 stayed
 * as the Python packer wrote it: JSON.stringify lays out these files as json.dumps did, and the
 * synthesizer spells config.json's three float literals (800000.0, 1e-05, 0.0) as the official
 * file does, because every .idx embeds config.json verbatim. A JSON file's hash may change in
 * the fixture if its layout ever changes; the .bin and .idx hashes must not.
 *
 * The full-size preset (33 GB checkpoint, 18.5 GB pack, about 5 minutes) is too big for the
 * suite: bench/full-pack.mjs checks its pack hashes and peak RSS.
 */
import { createHash } from "node:crypto";
import { readFileSync, rmSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import type { CoreBackend } from "../host/core/core-api.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { packageRoot } from "../host/system/paths.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { synthesize } from "../packer/synth.js";
import { tempDir, treeBytes } from "./support/pack-fixtures.js";

interface Recorded {
  synth_args: string;
  ckpt: Record<string, string>;
  pack: Record<string, string>;
}
const FIXTURE = JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "python-packer-sha256.json"), "utf8")) as Record<string, Recorded>;

/** `--preset tiny --seed 1 --n-group 4 --topk-group 2` -> synthesize() options. */
function synthOptions(args: string): { preset: "tiny" | "full"; seed: number; biasDtype?: "bf16" | "f32"; nGroup?: number; topkGroup?: number } {
  const words = args.split(/\s+/);
  const value = (flag: string): string | undefined => {
    const i = words.indexOf(flag);
    return i >= 0 ? words[i + 1] : undefined;
  };
  const preset = value("--preset");
  if (preset !== "tiny" && preset !== "full") throw new Error(`unexpected preset in ${args}`);
  const bias = value("--bias-dtype");
  return {
    preset, seed: Number(value("--seed") ?? "0"),
    ...(bias === "bf16" || bias === "f32" ? { biasDtype: bias } : {}),
    ...(value("--n-group") !== undefined ? { nGroup: Number(value("--n-group")) } : {}),
    ...(value("--topk-group") !== undefined ? { topkGroup: Number(value("--topk-group")) } : {}),
  };
}

const TINY = Object.keys(FIXTURE).filter((k) => synthOptions(FIXTURE[k]!.synth_args).preset === "tiny");

function hashes(dir: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [name, bytes] of treeBytes(dir)) out[name] = createHash("sha256").update(bytes).digest("hex");
  return out;
}

let tmp: { dir: string; cleanup: () => void };
const cores: Record<string, CoreBackend> = {};
beforeAll(async () => {
  tmp = tempDir("pyhash");
  cores.native = new NativeBackend();
  cores.wasm = await WasmBackend.create();
});
afterAll(() => {
  for (const core of Object.values(cores)) core.close();
  tmp.cleanup();
});

describe("the TypeScript synthesizer and packer reproduce the Python ones", () => {
  it("covers the recorded presets", () => {
    expect(TINY.sort()).toEqual(["tiny-seed0", "tiny-seed1-grouped", "tiny-seed7-f32bias"]);
    expect(Object.keys(FIXTURE).filter((k) => !TINY.includes(k))).toEqual(["full-seed0"]); // bench/full-pack.mjs
  });

  it.each(TINY)("%s: every checkpoint and pack file has the recorded sha256, on both cores", async (name) => {
    const recorded = FIXTURE[name]!;
    const ckpt = await synthesize(join(tmp.dir, `${name}-ckpt`), { ...synthOptions(recorded.synth_args), core: cores.native! });
    expect(hashes(ckpt)).toEqual(recorded.ckpt);
    for (const backend of ["native", "wasm"]) {
      const pack = await packCheckpoint(ckpt, join(tmp.dir, `${name}-pack-${backend}`), { core: cores[backend]!, allowRevision: true });
      expect(hashes(pack), `pack made on the ${backend} core`).toEqual(recorded.pack);
      rmSync(pack, { recursive: true });
    }
    rmSync(ckpt, { recursive: true });
  });
});
