/**
 * image-decode.ts — decoding a user's image (file path or bytes) into the pixels the official
 * Kimi-VL processor works on, with clear errors and hard limits.
 *
 * Owns: reading the source (size limit checked before the file is read), recognising the format
 * by its signature (JPEG, PNG, WebP, GIF only: every other decoder is attack surface), parsing the
 * header ourselves (dimensions and the pixel limit before any pixel is decoded; the Pillow mode
 * the official processor would see), decoding with sharp (libvips) to raw pixels, and mapping
 * them to that Pillow mode (DecodedImage); checking that an image decodes without keeping its
 * pixels (checkImage: the server's check before a reply starts); libvips pipelines one at a time
 * in the process (the plan reserves one decode). Does not own: resizing, padding, normalising
 * (image-preprocess.ts) or the token arithmetic.
 *
 * Why the Pillow mode matters (spec §6 step 4): the official processor resizes and pads in the
 * mode Pillow opened the file in and only then calls convert("RGB"). The mode comes from the file's
 * own header, not from sharp's metadata, which cannot tell some of them apart (an 8-bit grey PNG
 * with tRNS and a grey+alpha PNG both report channels 2, hasAlpha true; Pillow opens the first as
 * "L", the second as "LA"; sharp has no palette contents at all). So the header decides:
 *   PNG  colour type 0: 1-bit -> "1" (returned as "P", colours 0/255, pad black), 2/4/8-bit -> "L",
 *        16-bit -> "I;16" (returned as "L" plus the 16-bit samples `i16`; see below);
 *        type 2 -> "RGB" (16-bit: Pillow keeps the high byte of each sample, and so does libvips'
 *        16->8 bit conversion; checked bit-identical); type 3 -> "P" (pad colour = PLTE entry 0);
 *        type 4 -> "LA" (16-bit: Pillow opens it as "RGBA" with R=G=B, and so do we);
 *        type 6 -> "RGBA". A tRNS chunk does not change the mode (convert("RGB") ignores it), so
 *        the alpha sharp adds for it is dropped.
 *   JPEG 1 component -> "L", 3 -> "RGB", 4 (CMYK/YCCK) -> refused (out of scope: Pillow's naive
 *        CMYK->RGB is not reproduced). Only 8-bit JPEG (Pillow refuses 12-bit).
 *   WebP "RGBA" if libwebp's WebPGetFeatures reports alpha (VP8X alpha flag, VP8L alpha bit, or an
 *        ALPH chunk; the same rule is implemented here), else "RGB".
 *   GIF  first frame: "P" with the frame's colour table (local, else global), or "L" when that
 *        table is exactly the identity grey ramp (Pillow's _is_palette_needed). Pillow paints the
 *        frame on a canvas filled with the transparent index (if the frame has one) else index 0;
 *        transparent pixels keep their index, so convert("RGB") shows that index's colour.
 *        libvips returns transparent pixels as alpha 0 and leaves the canvas outside the frame
 *        empty, so both are repainted here with the colour Pillow uses (checked on fixtures).
 * EXIF orientation is never applied and embedded ICC profiles are ignored (ignoreIcc): the
 * official processor sees the stored pixels. JPEG: sharp's libjpeg-turbo-derived decoder (mozjpeg)
 * and Pillow's libjpeg-turbo give identical pixels for baseline and progressive, 4:2:0 and 4:4:4
 * (islow IDCT, fancy upsampling; checked on the fixtures).
 *
 * Limits: the file size is checked before reading (fstat), width x height against maxPixels from
 * our own header parse before sharp sees the data (sharp's limitInputPixels is set too), and
 * sharp runs with failOn "error": truncated or undecodable data is an error instead of grey rows,
 * while data a decoder recovers from with a warning decodes, as it does in Pillow (a JPEG with
 * corrupt entropy-coded data decodes to the same pixels in both; fixture rgb-corrupt-scan.jpg).
 * failOn "warning" is documented to abort on such warnings as well, which Pillow does not.
 *
 * Documented differences from Pillow (found while checking; none affects the fixtures):
 *   - A GIF without any colour table (neither global nor local): Pillow opens it as "L" with the
 *     raw indices; libvips has no colours for it. Refused with a UserError.
 *   - GIF/PNG palette indices beyond the colour table's length: not reproduced (unverified).
 *   - Animated WebP whose first frame does not cover the canvas: not verified.
 *   - Which damaged files are refused differs in details: Pillow refuses a PNG with a bad CRC in
 *     an ancillary chunk before IDAT (e.g. tEXt), libpng drops that chunk and decodes the image.
 * Memory: see decodeBufferBytes, and image-budget.ts for the bytes the RAM plan reserves: an image
 * whose decode would need more than DecodeLimits.budget is refused from its header, before any
 * pixel is decoded (with its size, the limit and what to do).
 */
import { open, stat } from "node:fs/promises";

import type sharpModule from "sharp";
import type { OutputInfo, SharpOptions } from "sharp";

