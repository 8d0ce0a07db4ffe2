/**
 * host/text/tokenizer.ts against the Python tokenizers' goldens (test/fixtures/goldens/tokenizer.json,
 * made by test/fixtures/make-tokenizer-goldens.py: the ids of the official tokenizer on tiktoken
 * AND of the independent test/fixtures/reference/tokenizer.py, which agree there), on a tiny pack synthesized and
 * packed here (its tokenizer files are checked to be the goldens' by sha256).
 *
 * What is compared: ids of every golden text id for id (the script's CORPUS, CJK,
 * emoji, whitespace kinds, every special in running text, the pre-split limits in code points and
 * Python whitespace); encodeOrdinary; decode round trips and Python's U+FFFD replacement; the
 * stream decoder (never half a character, U+FFFD on flush); specials by name, stop ids and the
 * ids the sampler must never emit; Python's str.isspace on every code point; UserErrors for
 * missing or corrupt tokenizer files. Expected values are Python's or literals, never the code's.
 */
import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { packageRoot } from "../host/system/paths.js";
import { MAX_CHUNK_CHARS, MAX_RUN_CHARS, Tokenizer, isPySpace, splitRuns } from "../host/text/tokenizer.js";
import { UserError } from "../host/system/user-error.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

interface TextCase {
  text?: string;
  recipe?: Array<[string, number]>;
  length?: number;
}
interface IdsCase extends TextCase {
  name?: string;
  ids?: number[];
  ids_sha256?: string;
  ids_count?: number;
}
interface Goldens {
  provenance: { pack_files_sha256: Record<string, string> };
  limits: { max_chunk_chars: number; max_run_chars: number };
  python_isspace: number[];
  n_base_tokens: number;
  n_vocab: number;
  specials: Record<string, number>;
  ids: { im_end: number; eos: number; media_pad: number; media_start: number; media_end: number };
  stop_ids: number[];
  byte_ids: number[];
  encode: IdsCase[];
  encode_ordinary: IdsCase[];
  decode: Array<{ ids: number[]; text: string; pieces: string[]; flush: string }>;
}

const G = JSON.parse(readFileSync(join(packageRoot, "test", "fixtures", "goldens", "tokenizer.json"), "utf8")) as Goldens;

function textOf(c: TextCase): string {
  const text = c.text ?? c.recipe!.map(([piece, n]) => piece.repeat(n)).join("");
  if (c.length !== undefined) expect([...text].length).toBe(c.length); // Python's len(): code points
  return text;
}

/** sha256 of ids as little-endian uint32, as the golden script stores long id lists. */
function idsSha256(ids: readonly number[]): string {
  const bytes = new Uint8Array(ids.length * 4);
  const view = new DataView(bytes.buffer);
  ids.forEach((id, i) => view.setUint32(i * 4, id, true));
  return createHash("sha256").update(bytes).digest("hex");
}

function expectIds(got: number[], want: IdsCase, label: string): void {
  if (want.ids) {
    expect(got, label).toEqual(want.ids);
  } else {
    expect(got.length, label).toBe(want.ids_count);
    expect(idsSha256(got), label).toBe(want.ids_sha256);
  }
}

function sha256File(path: string): string {
  return createHash("sha256").update(readFileSync(path)).digest("hex");
}

const isValidUtf8 = (bytes: Uint8Array): boolean => {
  try {
    new TextDecoder("utf-8", { fatal: true }).decode(bytes);
    return true;
  } catch {
    return false;
  }
};

let tmp: { dir: string; cleanup: () => void };
let pack: string;
let tok: Tokenizer;

beforeAll(async () => {
  tmp = tempDir("tokenizer");
  ({ pack } = await tinyPack(tmp.dir));
  tok = new Tokenizer(pack);
}, 300_000);

afterAll(() => {
  tok?.close();
  tmp?.cleanup();
});

describe("the tokenizer files", () => {
  it("are the ones the goldens were made from", () => {
    for (const [file, sha] of Object.entries(G.provenance.pack_files_sha256)) {
      expect(sha256File(join(pack, file)), file).toBe(sha);
    }
  });
});

