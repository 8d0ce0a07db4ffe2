/**
 * math.ts — the float64 building blocks of the reference model: dense row-major tensors, Linear,
 * RMSNorm, LayerNorm, activations (SiLU, GELU tanh and erf), softmax and top-k.
 *
 * Owns: plain loops over Float64Array, written for clarity, not speed (the reference runs on tiny
 * checkpoints). Does not own: any model layout or file format. Imports nothing from the runtime.
 */

/** A dense row-major float64 tensor. */
export interface Tensor {
  readonly shape: readonly number[];
  readonly data: Float64Array;
}

export function numel(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

/** y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]); x [rows, in], w [out, in] (PyTorch Linear). */
export function linear(x: Float64Array, rows: number, w: Tensor, bias?: Tensor): Float64Array {
  if (w.shape.length !== 2) throw new Error(`linear: weight must be 2-D, got [${w.shape.join(", ")}]`);
  const out = w.shape[0]!;
  const inDim = w.shape[1]!;
  if (x.length !== rows * inDim) throw new Error(`linear: input has ${x.length} values, expected ${rows} x ${inDim}`);
  if (bias && bias.data.length !== out) throw new Error(`linear: bias has ${bias.data.length} values, expected ${out}`);
  const y = new Float64Array(rows * out);
  const wd = w.data;
  const bd = bias ? bias.data : undefined;
  for (let o = 0; o < out; o++) {
    const wRow = wd.subarray(o * inDim, (o + 1) * inDim);
    const b = bd ? bd[o]! : 0;
    for (let r = 0; r < rows; r++) {
      y[r * out + o] = dot(x, r * inDim, wRow, inDim) + b;
    }
  }
  return y;
}

/** sum_i x[off + i] * w[i], in index order (one accumulator: a plain float64 dot product). */
function dot(x: Float64Array, off: number, w: Float64Array, n: number): number {
  let s = 0;
  for (let i = 0; i < n; i++) s += x[off + i]! * w[i]!;
  return s;
}

/** Row-wise RMSNorm: w * x / sqrt(mean(x^2) + eps) (spec §4.2). */
export function rmsNorm(x: Float64Array, rows: number, weight: Tensor, eps: number): Float64Array {
  const d = weight.data.length;
  const y = new Float64Array(rows * d);
  for (let r = 0; r < rows; r++) {
    let ss = 0;
    for (let i = 0; i < d; i++) ss += x[r * d + i]! ** 2;
    const inv = 1 / Math.sqrt(ss / d + eps);
    for (let i = 0; i < d; i++) y[r * d + i] = weight.data[i]! * (x[r * d + i]! * inv);
  }
  return y;
}

/** Row-wise LayerNorm with affine weight and bias (biased variance, as torch). */
export function layerNorm(x: Float64Array, rows: number, weight: Tensor, bias: Tensor, eps: number): Float64Array {
  const d = weight.data.length;
  const y = new Float64Array(rows * d);
  for (let r = 0; r < rows; r++) {
    let mean = 0;
    for (let i = 0; i < d; i++) mean += x[r * d + i]!;
    mean /= d;
    let v = 0;
    for (let i = 0; i < d; i++) v += (x[r * d + i]! - mean) ** 2;
    const inv = 1 / Math.sqrt(v / d + eps);
    for (let i = 0; i < d; i++) y[r * d + i] = (x[r * d + i]! - mean) * inv * weight.data[i]! + bias.data[i]!;
  }
  return y;
}

export function sigmoid(z: number): number {
  return 1 / (1 + Math.exp(-z));
}

export function silu(z: number): number {
  return z * sigmoid(z);
}

const SQRT_2_OVER_PI = Math.sqrt(2 / Math.PI);

/** GELU with the tanh approximation (MoonViT MLP, spec §5.4). */
export function geluTanh(z: number): number {
  return 0.5 * z * (1 + Math.tanh(SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)));
}

/**
 * erf to float64 accuracy. JavaScript has no Math.erf; this sums the everywhere-convergent series
 * erf(x) = 2/sqrt(pi) * exp(-x^2) * sum_n 2^n x^(2n+1) / (1*3*...*(2n+1)), whose terms are all
 * positive (no cancellation); beyond |x| = 6 erf is +-1 to double precision (erfc(6) ~ 2e-17).
 */
export function erf(x: number): number {
  if (Number.isNaN(x)) return NaN;
  const ax = Math.abs(x);
  if (ax >= 6) return Math.sign(x);
  const x2 = ax * ax;
  let term = ax;
  let sum = ax;
  for (let n = 1; n < 500; n++) {
    term *= (2 * x2) / (2 * n + 1);
    sum += term;
    if (term < sum * 1e-17) break;
  }
  const r = (2 / Math.sqrt(Math.PI)) * Math.exp(-x2) * sum;
  return x < 0 ? -r : r;
}

/** Exact GELU, 0.5 z (1 + erf(z / sqrt 2)) (projector, spec §5.8). */
export function geluErf(z: number): number {
  return 0.5 * z * (1 + erf(z / Math.SQRT2));
}

/** In-place softmax of v[start, start + n). */
export function softmaxInPlace(v: Float64Array, start = 0, n = v.length - start): void {
  let max = -Infinity;
  for (let i = 0; i < n; i++) max = Math.max(max, v[start + i]!);
  let sum = 0;
  for (let i = 0; i < n; i++) {
    const e = Math.exp(v[start + i]! - max);
    v[start + i] = e;
    sum += e;
  }
  for (let i = 0; i < n; i++) v[start + i]! /= sum;
}

/** Indices of the k largest values, largest first; ties go to the lower index. */
export function topkIndices(values: ArrayLike<number>, k: number): number[] {
  // Insertion into a sorted list of k: one pass over a vocabulary-sized row for small k.
  const top: number[] = [];
  for (let i = 0; i < values.length; i++) {
    const v = values[i]!;
    if (top.length === k && !(v > values[top[k - 1]!]!)) continue;
    let j = top.length === k ? k - 1 : top.length;
    while (j > 0 && v > values[top[j - 1]!]!) {
      top[j] = top[j - 1]!;
      j--;
    }
    top[j] = i;
  }
  return top;
}

/** Index of the first maximum (torch.argmax's choice on exact ties). */
export function argmax(values: ArrayLike<number>, start = 0, n = values.length - start): number {
  let best = 0;
  for (let i = 1; i < n; i++) if (values[start + i]! > values[start + best]!) best = i;
  return best;
}