import { DECODE_BYTES_PER_PIXEL, DECODE_FIXED_BYTES, type DecodeBudget, type DecodeKind, imageRefusal } from "./image-budget.js";
import { requireDependency } from "../system/paths.js";
import { UserError } from "../system/user-error.js";

export interface DecodeLimits {
  maxPixels: number;
  maxFileBytes: number;
  /** The RAM plan's image decode line (planner.ts): an image it does not admit (image-budget.ts
   * imageRefusal) is refused from its header. Absent: no such check. */
  budget?: DecodeBudget;
}

/** 64 megapixels (~256 MB as RGBA), files up to 256 MiB (compressed data). */
export const DEFAULT_DECODE_LIMITS: DecodeLimits = Object.freeze({ maxPixels: 64_000_000, maxFileBytes: 256 * 1024 * 1024 });

/** An image as the official processor holds it before convert("RGB"): its Pillow mode family and pixels. */
export interface DecodedImage {
  width: number;
  height: number;
  /** "RGB" | "RGBA" | "L" | "LA" | "P" (palette and 1-bit: resized NEAREST) — see spec §6 step 4 */
  mode: "RGB" | "RGBA" | "L" | "LA" | "P";
  /** interleaved 8-bit channels: RGB 3, RGBA 4, L 1, LA 2, P: 3 (the palette colours, RGB) */
  data: Uint8Array;
  /** P only: the RGB colour of palette index 0 (what Pillow pads with) */
  padColour?: [number, number, number];
  /**
   * Pillow mode "I;16" (a 16-bit greyscale PNG), mode "L" only: the 16-bit samples. Pillow resizes
   * them with its 16-bit resampler and convert("RGB") then clips each to 255 (Convert.c I16_RGB),
   * so most of such an image turns white — the official behaviour, reproduced. `data` holds
   * min(sample, 255), which is what the image is when it is not resized.
   */
  i16?: Uint16Array;
}

type ImageFormat = "JPEG" | "PNG" | "WebP" | "GIF";
const SUPPORTED = "JPEG, PNG, WebP, GIF";

/** The mode Pillow opens the file in ("1" and "I;16" are reported as "P" and "L" in DecodedImage). */
type PillowMode = "RGB" | "RGBA" | "L" | "LA" | "P" | "1" | "I;16";

interface GifFrame {
  /** frame rectangle inside the (possibly enlarged) canvas */
  x: number;
  y: number;
  w: number;
  h: number;
  /** colour (P) or grey value (L, as r=g=b) Pillow fills the canvas outside the frame with */
  fill: [number, number, number];
  /** colour of the frame's transparent index, when it has one */
  transparent?: [number, number, number];
}

interface Header {
  format: ImageFormat;
  width: number;
  height: number;
  mode: PillowMode;
  padColour?: [number, number, number];
  gif?: GifFrame;
  /** PNG: Adam7 interlacing (libpng then holds every pass: a full frame) */
  interlaced?: boolean;
  /** PNG: 16-bit samples */
  deep?: boolean;
}

/** How the decoder of this file holds its picture (image-budget.ts). */
function decodeKind(header: Header): DecodeKind {
  switch (header.format) {
    case "WebP": return "webp";
    case "GIF": return "gif";
    case "PNG": return header.interlaced ? (header.deep ? "interlaced-png-16" : "interlaced-png") : "strips";
    case "JPEG": return "strips";
  }
}

// -- sharp set-up ------------------------------------------------------------------------------

let sharpLoaded: typeof sharpModule | undefined;

/**
 * sharp, loaded on first use (only images need it: loading it costs every other command ~0.1 s
 * and ~20 MB) where paths.ts says (a single executable's asset folder too), and set up once per
 * process: no libvips operation cache (a decoded image is used once; the cache would
 * keep up to 50 MB of pixels alive) and one libvips worker thread per image — the decoders
 * themselves (libpng, libjpeg, libwebp, nsgif) are sequential, and every extra worker would hold
 * its own strip buffers. Both are process-wide sharp settings; nothing else in kvl uses sharp.
 */
function loadSharp(): typeof sharpModule {
  if (sharpLoaded) return sharpLoaded;
  const sharp = requireDependency("sharp") as typeof sharpModule;
  sharp.cache(false);
  sharp.concurrency(1);
  sharpLoaded = sharp;
  return sharp;
}

/**
 * Peak bytes the decode path holds for an image of width x height, for the RAM planner.
 * Buffers: sharp's raw output, kept as DecodedImage.data without a copy (at most RGBA, 4
 * bytes/pixel; channels are dropped in place); libvips' full-frame buffer where the format needs
 * one — GIF (nsgif renders RGBA frames), WebP (libwebp decodes the whole picture), interlaced PNG
 * (libpng needs all passes; 8 bytes/pixel for 16-bit RGBA) — while JPEG and non-interlaced PNG
 * stream in strips; for a 16-bit greyscale PNG the 16-bit samples next to the clipped 8-bit copy.
 * The bound is the worst case, an interlaced 16-bit RGBA PNG (8 + 4 = 12 bytes/pixel), plus
 * libvips' strip buffers and state. Measured peaks over Node's baseline for 8000 x 8000
 * (RGBA = 256 MB), including the file read into memory: RGBA PNG 275 MB, JPEG 202 MB,
 * interlaced PNG / WebP / GIF ~515 MB, interlaced 16-bit RGBA PNG 760 MB (bound: 800 MB).
 * Not included: the encoded file itself (read whole, at most maxFileBytes) and preprocessing
 * (image-preprocess.ts: the resized image and one intermediate pass, small after a downscale).
 */
