/**
 * notices.test.ts — the package is fit to publish as far as its licences go: the MIT LICENSE that
 * package.json declares, and THIRD_PARTY_NOTICES.md naming every production dependency of
 * package-lock.json at its locked version (a dependency added or upgraded without rerunning
 * scripts/third-party-notices.mjs fails here), with sharp's libvips said to stay a separate,
 * replaceable library, and the package's `files` shipping both.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";

const read = (f: string): string => readFileSync(join(packageRoot, f), "utf8");
const manifest = JSON.parse(read("package.json")) as { license: string; files: string[] };
const lock = JSON.parse(read("package-lock.json")) as { packages: Record<string, { version: string; dev?: boolean; optional?: boolean }> };

describe("licences", () => {
  it("LICENSE is the MIT licence package.json declares, and both files ship", () => {
    expect(manifest.license).toBe("MIT");
    expect(read("LICENSE")).toMatch(/^MIT License\n/);
    expect(manifest.files).toEqual(expect.arrayContaining(["LICENSE", "THIRD_PARTY_NOTICES.md"]));
  });

  it("THIRD_PARTY_NOTICES.md lists every production dependency at its locked version", () => {
    const notices = read("THIRD_PARTY_NOTICES.md");
    const listed = new Set([...notices.matchAll(/^### (\S+)$/gm)].map((m) => m[1]));
    const wanted = Object.entries(lock.packages)
      .filter(([path, e]) => path.startsWith("node_modules/") && !e.dev && !e.optional)
      .map(([path, e]) => `${path.replace(/^.*node_modules\//, "")}@${e.version}`);
    expect(wanted.length).toBeGreaterThan(20);
    expect(wanted.filter((w) => !listed.has(w))).toEqual([]);
    expect(notices).toMatch(/## Node\.js \(inside the single executables\)/);
    expect(notices).toMatch(/separate shared libraries[^]*replace them/);
    expect(notices).toMatch(/GNU LESSER GENERAL PUBLIC LICENSE\s+Version 3/);
  });
});