describe("pre-split", () => {
  it("uses the official limits", () => {
    expect(MAX_CHUNK_CHARS).toBe(G.limits.max_chunk_chars);
    expect(MAX_RUN_CHARS).toBe(G.limits.max_run_chars);
  });

  it("counts as whitespace exactly what Python's str.isspace does, on every code point", () => {
    const py = new Set(G.python_isspace);
    const differ: number[] = [];
    for (let cp = 0; cp <= 0x10ffff; cp++) if (isPySpace(cp) !== py.has(cp)) differ.push(cp);
    expect(differ).toEqual([]);
    // the characters where JavaScript's \s disagrees with Python
    for (const cp of [0x1c, 0x1d, 0x1e, 0x1f, 0x85]) expect(isPySpace(cp)).toBe(true);
    expect(isPySpace(0xfeff)).toBe(false);
  });

  it("cuts runs at 25,000 code points, not UTF-16 units, and restarts in each 400,000 chunk", () => {
    const astral = "\u{1D7D5}".repeat(MAX_RUN_CHARS + 1); // one code point, two UTF-16 units each
    const pieces = [...splitRuns(astral)].map((p) => [...p].length);
    expect(pieces).toEqual([MAX_RUN_CHARS, 1]);
    const spaced = ("7".repeat(20_000) + " ").repeat(20); // 400,020 code points
    const lengths = [...splitRuns(spaced)].map((p) => p.length);
    expect(lengths).toEqual([MAX_CHUNK_CHARS, 20]);
    expect([...splitRuns("")]).toEqual([]);
  });
});

describe("encode", () => {
  it.each(G.encode.map((c) => [c.name!, c] as const))("%s: the Python ids, id for id", (name, c) => {
    expectIds(tok.encode(textOf(c)), c, name);
  });

  it("encodeOrdinary treats special strings as text", () => {
    for (const c of G.encode_ordinary) {
      const ids = tok.encodeOrdinary(textOf(c));
      expectIds(ids, c, c.text?.slice(0, 40) ?? "long");
      expect(ids).not.toContain(G.ids.im_end);
      expect(ids).not.toContain(G.ids.media_pad);
    }
    const ids = tok.encodeOrdinary("<|im_end|>");
    expect(tok.decode(ids)).toBe("<|im_end|>");
  });

  it("encodes a lone surrogate as U+FFFD (as Python's tiktoken does)", () => {
    expect(tok.encode("a\ud800b")).toEqual(tok.encode("a\ufffdb"));
    expect(tok.encode("x\udfffy".repeat(9000))).toEqual(tok.encode("x\ufffdy".repeat(9000)));
  });
});

describe("decode", () => {
  it("round-trips every golden text", () => {
    for (const c of G.encode) {
      const text = textOf(c);
      if (!c.ids) continue; // long texts: their ids are only stored as a hash
      expect(tok.decode(c.ids), c.name).toBe(text);
      const bytes = tok.decodeBytes(c.ids);
      expect(Buffer.from(bytes).equals(Buffer.from(text, "utf8")), c.name).toBe(true);
    }
    const long = textOf(G.encode.find((c) => c.name === "chunk_boundary")!);
    expect(tok.decode(tok.encode(long))).toBe(long);
  });

  it("gives each single byte its own token", () => {
    G.byte_ids.forEach((id, b) => expect(Array.from(tok.tokenBytes(id)), `byte ${b}`).toEqual([b]));
  });

  it("replaces invalid UTF-8 as Python does, and writes specials as their names", () => {
    for (const c of G.decode) expect(tok.decode(c.ids), JSON.stringify(c.ids)).toBe(c.text);
  });

  it("refuses an id outside the vocabulary", () => {
    for (const bad of [-1, G.n_vocab, G.n_vocab + 5, 1.5]) {
      expect(() => tok.decode([bad])).toThrow(UserError);
      expect(() => tok.tokenBytes(bad)).toThrow(/not in the vocabulary/);
    }
  });
});