export function decodeBufferBytes(width: number, height: number): number {
  const pixels = Math.max(0, width) * Math.max(0, height);
  return pixels * DECODE_BYTES_PER_PIXEL["interlaced-png-16"] + DECODE_FIXED_BYTES;
}

// -- reading the source ------------------------------------------------------------------------

interface Source {
  what: string;
  bytes: Uint8Array;
  /** the whole file (or buffer) is in `bytes` */
  complete: boolean;
  /** when incomplete, how to get the rest */
  readAll?: () => Promise<Uint8Array>;
  /** the whole file's (or buffer's) length */
  size: number;
}

function describe(source: string | Uint8Array): string {
  return typeof source === "string" ? `image file '${source}'` : `image data (${source.length} bytes)`;
}

function osReason(err: unknown): string {
  const code = (err as NodeJS.ErrnoException).code;
  switch (code) {
    case "ENOENT": return "no such file or directory";
    case "EACCES": case "EPERM": return "permission denied";
    case "EISDIR": return "it is a directory";
    case "ENOTDIR": return "a component of the path is not a directory";
    case "ELOOP": return "too many levels of symbolic links";
    default: return (err as Error).message;
  }
}

/** Reads the source; a file only up to `prefix` bytes when given (imageSize), never past maxFileBytes. */
async function readSource(source: string | Uint8Array, limits: DecodeLimits, prefix?: number): Promise<Source> {
  if (typeof source !== "string" && !(source instanceof Uint8Array)) {
    const kind = source === null ? "null" : typeof source;
    throw new UserError(`an image must be given as bytes or a file path, not ${kind}`);
  }
  const what = describe(source);
  if (source instanceof Uint8Array) {
    if (source.length > limits.maxFileBytes) {
      throw new UserError(`${what} is over the ${limits.maxFileBytes}-byte limit for images; downscale or recompress it`);
    }
    if (source.length === 0) throw new UserError(`${what} is empty; send a JPEG, PNG, WebP or GIF image`);
    return { what, bytes: source, complete: true, size: source.length };
  }
  const path = source;
  let size: number;
  try {
    // stat before open: opening a FIFO would block, a directory is refused by name
    const st = await stat(path);
    if (st.isDirectory()) throw Object.assign(new Error("is a directory"), { code: "EISDIR" });
    if (!st.isFile()) throw new UserError(`cannot read ${what}: it is not a regular file; check the path`);
  } catch (err) {
    if (err instanceof UserError) throw err;
    throw new UserError(`cannot read ${what}: ${osReason(err)}; check the path`);
  }
  let handle;
  try {
    handle = await open(path, "r");
  } catch (err) {
    throw new UserError(`cannot read ${what}: ${osReason(err)}; check the path`);
  }
  try {
    try {
      const st = await handle.stat();   // the file actually opened
      if (!st.isFile()) throw new UserError(`cannot read ${what}: it is not a regular file; check the path`);
      size = st.size;
    } catch (err) {
      if (err instanceof UserError) throw err;
      throw new UserError(`cannot read ${what}: ${osReason(err)}; check the path`);
    }
    if (size > limits.maxFileBytes) {
      throw new UserError(`${what} is ${size} bytes, over the ${limits.maxFileBytes}-byte limit for images; downscale or recompress it`);
    }
    if (size === 0) throw new UserError(`${what} is empty; send a JPEG, PNG, WebP or GIF image`);
    const readBytes = async (n: number): Promise<Uint8Array> => {
      const buf = Buffer.allocUnsafe(n);
      let got = 0;
      try {
        while (got < n) {
          const { bytesRead } = await handle!.read(buf, got, n - got, got);
          if (bytesRead === 0) break;   // the file shrank since fstat
          got += bytesRead;
        }
      } catch (err) {
        throw new UserError(`cannot read ${what}: ${osReason(err)}; check the path`);
      }
      return got === n ? buf : buf.subarray(0, got);
    };
    if (prefix !== undefined && prefix < size) {
      // imageSize: the header is at the start; the rest is read only if the header parser needs
      // it (a JPEG with large APP segments before its SOF)
      return { what, bytes: await readBytes(prefix), complete: false, readAll: () => readSource(path, limits).then((s) => s.bytes), size };
    }
    const bytes = await readBytes(size);
    if (bytes.length === 0) throw new UserError(`${what} is empty; send a JPEG, PNG, WebP or GIF image`);
    return { what, bytes, complete: true, size: bytes.length };
  } finally {
    await handle.close();
  }
}

// -- header parsing ----------------------------------------------------------------------------

