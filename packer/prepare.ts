/**
 * prepare.ts — `kvl prepare DST`: download the pinned checkpoint and pack it, with about one shard
 * of scratch space.
 *
 * Owns: the order of the work — probe the hub (fail fast when unreachable, gated or at an unknown
 * revision), fetch the small files and every shard's safetensors header (Range requests) so the
 * whole inventory and pack layout are known before any shard byte arrives, then hand the packer
 * an inventory source whose shard hooks download a shard just before its tensors are read and
 * delete it once everything read from it is durably packed — and the final check.
 * Does not own: the HTTP side (hub.ts), packing (pack.ts), the format (docs/FORMAT.md).
 *
 * Resumable end to end: a rerun after any interruption (network, SIGKILL) continues the pack from
 * its journal and a shard's download from its `.part` file.
 */
import { existsSync, rmSync } from "node:fs";
import { mkdir, readFile } from "node:fs/promises";
import { join } from "node:path";

import type { BackendName, PackingCore } from "../host/core/core-api.js";
import { checkOutputDir, makeOutputDir } from "../host/system/output-path.js";
import { probeNativeAddon } from "../host/core/backend.js";
import type { RamChoice } from "../host/plan/ram-budget.js";
import { wasmBuildFor } from "../host/core/wasm-relaxed.js";
import { resolveActMode } from "../host/plan/act-mode.js";
import { plan } from "../host/plan/planner.js";
import { COMPLETE_FILE, type ExpertDtype, JOURNAL_DIR, verify } from "../host/pack/pack-format.js";
import { UserError } from "../host/system/user-error.js";
import { Hub, PINNED_REPO, PINNED_REVISION, hubEndpoint } from "./hub.js";
import { packCheckpoint } from "./pack.js";
import { type Progress, silentProgress } from "./progress.js";
import { ASSET_NAMES, INDEX_NAME, readIndex } from "./safetensors.js";
import { type InventoryEntry, InventorySource } from "./tensor-source.js";

/** DST/.download: the small files and the shard in flight (all shards with keepDownload). */
const SCRATCH_DIR = ".download";

export interface PrepareOptions {
  /** The core that quantises the experts (either backend; the bytes are the same). */
  core: PackingCore;
  /** Hub revision; default the pinned commit. Another one is packed with a warning. */
  revision?: string;
  /** Keep DST/.download (every shard) instead of deleting each shard once it is packed. */
  keepDownload?: boolean;
  /** What the routed experts are stored as (kvl pack --expert-dtype); default "q8". */
  expertDtype?: ExpertDtype;
  /** RAM budget for the final check (MiB). */
  ramBudgetMib?: RamChoice | null;
  /** The backend whose RAM plan --ram-budget is checked against; default wasm (the larger plan). */
  planBackend?: BackendName;
  /** Byte progress of downloads and packing (one bar at a time). Default: none. */
  progress?: Progress;
  /** Default: HF_ENDPOINT, else https://huggingface.co. */
  endpoint?: string;
  /** Default: HF_TOKEN, else huggingface_hub's token file; null sends none. */
  token?: string | null;
  /** Status lines (resumes, warnings); default: stderr, prefixed `kvl prepare: `. */
  log?: (line: string) => void;
  /** Base of the retry back-off in ms (tests shorten it). */
  retryDelayMs?: number;
}

function stderrLog(line: string): void {
  process.stderr.write(`kvl prepare: ${line}\n`);
}

/**
 * One bar on screen at a time: a shard's download interrupts the packing bar (the packer asks for
 * the shard between two items), which continues, with its count, when the shard is in. Status
 * lines are written only while no bar is showing.
 */
class ProgressSwitch {
  #pack: { label: string; total: number; done: number } | null = null;
  #suspended = false;

  constructor(readonly out: Progress) {}