describe("stream decoder", () => {
  it("never emits half a character and ends with the text", () => {
    let splitSomewhere = false;
    for (const c of G.encode) {
      if (!c.ids) continue;
      const text = textOf(c);
      splitSomewhere ||= c.ids.some((id) => !isValidUtf8(tok.tokenBytes(id)));
      const decoder = tok.streamDecoder();
      const pieces = [...c.ids.map((id) => decoder.push(id)), decoder.flush()];
      expect(pieces.join(""), c.name).toBe(text);
      for (const piece of pieces) expect(piece.includes("\ufffd"), c.name).toBe(false);
    }
    // tokens that end inside a multi-byte character exist, else the check above proves nothing
    expect(splitSomewhere).toBe(true);
  });

  it("flushes an unfinished character as U+FFFD", () => {
    const euro = [0xe2, 0x82]; // the first 2 of the 3 bytes of "€"
    const decoder = tok.streamDecoder();
    expect(euro.map((b) => decoder.push(G.byte_ids[b]!))).toEqual(["", ""]);
    expect(decoder.flush()).toBe("\ufffd");
    // and starts afresh afterwards
    expect(decoder.push(G.byte_ids[0x41]!)).toBe("A");
  });

  it("gives Python's text on invalid UTF-8 (piece by piece where Python replaces at the end)", () => {
    for (const c of G.decode) {
      const decoder = tok.streamDecoder();
      const pieces = c.ids.map((id) => decoder.push(id));
      const flush = decoder.flush();
      expect(pieces.join("") + flush, JSON.stringify(c.ids)).toBe(c.pieces.join("") + c.flush);
      // CPython's incremental decoder may hold an invalid sequence one byte longer than the
      // WHATWG decoder (e.g. ED A0 80: Python replaces at the 3rd byte, TextDecoder at the 2nd);
      // the text is the same, only when the U+FFFD appear differs
      if (!c.pieces.join("").includes("\ufffd")) {
        expect(pieces, JSON.stringify(c.ids)).toEqual(c.pieces);
        expect(flush).toBe(c.flush);
      }
    }
  });
});

describe("special tokens", () => {
  it("reads the reserved range and its names as the Python does", () => {
    expect(tok.numBaseTokens).toBe(G.n_base_tokens);
    expect(tok.nVocab).toBe(G.n_vocab);
    expect(Object.fromEntries(tok.specialTokens)).toEqual(G.specials);
    expect(tok.specialTokens.size).toBe(258);
  });

  it("has the runtime's ids by name", () => {
    expect(tok.imEnd).toBe(G.ids.im_end);
    expect(tok.eos).toBe(G.ids.eos);
    expect(tok.mediaPad).toBe(G.ids.media_pad);
    expect(tok.mediaStart).toBe(G.ids.media_start);
    expect(tok.mediaEnd).toBe(G.ids.media_end);
    expect([...tok.stopIds].sort()).toEqual(G.stop_ids);
    // spec §8 ids (the synthesized tokenizer_config.json keeps the official special ids)
    expect([tok.imEnd, tok.eos, tok.mediaPad]).toEqual([163586, 163585, 163605]);
    expect(tok.idOf("<|im_user|>")).toBe(163587);
    expect(() => tok.idOf("<|no_such|>")).toThrow(/has no special token "<\|no_such\|>"/);
  });

  it("encodes and decodes every special by name", () => {
    for (const [name, id] of Object.entries(G.specials)) {
      expect(tok.encode(name), name).toEqual([id]);
      expect(tok.decode([id]), name).toBe(name);
    }
  });

  it("never lets the sampler emit a special other than a stop token", () => {
    const ids = tok.unsampleableIds();
    expect(ids).toBeInstanceOf(Int32Array);
    const all = Object.values(G.specials).sort((a, b) => a - b);
    const stops = new Set(G.stop_ids);
    expect(Array.from(ids)).toEqual(all.filter((id) => !stops.has(id)));
    expect(all.filter((id) => !ids.includes(id))).toEqual(G.stop_ids);
    for (const id of [G.ids.media_pad, G.ids.media_start, G.ids.media_end, G.specials["<|im_user|>"]!, G.specials["<|im_middle|>"]!]) {
      expect(ids.includes(id), String(id)).toBe(true);
    }
    expect(ids.length).toBe(256);
  });
});

