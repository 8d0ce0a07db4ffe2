/**
 * The production image path (host/image/image-decode.ts, host/image/image-preprocess.ts) against what the
 * official pipeline — Pillow 13 resize in the image's own mode, torchvision-style pad,
 * convert("RGB"), float32 normalise, patchify; make-image-goldens.py writes it out — makes of small image
 * files in every mode and format (test/fixtures/images/, goldens in
 * test/fixtures/goldens/images.json, both made by test/fixtures/make-image-goldens.py; no Python
 * at test time).
 *
 * Expectations: decoded pixels identical to Pillow's (in the mode Pillow opens the file in);
 * uint8 RGB after resize + pad + convert bit-identical (sha256); pixel_values within 2e-6 of the
 * golden samples and, in fact, bit-identical (sha256 of the float32 bytes). Plus: the spec's
 * token-count examples, a cross-check of the resampler against the independent float64
 * reference (test/reference/preprocess.ts) on random RGB arrays, and every refusal with a
 * UserError whose message names the problem. There is no documented difference from Pillow for
 * any fixture (see image-decode.ts for the cases outside them).
 */
import { createHash } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { deflateSync } from "node:zlib";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { afterAll, describe, expect, it } from "vitest";

import { decodeBufferBytes, decodeImage, DEFAULT_DECODE_LIMITS, imageHeader, imageSize, type DecodedImage } from "../host/image/image-decode.js";
import { imageDecodeBudget } from "../host/image/image-budget.js";
import {
  gridForSize,
  loadPreprocessorConfig,
  mediaTokens,
  preprocessImage,
  resampleBicubic8,
  resizePadRgb,
  type PreprocessorConfig,
} from "../host/image/image-preprocess.js";
import { UserError } from "../host/system/user-error.js";
import { pillowResizeBicubic, preprocessOne } from "./reference/preprocess.js";

const HERE = dirname(fileURLToPath(import.meta.url));
const IMAGES = join(HERE, "fixtures", "images");

interface GoldenResult {
  grid: [number, number];
  rgb_shape: [number, number, number];
  rgb_sha256: string;
  pixel_values_shape: number[];
  pixel_values_sha256: string;
  samples: [number, number][];
}
interface GoldenImage {
  file: string;
  format: string;
  width: number;
  height: number;
  file_sha256: string;
  pillow_mode: string;
  mode: DecodedImage["mode"];
  decoded_sha256: string;
  decoded_i16_sha256?: string;
  pad_colour?: [number, number, number];
  results: Record<string, GoldenResult>;
}
interface RawConfig {
  patch_size: number;
  in_token_limit: number;
  merge_kernel_size: [number, number];
  pad_input: boolean;
  image_mean: [number, number, number];
  image_std: [number, number, number];
}
const golden = JSON.parse(readFileSync(join(HERE, "fixtures", "goldens", "images.json"), "utf8")) as {
  pillow: string;
  configs: Record<string, RawConfig>;
  images: GoldenImage[];
};

function toConfig(raw: RawConfig): PreprocessorConfig {
  return {
    patchSize: raw.patch_size, inTokenLimit: raw.in_token_limit, mergeKernel: raw.merge_kernel_size,
    padInput: raw.pad_input, imageMean: raw.image_mean, imageStd: raw.image_std,
  };
}
const CONFIGS = Object.fromEntries(Object.entries(golden.configs).map(([k, v]) => [k, toConfig(v)]));
const SHIPPED = CONFIGS.shipped!;

const sha = (bytes: ArrayBufferView): string =>
  createHash("sha256").update(new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength)).digest("hex");

const tmp = mkdtempSync(join(tmpdir(), "kvl-image-"));
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