/** The supported format the file's signature names, or null. */
function sniffFormat(data: Uint8Array): ImageFormat | null {
  const at = (i: number, s: string): boolean => {
    for (let k = 0; k < s.length; k++) if (data[i + k] !== s.charCodeAt(k)) return false;
    return data.length >= i + s.length;
  };
  if (at(0, "\x89PNG\r\n\x1a\n")) return "PNG";
  if (at(0, "\xff\xd8\xff")) return "JPEG";
  if (at(0, "GIF87a") || at(0, "GIF89a")) return "GIF";
  if (at(0, "RIFF") && at(8, "WEBP")) return "WebP";
  return null;
}

/** Thrown by a header parser that ran off the end of an incomplete prefix. */
class NeedMore extends Error {}

class HeaderError extends Error {}

/** Bounds-checked big/little-endian reads over the header bytes. */
class Bytes {
  constructor(readonly b: Uint8Array, readonly complete: boolean) {}
  need(end: number, what: string): void {
    if (end > this.b.length) {
      if (!this.complete) throw new NeedMore();
      throw new HeaderError(`the file ends inside ${what}`);
    }
  }
  u8(i: number): number {
    this.need(i + 1, "the header");
    return this.b[i]!;
  }
  be16(i: number): number {
    this.need(i + 2, "the header");
    return (this.b[i]! << 8) | this.b[i + 1]!;
  }
  be32(i: number): number {
    this.need(i + 4, "the header");
    return ((this.b[i]! << 24) >>> 0) + (this.b[i + 1]! << 16) + (this.b[i + 2]! << 8) + this.b[i + 3]!;
  }
  le16(i: number): number {
    this.need(i + 2, "the header");
    return this.b[i]! | (this.b[i + 1]! << 8);
  }
  le24(i: number): number {
    this.need(i + 3, "the header");
    return this.b[i]! | (this.b[i + 1]! << 8) | (this.b[i + 2]! << 16);
  }
  le32(i: number): number {
    this.need(i + 4, "the header");
    return (this.b[i]! | (this.b[i + 1]! << 8) | (this.b[i + 2]! << 16)) + this.b[i + 3]! * 2 ** 24;
  }
  tag(i: number): string {
    this.need(i + 4, "the header");
    return String.fromCharCode(this.b[i]!, this.b[i + 1]!, this.b[i + 2]!, this.b[i + 3]!);
  }
}

let crcTable: Uint32Array | undefined;

