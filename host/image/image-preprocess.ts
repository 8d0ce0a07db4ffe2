/**
 * image-preprocess.ts — the official Kimi-VL image preprocessing (spec §6) of one decoded image,
 * bit-identical to the official processor (Pillow + torchvision + numpy), and the grid / media-token
 * arithmetic.
 *
 * Owns: reading and validating preprocessor_config.json; the downscale rule (only past
 * in_token_limit patches, int truncation); the resize *in the image's own Pillow mode* —
 * Pillow's fixed-point BICUBIC resampler (Resample.c: coefficients in double, normalised to sum 1,
 * converted to 22-bit fixed point rounding half away from zero; horizontal pass then vertical,
 * each rounding to uint8 with +2^21 >> 22 and clipping), with RGBA/LA premultiplied first and
 * unpremultiplied after exactly as Image.resize does it (convert to "RGBa"/"La": c*a/255 by
 * Pillow's MULDIV255; back: 255*c/a integer division, clipped; alpha 0 and 255 untouched),
 * palette and 1-bit images resized with NEAREST whatever filter is asked (ImagingScaleAffine: the
 * source coordinate accumulates a double step from half a step), 16-bit greyscale ("I;16") with
 * Pillow's 16-bit resampler (double weights, round half away from zero, clip to 0..65535); then
 * right/bottom padding with 0 in the image's own mode (a palette image pads with the colour of
 * index 0), or the centre crop when pad_input is off; then convert("RGB") (alpha dropped, not
 * composited; "I;16" clipped to 255); then float32 (x/255 - mean)/std in that float32 operation
 * order; patchify to [gh*gw, 3, p, p] (patches row-major, each channel-major).
 * Does not own: decoding files (image-decode.ts) or the vision forward.
 *
 * The official processor does all of this on the Pillow image; there is no documented
 * difference for the modes image-decode.ts produces (test/image-preprocess.test.ts checks every
 * fixture mode bit-identical against Pillow 13).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import type { DecodedImage } from "./image-decode.js";
import { ROPE_GRID_LIMIT } from "./image-budget.js";
import { JsonTextError, isJsonObject, jsonText, parseJson } from "../system/json-file.js";
import { UserError } from "../system/user-error.js";


export interface PreprocessorConfig {
  patchSize: number;
  inTokenLimit: number;
  mergeKernel: [number, number];
  padInput: boolean;
  imageMean: [number, number, number];
  imageStd: [number, number, number];
}

// -- the config --------------------------------------------------------------------------------

/** Reads and validates the pack's preprocessor_config.json (UserError naming the file and key when damaged); merge kernel from the argument (config.json vision_config) when given. */
export function loadPreprocessorConfig(packDir: string, mergeKernel?: [number, number]): PreprocessorConfig {
  const path = join(packDir, "preprocessor_config.json");
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (err) {
    throw new UserError(`${path} is missing or unreadable (${(err as Error).message}); rerun kvl pack`);
  }
  let config: unknown;
  try {
    config = parseJson(bytes);
  } catch (err) {
    if (err instanceof JsonTextError) throw new UserError(`${path} is not valid JSON (${err.message}); rerun kvl pack`);
    throw err;
  }
  if (!isJsonObject(config)) throw new UserError(`${path} is not a JSON object; rerun kvl pack`);
  const damaged = "the pack's preprocessor_config.json looks damaged; rerun kvl pack";
  const got = (key: string): string => (Object.hasOwn(config, key) ? jsonText(config[key]) : "nothing (it is missing)");
  const int = (key: string): number => {
    const value = config[key];
    if (!(typeof value === "number" && Number.isInteger(value) && value > 0)) {
      throw new UserError(`${path}: '${key}' must be a positive integer, got ${got(key)}; ${damaged}`);
    }
    return value;
  };
  const triple = (key: string): [number, number, number] => {
    const value = config[key];
    if (!Array.isArray(value) || value.length !== 3 || !value.every((v) => typeof v === "number" && Number.isFinite(v))) {
      throw new UserError(`${path}: '${key}' must be a list of 3 finite numbers, got ${got(key)}; ${damaged}`);
    }
    return [value[0] as number, value[1] as number, value[2] as number];
  };
  const patchSize = int("patch_size");
  const inTokenLimit = int("in_token_limit");
  const imageMean = triple("image_mean");
  const imageStd = triple("image_std");
  if (imageStd.some((s) => s === 0)) throw new UserError(`${path}: 'image_std' contains a zero; ${damaged}`);
  const merge: unknown = mergeKernel ?? config.merge_kernel_size;
  if (!Array.isArray(merge) || merge.length !== 2 || !merge.every((m) => typeof m === "number" && Number.isInteger(m) && m > 0)) {
    const [where, value] = mergeKernel === undefined ? [`${path}: 'merge_kernel_size'`, got("merge_kernel_size")] : ["merge_kernel_size", jsonText(merge)];
    throw new UserError(`${where} must be two positive integers, got ${value}`);
  }
  const padInput = config.pad_input ?? false;
  if (typeof padInput !== "boolean") {
    throw new UserError(`${path}: 'pad_input' must be true or false, got ${got("pad_input")}; ${damaged}`);
  }
  return { patchSize, inTokenLimit, mergeKernel: [merge[0] as number, merge[1] as number], padInput, imageMean, imageStd };
}

