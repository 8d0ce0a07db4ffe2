/**
 * host/pack/py-json.ts against what Python's json module and repr() gave (CPython 3, recorded here as
 * literal strings): error messages and positions, NaN/Infinity, int versus float literals, key
 * order, the nesting limit, and json.dumps output byte for byte.
 */
import { describe, expect, it } from "vitest";

import {
  JsonSyntaxError, dumpsPy, isFloatMember, isIntMember, loadsPy, orderedKeys, pyBytesRepr, pyFloatRepr, pyRepr, pyTruthy,
} from "../host/pack/py-json.js";

describe("loadsPy", () => {
  it.each([
    ["", "Expecting value: line 1 column 1 (char 0)"],
    ["{not json", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"],
    ["[1,]", "Expecting value: line 1 column 4 (char 3)"],
    ['{"a" 1}', "Expecting ':' delimiter: line 1 column 6 (char 5)"],
    ['{"a": 1,}', "Expecting property name enclosed in double quotes: line 1 column 9 (char 8)"],
    ['"abc', "Unterminated string starting at: line 1 column 1 (char 0)"],
    ['"a\x01b"', "Invalid control character at: line 1 column 3 (char 2)"],
    ['"\\q"', "Invalid \\escape: line 1 column 2 (char 1)"],
    ['"\\u12"', "Invalid \\uXXXX escape: line 1 column 3 (char 2)"],
    ["1 2", "Extra data: line 1 column 3 (char 2)"],
    ['{\n "a": tru}', "Expecting value: line 2 column 7 (char 8)"],
    ["[1, 2", "Expecting ',' delimiter: line 1 column 6 (char 5)"],
    ["\ufeff{}", "Unexpected UTF-8 BOM (decode using utf-8-sig): line 1 column 1 (char 0)"],
    ["-", "Expecting value: line 1 column 1 (char 0)"],
    ["01", "Extra data: line 1 column 2 (char 1)"],
  ])("refuses %j as Python does", (text, message) => {
    expect(() => loadsPy(text)).toThrow(new JsonSyntaxError(message));
  });

  it("stops at Python's nesting limit with its message", () => {
    expect(() => loadsPy(`${"[".repeat(100000)}${"]".repeat(100000)}`))
      .toThrow("maximum recursion depth exceeded while decoding a JSON array from a unicode string");
    expect(loadsPy(`${"[".repeat(500)}${"]".repeat(500)}`)).toBeInstanceOf(Array);
  });

  it("keeps integer and float literals apart, and accepts NaN and Infinity", () => {
    const obj = loadsPy('{"a": 2048, "b": 2048.0, "c": 1e3, "d": [1, 1.5, -0], "e": NaN, "f": -Infinity, "g": true}') as Record<string, unknown>;
    expect(isIntMember(obj, "a")).toBe(true);
    expect(isIntMember(obj, "b")).toBe(false);
    expect(isFloatMember(obj, "b")).toBe(true);
    expect(isIntMember(obj, "c")).toBe(false);
    expect(obj.c).toBe(1000);
    const d = obj.d as unknown[];
    expect([isIntMember(d, 0), isIntMember(d, 1), isIntMember(d, 2)]).toEqual([true, false, true]);
    expect(Number.isNaN(obj.e)).toBe(true);
    expect(obj.f).toBe(-Infinity);
    expect(isIntMember(obj, "g")).toBe(false); // a bool is not an int for these checks
    expect(pyRepr(obj.b, isFloatMember(obj, "b"))).toBe("2048.0");
  });

  it("keeps key order (integer-like keys too), the last duplicate's value and __proto__ as data", () => {
    const obj = loadsPy('{"y": 1, "10": 2, "x": 3, "y": 4, "__proto__": 5}') as Record<string, unknown>;
    expect(orderedKeys(obj)).toEqual(["y", "10", "x", "__proto__"]);
    expect(obj.y).toBe(4);
    expect(Object.getPrototypeOf(obj)).toBe(Object.prototype);
    expect(Object.getOwnPropertyDescriptor(obj, "__proto__")?.value).toBe(5);
  });

  it("decodes escapes and surrogate pairs", () => {
    expect(loadsPy('"caf\\u00e9 \\ud83d\\ude00 \\n\\t\\/\\""')).toBe("café 😀 \n\t/\"");
  });
});

describe("dumpsPy", () => {
  it("writes json.dumps(separators=(',', ':')) with ensure_ascii", () => {
    const header = new Map<string, unknown>([
      ["__metadata__", { format: "pt" }],
      ["caf\u00e9\u2028\u{1F600}", { dtype: "BF16", shape: [2, 3], data_offsets: [0, 12] }],
      ["x\x7f\x1f", []],
    ]);
    expect(dumpsPy(header, { separators: [",", ":"] })).toBe(
      '{"__metadata__":{"format":"pt"},"caf\\u00e9\\u2028\\ud83d\\ude00":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"x\\u007f\\u001f":[]}');
  });

  // (A JS number cannot say it was a float, so integral floats like 2.0 are not tested: the
  // packer writes only integers and strings.)
  it("writes json.dumps(indent=2) and indent=1 byte for byte", () => {
    const data = new Map<string, unknown>([
      ["metadata", { total_size: 35 }], ["weight_map", new Map([["y", "s2"], ["10", "s1"]])], ["e", {}], ["l", []],
      ["f", [1.5, 1e-5, -0, 123456789.125]],
    ]);
    expect(dumpsPy(data, { indent: 2 })).toBe(`{
  "metadata": {
    "total_size": 35
  },
  "weight_map": {
    "y": "s2",
    "10": "s1"
  },
  "e": {},
  "l": [],
  "f": [
    1.5,
    1e-05,
    -0.0,
    123456789.125
  ]
}`);
    const complete = { format_version: 1, source_revision: null, files: { "a.bin": { size: 4096 }, "a.idx": { size: 10, crc32: 4294967295 } } };
    expect(dumpsPy(complete, { indent: 1 })).toBe(
      '{\n "format_version": 1,\n "source_revision": null,\n "files": {\n  "a.bin": {\n   "size": 4096\n  },\n' +
      '  "a.idx": {\n   "size": 10,\n   "crc32": 4294967295\n  }\n }\n}');
  });
});

describe("Python repr", () => {
  it("quotes strings, bytes, containers and floats as CPython does", () => {
    expect(pyRepr(loadsPy('{"type": "yarn", "factor": 4.0}'))).toBe("{'type': 'yarn', 'factor': 4.0}");
    expect(pyRepr("it's")).toBe('"it\'s"');
    expect(pyRepr('a"b')).toBe("'a\"b'");
    expect(pyRepr("x\ty\x00\x7f\x85é")).toBe("'x\\ty\\x00\\x7f\\x85é'");
    expect(pyBytesRepr(Uint8Array.from(Buffer.from("NOTANIDX\x00\xff'", "latin1")))).toBe("b\"NOTANIDX\\x00\\xff'\"");
    expect(pyRepr(null)).toBe("None");
    expect(pyRepr([true, 1, 2.5])).toBe("[True, 1, 2.5]");
    const floats = [1e-5, 1e16, 1e15, 123456789.125, 0.1, 2.446, 800000.0, 1e22, 5e-324, 1.7976931348623157e308, -2.5e-7];
    expect(floats.map((v) => pyFloatRepr(v)).join(" | ")).toBe(
      "1e-05 | 1e+16 | 1000000000000000.0 | 123456789.125 | 0.1 | 2.446 | 800000.0 | 1e+22 | 5e-324 | 1.7976931348623157e+308 | -2.5e-07");
    expect([NaN, Infinity, -Infinity].map(pyFloatRepr)).toEqual(["nan", "inf", "-inf"]);
  });

  it("has Python's truth values", () => {
    expect([0, NaN, "", [], {}, null, false, 1, "x", [0], { a: 0 }].map(pyTruthy))
      .toEqual([false, true, false, false, false, false, false, true, true, true, true]);
  });
});