function crc32(data: Uint8Array, start: number, end: number): number {
  if (!crcTable) {
    crcTable = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      crcTable[n] = c >>> 0;
    }
  }
  let c = 0xffffffff;
  for (let i = start; i < end; i++) c = crcTable[(c ^ data[i]!) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

// PNG (bit depth, colour type) -> Pillow mode, as PngImagePlugin._MODES
const PNG_MODES: Record<string, PillowMode> = {
  "1,0": "1", "2,0": "L", "4,0": "L", "8,0": "L", "16,0": "I;16",
  "8,2": "RGB", "16,2": "RGB",
  "1,3": "P", "2,3": "P", "4,3": "P", "8,3": "P",
  "8,4": "LA", "16,4": "RGBA",
  "8,6": "RGBA", "16,6": "RGBA",
};

function parsePng(r: Bytes, sizeOnly: boolean): Header {
  if (r.be32(8) !== 13 || r.tag(12) !== "IHDR") throw new HeaderError("no IHDR chunk first");
  r.need(33, "the IHDR chunk");
  if (crc32(r.b, 12, 29) !== r.be32(29)) throw new HeaderError("IHDR checksum mismatch");
  const width = r.be32(16);
  const height = r.be32(20);
  const depth = r.u8(24);
  const colourType = r.u8(25);
  if (width > 0x7fffffff || height > 0x7fffffff) throw new HeaderError("dimensions beyond the PNG maximum");
  const mode = PNG_MODES[`${depth},${colourType}`];
  if (!mode) throw new HeaderError(`unsupported bit depth ${depth} with colour type ${colourType}`);
  if (r.u8(26) !== 0 || r.u8(27) !== 0 || r.u8(28) > 1) throw new HeaderError("unknown compression, filter or interlace method");
  const header: Header = { format: "PNG", width, height, mode, interlaced: r.u8(28) === 1, deep: depth === 16 };
  if (mode === "1") header.padColour = [0, 0, 0];
  if (mode !== "P" || sizeOnly) return header;
  // the palette: chunks until PLTE (it must come before IDAT)
  let at = 33;
  for (;;) {
    const len = r.be32(at);
    const tag = r.tag(at + 4);
    if (tag === "IDAT" || tag === "IEND") throw new HeaderError("palette image without a PLTE chunk");
    if (len > 0x7fffffff) throw new HeaderError(`bad length of chunk ${JSON.stringify(tag)}`);
    if (tag === "PLTE") {
      r.need(at + 12 + len, "the PLTE chunk");
      if (len < 3 || len % 3 !== 0) throw new HeaderError("bad PLTE chunk length");
      if (crc32(r.b, at + 4, at + 8 + len) !== r.be32(at + 8 + len)) throw new HeaderError("PLTE checksum mismatch");
      header.padColour = [r.b[at + 8]!, r.b[at + 9]!, r.b[at + 10]!];
      return header;
    }
    at += 12 + len;
  }
}

function parseJpeg(r: Bytes, what: string): Header {
  // marker walk as Pillow's JpegImageFile._open: junk before a 0xFF is skipped, fill bytes too
  let i = 2;
  for (;;) {
    if (r.u8(i) !== 0xff) {
      i++;
      continue;
    }
    const marker = r.u8(i + 1);
    if (marker === 0xff || marker === 0x00) {
      i++;
      continue;
    }
    if ((marker >= 0xd0 && marker <= 0xd7) || marker === 0x01) {
      i += 2;
      continue;
    }
    if (marker === 0xd9 || marker === 0xda) throw new HeaderError("no frame header (SOF) before the image data");
    const len = r.be16(i + 2);
    if (len < 2) throw new HeaderError("bad segment length");
    const sof = marker >= 0xc0 && marker <= 0xcf && marker !== 0xc4 && marker !== 0xc8 && marker !== 0xcc;
    if (sof) {
      r.need(i + 2 + len, "the SOF segment");
      if (len < 8) throw new HeaderError("SOF segment too short");
      const bits = r.u8(i + 4);
      const height = r.be16(i + 5);
      const width = r.be16(i + 7);
      const components = r.u8(i + 9);
      if (bits !== 8) throw new HeaderError(`${bits}-bit samples (only 8-bit JPEG is supported)`);
      if (components === 4) {
        throw new UserError(`${what} is a CMYK JPEG, which is not supported; convert it to RGB (re-save it as an sRGB JPEG or PNG)`);
      }
      if (components !== 1 && components !== 3) throw new HeaderError(`${components} colour components`);
      return { format: "JPEG", width, height, mode: components === 1 ? "L" : "RGB" };
    }
    i += 2 + len;
  }
}

function parseWebp(r: Bytes): Header {
  // libwebp ParseHeadersInternal, as WebPGetFeatures uses it (which is what sets Pillow's mode)
  const riffSize = r.le32(4);
  if (riffSize < 12) throw new HeaderError("RIFF size too small");
  let at = 12;
  let hasAlpha = false;
  let canvas: { w: number; h: number } | undefined;
  if (r.tag(at) === "VP8X") {
    if (r.le32(at + 4) !== 10) throw new HeaderError("bad VP8X chunk size");
    const flags = r.le32(at + 8);
    canvas = { w: 1 + r.le24(at + 12), h: 1 + r.le24(at + 15) };
    hasAlpha = (flags & 0x10) !== 0;
    if (flags & 0x02) return { format: "WebP", width: canvas.w, height: canvas.h, mode: hasAlpha ? "RGBA" : "RGB" };  // animated
    at += 18;
  }
  let alphChunk = false;
  for (;;) {
    const tag = r.tag(at);
    const size = r.le32(at + 4);
    if (tag === "VP8 " || tag === "VP8L") break;
    if (!canvas) throw new HeaderError(`unexpected chunk ${JSON.stringify(tag)}`);
    if (tag === "ALPH") alphChunk = true;
    at += 8 + size + (size & 1);
  }
  let width: number;
  let height: number;
  const payload = at + 8;
  if (r.tag(at) === "VP8 ") {
    const bits = r.le24(payload);
    if (bits & 1) throw new HeaderError("the first VP8 frame is not a key frame");
    if (((bits >> 1) & 7) > 3 || !((bits >> 4) & 1)) throw new HeaderError("bad VP8 frame header");
    if (r.u8(payload + 3) !== 0x9d || r.u8(payload + 4) !== 0x01 || r.u8(payload + 5) !== 0x2a) throw new HeaderError("bad VP8 start code");
    width = r.le16(payload + 6) & 0x3fff;
    height = r.le16(payload + 8) & 0x3fff;
  } else {
    if (r.u8(payload) !== 0x2f) throw new HeaderError("bad VP8L signature");
    const bits = r.le32(payload + 1);
    width = (bits & 0x3fff) + 1;
    height = ((bits >>> 14) & 0x3fff) + 1;
    if (bits >>> 29 !== 0) throw new HeaderError("unknown VP8L version");
    hasAlpha = ((bits >>> 28) & 1) === 1;
  }
  hasAlpha ||= alphChunk;
  if (canvas && (canvas.w !== width || canvas.h !== height)) throw new HeaderError("VP8X canvas and image sizes differ");
  return { format: "WebP", width, height, mode: hasAlpha ? "RGBA" : "RGB" };
}

function parseGif(r: Bytes, what: string): Header {
  let width = r.le16(6);
  let height = r.le16(8);
  const flags = r.u8(10);
  let at = 13;
  let globalTable: Uint8Array | undefined;
  if (flags & 0x80) {
    const n = 3 << ((flags & 7) + 1);
    r.need(at + n, "the global colour table");
    globalTable = r.b.subarray(at, at + n);
    at += n;
  }
  let transparency: number | undefined;
  for (;;) {
    const b = r.u8(at);
    if (b === 0x3b) throw new HeaderError("no image in the file");
    if (b === 0x21) {
      const label = r.u8(at + 1);
      at += 2;
      let first = true;
      for (;;) {
        const len = r.u8(at);
        if (len === 0) {
          at += 1;
          break;
        }
        r.need(at + 1 + len, "an extension block");
        if (first && label === 0xf9 && len >= 4 && r.b[at + 1]! & 1) transparency = r.b[at + 4]!;
        first = false;
        at += 1 + len;
      }
      continue;
    }
    if (b !== 0x2c) {   // Pillow skips stray bytes between blocks
      at += 1;
      continue;
    }
    const x = r.le16(at + 1);
    const y = r.le16(at + 3);
    const w = r.le16(at + 5);
    const h = r.le16(at + 7);
    const lflags = r.u8(at + 9);
    let table = globalTable;
    if (lflags & 0x80) {
      const n = 3 << ((lflags & 7) + 1);
      r.need(at + 10 + n, "the local colour table");
      table = r.b.subarray(at + 10, at + 10 + n);
    }
    // Pillow enlarges the canvas to hold the first frame
    width = Math.max(width, x + w);
    height = Math.max(height, y + h);
    if (!table) {
      throw new UserError(`${what} is a GIF without a colour table, which is not supported; re-export it as PNG`);
    }
    let greyRamp = true;
    for (let k = 0; k < table.length; k += 3) {
      const v = k / 3;
      if (table[k] !== v || table[k + 1] !== v || table[k + 2] !== v) {
        greyRamp = false;
        break;
      }
    }
    const colour = (index: number): [number, number, number] => {
      if (greyRamp) return [index, index, index];
      const o = index * 3;
      return o + 3 <= table.length ? [table[o]!, table[o + 1]!, table[o + 2]!] : [0, 0, 0];
    };
    const frame: GifFrame = { x, y, w, h, fill: colour(transparency ?? 0) };
    if (transparency !== undefined) frame.transparent = colour(transparency);
    const header: Header = { format: "GIF", width, height, mode: greyRamp ? "L" : "P", gif: frame };
    if (!greyRamp) header.padColour = colour(0);
    return header;
  }
}

/** Parses the header of a supported format; UserError when unsupported or invalid. */
function parseHeader(src: { what: string; bytes: Uint8Array; complete: boolean }, sizeOnly: boolean): Header {
  const { what, bytes } = src;
  const format = sniffFormat(bytes);
  if (!format) {
    if (!src.complete && bytes.length < 12) throw new NeedMore();
    throw new UserError(`${what} is not a supported image (expected one of ${SUPPORTED}); check that the file is really an image`);
  }
  const r = new Bytes(bytes, src.complete);
  try {
    switch (format) {
      case "PNG": return parsePng(r, sizeOnly);
      case "JPEG": return parseJpeg(r, what);
      case "WebP": return parseWebp(r);
      case "GIF": return parseGif(r, what);
    }
  } catch (err) {
    if (err instanceof HeaderError) {
      throw new UserError(`${what} starts like a ${format} file but its header is invalid (${err.message}); re-export the image`);
    }
    throw err;
  }
}

function checkDimensions(header: Header, what: string, limits: DecodeLimits, fileBytes: number): void {
  const { width, height } = header;
  if (width <= 0 || height <= 0) throw new UserError(`${what} has zero size (${width}x${height}); send a non-empty image`);
  // the plan's rule first: its limit never exceeds the decoder's, and every message of the plan quotes it
  const refusal = limits.budget ? imageRefusal(limits.budget, what, width, height, decodeKind(header), fileBytes) : null;
  if (refusal !== null) throw new UserError(refusal);
  if (width * height > limits.maxPixels) {
    throw new UserError(`${what} is ${width}x${height} = ${width * height} pixels, over the ${limits.maxPixels}-pixel limit ` +
      "(possible decompression bomb); downscale it first");
  }
}

async function readHeader(source: string | Uint8Array, limits: DecodeLimits, sizeOnly: boolean, what?: string): Promise<{ src: Source; header: Header }> {
  let src = await readSource(source, limits, sizeOnly ? 256 * 1024 : undefined);
  if (what !== undefined) src = { ...src, what };
  let header: Header;
  try {
    header = parseHeader(src, sizeOnly);
  } catch (err) {
    if (!(err instanceof NeedMore) || !src.readAll) throw err;
    const bytes = await src.readAll();
    src = { what: src.what, bytes, complete: true, size: bytes.length };
    header = parseHeader(src, sizeOnly);
  }
  checkDimensions(header, src.what, limits, src.size);
  return { src, header };
}

// -- decoding ----------------------------------------------------------------------------------

/** Width and height from the header only, without decoding pixels (for planning / token counts). */
export async function imageSize(source: string | Uint8Array, limits: DecodeLimits = DEFAULT_DECODE_LIMITS): Promise<{ width: number; height: number }> {
  const { header } = await readHeader(source, limits, true);
  return { width: header.width, height: header.height };
}

/** imageSize plus what the decode will hold (format, decode kind), the limits checked the same way;
 * `what` names the image in errors (default: the path, or "image data (N bytes)"). */
export async function imageHeader(source: string | Uint8Array, limits: DecodeLimits = DEFAULT_DECODE_LIMITS, what?: string):
  Promise<{ width: number; height: number; format: ImageFormat; kind: DecodeKind; fileBytes: number }> {
  const { src, header } = await readHeader(source, limits, true, what);
  return { width: header.width, height: header.height, format: header.format, kind: decodeKind(header), fileBytes: src.size };
}

/** Keeps channels `pick` of each `from`-channel pixel, in place; returns the shortened view. */
function compact(buf: Uint8Array, pixels: number, from: number, pick: readonly number[]): Uint8Array {
  const to = pick.length;
  if (from === to && pick.every((c, k) => c === k)) return buf.subarray(0, pixels * to);
  for (let p = 0, i = 0, o = 0; p < pixels; p++, i += from, o += to) {
    for (let k = 0; k < to; k++) buf[o + k] = buf[i + pick[k]!]!;
  }
  return buf.subarray(0, pixels * to);
}

/**
 * GIF first frame as Pillow shows it: transparent pixels (alpha 0 from libvips) get the colour of
 * the transparent index, the canvas outside the frame the fill colour; returns RGB in place.
 */
function gifToPillow(buf: Uint8Array, channels: number, width: number, height: number, frame: GifFrame): Uint8Array {
  const t = frame.transparent;
  const [fr, fg, fb] = frame.fill;
  const x1 = Math.min(width, frame.x + frame.w);
  const y1 = Math.min(height, frame.y + frame.h);
  for (let y = 0, i = 0, o = 0; y < height; y++) {
    const rowIn = y >= frame.y && y < y1;
    for (let x = 0; x < width; x++, i += channels, o += 3) {
      if (!rowIn || x < frame.x || x >= x1) {
        buf[o] = fr;
        buf[o + 1] = fg;
        buf[o + 2] = fb;
      } else if (channels === 4 && buf[i + 3] === 0) {
        const [r, g, b] = t ?? frame.fill;
        buf[o] = r;
        buf[o + 1] = g;
        buf[o + 2] = b;
      } else {
        buf[o] = buf[i]!;
        buf[o + 1] = buf[i + 1]!;
        buf[o + 2] = buf[i + 2]!;
      }
    }
  }
  return buf.subarray(0, width * height * 3);
}

function corrupt(what: string, err: unknown): UserError {
  const detail = String((err as Error)?.message ?? err).split("\n")[0]!.trim();
  return new UserError(`${what} is corrupt or truncated and cannot be decoded (${detail}); re-export the image`);
}

/** The libvips pipeline that decodes an image as the official processor sees it (before its raw
 * output); the options also open the same input for metadata. */
function decodePipeline(src: Source, header: Header, limits: DecodeLimits): { pipeline: ReturnType<typeof sharpModule>; options: SharpOptions } {
  const { mode } = header;
  const sharp = loadSharp();
  const options: SharpOptions = {
    failOn: "error",
    ignoreIcc: true,
    autoOrient: false,
    sequentialRead: true,
    limitInputPixels: Math.max(1, Math.floor(limits.maxPixels)),
  };
  if (header.format === "GIF" || header.format === "WebP") Object.assign(options, { pages: 1, page: 0 });
  let pipeline = sharp(src.bytes, options);
  switch (mode) {
    case "RGB": case "P": case "1":
      if (header.format !== "GIF") pipeline = pipeline.removeAlpha();
      break;
    case "RGBA":
      pipeline = pipeline.ensureAlpha();
      break;
    case "L":
      if (header.format !== "GIF") pipeline = pipeline.extractChannel(0);
      break;
    case "I;16":
      pipeline = pipeline.toColourspace("grey16");
      break;
    case "LA":
      break;
  }
  return { pipeline, options };
}

let pipelineTail: Promise<unknown> = Promise.resolve();

/**
 * Runs `work` (one libvips pipeline) after every pipeline started before it: libvips decodes one
 * image at a time in this process, so a server checking one request's images (checkImage) while
 * the engine decodes another's never holds two decodes at once — the RAM plan reserves one.
 */
function oneAtATime<T>(work: () => Promise<T>): Promise<T> {
  const run = pipelineTail.then(work);
  pipelineTail = run.catch(() => undefined);
  return run;
}

function sizeMismatch(what: string, width: number, height: number, decodedWidth: number | undefined, decodedHeight: number | undefined): UserError {
  return new UserError(`${what} decodes to ${decodedWidth}x${decodedHeight} pixels but its header says ${width}x${height}; ` +
    "it is damaged or unusual: re-export the image");
}

/**
 * Checks that an image decodes as decodeImage would decode it — the same header parse and limits,
 * the same libvips pipeline and failure rule, the same size check — keeping none of its pixels:
 * the decoded rows stream into a downscale to 8x8 instead of a buffer, so a JPEG or PNG needs only
 * libvips' strip buffers (measured: under 15 MiB at 48 MP) and a GIF, WebP or interlaced PNG the one
 * frame its decode holds too, freed when this returns. `kvl serve` checks every image of a request
 * this way before its reply starts (server/model.ts), so an image that cannot be decoded is a 400,
 * never an error after a stream's 200. UserError as decodeImage.
 */
export async function checkImage(source: string | Uint8Array, limits: DecodeLimits = DEFAULT_DECODE_LIMITS): Promise<void> {
  const { src, header } = await readHeader(source, limits, false);
  const { pipeline, options } = decodePipeline(src, header, limits);
  const size = await oneAtATime(async () => {
    try {
      const meta = await loadSharp()(src.bytes, options).metadata();
      // every pixel decoded (not fastShrinkOnLoad: a JPEG would skip its full-size IDCT; not
      // nearest: it would skip rows, and a cut at the end of the file would pass)
      await pipeline.resize({ width: 8, height: 8, fit: "fill", fastShrinkOnLoad: false }).raw().toBuffer();
      return { width: meta.width, height: meta.height };
    } catch (err) {
      throw corrupt(src.what, err);
    }
  });
  if (size.width !== header.width || size.height !== header.height) throw sizeMismatch(src.what, header.width, header.height, size.width, size.height);
}

/** Decodes a file path or encoded bytes (JPEG, PNG, WebP, GIF first frame) or throws UserError (host/system/user-error.ts) saying what is wrong and what to do. */
export function decodeImage(source: string | Uint8Array, limits: DecodeLimits = DEFAULT_DECODE_LIMITS): Promise<DecodedImage> {
  return oneAtATime(() => decodeInSlot(source, limits));
}

/**
 * Decodes as decodeImage does and hands the pixels to `use` (the engine's preprocessing) in the
 * same one-at-a-time slot: a server's checkImage of the next request cannot decode a second frame
 * while this one's pixels are still being turned into patches — the RAM plan reserves one.
 */
export function decodeImageWith<T>(source: string | Uint8Array, limits: DecodeLimits, use: (image: DecodedImage) => T): Promise<T> {
  return oneAtATime(async () => use(await decodeInSlot(source, limits)));
}

/** decodeImage's work; the caller holds the one-at-a-time slot. */
async function decodeInSlot(source: string | Uint8Array, limits: DecodeLimits): Promise<DecodedImage> {
  const { src, header } = await readHeader(source, limits, false);
  const { what } = src;
  const { width, height, mode } = header;
  const { pipeline } = decodePipeline(src, header, limits);
  let out: { data: Buffer; info: OutputInfo };
  try {
    out = await pipeline.raw(mode === "I;16" ? { depth: "ushort" } : {}).toBuffer({ resolveWithObject: true });
  } catch (err) {
    throw corrupt(what, err);
  }
  const { data, info } = out;
  if (info.width !== width || info.height !== height) throw sizeMismatch(what, width, height, info.width, info.height);
  const pixels = width * height;
  const ch = info.channels;
  const unexpected = (): Error => new Error(`image-decode: sharp returned ${ch} channels for a ${header.format} file in Pillow mode ${mode}`);
  const bytes = new Uint8Array(data.buffer, data.byteOffset, data.length);

  if (header.gif) {
    if (ch !== 3 && ch !== 4) throw unexpected();
    const rgb = gifToPillow(bytes, ch, width, height, header.gif);
    if (mode === "L") return { width, height, mode: "L", data: compact(rgb, pixels, 3, [0]) };
    return { width, height, mode: "P", data: rgb, padColour: header.padColour! };
  }
  switch (mode) {
    case "RGB":
      if (ch !== 3) throw unexpected();
      return { width, height, mode, data: bytes };
    case "RGBA":
      if (ch !== 4) throw unexpected();
      return { width, height, mode, data: bytes };
    case "L":
      if (ch !== 1) throw unexpected();
      return { width, height, mode, data: bytes };
    case "LA":
      if (ch === 2) return { width, height, mode, data: bytes };
      if (ch !== 4) throw unexpected();
      return { width, height, mode, data: compact(bytes, pixels, 4, [0, 3]) };
    case "P": case "1":
      if (ch !== 3) throw unexpected();
      return { width, height, mode: "P", data: bytes, padColour: header.padColour! };
    case "I;16": {
      if (ch !== 1 && ch !== 2) throw unexpected();
      let samples: Uint16Array;
      if (data.byteOffset % 2 === 0) samples = new Uint16Array(data.buffer, data.byteOffset, data.length / 2);
      else samples = new Uint16Array(new Uint8Array(data).buffer);
      if (ch === 2) {   // grey + the alpha sharp adds for tRNS: keep grey only
        const grey = new Uint16Array(pixels);
        for (let p = 0; p < pixels; p++) grey[p] = samples[p * 2]!;
        samples = grey;
      }
      const clipped = new Uint8Array(pixels);
      for (let p = 0; p < pixels; p++) {
        const v = samples[p]!;
        clipped[p] = v < 255 ? v : 255;
      }
      return { width, height, mode: "L", data: clipped, i16: samples };
    }
  }
}
