/** What kvl's command tree loads at startup: sharp (libvips, ~0.1 s and ~20 MB) only once an image
 * is decoded (host/image/image-decode.ts loadSharp), so the commands without images never pay for it. */
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const dist = (file: string): string => pathToFileURL(join(packageRoot, "dist", file)).href;

describe.runIf(process.platform === "linux")("lazy dependencies", () => {
  it("the command tree loads without libvips; decoding an image maps it", () => {
    // a fresh process (this one may have sharp loaded by other tests): /proc/self/maps names
    // every shared library mapped into it
    const script = `
      import { readFileSync } from "node:fs";
      const libvips = () => readFileSync("/proc/self/maps", "utf8").includes("libvips");
      await import(${JSON.stringify(dist("cli/program.js"))});
      const before = libvips();
      const { decodeImage } = await import(${JSON.stringify(dist("host/image/image-decode.js"))});
      const image = await decodeImage(${JSON.stringify(join(packageRoot, "test", "fixtures", "images", "rgb.png"))});
      console.log(JSON.stringify({ before, after: libvips(), width: image.width }));`;
    const r = spawnSync(process.execPath, ["--input-type=module", "-e", script], { encoding: "utf8" });
    expect(r.status, r.stderr).toBe(0);
    const seen = JSON.parse(r.stdout) as { before: boolean; after: boolean; width: number };
    expect(seen.before).toBe(false);
    expect(seen.after).toBe(true);
    expect(seen.width).toBeGreaterThan(0);
  });
});
