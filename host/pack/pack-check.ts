/**
 * pack-check.ts — whether a directory is a pack the engine can run, from its indexes and
 * config.json alone (no tensor data is read): what `kvl doctor` reports check by check and what
 * `kvl chat` / `kvl serve` refuse to start on.
 *
 * Owns: telling a source checkpoint from a pack, the runtime files a pack must hold, and the
 * agreement of the tensor directory and hparams with config.json. Does not own: the pack's
 * structure and CRCs (pack-format.ts) or what a check looks like to the user (the callers).
 */
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { isDeepStrictEqual } from "node:util";

import { isFile } from "./file-kind.js";
import { expectedTensors, hparams, isTrunkLinear, textDims } from "./model-spec.js";
import { COMPLETE_FILE, DTYPE_BF16, DTYPE_F32, DTYPE_NAMES, DTYPE_Q4_EXPERT, DTYPE_Q8_EXPERT, DTYPE_Q8_ROWS, PackReader } from "./pack-format.js";
import { parseJson } from "../system/json-file.js";
import { UserError } from "../system/user-error.js";

/** Files besides the stores that the runtime reads (tokenizer, template, vision preprocessing). */
const RUNTIME_FILES = ["config.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja", "preprocessor_config.json"];

/** If `model` is a source checkpoint (safetensors, no pack marker): what it is and what to run
 * instead; else null. */
export function checkpointNotPack(model: string): { detail: string; fix: string } | null {
  if (isFile(join(model, COMPLETE_FILE))) return null;
  let names: string[] = [];
  try {
    names = readdirSync(model);
  } catch {
    return null; // PackReader.open says what is wrong with the path
  }
  if (!names.includes("model.safetensors.index.json") && !names.some((n) => n.endsWith(".safetensors"))) return null;
  return {
    detail: `${model} holds safetensors and no ${COMPLETE_FILE}: it is a source checkpoint, not a pack`,
    fix: `this is a checkpoint, not a pack: run kvl pack ${model} DST, then use DST`,
  };
}

/** Runtime files missing from the pack. */
export function missingRuntimeFiles(model: string): string[] {
  return RUNTIME_FILES.filter((f) => !isFile(join(model, f)));
}

/** How the pack's tensors and hparams disagree with its config.json (empty: they agree).
 * `unusable` is set when config.json cannot be read as a Kimi-VL config at all. */
export function configProblems(model: string, reader: PackReader): { problems: string[]; unusable: boolean } {
  let config: unknown;
  try {
    config = parseJson(readFileSync(join(model, "config.json")));
  } catch (err) {
    const why = err instanceof Error ? err.message : String(err); // a JsonTextError's or the file system's
    return { problems: [`config.json unreadable (${why})`], unusable: true };
  }
  const problems: string[] = [];
  let stored: unknown = null;
  try {
    stored = JSON.parse(reader.configText);
  } catch {
    /* differs below */
  }
  if (!isDeepStrictEqual(stored, config)) problems.push("config.json differs from the config stored in the indexes");
  let expected;
  let expectedHp;
  let text;
  try {
    expected = expectedTensors(config);
    expectedHp = hparams(config);
    text = textDims(config);
  } catch (err) {
    if (!(err instanceof UserError)) throw err;
    return { problems: [...problems, err.message], unusable: true };
  }
  for (const [key, value] of expectedHp) {
    const got = reader.hparams.get(key);
    if (got !== value) problems.push(`hparam ${key} = ${got ?? "missing"}, config says ${value}`);
  }
  const dense = new Map([...reader.stores.get("trunk")!.byName, ...reader.stores.get("vision")!.byName]);
  const experts = reader.stores.get("experts")!.records;
  for (const [tensor, info] of expected) {
    if (tensor.includes(".mlp.experts.")) continue;
    const rec = dense.get(tensor);
    if (rec === undefined) {
      problems.push(`missing tensor ${tensor}`);
      continue;
    }
    // a trunk Linear weight may be row-wise Q8 (kvl pack --trunk-dtype q8); the rest is as packed
    const want = tensor.endsWith("e_score_correction_bias") ? DTYPE_F32
      : isTrunkLinear(tensor) && rec.dtype === DTYPE_Q8_ROWS ? DTYPE_Q8_ROWS : DTYPE_BF16;
    if (rec.dtype !== want || rec.shape.join() !== info.shape.join()) {
      problems.push(`${tensor}: dtype ${DTYPE_NAMES[rec.dtype]} shape [${rec.shape.join(", ")}], expected ${DTYPE_NAMES[want]} [${info.shape.join(", ")}]`);
    }
  }
  const extra = [...dense.keys()].filter((t) => !expected.has(t)).sort();
  if (extra.length) problems.push(`${extra.length} unexpected tensors, e.g. ${extra[0]}`);
  const nMoe = text.num_hidden_layers - text.first_k_dense_replace;
  if (experts.length !== nMoe * text.n_routed_experts) {
    problems.push(`experts.idx has ${experts.length} extents, expected ${nMoe * text.n_routed_experts}`);
  }
  const badExtent = experts.find((r) => r.shape[2] !== text.moe_intermediate_size || r.shape[3] !== text.hidden_size);
  if (badExtent) problems.push(`${badExtent.name}: shape [${badExtent.shape.join(", ")}] does not match config`);
  // the routed experts are all Q8_EXPERT or all Q4_EXPERT (kvl pack --expert-dtype): one dtype per pack
  const expertDtype = experts[0]?.dtype ?? DTYPE_Q8_EXPERT;
  const badDtype = experts.find((r) => r.dtype !== expertDtype || (r.dtype !== DTYPE_Q8_EXPERT && r.dtype !== DTYPE_Q4_EXPERT));
  if (badDtype) {
    problems.push(`${badDtype.name}: dtype ${DTYPE_NAMES[badDtype.dtype]}, ${experts[0]!.name} ${DTYPE_NAMES[expertDtype]}; ` +
      "the extents must all be Q8_EXPERT or all Q4_EXPERT");
  }
  return { problems, unusable: false };
}

/** Opens a pack for running, or throws a UserError saying what is wrong and what to do: a
 * checkpoint, a broken or incomplete pack, a config.json that disagrees with the tensors. */
export async function openRunnablePack(model: string): Promise<PackReader> {
  const checkpoint = checkpointNotPack(model);
  if (checkpoint) throw new UserError(`${checkpoint.detail}; ${checkpoint.fix.slice(checkpoint.fix.indexOf(":") + 2)}`);
  const reader = await PackReader.open(model);
  const missing = missingRuntimeFiles(model);
  if (missing.length) throw new UserError(`${missing.join(", ")} missing from ${model}: the pack is incomplete; rerun kvl pack`);
  const { problems } = configProblems(model, reader);
  if (problems.length) {
    const more = problems.length > 3 ? ` (+${problems.length - 3} more)` : "";
    throw new UserError(`${model}: the pack does not match its config.json: ${problems.slice(0, 3).join("; ")}${more}; ` +
      "restore config.json or rerun kvl pack (kvl doctor MODEL checks everything)");
  }
  return reader;
}
