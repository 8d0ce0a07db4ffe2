/**
 * preprocess.ts — the reference image preprocessing (spec §6) on decoded RGB pixel arrays.
 *
 * Owns: the official processor's pixel pipeline — BICUBIC downscale past in_token_limit with
 * Pillow's exact fixed-point resampler (so resized pixels are bit-identical to Pillow's),
 * right/bottom zero padding to multiples of merge_kernel x patch, the "Exceed pos emb" check,
 * normalisation (x/255 - mean)/std, patchify to [gh*gw, 3, p, p] (patches row-major, each
 * channel-major) — and the media-token count.
 * Does not own: decoding files, EXIF, or non-RGB source modes. The official code resizes and pads
 * in the file's own mode before convert("RGB"), so RGBA/LA (premultiplied resize), P and 1
 * (NEAREST resize, palette-index padding) inputs differ from decoding to RGB first (spec §6
 * step 4); this reference takes RGB arrays and so matches the official pixels for RGB and L files.
 */
import { join } from "node:path";

import { readJson } from "./checkpoint.js";

/** The position-embedding RoPE table of the official encoder has 512 x 512 entries. */
export const MAX_GRID_SIDE = 512;

/** A decoded image: data is [height, width, 3] uint8, row-major. */
export interface RgbImage {
  readonly width: number;
  readonly height: number;
  readonly data: Uint8Array;
}

export interface PreprocessorConfig {
  patch_size: number;
  in_token_limit: number;
  merge_kernel_size: [number, number];
  pad_input: boolean;
  image_mean: [number, number, number];
  image_std: [number, number, number];
}

export function loadPreprocessorConfig(dir: string): PreprocessorConfig {
  return readJson(join(dir, "preprocessor_config.json")) as PreprocessorConfig;
}

// -- Pillow's BICUBIC resampler (src/libImaging/Resample.c), 8 bits per channel ---------------