const crcTable = (() => {
  const t = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c >>> 0;
  }
  return t;
})();
const crc = (b: Uint8Array): number => {
  let c = 0xffffffff;
  for (const v of b) c = crcTable[(c ^ v) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
};
/** One PNG chunk: length, tag, body, CRC. */
const pngChunk = (tag: string, body: Uint8Array): Uint8Array => {
  const out = Buffer.alloc(12 + body.length);
  out.writeUInt32BE(body.length, 0);
  out.write(tag, 4, "latin1");
  out.set(body, 8);
  out.writeUInt32BE(crc(out.subarray(4, 8 + body.length)), 8 + body.length);
  return new Uint8Array(out);
};
const bytesOf = (name: string): Uint8Array => new Uint8Array(readFileSync(join(IMAGES, name)));

/** A PNG signature + IHDR (valid CRC) declaring width x height, 8-bit RGBA, and nothing else. */
const pngHeader = (width: number, height: number): Uint8Array => {
  const out = Buffer.alloc(8 + 25);
  Buffer.from("\x89PNG\r\n\x1a\n", "latin1").copy(out, 0);
  out.writeUInt32BE(13, 8);
  out.write("IHDR", 12, "latin1");
  out.writeUInt32BE(width, 16);
  out.writeUInt32BE(height, 20);
  out.set([8, 6, 0, 0, 0], 24);
  out.writeUInt32BE(crc(out.subarray(12, 29)), 29);
  return new Uint8Array(out);
};

/** Runs fn and returns the UserError it throws (fails the test otherwise). */
async function userError(fn: () => Promise<unknown> | unknown): Promise<UserError> {
  try {
    await fn();
  } catch (err) {
    expect(err).toBeInstanceOf(UserError);
    return err as UserError;
  }
  throw new Error("expected a UserError, got success");
}

describe(`golden images (Pillow ${golden.pillow})`, () => {
  it("covers every mode and format the brief lists", () => {
    const modes = new Set(golden.images.map((g) => `${g.format}/${g.pillow_mode}`));
    for (const m of ["PNG/RGB", "PNG/RGBA", "PNG/L", "PNG/LA", "PNG/P", "PNG/1", "PNG/I;16", "JPEG/RGB", "JPEG/L",
      "WEBP/RGB", "WEBP/RGBA", "GIF/P", "GIF/L"]) expect(modes, m).toContain(m);
  });

  for (const g of golden.images) {
    describe(g.file, () => {
      const path = join(IMAGES, g.file);

      it("is the fixture the goldens were made from", () => {
        expect(createHash("sha256").update(readFileSync(path)).digest("hex")).toBe(g.file_sha256);
      });

      it(`decodes as Pillow's ${g.pillow_mode} (mode ${g.mode}), pixel for pixel`, async () => {
        const img = await decodeImage(path);
        expect([img.width, img.height, img.mode]).toEqual([g.width, g.height, g.mode]);
        expect(sha(img.data)).toBe(g.decoded_sha256);
        if (g.decoded_i16_sha256) expect(sha(img.i16!)).toBe(g.decoded_i16_sha256);
        else expect(img.i16).toBeUndefined();
        if (g.mode === "P") expect(img.padColour).toEqual(g.pad_colour);
        // from bytes: the same
        const fromBytes = await decodeImage(new Uint8Array(readFileSync(path)));
        expect(sha(fromBytes.data)).toBe(g.decoded_sha256);
      });

      it("imageSize reads the size from the header", async () => {
        expect(await imageSize(path)).toEqual({ width: g.width, height: g.height });
      });

      for (const [name, result] of Object.entries(g.results)) {
        it(`preprocesses bit-identically with the ${name} config`, async () => {
          const img = await decodeImage(path);
          const config = CONFIGS[name]!;
          const stage = resizePadRgb(img, config);
          expect([stage.height, stage.width, 3]).toEqual(result.rgb_shape);
          expect(stage.grid).toEqual(result.grid);
          expect(sha(stage.rgb), "uint8 RGB after resize + pad + convert").toBe(result.rgb_sha256);
          const { pixelValues, grid } = preprocessImage(img, config);
          expect(grid).toEqual(result.grid);
          expect([grid[0] * grid[1], 3, config.patchSize, config.patchSize]).toEqual(result.pixel_values_shape);
          expect(pixelValues.length).toBe(result.pixel_values_shape.reduce((a, b) => a * b, 1));
          let maxDiff = 0;
          for (const [index, value] of result.samples) maxDiff = Math.max(maxDiff, Math.abs(pixelValues[index]! - value));
          expect(maxDiff).toBeLessThanOrEqual(2e-6);
          expect(maxDiff).toBe(0);
          expect(sha(pixelValues), "float32 pixel_values").toBe(result.pixel_values_sha256);
        });
      }
    });
  }

  it("ignores embedded ICC profiles (the official processor sees the stored pixels)", async () => {
    const { default: sharp } = await import("sharp");
    const tagged = await sharp({ create: { width: 2, height: 2, channels: 3, background: "#808080" } }).withIccProfile("p3").png().toBuffer();
    const icc = (await sharp(tagged).metadata()).icc!;
    expect(icc.length).toBeGreaterThan(100);
    const expected = (name: string): string => golden.images.find((g) => g.file === name)!.decoded_sha256;
    // PNG: an iCCP chunk (Display P3) right after IHDR; same pixels
    const png = bytesOf("rgb.png");
    const iccp = pngChunk("iCCP", Buffer.concat([Buffer.from("Display P3\0\0", "latin1"), deflateSync(icc)]));
    const withIccp = Buffer.concat([png.subarray(0, 33), iccp, png.subarray(33)]);
    expect(sha((await decodeImage(withIccp)).data)).toBe(expected("rgb.png"));
    // JPEG: an APP2 ICC_PROFILE segment right after SOI
    const jpg = bytesOf("rgb-q90.jpg");
    const app2 = Buffer.alloc(4 + 14 + icc.length);
    app2.set([0xff, 0xe2]);
    app2.writeUInt16BE(2 + 14 + icc.length, 2);
    app2.write("ICC_PROFILE\0", 4, "latin1");
    app2.set([1, 1], 16);
    app2.set(icc, 18);
    const withApp2 = Buffer.concat([jpg.subarray(0, 2), app2, jpg.subarray(2)]);
    expect(sha((await decodeImage(withApp2)).data)).toBe(expected("rgb-q90.jpg"));
  });

  it("does not apply EXIF orientation", async () => {
    const img = await decodeImage(join(IMAGES, "exif-rotated.jpg"));
    expect([img.width, img.height]).toEqual([130, 100]);   // stored 130 x 100, Orientation 6 would show 100 x 130
  });
});

describe("token counts (spec §6 examples, shipped config)", () => {
  const cases: Array<[number, number, [number, number], number]> = [
    [196, 196, [14, 14], 49], [224, 224, [16, 16], 64], [28, 28, [2, 2], 1], [10, 10, [2, 2], 1],
    [100, 50, [4, 8], 8], [640, 480, [36, 46], 414], [1024, 1024, [66, 66], 1089], [1920, 1080, [48, 86], 1032],
  ];
  for (const [w, h, grid, tokens] of cases) {
    it(`${w}x${h} -> grid ${grid[0]}x${grid[1]} -> ${tokens} tokens`, () => {
      const g = gridForSize(w, h, SHIPPED);
      expect(g).toEqual(grid);
      expect(mediaTokens(g, SHIPPED.mergeKernel)).toBe(tokens);
    });
  }

  it("refuses sizes the official processor cannot handle", async () => {
    expect((await userError(() => gridForSize(0, 10, SHIPPED))).message).toMatch(/has no content/);
    expect((await userError(() => gridForSize(100_000, 20, SHIPPED))).message).toMatch(/too elongated.*Exceed pos emb/);
    expect((await userError(() => gridForSize(20_000_000, 14, SHIPPED))).message).toMatch(/too extreme an aspect ratio/);
    const noPad = { ...SHIPPED, padInput: false };
    expect((await userError(() => gridForSize(14 * 3, 14 * 2, noPad))).message).toMatch(/not a positive multiple of the 2x2 merge kernel/);
  });
});

describe("resampler against the independent float64 reference (random RGB)", () => {
  // deterministic xorshift noise with some structure
  function randomRgb(width: number, height: number, seed: number): Uint8Array {
    const out = new Uint8Array(width * height * 3);
    let s = seed >>> 0 || 1;
    for (let i = 0; i < out.length; i++) {
      s ^= s << 13;
      s >>>= 0;
      s ^= s >>> 17;
      s ^= s << 5;
      s >>>= 0;
      const x = Math.floor(i / 3) % width;
      out[i] = (s & 1) === 0 ? (s >>> 8) & 255 : (x * 7 + (i % 3) * 60) & 255;
    }
    return out;
  }
  const small: PreprocessorConfig = { ...CONFIGS.small!, imageMean: [0.5, 0.5, 0.5], imageStd: [0.5, 0.5, 0.5] };
  const sizes: Array<[number, number, PreprocessorConfig]> = [
    [100, 80, small], [333, 97, small], [57, 250, small], [211, 211, small], [640, 480, small], [1100, 950, SHIPPED],
  ];
  for (const [w, h, config] of sizes) {
    it(`${w}x${h} (in_token_limit ${config.inTokenLimit})`, () => {
      const data = randomRgb(w, h, w * 131 + h);
      const ref = preprocessOne({ width: w, height: h, data }, {
        patch_size: config.patchSize, in_token_limit: config.inTokenLimit, merge_kernel_size: config.mergeKernel,
        pad_input: config.padInput, image_mean: config.imageMean, image_std: config.imageStd,
      });
      expect(ref.resized.width).toBeLessThan(w);   // the case needs a downscale
      const ours = resampleBicubic8(data, w, h, 3, ref.resized.width, ref.resized.height);
      expect(sha(ours)).toBe(sha(ref.resized.data));
      expect(sha(ours)).toBe(sha(pillowResizeBicubic({ width: w, height: h, data }, ref.resized.width, ref.resized.height).data));
      const { pixelValues, grid } = preprocessImage({ width: w, height: h, mode: "RGB", data }, config);
      expect(grid).toEqual(ref.grid);
      let maxDiff = 0;
      for (let i = 0; i < pixelValues.length; i++) maxDiff = Math.max(maxDiff, Math.abs(pixelValues[i]! - ref.pixelValues[i]!));
      expect(maxDiff).toBeLessThanOrEqual(2e-7);   // float32 rounding of values in [-1, 1]
    });
  }
});

describe("bad inputs are refused with a UserError naming the problem", () => {
  const write = (name: string, data: Uint8Array | string): string => {
    const path = join(tmp, name);
    writeFileSync(path, data);
    return path;
  };
  it("a PNG header declaring 20000x20000 is refused from the header (decode and imageSize)", async () => {
    const path = write("huge.png", pngHeader(20000, 20000));
    for (const fn of [() => decodeImage(path), () => imageSize(path)]) {
      const err = await userError(fn);
      expect(err.message).toMatch(/20000x20000 = 400000000 pixels, over the 64000000-pixel limit/);
    }
    // with the IDAT missing, a decoder that got this far would have said "corrupt", not this
    const mem = process.memoryUsage().rss;
    await userError(() => decodeImage(pngHeader(20000, 20000)));
    expect(process.memoryUsage().rss - mem).toBeLessThan(64 * 1024 * 1024);
  });

  it("an image over the RAM plan's decode budget is refused from its header: its size, the budget, what to do", async () => {
    const shape = { patchSize: 14, inTokenLimit: 4096 };
    const limits = { ...DEFAULT_DECODE_LIMITS, budget: { bytes: imageDecodeBudget(12_000_000, shape), shape } };
    for (const fn of [() => decodeImage(pngHeader(8000, 8000), limits), () => imageHeader(pngHeader(8000, 8000), limits)]) {
      const err = await userError(fn);
      // the budget was made for 12 MP JPEG/PNG: that is the limit, and the figure the message quotes
      expect(err.message).toContain("is 8000x8000 = 64.0 MP, over the 12.0 MP the RAM plan admits for a JPEG or PNG; " +
        "downscale it to at most 12.0 MP, or raise --ram-mib or --max-image-mp");
    }
    // a 4000x3000 PNG (12 MP) passes the header check (it then fails for its missing IDAT, not for its size)
    expect((await userError(() => decodeImage(pngHeader(4000, 3000), limits))).message).toMatch(/corrupt or truncated/);
    // the same size interlaced: libpng holds the whole frame, so it needs more than the budget holds
    const ihdr = Buffer.alloc(13);
    ihdr.writeUInt32BE(4000, 0);
    ihdr.writeUInt32BE(3000, 4);
    ihdr.set([8, 6, 0, 0, 1], 8);
    const interlaced = new Uint8Array([...Buffer.from("\x89PNG\r\n\x1a\n", "latin1"), ...pngChunk("IHDR", ihdr)]);
    expect((await userError(() => imageHeader(interlaced, limits))).message)
      .toMatch(/4000x3000 = 12\.0 MP, over the \d+\.\d MP the RAM plan admits for a GIF or interlaced PNG \(which decodes the whole frame at once\)/);
    // within the pixel limit but with a file far denser than planned (2 bytes a pixel): the decode
    // would not fit with that file, so it is refused too, saying why
    const dense = new Uint8Array(48 * 2 ** 20);
    dense.set(pngHeader(3000, 3000));
    expect((await userError(() => imageHeader(dense, limits))).message)
      .toMatch(/is 3000x3000 = 9\.0 MP, within the 12\.0 MP limit for a JPEG or PNG, but its file is 48\.0 MiB: decoding it needs about \d+ MiB/);
    // real files under the budget decode as before
    expect((await decodeImage(join(IMAGES, "rgb.png"), limits)).width).toBe(181);
  });

  it("a lower maxPixels applies too", async () => {
    const err = await userError(() => decodeImage(join(IMAGES, "rgb.png"), { ...DEFAULT_DECODE_LIMITS, maxPixels: 10_000 }));
    expect(err.message).toMatch(/181x137 = 24797 pixels, over the 10000-pixel limit/);
  });

  it("zero width or height", async () => {
    expect((await userError(() => decodeImage(pngHeader(0, 10)))).message).toMatch(/has zero size \(0x10\)/);
  });

  it("truncated PNG, JPEG, WebP and GIF (cut goldens)", async () => {
    for (const name of ["rgb.png", "rgb-q90.jpg", "rgb-444-progressive.jpg", "lossless-rgb.webp", "lossy-rgb.webp", "anim.gif", "p.png", "grey16.png"]) {
      const full = bytesOf(name);
      for (const frac of [0.3, 0.6, 0.95]) {
        const cut = full.subarray(0, Math.floor(full.length * frac));
        if (name === "anim.gif" && frac > 0.5) continue;   // the first frame is complete: Pillow decodes it too
        const err = await userError(() => decodeImage(cut));
        expect(err.message, `${name} cut at ${frac}`).toMatch(/is corrupt or truncated and cannot be decoded \(.*\); re-export the image/);
      }
    }
    // cut inside the header
    const err = await userError(() => decodeImage(bytesOf("rgb.png").subarray(0, 20)));
    expect(err.message).toMatch(/starts like a PNG file but its header is invalid \(.*\); re-export the image/);
  });

  it("imageSize needs only the header (a file cut after it still has a size)", async () => {
    const path = write("cut.png", bytesOf("rgb.png").subarray(0, 60));
    expect(await imageSize(path)).toEqual({ width: 181, height: 137 });
    expect((await userError(() => decodeImage(path))).message).toMatch(/corrupt or truncated/);
    // a JPEG whose SOF comes after 320 KB of APP segments: past the first read, the rest is read
    const jpg = bytesOf("rgb-q90.jpg");
    const app = Buffer.alloc(65537, 0x41);
    app.set([0xff, 0xe9]);
    app.writeUInt16BE(65535, 2);
    const padded = write("late-sof.jpg", Buffer.concat([jpg.subarray(0, 2), app, app, app, app, app, jpg.subarray(2)]));
    expect(await imageSize(padded)).toEqual({ width: 181, height: 137 });
    expect(sha((await decodeImage(padded)).data)).toBe(golden.images.find((g) => g.file === "rgb-q90.jpg")!.decoded_sha256);
  });

  it("corrupt bytes", async () => {
    // damaged IDAT (its CRC no longer matches)
    const png = bytesOf("rgb.png").slice();
    for (let i = 200; i < 260; i++) png[i] = png[i]! ^ 0x5a;
    expect((await userError(() => decodeImage(png))).message).toMatch(/is corrupt or truncated/);
    // damaged IHDR
    const bad = pngHeader(100, 100);
    bad[18] = bad[18]! ^ 1;
    expect((await userError(() => decodeImage(bad))).message).toMatch(/starts like a PNG file but its header is invalid \(IHDR checksum mismatch\)/);
    // a JPEG signature followed by garbage
    const jpeg = new Uint8Array(400).fill(0x37);
    jpeg.set([0xff, 0xd8, 0xff, 0xe0, 0x00, 0x10]);
    expect((await userError(() => decodeImage(jpeg))).message).toMatch(/starts like a JPEG file but its header is invalid|corrupt or truncated/);
    // RIFF/WEBP with nonsense inside
    const webp = new Uint8Array(64);
    webp.set(Buffer.from("RIFF\x38\x00\x00\x00WEBPJUNK", "latin1"));
    expect((await userError(() => decodeImage(webp))).message).toMatch(/starts like a WebP file but its header is invalid/);
  });

  it("zero-length file and buffer", async () => {
    const path = write("empty.png", "");
    expect((await userError(() => decodeImage(path))).message).toMatch(/image file '.*empty\.png' is empty; send a JPEG, PNG, WebP or GIF image/);
    expect((await userError(() => decodeImage(new Uint8Array(0)))).message).toMatch(/image data \(0 bytes\) is empty/);
    expect((await userError(() => imageSize(path))).message).toMatch(/is empty/);
  });

  it("a directory, a missing file", async () => {
    const dir = join(tmp, "a-dir.png");
    mkdirSync(dir, { recursive: true });
    expect((await userError(() => decodeImage(dir))).message).toMatch(/cannot read image file '.*a-dir\.png': it is a directory; check the path/);
    const missing = join(tmp, "missing.jpg");
    expect((await userError(() => decodeImage(missing))).message).toMatch(/cannot read image file '.*missing\.jpg': no such file or directory; check the path/);
    expect((await userError(() => imageSize(missing))).message).toMatch(/no such file or directory/);
  });

  it("unsupported formats (BMP, text)", async () => {
    const bmp = Buffer.alloc(70);
    bmp.write("BM", 0, "latin1");
    for (const data of [new Uint8Array(bmp), new TextEncoder().encode("just some text, not an image\n")]) {
      expect((await userError(() => decodeImage(data))).message)
        .toMatch(/is not a supported image \(expected one of JPEG, PNG, WebP, GIF\); check that the file is really an image/);
    }
    const path = write("notes.png", "hello");
    expect((await userError(() => decodeImage(path))).message).toMatch(/image file '.*notes\.png' is not a supported image/);
  });

  it("a CMYK JPEG (out of scope) and a GIF without a colour table", async () => {
    // rgb-q90.jpg with its SOF component count patched to 4
    const jpeg = bytesOf("rgb-q90.jpg").slice();
    let sof = -1;
    for (let i = 2; i < jpeg.length - 1; i++) if (jpeg[i] === 0xff && (jpeg[i + 1] === 0xc0 || jpeg[i + 1] === 0xc2)) { sof = i; break; }
    expect(sof).toBeGreaterThan(0);
    jpeg[sof + 9] = 4;
    expect((await userError(() => decodeImage(jpeg))).message).toMatch(/is a CMYK JPEG, which is not supported; convert it to RGB/);
    // partial-frame.gif has a global table and no local one: drop the global table
    const gif = bytesOf("partial-frame.gif");
    const n = 3 << ((gif[10]! & 7) + 1);
    const stripped = new Uint8Array(gif.length - n);
    stripped.set(gif.subarray(0, 13));
    stripped[10] = gif[10]! & 0x7f;
    stripped.set(gif.subarray(13 + n), 13);
    expect((await userError(() => decodeImage(stripped))).message).toMatch(/is a GIF without a colour table/);
  });

  it("over maxFileBytes, checked before reading", async () => {
    const err = await userError(() => decodeImage(join(IMAGES, "rgb.png"), { ...DEFAULT_DECODE_LIMITS, maxFileBytes: 1000 }));
    expect(err.message).toMatch(/image file '.*rgb\.png' is \d+ bytes, over the 1000-byte limit for images; downscale or recompress it/);
    expect((await userError(() => decodeImage(bytesOf("rgb.png"), { ...DEFAULT_DECODE_LIMITS, maxFileBytes: 1000 }))).message)
      .toMatch(/image data \(\d+ bytes\) is over the 1000-byte limit/);
    // a sparse 300 MiB file: refused from its size alone (reading it would take the full size)
    const big = join(tmp, "big.png");
    writeFileSync(big, pngHeader(100, 100));
    truncateSync(big, 300 * 1024 * 1024);
    const mem = process.memoryUsage().rss;
    expect((await userError(() => decodeImage(big))).message).toMatch(/is 314572800 bytes, over the 268435456-byte limit/);
    expect(process.memoryUsage().rss - mem).toBeLessThan(64 * 1024 * 1024);
  });

  it("not a path or bytes", async () => {
    expect((await userError(() => decodeImage(42 as unknown as string))).message).toMatch(/must be given as bytes or a file path, not number/);
  });
});

describe("preprocessor_config.json", () => {
  const pack = (name: string, text: string): string => {
    const dir = join(tmp, name);
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, "preprocessor_config.json"), text);
    return dir;
  };
  const shipped = JSON.stringify({
    image_processor_type: "KimiVLImageProcessor", patch_size: 14, in_token_limit: 4096, merge_kernel_size: [2, 2],
    num_pooled_tokens: 1024, pad_input: true, image_mean: [0.5, 0.5, 0.5], image_std: [0.5, 0.5, 0.5],
  });

  it("reads the shipped config; the merge kernel argument wins", () => {
    const dir = pack("ok", shipped);
    expect(loadPreprocessorConfig(dir)).toEqual(SHIPPED);
    expect(loadPreprocessorConfig(dir, [1, 1]).mergeKernel).toEqual([1, 1]);
    // JSON has one number type: 14.0 is the integer 14
    expect(loadPreprocessorConfig(pack("ok-float", shipped.replace('"patch_size":14', '"patch_size":14.0')))).toEqual(SHIPPED);
  });

  it("names the file and key when damaged", async () => {
    const cases: Array<[string, RegExp]> = [
      [shipped.replace('"patch_size":14', '"patch_size":"14"'), /preprocessor_config\.json: 'patch_size' must be a positive integer, got "14"/],
      [shipped.replace('"patch_size":14', '"patch_size":14.5'), /'patch_size' must be a positive integer, got 14\.5/],
      [shipped.replace('"patch_size":14,', ''), /'patch_size' must be a positive integer, got nothing \(it is missing\)/],
      [shipped.replace('"pad_input":true', '"pad_input":1'), /preprocessor_config\.json: 'pad_input' must be true or false, got 1;/],
      [shipped.replace('"in_token_limit":4096', '"in_token_limit":0'), /'in_token_limit' must be a positive integer, got 0/],
      [shipped.replace('"image_mean":[0.5,0.5,0.5]', '"image_mean":[0.5,0.5]'), /'image_mean' must be a list of 3 finite numbers/],
      [shipped.replace('"image_std":[0.5,0.5,0.5]', '"image_std":[0.5,0,0.5]'), /'image_std' contains a zero/],
      [shipped.replace('"merge_kernel_size":[2,2]', '"merge_kernel_size":[2]'), /'merge_kernel_size' must be two positive integers, got \[2\]/],
      ["{not json", /preprocessor_config\.json is not valid JSON \(.* \(line 1 column 2\)\); rerun kvl pack$/],
      ["{\n \"patch_size\": NaN}", /preprocessor_config\.json is not valid JSON \(.*NaN.*\); rerun kvl pack$/],
      ["[1, 2]", /preprocessor_config\.json is not a JSON object/],
    ];
    let i = 0;
    for (const [text, message] of cases) {
      const dir = pack(`bad${i++}`, text);
      const err = await userError(() => loadPreprocessorConfig(dir));
      expect(err.message).toMatch(message);
      expect(err.message).toContain(join(dir, "preprocessor_config.json"));
    }
    const missing = join(tmp, "no-pack");
    expect((await userError(() => loadPreprocessorConfig(missing))).message).toMatch(/no-pack\/preprocessor_config\.json is missing or unreadable/);
  });
});

describe("memory", () => {
  it("decodeBufferBytes bounds the decode path (at least the RGBA pixels)", () => {
    expect(decodeBufferBytes(8000, 8000)).toBeGreaterThanOrEqual(8000 * 8000 * 4);
    expect(decodeBufferBytes(8000, 8000)).toBeLessThanOrEqual(8000 * 8000 * 12 + 32 * 1024 * 1024);
  });
});