function checkConfig(config: PreprocessorConfig): void {
  const { patchSize: p, inTokenLimit: t, mergeKernel: [mh, mw] } = config;
  for (const [name, v] of [["patchSize", p], ["inTokenLimit", t], ["mergeKernel[0]", mh], ["mergeKernel[1]", mw]] as const) {
    if (!Number.isInteger(v) || v <= 0) throw new UserError(`preprocessor config: ${name} must be a positive integer, got ${v}`);
  }
}

// -- sizes, grids, tokens ----------------------------------------------------------------------

/** Official downscale rule: only when the patch count exceeds in_token_limit; int truncation. */
function resizedSize(width: number, height: number, patch: number, limit: number): [number, number] {
  const patches = Math.floor(width / patch) * Math.floor(height / patch);
  if (patches <= limit) return [width, height];
  const scale = Math.sqrt(limit / patches);
  return [Math.trunc(width * scale), Math.trunc(height * scale)];
}

function padded(dim: number, unit: number): number {
  return dim + ((unit - (dim % unit)) % unit);
}

function elongatedMessage(what: string, width: number, height: number, patch: number): string {
  return `${what} is too elongated: after scaling to the token limit it is ${width}x${height} pixels = ` +
    `${Math.floor(height / patch)}x${Math.floor(width / patch)} patches, and the vision model supports fewer than ` +
    `${ROPE_GRID_LIMIT} patches per side (official 'Exceed pos emb'); crop it to a less extreme aspect ratio`;
}

export function gridForSize(width: number, height: number, config: PreprocessorConfig): [number, number] {
  checkConfig(config);
  const patch = config.patchSize;
  const [mergeH, mergeW] = config.mergeKernel;
  if (!(width > 0) || !(height > 0)) throw new UserError(`an image of ${width}x${height} pixels has no content`);
  let [newW, newH] = resizedSize(width, height, patch, config.inTokenLimit);
  if (newW <= 0 || newH <= 0) {
    throw new UserError(`an image of ${width}x${height} pixels has too extreme an aspect ratio: downscaling it to the token ` +
      "limit leaves no pixels; crop it first");
  }
  if (config.padInput) {
    newW = padded(newW, patch * mergeW);
    newH = padded(newH, patch * mergeH);
  } else {
    newW -= newW % patch;
    newH -= newH % patch;
  }
  const gridH = Math.floor(newH / patch);
  const gridW = Math.floor(newW / patch);
  if (gridH >= ROPE_GRID_LIMIT || gridW >= ROPE_GRID_LIMIT) {
    throw new UserError(elongatedMessage(`an image of ${width}x${height} pixels`, newW, newH, patch));
  }
  if (gridH === 0 || gridW === 0 || gridH % mergeH || gridW % mergeW) {
    throw new UserError(`an image of ${width}x${height} pixels gives a ${gridH}x${gridW} patch grid, not a positive multiple ` +
      `of the ${mergeH}x${mergeW} merge kernel (pad_input is off in preprocessor_config.json); resize it to a multiple of ` +
      `${patch * mergeW}x${patch * mergeH} pixels`);
  }
  return [gridH, gridW];
}

/** Media tokens of one image: one per merge_h x merge_w block of patches. */
export function mediaTokens(grid: [number, number], merge: [number, number]): number {
  return Math.floor(grid[0] / merge[0]) * Math.floor(grid[1] / merge[1]);
}

// -- Pillow's resamplers -----------------------------------------------------------------------