/** Pillow's bicubic kernel, a = -0.5, support 2; same operation order as the C. */
function pillowBicubic(x: number): number {
  const a = -0.5;
  if (x < 0) x = -x;
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

const PRECISION_BITS = 32 - 8 - 2;

interface Coeffs {
  ksize: number;
  /** per output index: first source index and number of taps */
  bounds: Int32Array;
  /** fixed-point weights [outSize, ksize] */
  kk: Int32Array;
}

/**
 * precompute_coeffs + normalize_coeffs_8bpc: the filter is stretched by the downscale factor
 * (antialiasing), centre = (i + 0.5) * scale, window [int(centre - support + 0.5),
 * int(centre + support + 0.5)) clamped to the image, weights normalised to sum 1 and converted to
 * fixed point with 22 fractional bits, rounded half away from zero.
 */
function precomputeCoeffs(inSize: number, outSize: number): Coeffs {
  const scale = inSize / outSize;
  const filterscale = Math.max(scale, 1);
  const support = 2 * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const kk = new Int32Array(outSize * ksize);
  const k = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    const ss = 1 / filterscale;
    const xmin = Math.max(Math.trunc(center - support + 0.5), 0);
    const xmax = Math.min(Math.trunc(center + support + 0.5), inSize) - xmin;
    let ww = 0;
    k.fill(0);
    for (let x = 0; x < xmax; x++) {
      const w = pillowBicubic((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    for (let x = 0; x < xmax; x++) {
      if (ww !== 0) k[x]! /= ww;
    }
    for (let x = 0; x < ksize; x++) {
      const v = k[x]!;
      kk[xx * ksize + x] = v < 0 ? Math.trunc(-0.5 + v * (1 << PRECISION_BITS)) : Math.trunc(0.5 + v * (1 << PRECISION_BITS));
    }
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = xmax;
  }
  return { ksize, bounds, kk };
}

function clip8(ss: number): number {
  const v = Math.floor(ss / (1 << PRECISION_BITS)); // arithmetic shift right
  return v < 0 ? 0 : v > 255 ? 255 : v;
}

/** One pass along x (horizontal) or y (vertical) on 3-channel uint8 data. */
function resamplePass(src: RgbImage, outSize: number, horizontal: boolean): RgbImage {
  const inSize = horizontal ? src.width : src.height;
  const { ksize, bounds, kk } = precomputeCoeffs(inSize, outSize);
  const width = horizontal ? outSize : src.width;
  const height = horizontal ? src.height : outSize;
  const out = new Uint8Array(width * height * 3);
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      const o = horizontal ? x : y;
      const min = bounds[o * 2]!;
      const count = bounds[o * 2 + 1]!;
      for (let ch = 0; ch < 3; ch++) {
        let ss = 1 << (PRECISION_BITS - 1);
        for (let t = 0; t < count; t++) {
          const sx = horizontal ? min + t : x;
          const sy = horizontal ? y : min + t;
          ss += src.data[(sy * src.width + sx) * 3 + ch]! * kk[o * ksize + t]!;
        }
        out[(y * width + x) * 3 + ch] = clip8(ss);
      }
    }
  }
  return { width, height, data: out };
}

/**
 * Image.resize((width, height), Image.BICUBIC) of an RGB image, bit-identical to Pillow: a
 * horizontal pass then a vertical pass, each rounding to uint8; a pass is skipped when that
 * dimension does not change.
 */
export function pillowResizeBicubic(img: RgbImage, width: number, height: number): RgbImage {
  let out = img;
  if (width !== img.width) out = resamplePass(out, width, true);
  if (height !== img.height) out = resamplePass(out, height, false);
  return out === img ? { width: img.width, height: img.height, data: img.data.slice() } : out;
}

// -- the processor -----------------------------------------------------------------------------

export interface Preprocessed {
  /** [gh*gw, 3, p, p] row-major, patches row-major over the grid, each channel-major */
  pixelValues: Float64Array;
  grid: [number, number];
  /** the RGB image after the optional resize, before padding */
  resized: RgbImage;
}

export function preprocessOne(img: RgbImage, config: PreprocessorConfig): Preprocessed {
  const patch = config.patch_size;
  const limit = config.in_token_limit;
  const [mergeH, mergeW] = config.merge_kernel_size;
  if (img.data.length !== img.width * img.height * 3) throw new Error("RGB data length does not match width x height x 3");
  let image = img;
  const patches = Math.floor(img.width / patch) * Math.floor(img.height / patch);
  if (patches > limit) {
    const scale = Math.sqrt(limit / patches);
    image = pillowResizeBicubic(img, Math.trunc(img.width * scale), Math.trunc(img.height * scale));
  }
  if (!config.pad_input) {
    // The spec only pins down the padding path (the real preprocessor_config.json has pad_input
    // true); guessing the other path would make this oracle untrustworthy.
    throw new Error("reference preprocessing models pad_input=true only");
  }
  const stepW = mergeW * patch;
  const stepH = mergeH * patch;
  const width = image.width + ((stepW - (image.width % stepW)) % stepW);
  const height = image.height + ((stepH - (image.height % stepH)) % stepH);
  if (width / patch >= MAX_GRID_SIDE || height / patch >= MAX_GRID_SIDE) throw new Error("Exceed pos emb");
  const gh = height / patch;
  const gw = width / patch;
  const pixelValues = new Float64Array(gh * gw * 3 * patch * patch);
  const { image_mean: mean, image_std: std } = config;
  // Padding is value 0 before normalisation, so it becomes (0 - mean) / std.
  let o = 0;
  for (let r = 0; r < gh; r++) {
    for (let c = 0; c < gw; c++) {
      for (let ch = 0; ch < 3; ch++) {
        for (let ky = 0; ky < patch; ky++) {
          for (let kx = 0; kx < patch; kx++) {
            const y = r * patch + ky;
            const x = c * patch + kx;
            const v = y < image.height && x < image.width ? image.data[(y * image.width + x) * 3 + ch]! : 0;
            pixelValues[o++] = (v / 255 - mean[ch]!) / std[ch]!;
          }
        }
      }
    }
  }
  return { pixelValues, grid: [gh, gw], resized: image };
}

/** All images' patches concatenated and the grids (rows, cols), in image order. */
export function preprocess(images: readonly RgbImage[], config: PreprocessorConfig): { pixelValues: Float64Array; grids: [number, number][] } {
  const parts = images.map((img) => preprocessOne(img, config));
  const pixelValues = new Float64Array(parts.reduce((a, p) => a + p.pixelValues.length, 0));
  let o = 0;
  for (const p of parts) {
    pixelValues.set(p.pixelValues, o);
    o += p.pixelValues.length;
  }
  return { pixelValues, grids: parts.map((p) => p.grid) };
}

/** Media tokens of one image: one per merge window (spec §5.7). */
export function numMediaTokens(grid: readonly [number, number], merge: readonly [number, number]): number {
  return Math.floor(grid[0] / merge[0]) * Math.floor(grid[1] / merge[1]);
}
