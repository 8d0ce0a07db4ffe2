/**
 * image-budget.ts — the memory an image decode takes, as arithmetic only (no sharp, no I/O), so the
 * RAM planner can reserve it and the decoder can refuse an image that would not fit.
 *
 * Owns: the bytes one decode + preprocessing holds at its peak for an image of a given size and
 * kind (the encoded file, libvips' buffers, the raw pixels, the resize passes), the byte budget
 * the plan reserves for "an image of P pixels" (imageDecodeBudget), the auto pixel limit's range
 * (IMAGE_PIXELS_FLOOR..IMAGE_PIXELS_MAX), and admission: the one rule that admits or refuses an
 * image under the plan's budget (imageRefusal, with its message), the limit per decode kind it
 * admits (imagePixelLimit) and how every message shows megapixels (megapixels, imageLimitsText).
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
const PLANNED_FILE_BYTES_PER_PIXEL = 2;

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
function resizeBytes(pixels: number, shape: ResizeShape): number {
  const p = shape.patchSize;
  const limit = shape.inTokenLimit;
  return Math.ceil(4 * p * Math.sqrt(limit * Math.max(pixels, 0))) + 16 * limit * p * p + MIB;
}

/** Peak bytes of decoding and preprocessing one image whose encoded file is fileBytes long. */
function decodeNeedBytes(pixels: number, kind: DecodeKind, fileBytes: number, shape: ResizeShape): number {
  return DECODE_FIXED_BYTES + DECODE_BYTES_PER_PIXEL[kind] * pixels + fileBytes + resizeBytes(pixels, shape);
}

/** The plan's reservation for images of up to `pixels` decoded in strips (JPEG, PNG) with a typical file. */
export function imageDecodeBudget(pixels: number, shape: ResizeShape): number {
  return decodeNeedBytes(pixels, "strips", PLANNED_FILE_BYTES_PER_PIXEL * pixels, shape);
}

/** The most pixels of `kind` (file of fileBytesPerPixel) that fit budgetBytes; 0 when none do. */
function admittedPixels(budgetBytes: number, kind: DecodeKind, fileBytesPerPixel: number, shape: ResizeShape): number {
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

/** The plan's decode budget an image is checked against (planner.ts ImageBudget; image-decode.ts DecodeLimits). */
export interface DecodeBudget {
  bytes: number;
  shape: ResizeShape;
}

/** Decode kinds with the same bytes per pixel have the same limit; named as users know them. */
const KIND_GROUPS: ReadonlyArray<{ kinds: readonly DecodeKind[]; names: readonly string[] }> = [
  { kinds: ["strips"], names: ["JPEG", "PNG"] },
  { kinds: ["gif", "interlaced-png"], names: ["GIF", "interlaced PNG"] },
  { kinds: ["webp", "interlaced-png-16"], names: ["WebP", "16-bit interlaced PNG"] },
];

/**
 * The largest image of `kind` the budget admits, in pixels: the limit every message quotes (the
 * plan's image decode line, kvl serve's ready line, a refusal). Its encoded file is counted at
 * the planned bytes per pixel, so for JPEG and PNG this is exactly the pixels the plan reserved for.
 */
function imagePixelLimit(budget: DecodeBudget, kind: DecodeKind): number {
  return admittedPixels(budget.bytes, kind, PLANNED_FILE_BYTES_PER_PIXEL, budget.shape);
}

/**
 * Megapixels as every message shows them, with one decimal: a limit rounded down (what is shown
 * is admitted), an image's size rounded up (an image shown at the limit's figure is within it).
 */
function megapixels(pixels: number, round: "down" | "up" = "down"): string {
  const tenths = round === "down" ? Math.floor(pixels / 100_000) : Math.ceil(pixels / 100_000);
  return `${Math.floor(tenths / 10)}.${tenths % 10} MP`;
}

/** The budget's limits as the plan's line and the ready lines quote them: "up to 35.7 MP (JPEG, PNG), 23.8 MP
 * (GIF, interlaced PNG), ..." ("first": the JPEG and PNG limit only). */
export function imageLimitsText(budget: DecodeBudget, groups: "all" | "first" = "all"): string {
  const shown = groups === "all" ? KIND_GROUPS : KIND_GROUPS.slice(0, 1);
  return `up to ${shown.map((g) => `${megapixels(imagePixelLimit(budget, g.kinds[0]!))} (${g.names.join(", ")})`).join(", ")}`;
}

/**
 * Admission of an image to a decode under the plan: null when admitted, else why not and what to
 * do. The one rule chat and serve apply (image-decode.ts, from the header): at most
 * imagePixelLimit(kind) pixels, and — for a file denser than planned — the decode with the actual
 * file must still fit the budget.
 */
export function imageRefusal(budget: DecodeBudget, what: string, width: number, height: number, kind: DecodeKind, fileBytes: number): string | null {
  const pixels = width * height;
  const limit = imagePixelLimit(budget, kind);
  const need = decodeNeedBytes(pixels, kind, fileBytes, budget.shape);
  if (pixels <= limit && need <= budget.bytes) return null;
  const names = KIND_GROUPS.find((g) => g.kinds.includes(kind))!.names.join(" or ");
  const size = `${what} is ${width}x${height} = ${megapixels(pixels, "up")}`;
  // a plan below the ceiling can reserve for more; at the ceiling only a smaller image helps
  const more = imagePixelLimit(budget, "strips") < IMAGE_PIXELS_MAX
    ? ", or raise --ram-mib or --max-image-mp (the plan's 'image decode' line shows the limits)" : "";
  if (pixels > limit) {
    const todo = limit > 0 ? `downscale it to at most ${megapixels(limit)}` : "send a smaller image";
    const whole = kind === "strips" ? "" : " (which decodes the whole frame at once)";
    return `${size}, over the ${megapixels(limit)} the RAM plan admits for a ${names}${whole}; ${todo}${more}`;
  }
  return `${size}, within the ${megapixels(limit)} limit for a ${names}, but its file is ${(fileBytes / MIB).toFixed(1)} MiB: ` +
    `decoding it needs about ${(need / MIB).toFixed(0)} MiB, over the ${(budget.bytes / MIB).toFixed(0)} MiB the RAM plan reserves; ` +
    `re-encode it more compactly (e.g. as JPEG) or downscale it${more}`;
}

/**
 * The official processor rejects grids with >= 512 patches per side: MoonViT's 2D-RoPE table is
 * built for 512 x 512 positions in the modeling code (not serialised in config.json). The
 * preprocessor refuses such an image and the plan's largest image stays below it.
 */
export const ROPE_GRID_LIMIT = 512;