describe("missing or corrupt tokenizer files", () => {
  let n = 0;
  /** A directory with the pack's tokenizer files, then `edit` applied. */
  const copy = (edit: (dir: string) => void, files = ["tiktoken.model", "tokenizer_config.json"]): string => {
    const dir = join(tmp.dir, `copy-${n++}`);
    mkdirSync(dir);
    for (const f of files) copyFileSync(join(pack, f), join(dir, f));
    edit(dir);
    return dir;
  };
  const fails = (dir: string): UserError => {
    try {
      new Tokenizer(dir).close();
    } catch (err) {
      expect(err).toBeInstanceOf(UserError);
      return err as UserError;
    }
    throw new Error("no error");
  };

  it("names a missing tiktoken.model and says to rerun kvl pack", () => {
    const err = fails(copy(() => {}, ["tokenizer_config.json"]));
    expect(err.message).toMatch(/tiktoken\.model is missing/);
    expect(err.message).toMatch(/rerun kvl pack/);
  });

  it("names the line of a corrupt tiktoken.model", () => {
    const dir = copy((d) => writeFileSync(join(d, "tiktoken.model"), "not base64 at all\n"));
    expect(fails(dir).message).toMatch(/tiktoken\.model:1 is not 'base64 rank'.*rerun kvl pack/);
    const lines = readFileSync(join(pack, "tiktoken.model"), "latin1").split("\n");
    for (const [bad, why] of [["IQ== x", /\(the rank 'x' is not a whole number\)/], ["I!== 3", /Non-base64/], ["IQ 3", /Incorrect padding/],
      ["IQ==", /\(1 field, not 2\)/], ["IQ== 3 4", /\(3 fields, not 2\)/]] as const) {
      const edited = [...lines];
      edited[2] = bad;
      writeFileSync(join(dir, "tiktoken.model"), edited.join("\n"), "latin1");
      const err = fails(dir);
      expect(err.message, bad).toMatch(/tiktoken\.model:3 is not 'base64 rank'/);
      expect(err.message, bad).toMatch(why);
    }
  });

  it("refuses an empty tiktoken.model or one whose ranks are not 0..N-1", () => {
    const dir = copy((d) => writeFileSync(join(d, "tiktoken.model"), "\n \n"));
    expect(fails(dir).message).toMatch(/tiktoken\.model is empty; rerun kvl pack/);
    const lines = readFileSync(join(pack, "tiktoken.model"), "latin1").split("\n");
    lines[5] = lines[5]!.replace(/ \d+$/, " 4"); // rank 4 twice
    writeFileSync(join(dir, "tiktoken.model"), lines.join("\n"), "latin1");
    expect(fails(dir).message).toMatch(/tiktoken\.model: rank 4 is used twice.*rerun kvl pack/);
  });

  it("names a missing or invalid tokenizer_config.json", () => {
    expect(fails(copy(() => {}, ["tiktoken.model"])).message).toMatch(/tokenizer_config\.json is missing; rerun kvl pack/);
    const bad = copy((d) => writeFileSync(join(d, "tokenizer_config.json"), "{\"added_tokens_decoder\": "));
    expect(fails(bad).message).toMatch(/tokenizer_config\.json is not valid JSON \(Unexpected end of JSON input\); rerun kvl pack$/);
    const none = copy((d) => writeFileSync(join(d, "tokenizer_config.json"), "{\"eos_token\": \"[EOS]\"}"));
    expect(fails(none).message).toMatch(/has no added_tokens_decoder object.*rerun kvl pack/);
    const entry = copy((d) => writeFileSync(join(d, "tokenizer_config.json"), "{\"added_tokens_decoder\": {\"x\": {\"content\": \"a\"}}}"));
    expect(fails(entry).message).toMatch(/tokenizer_config\.json: bad added_tokens_decoder entry "x"; rerun kvl pack$/);
  });

  it("refuses a config without the specials the runtime needs", () => {
    const config = JSON.parse(readFileSync(join(pack, "tokenizer_config.json"), "utf8")) as { added_tokens_decoder: Record<string, { content: string }> };
    config.added_tokens_decoder[String(G.ids.media_pad)]!.content = "<|something_else|>";
    const dir = copy((d) => writeFileSync(join(d, "tokenizer_config.json"), JSON.stringify(config)));
    expect(fails(dir).message).toMatch(/has no special token "<\|media_pad\|>"; the model directory is not a Kimi-VL pack/);
  });

  it("takes eos from the config, also as an AddedToken object", () => {
    const config = JSON.parse(readFileSync(join(pack, "tokenizer_config.json"), "utf8")) as Record<string, unknown>;
    config.eos_token = { content: "<|im_end|>", special: true };
    const dir = copy((d) => writeFileSync(join(d, "tokenizer_config.json"), JSON.stringify(config)));
    const t = new Tokenizer(dir);
    try {
      expect(t.eos).toBe(G.ids.im_end);
      expect([...t.stopIds]).toEqual([G.ids.im_end]);
    } finally {
      t.close();
    }
  });
});

describe("close", () => {
  it("frees the tokenizer; using it afterwards is an error", () => {
    const t = new Tokenizer(pack);
    expect(t.encode("hello")).toEqual(tok.encode("hello"));
    t.close();
    t.close();
    expect(() => t.encode("hello")).toThrow(/closed/);
  });
});