/** Pillow's bicubic kernel (a = -0.5), same operation order as Resample.c bicubic_filter. */
function bicubicFilter(x: number): number {
  const a = -0.5;
  if (x < 0) x = -x;
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

const PRECISION_BITS = 32 - 8 - 2;

interface Coeffs {
  ksize: number;
  /** per output index: first source index, number of taps */
  bounds: Int32Array;
  /** weights [outSize, ksize], normalised to sum 1 (double) */
  kk: Float64Array;
}

/** Resample.c precompute_coeffs for the whole source (box 0..inSize) and the BICUBIC filter. */
function precomputeCoeffs(inSize: number, outSize: number): Coeffs {
  const scale = inSize / outSize;
  const filterscale = scale < 1 ? 1 : scale;
  const support = 2 * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const kk = new Float64Array(outSize * ksize);
  const invFilterscale = 1 / filterscale;
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    let ww = 0;
    let xmin = Math.trunc(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    let xmax = Math.trunc(center + support + 0.5);
    if (xmax > inSize) xmax = inSize;
    xmax -= xmin;
    const k = xx * ksize;
    for (let x = 0; x < xmax; x++) {
      const w = bicubicFilter((x + xmin - center + 0.5) * invFilterscale);
      kk[k + x] = w;
      ww += w;
    }
    if (ww !== 0) for (let x = 0; x < xmax; x++) kk[k + x]! /= ww;
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = xmax;
  }
  return { ksize, bounds, kk };
}

/** normalize_coeffs_8bpc: 22-bit fixed point, rounded half away from zero. */
function fixedPoint(kk: Float64Array): Int32Array {
  const out = new Int32Array(kk.length);
  const one = 1 << PRECISION_BITS;
  for (let i = 0; i < kk.length; i++) {
    const v = kk[i]!;
    out[i] = v < 0 ? Math.trunc(-0.5 + v * one) : Math.trunc(0.5 + v * one);
  }
  return out;
}

function clip8(ss: number): number {
  const v = ss >> PRECISION_BITS;
  return v < 0 ? 0 : v > 255 ? 255 : v;
}

/** MULDIV255: (a * b + 127) / 255 the way Pillow computes it. */
function mulDiv255(a: number, b: number): number {
  const tmp = a * b + 128;
  return ((tmp >> 8) + tmp) >> 8;
}

/** Pillow's "RGBa"/"La" premultiplication of one row (rgbA2rgba / lA2la), into `out`. */
function premultiplyRow(src: Uint8Array, start: number, pixels: number, channels: number, out: Uint8Array): void {
  for (let p = 0, i = start, o = 0; p < pixels; p++, i += channels, o += channels) {
    const alpha = src[i + channels - 1]!;
    for (let c = 0; c < channels - 1; c++) out[o + c] = mulDiv255(src[i + c]!, alpha);
    out[o + channels - 1] = alpha;
  }
}

/** Back from "RGBa"/"La" (rgba2rgbA / la2lA), in place. */
function unpremultiply(data: Uint8Array, channels: number): void {
  for (let i = 0; i < data.length; i += channels) {
    const alpha = data[i + channels - 1]!;
    if (alpha === 255 || alpha === 0) continue;
    for (let c = 0; c < channels - 1; c++) {
      const v = Math.floor((255 * data[i + c]!) / alpha);
      data[i + c] = v > 255 ? 255 : v;
    }
  }
}

/**
 * Image.resize((outW, outH), BICUBIC) of interleaved 8-bit data with 1-4 channels, as
 * ImagingResampleInner: the horizontal pass over the rows the vertical pass reads, then the
 * vertical pass; a pass is skipped when its dimension does not change. `premultiply`: the data
 * is RGBA/LA, premultiplied before and unpremultiplied after (Image.resize's RGBa/La route).
 */
export function resampleBicubic8(src: Uint8Array, width: number, height: number, channels: number, outW: number, outH: number,
  premultiply = false): Uint8Array {
  const needH = outW !== width;
  const needV = outH !== height;
  const vert = precomputeCoeffs(height, outH);
  const yFirst = vert.bounds[0]!;
  const yLast = vert.bounds[(outH - 1) * 2]! + vert.bounds[(outH - 1) * 2 + 1]!;
  let cur = src;
  let curW = width;
  let rowOffset = 0;   // source row of cur's first row
  let premultiplied = false;
  if (needH) {
    const { ksize, bounds, kk } = precomputeCoeffs(width, outW);
    const k = fixedPoint(kk);
    const rows = needV ? yLast - yFirst : height;
    const y0 = needV ? yFirst : 0;
    const out = new Uint8Array(outW * rows * channels);
    const rowBuf = premultiply ? new Uint8Array(width * channels) : undefined;
    const half = 1 << (PRECISION_BITS - 1);
    for (let yy = 0; yy < rows; yy++) {
      let line = src;
      let base = (yy + y0) * width * channels;
      if (rowBuf) {
        premultiplyRow(src, base, width, channels, rowBuf);
        line = rowBuf;
        base = 0;
      }
      let o = yy * outW * channels;
      // all channels of a tap together (as Resample.c does): one pass over the source row
      for (let xx = 0; xx < outW; xx++, o += channels) {
        const xmin = bounds[xx * 2]!;
        const xmax = bounds[xx * 2 + 1]!;
        const kb = xx * ksize;
        let i = base + xmin * channels;
        if (channels === 3) {
          let s0 = half, s1 = half, s2 = half;
          for (let x = 0; x < xmax; x++, i += 3) {
            const w = k[kb + x]!;
            s0 += line[i]! * w;
            s1 += line[i + 1]! * w;
            s2 += line[i + 2]! * w;
          }
          out[o] = clip8(s0);
          out[o + 1] = clip8(s1);
          out[o + 2] = clip8(s2);
        } else if (channels === 4) {
          let s0 = half, s1 = half, s2 = half, s3 = half;
          for (let x = 0; x < xmax; x++, i += 4) {
            const w = k[kb + x]!;
            s0 += line[i]! * w;
            s1 += line[i + 1]! * w;
            s2 += line[i + 2]! * w;
            s3 += line[i + 3]! * w;
          }
          out[o] = clip8(s0);
          out[o + 1] = clip8(s1);
          out[o + 2] = clip8(s2);
          out[o + 3] = clip8(s3);
        } else {
          for (let c = 0; c < channels; c++) {
            let ss = half;
            for (let x = 0, j = i + c; x < xmax; x++, j += channels) ss += line[j]! * k[kb + x]!;
            out[o + c] = clip8(ss);
          }
        }
      }
    }
    cur = out;
    curW = outW;
    rowOffset = y0;
    premultiplied = premultiply;
  } else if (premultiply) {
    const out = new Uint8Array(src.length);
    for (let y = 0; y < height; y++) {
      premultiplyRow(src, y * width * channels, width, channels, out.subarray(y * width * channels, (y + 1) * width * channels));
    }
    cur = out;
    premultiplied = true;
  }
  if (needV) {
    const { ksize, bounds, kk } = vert;
    const k = fixedPoint(kk);
    const out = new Uint8Array(curW * outH * channels);
    const half = 1 << (PRECISION_BITS - 1);
    const stride = curW * channels;
    for (let yy = 0; yy < outH; yy++) {
      const ymin = bounds[yy * 2]! - rowOffset;
      const ymax = bounds[yy * 2 + 1]!;
      const kb = yy * ksize;
      const o = yy * stride;
      for (let xc = 0; xc < stride; xc++) {
        let ss = half;
        let i = ymin * stride + xc;
        for (let y = 0; y < ymax; y++, i += stride) ss += cur[i]! * k[kb + y]!;
        out[o + xc] = clip8(ss);
      }
    }
    cur = out;
  }
  if (cur === src) cur = src.slice();
  if (premultiplied) unpremultiply(cur, channels);
  return cur;
}

/** ROUND_UP then CLIP16 of Resample.c's 16-bit passes. */
function roundClip16(ss: number): number {
  const v = Math.trunc(ss >= 0 ? ss + 0.5 : ss - 0.5);
  return v <= 0 ? 0 : v < 65536 ? v : 65535;
}

/** Image.resize BICUBIC of an "I;16" image (Resample.c _ImagingResample{Horizontal,Vertical}_16bpc). */
function resampleBicubic16(src: Uint16Array, width: number, height: number, outW: number, outH: number): Uint16Array {
  const needH = outW !== width;
  const needV = outH !== height;
  const vert = precomputeCoeffs(height, outH);
  const yFirst = vert.bounds[0]!;
  const yLast = vert.bounds[(outH - 1) * 2]! + vert.bounds[(outH - 1) * 2 + 1]!;
  let cur = src;
  let curW = width;
  let rowOffset = 0;
  if (needH) {
    const { ksize, bounds, kk } = precomputeCoeffs(width, outW);
    const rows = needV ? yLast - yFirst : height;
    const y0 = needV ? yFirst : 0;
    const out = new Uint16Array(outW * rows);
    for (let yy = 0; yy < rows; yy++) {
      const base = (yy + y0) * width;
      for (let xx = 0; xx < outW; xx++) {
        const xmin = bounds[xx * 2]!;
        const xmax = bounds[xx * 2 + 1]!;
        const kb = xx * ksize;
        let ss = 0;
        for (let x = 0; x < xmax; x++) ss += src[base + xmin + x]! * kk[kb + x]!;
        out[yy * outW + xx] = roundClip16(ss);
      }
    }
    cur = out;
    curW = outW;
    rowOffset = y0;
  }
  if (needV) {
    const { ksize, bounds, kk } = vert;
    const out = new Uint16Array(curW * outH);
    for (let yy = 0; yy < outH; yy++) {
      const ymin = bounds[yy * 2]! - rowOffset;
      const ymax = bounds[yy * 2 + 1]!;
      const kb = yy * ksize;
      for (let xx = 0; xx < curW; xx++) {
        let ss = 0;
        for (let y = 0; y < ymax; y++) ss += cur[(ymin + y) * curW + xx]! * kk[kb + y]!;
        out[yy * curW + xx] = roundClip16(ss);
      }
    }
    cur = out;
  }
  return cur === src ? src.slice() : cur;
}

/**
 * Image.resize of a "P" or "1" image (always NEAREST): _imaging.c _resize -> ImagingScaleAffine
 * with a = in/out per axis; source coordinates start at half a step and accumulate the step in
 * double; pixels whose coordinate falls outside the source keep the fill, palette index 0
 * (`fill`, its colour here).
 */
function resampleNearest(src: Uint8Array, width: number, height: number, channels: number, outW: number, outH: number,
  fill: readonly number[]): Uint8Array {
  const out = new Uint8Array(outW * outH * channels);
  const a0 = width / outW;
  const a4 = height / outH;
  const xintab = new Int32Array(outW);
  let xo = a0 * 0.5;
  for (let x = 0; x < outW; x++) {
    xintab[x] = xo < 0 ? -1 : Math.trunc(xo);
    xo += a0;
  }
  let yo = a4 * 0.5;
  for (let y = 0; y < outH; y++) {
    const yi = yo < 0 ? -1 : Math.trunc(yo);
    yo += a4;
    for (let x = 0; x < outW; x++) {
      const xi = xintab[x]!;
      const o = (y * outW + x) * channels;
      if (yi >= 0 && yi < height && xi >= 0 && xi < width) {
        const i = (yi * width + xi) * channels;
        for (let c = 0; c < channels; c++) out[o + c] = src[i + c]!;
      } else {
        for (let c = 0; c < channels; c++) out[o + c] = fill[c] ?? 0;
      }
    }
  }
  return out;
}

// -- the pipeline ------------------------------------------------------------------------------

const CHANNELS: Record<DecodedImage["mode"], number> = { RGB: 3, RGBA: 4, L: 1, LA: 2, P: 3 };

/** Python's round() of a half-integer or integer (round half to even). */
function roundHalfEven(x: number): number {
  const f = Math.floor(x);
  const diff = x - f;
  if (diff > 0.5) return f + 1;
  if (diff < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/**
 * The official uint8 RGB image before normalisation: resize in the image's own mode (when the
 * patch count exceeds in_token_limit), pad right/bottom (or centre-crop when pad_input is off),
 * convert("RGB"). rgb is [height, width, 3] row-major.
 */
export function resizePadRgb(image: DecodedImage, config: PreprocessorConfig): { width: number; height: number; rgb: Uint8Array; grid: [number, number] } {
  const { width, height, mode } = image;
  const channels = CHANNELS[mode];
  if (!Number.isInteger(width) || !Number.isInteger(height) || width <= 0 || height <= 0) {
    throw new UserError(`an image of ${width}x${height} pixels has no content`);
  }
  if (image.data.length < width * height * channels) {
    throw new Error(`image-preprocess: ${mode} data holds ${image.data.length} bytes, ${width}x${height}x${channels} expected`);
  }
  if (image.i16 && (mode !== "L" || image.i16.length < width * height)) throw new Error("image-preprocess: i16 samples need mode L and width*height samples");
  const grid = gridForSize(width, height, config);   // validates first: no huge pad for an absurd aspect ratio
  const patch = config.patchSize;
  const [newW, newH] = resizedSize(width, height, patch, config.inTokenLimit);
  const pad: readonly number[] = mode === "P" ? (image.padColour ?? [0, 0, 0]) : [0, 0, 0];

  // resize in the image's own mode
  let data = image.data;
  let i16 = image.i16;
  if (newW !== width || newH !== height) {
    if (i16) i16 = resampleBicubic16(i16, width, height, newW, newH);
    else if (mode === "P") data = resampleNearest(data, width, height, 3, newW, newH, pad);
    else data = resampleBicubic8(data, width, height, channels, newW, newH, mode === "RGBA" || mode === "LA");
  }

  // pad (or centre-crop), then convert("RGB")
  let outW: number;
  let outH: number;
  let left = 0;
  let top = 0;
  if (config.padInput) {
    const [mh, mw] = config.mergeKernel;
    outW = padded(newW, patch * mw);
    outH = padded(newH, patch * mh);
  } else {
    // pad_input false (not the shipped config): torchvision center_crop to whole patches
    outW = newW - (newW % patch);
    outH = newH - (newH % patch);
    top = roundHalfEven((newH - outH) / 2);
    left = roundHalfEven((newW - outW) / 2);
  }
  const rgb = new Uint8Array(outW * outH * 3);
  if (pad[0] || pad[1] || pad[2]) {
    for (let i = 0; i < rgb.length; i += 3) {
      rgb[i] = pad[0]!;
      rgb[i + 1] = pad[1]!;
      rgb[i + 2] = pad[2]!;
    }
  }
  const copyW = Math.min(outW, newW - left);
  const copyH = Math.min(outH, newH - top);
  for (let y = 0; y < copyH; y++) {
    const srcRow = (y + top) * newW + left;
    let o = y * outW * 3;
    if (i16) {
      for (let x = 0; x < copyW; x++, o += 3) {
        const s = i16[srcRow + x]!;
        const v = s < 255 ? s : 255;   // Convert.c I16_RGB
        rgb[o] = v;
        rgb[o + 1] = v;
        rgb[o + 2] = v;
      }
      continue;
    }
    let i = srcRow * channels;
    switch (mode) {
      case "RGB": case "P":
        rgb.set(data.subarray(i, i + copyW * 3), o);
        break;
      case "RGBA":
        for (let x = 0; x < copyW; x++, i += 4, o += 3) {
          rgb[o] = data[i]!;
          rgb[o + 1] = data[i + 1]!;
          rgb[o + 2] = data[i + 2]!;
        }
        break;
      case "L": case "LA":
        for (let x = 0; x < copyW; x++, i += channels, o += 3) {
          const v = data[i]!;
          rgb[o] = v;
          rgb[o + 1] = v;
          rgb[o + 2] = v;
        }
        break;
    }
  }
  return { width: outW, height: outH, rgb, grid };
}

/** Official resize / pad / convert("RGB") / normalise / patchify of one decoded image. */
export function preprocessImage(image: DecodedImage, config: PreprocessorConfig): { pixelValues: Float32Array; grid: [number, number] } {
  const { width, rgb, grid } = resizePadRgb(image, config);
  const p = config.patchSize;
  const [gh, gw] = grid;
  // float32 (x / 255 - mean) / std, each operation rounded to float32 as numpy does it
  const lut = new Float32Array(3 * 256);
  for (let c = 0; c < 3; c++) {
    const mean = Math.fround(config.imageMean[c]!);
    const std = Math.fround(config.imageStd[c]!);
    for (let v = 0; v < 256; v++) lut[c * 256 + v] = Math.fround(Math.fround(Math.fround(v / 255) - mean) / std);
  }
  const pixelValues = new Float32Array(gh * gw * 3 * p * p);
  let o = 0;
  for (let r = 0; r < gh; r++) {
    for (let q = 0; q < gw; q++) {
      for (let c = 0; c < 3; c++) {
        const table = c * 256;
        for (let ky = 0; ky < p; ky++) {
          let i = ((r * p + ky) * width + q * p) * 3 + c;
          for (let kx = 0; kx < p; kx++, i += 3) pixelValues[o++] = lut[table + rgb[i]!]!;
        }
      }
    }
  }
  return { pixelValues, grid };
}
