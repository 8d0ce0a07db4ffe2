/** host/core/huge-pages.ts: the THP mode as Linux writes it, and what each mode means per backend. */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, describe, expect, it } from "vitest";

import { hugePageAdvice, parseThpMode, readThpMode } from "../host/core/huge-pages.js";

describe("the transparent huge page mode", () => {
  it("is the bracketed word of the sysfs file", () => {
    expect(parseThpMode("always [madvise] never\n")).toBe("madvise");
    expect(parseThpMode("[always] madvise never\n")).toBe("always");
    expect(parseThpMode("always madvise [never]\n")).toBe("never");
    expect(parseThpMode("always madvise never\n")).toBeNull();
    expect(parseThpMode("[inherit] always\n")).toBeNull();
    expect(parseThpMode("")).toBeNull();
  });

  const dir = mkdtempSync(join(tmpdir(), "kvl-thp-"));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it("reads a file of that format, and is null where there is none", () => {
    const file = join(dir, "enabled");
    writeFileSync(file, "[always] madvise never\n");
    expect(readThpMode(file)).toBe("always");
    expect(readThpMode(join(dir, "missing"))).toBeNull();
  });

  it("is null on every platform but Linux, even where the file can be read (Windows under Wine reads Linux's)", () => {
    const file = join(dir, "enabled-elsewhere");
    writeFileSync(file, "always [madvise] never\n");
    expect(readThpMode(file, "linux")).toBe("madvise");
    for (const platform of ["win32", "darwin", "freebsd"] as const) expect(readThpMode(file, platform)).toBeNull();
  });
});

describe("what the mode means for a backend's direct reads", () => {
  it("WebAssembly gets huge pages only with \"always\": any other mode is a warning that says how to set it", () => {
    expect(hugePageAdvice("wasm", "always")!.status).toBe("OK");
    for (const mode of ["madvise", "never"] as const) {
      const advice = hugePageAdvice("wasm", mode)!;
      expect(advice.status).toBe("WARN");
      expect(advice.detail).toContain("echo always | sudo tee /sys/kernel/mm/transparent_hugepage/enabled");
    }
  });

  it("the native core asks for them itself, so only \"never\" is a warning", () => {
    expect(hugePageAdvice("native", "always")!.status).toBe("OK");
    expect(hugePageAdvice("native", "madvise")!.status).toBe("OK");
    expect(hugePageAdvice("native", "never")!.status).toBe("WARN");
  });

  it("says nothing where the system has no such setting", () => {
    expect(hugePageAdvice("wasm", null)).toBeNull();
    expect(hugePageAdvice("native", null)).toBeNull();
  });
});
