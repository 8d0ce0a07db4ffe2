/**
 * image-budget.ts — the memory an image decode takes, as arithmetic only (no sharp, no I/O), so the
 * RAM planner can reserve it and the decoder can refuse an image that would not fit.
 *
 * Owns: the bytes one decode + preprocessing holds at its peak for an image of a given size and
 * kind (the encoded file, libvips' buffers, the raw pixels, the resize passes), the byte budget
 * the plan reserves for "an image of P pixels" (imageDecodeBudget), the largest image a budget
 * admits (admittedPixels), the auto pixel limit's range (IMAGE_PIXELS_FLOOR..IMAGE_PIXELS_MAX)
 * and the message for an image over the budget.
 * Does not own: parsing headers or decoding (image-decode.ts), the resize itself
 * (image-preprocess.ts), choosing the limit for a plan (planner.ts "Image decode budget").
 *
 * Measured (node 20, linux-x64, the sharp in package-lock.json; a throwaway script reading VmHWM around
 * readFile + decodeImage + preprocessImage in a fresh process with sharp warmed up, random-pixel
 * images), peak growth per pixel beyond the encoded file:
 *   8000x8000 RGB PNG 3.91 B/px, RGBA PNG 4.91, RGB JPEG 3.90, 12 MP JPEG 5.92 (the fixed part
 *   dominates), interlaced RGB PNG 6.02, 5000x5000 WebP 10.37, 4000x4000 GIF 7.35, 6000x6000
 *   16-bit grey PNG 4.00 — each including the ~40 MiB of resize passes for the official grid.
 * The per-kind figures below bound those: raw output (<= 4 bytes/pixel, RGBA) for decoders that
 * stream in strips (JPEG, non-interlaced PNG); plus a full frame for those that need one
 * (interlaced PNG: channels x sample bytes <= 8; GIF: nsgif's RGBA frame; WebP: libwebp's
 * picture and its conversion); plus DECODE_FIXED_BYTES for libvips' state and strip buffers.
 */

const MIB = 2 ** 20;

/** How a format's decoder holds the picture while decoding (see the measured figures above). */
export type DecodeKind = "strips" | "interlaced-png" | "interlaced-png-16" | "gif" | "webp";

/** Peak bytes per pixel of a decode, the file excluded: raw output plus any full frame. */
export const DECODE_BYTES_PER_PIXEL: Readonly<Record<DecodeKind, number>> = Object.freeze({
  "strips": 4, "interlaced-png": 8, "interlaced-png-16": 12, "gif": 8, "webp": 12,
});

/** libvips' state, thread and strip buffers of one decode (measured 6 to 18 MiB above the raw output). */
export const DECODE_FIXED_BYTES = 32 * MIB;

/**
 * The encoded file the plan's budget allows for per pixel: a PNG of a photo takes 1.5 to 2 bytes
 * per pixel (random pixels at zlib level 1: 1.6 RGB, 2.2 RGBA), a JPEG well under 1. A larger
 * file of the same size in pixels is admitted only while the total still fits (need <= budget).
 */
export const PLANNED_FILE_BYTES_PER_PIXEL = 2;

/** The auto pixel limit never exceeds the decoder's hard limit (image-decode.ts DEFAULT_DECODE_LIMITS). */
export const IMAGE_PIXELS_MAX = 64_000_000;
/** ... and never goes below a normal phone photo (4000 x 3000): under it the plan refuses instead. */
export const IMAGE_PIXELS_FLOOR = 12_000_000;

/** What the preprocessing of an image needs to know: the patch side and the token limit. */
export interface ResizeShape {
  patchSize: number;
  inTokenLimit: number;
}

/**
 * Bytes of image-preprocess.ts's resize and pad for an image of `pixels`: the horizontal pass's
 * output (new width x source height, <= 4 bytes per pixel; new width x height = p * sqrt(limit *
 * pixels) after the official downscale), the vertical pass's output and the padded RGB copy (each
 * < 2 x limit x p^2 pixels, 4 and 3 bytes). The normalised float pixels are the plan's vision line.
 */
export function resizeBytes(pixels: number, shape: ResizeShape): number {
  const p = shape.patchSize;
  const limit = shape.inTokenLimit;
  return Math.ceil(4 * p * Math.sqrt(limit * Math.max(pixels, 0))) + 16 * limit * p * p + MIB;
}

/** Peak bytes of decoding and preprocessing one image whose encoded file is fileBytes long. */
export function decodeNeedBytes(pixels: number, kind: DecodeKind, fileBytes: number, shape: ResizeShape): number {
  return DECODE_FIXED_BYTES + DECODE_BYTES_PER_PIXEL[kind] * pixels + fileBytes + resizeBytes(pixels, shape);
}

/** The plan's reservation for images of up to `pixels` decoded in strips (JPEG, PNG) with a typical file. */
export function imageDecodeBudget(pixels: number, shape: ResizeShape): number {
  return decodeNeedBytes(pixels, "strips", PLANNED_FILE_BYTES_PER_PIXEL * pixels, shape);
}

/** The most pixels of `kind` (file of fileBytesPerPixel) that fit budgetBytes; 0 when none do. */
export function admittedPixels(budgetBytes: number, kind: DecodeKind, fileBytesPerPixel: number, shape: ResizeShape): number {
  const fits = (px: number): boolean => decodeNeedBytes(px, kind, fileBytesPerPixel * px, shape) <= budgetBytes;
  if (!fits(0)) return 0;
  let lo = 0;
  let hi = IMAGE_PIXELS_MAX;
  if (fits(hi)) return hi;
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/** Megapixels with one decimal. */
export function megapixels(pixels: number): string {
  return (pixels / 1e6).toFixed(1);
}

/** The reason an image is over the plan's decode budget, and what to do about it. */
export function overBudgetMessage(what: string, width: number, height: number, kind: DecodeKind, fileBytes: number,
  budgetBytes: number, shape: ResizeShape): string {
  const pixels = width * height;
  const need = decodeNeedBytes(pixels, kind, fileBytes, shape);
  const fit = admittedPixels(budgetBytes, kind, fileBytes / Math.max(pixels, 1), shape);
  const how = kind === "strips" ? "" : ` (${kind === "webp" ? "WebP" : kind === "gif" ? "GIF" : "interlaced PNG"} decodes the whole frame at once)`;
  const todo = fit > 0 ? `downscale it to at most ${megapixels(fit)} megapixels` : "downscale it";
  return `${what} is ${width}x${height} = ${megapixels(pixels)} megapixels: decoding it needs about ${(need / MIB).toFixed(0)} MiB` +
    `${how}, over the ${(budgetBytes / MIB).toFixed(0)} MiB the RAM plan reserves for decoding an image; ${todo}, ` +
    "or raise --ram-mib (the plan's 'image decode' line shows the limit)";
}
