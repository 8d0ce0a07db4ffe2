/**
 * native-backend.ts — the core as a Node-API addon (build/addon/kvl_core.node), with the
 * AVX2 / AVX-512 kernel sets chosen inside the core by CPUID.
 *
 * Owns: loading the addon in this process (only after backend.ts has test-loaded it in a child
 * process) and adapting it to CoreBackend. Does not own: building it (scripts/build-addon.mjs).
 */
import { createRequire } from "node:module";

import {
  type ConformanceReport, type CoreBackend, type KernelSet, type Pcg64State, checkPackExpertArgs, packExpertStatus,
  parseConformanceReport,
} from "./core-api.js";
import { nativeAddonPath } from "./paths.js";

/** What wasm-core/native/addon.c exports. */
export interface NativeAddon {
  abiVersion(): number;
  kernelSets(): KernelSet[];
  defaultKernelSet(): string;
  conformance(set: string): { failed: number; report: string };
  expertExtentBytes(intermediate: number, hidden: number): number;
  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number, out: Uint8Array): number;
  pcg64Seed(words: BigUint64Array, state: BigUint64Array): void;
  synthUniform(state: BigUint64Array, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void;
}

export function loadNativeAddon(path: string = nativeAddonPath()): NativeAddon {
  const require = createRequire(import.meta.url);
  return require(path) as NativeAddon;
}

export class NativeBackend implements CoreBackend {
  readonly backend = "native" as const;
  readonly #addon: NativeAddon;

  constructor(addon: NativeAddon = loadNativeAddon()) {
    this.#addon = addon;
  }

  abiVersion(): number {
    return this.#addon.abiVersion();
  }

  kernelSets(): KernelSet[] {
    return this.#addon.kernelSets();
  }

  defaultKernelSet(): string {
    return this.#addon.defaultKernelSet();
  }

  conformance(set: string): ConformanceReport {
    const { failed, report } = this.#addon.conformance(set);
    if (failed === -1) throw new Error(`kernel set ${set} is not available on the native backend here`);
    return parseConformanceReport(report, set);
  }

  expertExtentBytes(intermediate: number, hidden: number): number {
    return this.#addon.expertExtentBytes(intermediate, hidden);
  }

  packExpert(gate: Uint16Array, up: Uint16Array, down: Uint16Array, intermediate: number, hidden: number): Uint8Array {
    checkPackExpertArgs(gate, up, down, intermediate, hidden);
    const out = new Uint8Array(this.expertExtentBytes(intermediate, hidden));
    packExpertStatus(this.#addon.packExpert(gate, up, down, intermediate, hidden, out));
    return out;
  }

  pcg64Seed(seedWords: BigUint64Array): Pcg64State {
    const state = new BigUint64Array(4);
    this.#addon.pcg64Seed(seedWords, state);
    return state;
  }

  synthUniform(state: Pcg64State, count: number, center: number, halfWidth: number, out: Uint16Array | Float32Array): void {
    this.#addon.synthUniform(state, count, center, halfWidth, out);
  }

  close(): void {
    /* The addon's memory belongs to the process; nothing to release yet. */
  }
}
