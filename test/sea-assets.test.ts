/** host/system/sea-assets.ts: the single executable's files, extracted once into a folder named by their
 * content and reused as they are (test/portability/single-exe.mjs runs the real executables). */
import { mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { homedir, tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, describe, expect, it } from "vitest";

import { SEA_MANIFEST_ASSET, type SeaApi, assetSetKey, extractSeaAssets, kvlCacheDir } from "../host/system/sea-assets.js";
import { UserError } from "../host/system/user-error.js";

const scratch = mkdtempSync(join(tmpdir(), "kvl-sea-assets-"));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

const FILES = new Map<string, Uint8Array>([
  ["package.json", Buffer.from('{"name":"kvl"}')],
  ["wasm-core/dist/kvl_core.wasm", Buffer.from([0, 97, 115, 109, 1, 0, 0, 0])],
  ["node_modules/tiktoken/tiktoken_bg.wasm", Buffer.alloc(3000, 7)],
]);

/** node:sea's getAsset over FILES (as the build lays them out), counting the file reads. */
function fakeSea(files = FILES): SeaApi & { reads: number } {
  const manifest = JSON.stringify({ key: assetSetKey(files), files: Object.fromEntries([...files].map(([n, b]) => [n, b.byteLength])) });
  const sea = {
    reads: 0,
    getAsset(key: string, encoding?: string): never {
      if (key === SEA_MANIFEST_ASSET) return (encoding ? manifest : Buffer.from(manifest)) as never;
      const data = files.get(key);
      if (!data) throw new Error(`no asset ${key}`);
      sea.reads++;
      return data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength) as never;
    },
  };
  return sea;
}

describe("assetSetKey", () => {
  it("names the set by content: the same files in any order give one key, one changed byte another", () => {
    const reversed = new Map([...FILES].reverse());
    expect(assetSetKey(reversed)).toBe(assetSetKey(FILES));
    const changed = new Map(FILES);
    changed.set("package.json", Buffer.from('{"name":"kvm"}'));
    expect(assetSetKey(changed)).not.toBe(assetSetKey(FILES));
    const renamed = new Map([...FILES].map(([n, b]) => [n === "package.json" ? "package2.json" : n, b]));
    expect(assetSetKey(renamed)).not.toBe(assetSetKey(FILES));
    expect(assetSetKey(FILES)).toMatch(/^[0-9a-f]{16}$/);
  });
});

describe("kvlCacheDir", () => {
  it("is %LOCALAPPDATA%\\kvl on Windows and $XDG_CACHE_HOME/kvl or ~/.cache/kvl elsewhere", () => {
    expect(kvlCacheDir({ LOCALAPPDATA: "/users/u/AppData/Local" }, "win32")).toBe(join("/users/u/AppData/Local", "kvl"));
    expect(kvlCacheDir({ XDG_CACHE_HOME: "/var/cache/u" }, "linux")).toBe(join("/var/cache/u", "kvl"));
    expect(kvlCacheDir({}, "linux")).toBe(join(homedir(), ".cache", "kvl"));
    // the XDG spec: a relative value is ignored
    expect(kvlCacheDir({ XDG_CACHE_HOME: "relative/cache" }, "linux")).toBe(join(homedir(), ".cache", "kvl"));
  });
});

describe("extractSeaAssets", () => {
  it("writes the files once into sea-KEY and reuses them untouched on later runs", () => {
    const cache = join(scratch, "reuse");
    const sea = fakeSea();
    const dir = extractSeaAssets(sea, cache);
    expect(dir).toBe(join(cache, `sea-${assetSetKey(FILES)}`));
    for (const [name, data] of FILES) expect(readFileSync(join(dir, name))).toEqual(Buffer.from(data));
    expect(sea.reads).toBe(FILES.size);
    const inode = statSync(join(dir, "package.json")).ino;

    const again = fakeSea();
    expect(extractSeaAssets(again, cache)).toBe(dir);
    expect(again.reads).toBe(0);
    expect(statSync(join(dir, "package.json")).ino).toBe(inode);
    expect(readdirSync(cache)).toEqual([`sea-${assetSetKey(FILES)}`]);
  });

  it("replaces a folder with a file missing or cut short, leaving no partial folder", () => {
    const cache = join(scratch, "repair");
    const dir = extractSeaAssets(fakeSea(), cache);
    rmSync(join(dir, "wasm-core", "dist", "kvl_core.wasm"));
    writeFileSync(join(dir, "node_modules", "tiktoken", "tiktoken_bg.wasm"), "cut");
    const sea = fakeSea();
    expect(extractSeaAssets(sea, cache)).toBe(dir);
    expect(sea.reads).toBe(FILES.size);
    for (const [name, data] of FILES) expect(readFileSync(join(dir, name))).toEqual(Buffer.from(data));
    expect(readdirSync(cache)).toEqual([`sea-${assetSetKey(FILES)}`]);
  });

  it("another executable's files go to their own folder beside the first", () => {
    const cache = join(scratch, "two");
    const other = new Map(FILES);
    other.set("package.json", Buffer.from('{"name":"kvl","version":"2"}'));
    const a = extractSeaAssets(fakeSea(), cache);
    const b = extractSeaAssets(fakeSea(other), cache);
    expect(a).not.toBe(b);
    expect(readdirSync(cache).sort()).toEqual([`sea-${assetSetKey(FILES)}`, `sea-${assetSetKey(other)}`].sort());
  });

  it("an unwritable cache folder is a UserError naming the folder and the variable to set", () => {
    const blocker = join(scratch, "a-file");
    mkdirSync(scratch, { recursive: true });
    writeFileSync(blocker, "");
    let caught: unknown;
    try {
      extractSeaAssets(fakeSea(), join(blocker, "cache"));
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(UserError);
    expect((caught as Error).message).toMatch(/^cannot write kvl's files to .*a-file.*; set (XDG_CACHE_HOME|LOCALAPPDATA) to a folder you can write to$/);
  });
});
