/**
 * wasm-features.ts — what this JavaScript engine's WebAssembly can do, probed with
 * WebAssembly.validate on minimal modules (no code runs).
 *
 * Owns: the SIMD128, threads and relaxed-SIMD probes. Does not own: the choice they feed
 * (backend.ts).
 */

const HEADER = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];
/** type section: one function type () -> v128 */
const TYPE_V128 = [0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7b];
/** function section: one function of type 0 */
const FUNC_0 = [0x03, 0x02, 0x01, 0x00];
const V128_CONST_ZERO = [0xfd, 0x0c, ...new Array<number>(16).fill(0)];

function codeSection(body: number[]): number[] {
  const fn = [0x00, ...body, 0x0b]; // no locals, body, end
  const entries = [0x01, fn.length, ...fn];
  return [0x0a, entries.length, ...entries];
}

function validate(bytes: number[]): boolean {
  try {
    return WebAssembly.validate(new Uint8Array(bytes));
  } catch {
    return false;
  }
}

export interface WasmFeatures {
  /** v128 values and instructions (the simd128 kernel set). */
  readonly simd128: boolean;
  /** shared memories + SharedArrayBuffer (the core's thread pool). */
  readonly threads: boolean;
  /** relaxed SIMD (the relaxed build's simd128-relaxed, where its self-test passes: wasm-relaxed.ts). */
  readonly relaxedSimd: boolean;
}

export function probeWasmFeatures(): WasmFeatures {
  const simd128 = validate([...HEADER, ...TYPE_V128, ...FUNC_0, ...codeSection(V128_CONST_ZERO)]);
  // memory section: one memory, limits flag 3 = shared with a maximum, min 1, max 1 page
  const sharedMemory = validate([...HEADER, 0x05, 0x04, 0x01, 0x03, 0x01, 0x01]);
  const threads = sharedMemory && typeof SharedArrayBuffer === "function" && typeof Atomics === "object";
  // i32x4.relaxed_trunc_f32x4_s (0xfd 0x101) applied to a zero vector
  const relaxedSimd = validate([
    ...HEADER, ...TYPE_V128, ...FUNC_0, ...codeSection([...V128_CONST_ZERO, 0xfd, 0x81, 0x02]),
  ]);
  return { simd128, threads, relaxedSimd };
}