  readonly packing: Progress = {
    start: (label, total, done = 0) => {
      this.#pack = { label, total, done };
      if (!this.#suspended) this.out.start(label, total, done);
    },
    add: (bytes) => {
      if (this.#pack) this.#pack.done += bytes;
      if (!this.#suspended) this.out.add(bytes);
    },
    stop: () => {
      this.#pack = null;
      if (!this.#suspended) this.out.stop();
    },
  };

  /** The bar of each download attempt (started and stopped by the hub client). */
  readonly download: Progress = {
    start: (label, total, done = 0) => this.out.start(label, total, done),
    add: (bytes) => this.out.add(bytes),
    stop: () => this.out.stop(),
  };

  /** Around a shard's download: the packing bar leaves the screen, and comes back after. */
  async aside<T>(work: () => Promise<T>): Promise<T> {
    if (this.#pack && !this.#suspended) this.out.stop();
    this.#suspended = true;
    try {
      return await work();
    } finally {
      this.#suspended = false;
      if (this.#pack) this.out.start(this.#pack.label, this.#pack.total, this.#pack.done);
    }
  }
}

/** The small files downloaded, every shard's header read by range: the inventory, no shard data. */
async function buildSource(hub: Hub, scratch: string, keep: boolean, bars: ProgressSwitch,
  log: (line: string) => void): Promise<InventorySource> {
  await mkdir(scratch, { recursive: true });
  await hub.download("config.json", scratch);
  await hub.download(INDEX_NAME, scratch);
  const assets = new Map<string, Uint8Array>();
  for (const name of ASSET_NAMES) {
    if (name === "config.json" || (await hub.exists(name))) {
      assets.set(name, await readFile(await hub.download(name, scratch)));
    }
  }
  let weightMap: Map<string, string>;
  try {
    weightMap = readIndex(join(scratch, INDEX_NAME));
  } catch (err) {
    throw new UserError(`${INDEX_NAME} from the hub is unreadable (${(err as Error).message})`);
  }
  if (weightMap.size === 0) throw new UserError(`${INDEX_NAME} from the hub is unreadable (empty weight_map)`);
  const shards = [...new Set(weightMap.values())].sort();
  const headers = new Map<string, Record<string, unknown>>();
  for (const shard of shards) headers.set(shard, (await hub.safetensorsHeader(shard)).header);
  const inventory = new Map<string, InventoryEntry>();
  for (const [name, shard] of weightMap) {
    const meta = headers.get(shard)?.[name] as { dtype?: unknown; shape?: unknown } | undefined;
    if (typeof meta !== "object" || meta === null || typeof meta.dtype !== "string" || !Array.isArray(meta.shape) ||
      !meta.shape.every((d) => Number.isSafeInteger(d) && (d as number) >= 0)) {
      throw new UserError(`${shard} does not contain ${name}, which ${INDEX_NAME} puts there`);
    }
    inventory.set(name, { dtype: meta.dtype, shape: meta.shape as number[], shard });
  }
  const configText = Buffer.from(assets.get("config.json") as Uint8Array).toString("utf8");
  const order = new Map(shards.map((s, i) => [s, i + 1]));
  // The packer acquires a shard just before reading from it and releases it (after closing its
  // handle) once everything read from it is fsynced and journaled.
  return new InventorySource(scratch, configText, assets, inventory, hub.commit, {
    acquire: (shard: string) => bars.aside(async () => {
      const which = `${shard} (${order.get(shard)}/${shards.length})`;
      log(`downloading ${which}`);
      await hub.download(shard, scratch, { progress: bars.download, label: `downloading ${which}` });
    }),
    release: (shard: string) => {
      if (!keep) rmSync(join(scratch, shard), { force: true });
    },
  });
}

/** The final health check: full structural validation of the pack and, with a RAM budget, the
 * RAM plan for the backend that will run it (a UserError with what to lower when it does not
 * fit). The deeper checks (data CRCs, a generation) are `kvl doctor MODEL`'s. */
async function postPackCheck(dst: string, ramBudgetMib: RamChoice | null, backend: BackendName, log: (line: string) => void): Promise<void> {
  await verify(dst);
  if (ramBudgetMib === null) return;
  // planned with the mode kvl chat would run there by default (--act-dtype auto)
  const kernelSet = backend === "wasm" ? await wasmBuildFor("auto") : (probeNativeAddon().defaultKernelSet ?? "scalar");
  try {
    await plan(dst, { backend, ramMib: ramBudgetMib, actDtype: resolveActMode("auto", backend, kernelSet).actDtype });
  } catch (err) {
    // auto: the pack is good; what this machine has free now is a note for kvl chat, not a failure
    if (ramBudgetMib !== "auto" || !(err instanceof UserError)) throw err;
    log(`note: the pack is complete, but ${err.message.split("\n")[0]}`);
  }
}

/** Downloads the pinned revision from the hub and packs it into `dst`; returns `dst`. */
export async function prepare(dst: string, options: PrepareOptions): Promise<string> {
  const log = options.log ?? stderrLog;
  const revision = options.revision ?? PINNED_REVISION;
  const ramBudget = options.ramBudgetMib ?? null;
  const planBackend = options.planBackend ?? "wasm";
  if (existsSync(join(dst, COMPLETE_FILE)) && !existsSync(join(dst, JOURNAL_DIR))) {
    await postPackCheck(dst, ramBudget, planBackend, log);
    log(`${dst} already holds a complete pack`);
    return dst;
  }
  checkOutputDir(dst, "DST");
  const base = options.endpoint ?? hubEndpoint();
  const hub = new Hub(PINNED_REPO, revision, base, {
    log,
    ...(options.token !== undefined ? { token: options.token } : {}),
    ...(options.retryDelayMs !== undefined ? { retryDelayMs: options.retryDelayMs } : {}),
  });
  const commit = await hub.probe();
  if (revision === PINNED_REVISION && commit !== PINNED_REVISION) {
    throw new UserError(`${base} answered commit ${commit} for the pinned revision ${PINNED_REVISION}; ` +
      "this is not the checkpoint kvl was verified against — check HF_ENDPOINT");
  }
  // Asking for another revision explicitly is the consent that --allow-revision gives kvl pack.
  const allowRevision = commit !== PINNED_REVISION;
  if (allowRevision) {
    log(`warning: revision ${revision} (${commit}) is not the pinned ${PINNED_REVISION}; kvl was verified only against the pinned one`);
  }
  const scratch = join(dst, SCRATCH_DIR);
  makeOutputDir(dst, "DST");
  const bars = new ProgressSwitch(options.progress ?? silentProgress);
  const source = await buildSource(hub, scratch, options.keepDownload === true, bars, log);
  try {
    await packCheckpoint(source, dst, { core: options.core, allowRevision, expertDtype: options.expertDtype ?? "q8", progress: bars.packing, log });
  } finally {
    await source.close();
  }
  await postPackCheck(dst, ramBudget, planBackend, log);
  if (!options.keepDownload) rmSync(scratch, { recursive: true, force: true });
  log(`ready: ${dst}`);
  return dst;
}
