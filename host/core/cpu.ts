/**
 * cpu.ts — what the operating system says about the processor, for reports.
 *
 * Owns: the CPU model and the instruction-set flags that matter to the kernel sets. The core's
 * own CPUID check (kernels_select.c) decides what runs; this is what `kvl doctor` shows beside
 * it, and what the tests compare the core's choice with.
 */
import { readFileSync } from "node:fs";
import { cpus } from "node:os";

/** Flags named as Linux's /proc/cpuinfo names them. */
const KERNEL_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
  "avx512_vnni", "avx512_bf16"] as const;

export interface CpuInfo {
  readonly model: string;
  readonly cores: number;
  /** The KERNEL_FLAGS this CPU reports; null where the OS does not list flags (not Linux). */
  readonly flags: readonly string[] | null;
}

export function readCpuInfo(): CpuInfo {
  const model = cpus()[0]?.model ?? "unknown";
  const cores = cpus().length;
  let flags: string[] | null = null;
  try {
    const text = readFileSync("/proc/cpuinfo", "utf8");
    const line = text.split("\n").find((l) => l.startsWith("flags"));
    if (line) {
      const all = new Set(line.slice(line.indexOf(":") + 1).trim().split(/\s+/));
      flags = KERNEL_FLAGS.filter((f) => all.has(f));
    }
  } catch {
    flags = null;
  }
  return { model, cores, flags };
}

/** The best native kernel set these flags allow, by the same rule as kernels_select.c. */
export function expectedNativeKernelSet(flags: readonly string[]): string {
  const has = (f: string) => flags.includes(f);
  if (!(has("avx2") && has("fma") && has("f16c"))) return "scalar";
  if (["avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"].every(has)) {
    return has("avx512_bf16") ? "avx512-bf16" : "avx512";
  }
  return "avx2";
}
