/**
 * The structs that cross the TypeScript/C boundary (kvl_core.h KVL_STRUCT_*: kvl_engine_options,
 * kvl_engine_info, kvl_stats), described once in C (X-macro rows: the struct and the layout table
 * kvl_struct_layout) and once in TypeScript (EngineOptions, EngineInfo, EngineStats in
 * host/core/core-api.ts), on both backends (the native addon and WebAssembly):
 *   - the TypeScript types, read from their source with the TypeScript compiler (so that nothing
 *     here lists a field), name exactly the members of each backend's layout table, one property
 *     per member, of the member's JS type: a member added on one side only fails here;
 *   - the objects info() and stats() return have exactly those properties;
 *   - the two builds' tables are the same (offsets, sizes and kinds of wasm32 and x86-64);
 *   - options written by each backend reach the core: an engine opened with every option off its
 *     default reports each value back (kvl_engine_info, and the vision encoder for loadVision).
 * And the codes that cross it (kvl_core.h *_ROWS, the core's kvl_constants tables): the status
 * texts, kernel-set names and levels, option codes and `kvl chat --json`'s stats names that
 * host/ spells are the core's, on both backends.
 */
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import ts from "typescript";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { type CoreBackend, CoreError, type EngineOptions, type FieldKind, KERNEL_CHOICES, KVL_CONSTANTS, KVL_ERR_CANCELLED, KVL_STATUS_NAMES, KVL_STRUCTS, LOGITS_MODES, OPTION_CODES, ROUTING_MODE_CODES, type StructId, cFieldName, jsFieldName } from "../host/core/core-api.js";
import { AUTO_ACT_DTYPE } from "../host/plan/act-mode.js";
import { DTYPE_BF16, DTYPE_F32, DTYPE_NAMES, DTYPE_Q4_EXPERT, DTYPE_Q8_EXPERT, DTYPE_Q8_ROWS } from "../host/pack/pack-format.js";
import { NativeBackend } from "../host/core/native-backend.js";
import { WasmBackend } from "../host/core/wasm-backend.js";
import { packCheckpoint } from "../packer/pack.js";
import { tempDir, tinyCheckpoint } from "./support/pack-fixtures.js";

const CORE_API = join(dirname(fileURLToPath(import.meta.url)), "..", "host", "core", "core-api.ts");

type JsType = "number" | "boolean" | "string" | "names";

let program: ts.Program | undefined;

/** The properties of an interface of core-api.ts and their JS types ("names": a union of string
 * literals, the form EngineOptions gives the C enums), as the compiler sees them. */
function tsProperties(name: string): Map<string, JsType> {
  program ??= ts.createProgram([CORE_API], { strict: true, noEmit: true, module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext });
  const checker = program.getTypeChecker();
  const source = program.getSourceFile(CORE_API)!;
  const decl = source.statements.find((s): s is ts.InterfaceDeclaration => ts.isInterfaceDeclaration(s) && s.name.text === name);
  if (decl === undefined) throw new Error(`core-api.ts declares no interface ${name}`);
  const out = new Map<string, JsType>();
  for (const prop of checker.getPropertiesOfType(checker.getTypeAtLocation(decl))) {
    const type = checker.getNonNullableType(checker.getTypeOfSymbolAtLocation(prop, decl));
    const f = type.flags;
    const jsType: JsType | undefined = f & ts.TypeFlags.NumberLike ? "number"
      : f & ts.TypeFlags.BooleanLike ? "boolean"
      : f & ts.TypeFlags.String ? "string"
      : type.isUnion() && type.types.every((t) => t.flags & ts.TypeFlags.StringLiteral) ? "names"
      : undefined;
    if (jsType === undefined) throw new Error(`${name}.${prop.name} has type ${checker.typeToString(type)}, which no struct member has`);
    out.set(prop.name, jsType);
  }
  return out;
}

/** The JS type of each member kind; options may also name a C enum's values (engineOptionCodes). */
const JS_TYPES: Record<FieldKind, JsType[]> = { i32: ["number"], i64: ["number"], u64: ["number"], bool32: ["boolean"], chars: ["string"] };
/** Each struct: its TypeScript type, and whether that type may name a C enum's values. */
const STRUCTS: ReadonlyArray<[type: string, which: StructId, names: boolean]> = [
  ["EngineOptions", KVL_STRUCTS.engineOptions, true],
  ["EngineInfo", KVL_STRUCTS.engineInfo, false],
  ["EngineStats", KVL_STRUCTS.stats, false],
];

type BackendName = "native" | "wasm";
const BACKENDS: BackendName[] = ["native", "wasm"];
const THREADS = 2;

let tmp: { dir: string; cleanup: () => void };
let pack: string;
const cores = {} as Record<BackendName, CoreBackend>;

beforeAll(async () => {
  tmp = tempDir("boundary");
  cores.native = new NativeBackend();
  cores.wasm = await WasmBackend.create({ memoryBytes: 256 * 2 ** 20, pthreads: WasmBackend.pthreadsForEngine(THREADS) });
  const ckpt = await tinyCheckpoint(join(tmp.dir, "ckpt"), cores.native);
  pack = await packCheckpoint(ckpt, join(tmp.dir, "pack"), { core: cores.native, allowRevision: true });
}, 300_000);

afterAll(() => {
  cores.wasm?.close();
  cores.native?.close();
  tmp?.cleanup();
});

const sorted = (names: Iterable<string>): string[] => [...names].sort();

describe.each(BACKENDS)("the boundary structs on %s", (backend) => {
  describe.each(STRUCTS)("%s", (type, which, names) => {
    it("has one TypeScript property per member of the core's layout table, of the member's JS type", () => {
      const layout = cores[backend].structLayout(which);
      const props = tsProperties(type);
      expect(sorted(props.keys())).toEqual(sorted(layout.fields.map((f) => f.name)));
      expect(props.size).toBe(layout.fields.length);
      for (const f of layout.fields) {
        expect(f.name).toBe(jsFieldName(f.cName));
        const allowed = names && f.kind === "i32" ? [...JS_TYPES[f.kind], "names"] : JS_TYPES[f.kind];
        expect(allowed, `${type}.${f.name} (${f.cName}: ${f.kind})`).toContain(props.get(f.name));
      }
    });

    it("is laid out as in the other build", () => {
      expect(cores[backend].structLayout(which)).toEqual(cores[backend === "native" ? "wasm" : "native"].structLayout(which));
    });
  });

  it("returns info() and stats() with exactly the layout's properties", () => {
    const engine = cores[backend].openEngine(pack, { nThreads: THREADS });
    try {
      expect(sorted(Object.keys(engine.info()))).toEqual(sorted(cores[backend].structLayout(KVL_STRUCTS.engineInfo).fields.map((f) => f.name)));
      expect(sorted(Object.keys(engine.stats()))).toEqual(sorted(cores[backend].structLayout(KVL_STRUCTS.stats).fields.map((f) => f.name)));
    } finally {
      engine.close();
    }
  });

  it("hands every engine option to the core: each one off its default comes back through the engine", () => {
    const core = cores[backend];
    const defaults = core.openEngine(pack, { nThreads: THREADS });
    const base = defaults.info();
    expect(() => defaults.visionBytes(Int32Array.of(2, 2))).toThrow(CoreError);
    defaults.close();
    // off the defaults above: 2 threads, the whole trunk resident (> 0 bytes), auto kernels and
    // dtypes f32, no vision, every layer
    expect(base.nThreads).toBe(THREADS);
    expect(base.trunkCacheBytes).toBeGreaterThan(0);
    expect(base.nLayers).toBeGreaterThanOrEqual(3);
    expect(base.expertCachePolicy).toBe("adaptive"); // the default policy (kvl_core.h KVL_CACHE_POLICY_DEFAULT)
    const extents = 2 * base.numExpertsPerTok + 1;
    const options: Required<EngineOptions> = {
      nThreads: 1, expertCacheBytes: extents * base.expertExtentBytes, trunkCacheBytes: -1, ioMode: "buffered", kernels: "scalar",
      kvDtype: "bf16", loadVision: true, actDtype: "bf16", layerBegin: 1, layerEnd: base.nLayers - 1, expertLookahead: "off",
      expertCachePolicy: "lru",
    };
    const engine = core.openEngine(pack, options);
    try {
      const info = engine.info();
      expect(info).toMatchObject({
        nThreads: 1, expertCacheBytes: extents * base.expertExtentBytes, trunkCacheBytes: 0,
        trunkDirectIo: false, expertDirectIo: false, visionDirectIo: false, kernels: "scalar", kvDtype: "bf16", actDtype: "bf16",
        layerBegin: 1, layerEnd: base.nLayers - 1, expertLookahead: false, expertCachePolicy: "lru",
      });
      expect(engine.visionBytes(Int32Array.of(2, 2))).toBeGreaterThan(0);
    } finally {
      engine.close();
    }
    // the same small cache with expertLookahead auto (the default) reads ahead: "off" turned it off
    const auto = core.openEngine(pack, { ...options, expertLookahead: "auto" });
    try {
      expect(auto.info().expertLookahead).toBe(true);
    } finally {
      auto.close();
    }
    expect(base.expertLookahead).toBe(false); // the default cache holds every extent of the tiny model
  });
});

/** A kvl_constants list as name -> value. */
const asRecord = (rows: ReadonlyArray<{ name: string; value: number }>): Record<string, number> =>
  Object.fromEntries(rows.map((r) => [r.name, r.value]));

describe.each(BACKENDS)("the codes that cross the boundary on %s (kvl_constants)", (backend) => {
  it("has the status texts host/ has (KVL_STATUS_NAMES, KVL_ERR_CANCELLED)", () => {
    const rows = cores[backend].constants(KVL_CONSTANTS.status);
    expect(Object.fromEntries(rows.map((r) => [r.value, r.name]))).toEqual(KVL_STATUS_NAMES);
    expect(rows.find((r) => r.name === "cancelled")?.value).toBe(KVL_ERR_CANCELLED);
  });

  it("knows every kernel set and level host/ names, with the level host/ gives it", () => {
    const sets = asRecord(cores[backend].constants(KVL_CONSTANTS.kernelSets));
    const levels = asRecord(cores[backend].constants(KVL_CONSTANTS.kernelLevels));
    // the --kernels choices: a level's name or a set's, at that level (simd128-relaxed: level 4)
    for (const choice of KERNEL_CHOICES) {
      const code = OPTION_CODES.kernelLevels[choice];
      expect(levels[choice] ?? sets[choice], `--kernels ${choice}`).toBe(code);
    }
    expect(levels).toEqual(Object.fromEntries(Object.entries(OPTION_CODES.kernelLevels).filter(([name]) => name in levels)));
    // the sets --act-dtype auto chooses by
    for (const row of AUTO_ACT_DTYPE) for (const set of row.kernels) expect(Object.keys(sets), `act-mode.ts names ${set}`).toContain(set);
    // each set this backend has is a row
    for (const set of cores[backend].kernelSets()) expect(Object.keys(sets)).toContain(set.name);
  });

  it("has the option codes host/ writes (engineOptionCodes, logits and routing modes)", () => {
    const core = cores[backend];
    expect(asRecord(core.constants(KVL_CONSTANTS.io))).toEqual(OPTION_CODES.io);
    expect(asRecord(core.constants(KVL_CONSTANTS.lookahead))).toEqual(OPTION_CODES.lookahead);
    expect(asRecord(core.constants(KVL_CONSTANTS.logits))).toEqual(LOGITS_MODES);
    expect(asRecord(core.constants(KVL_CONSTANTS.routing))).toEqual(ROUTING_MODE_CODES);
    // host/ leaves out "default" (absent = 0) and the removed act mode "i16" (3: the core refuses it)
    const { default: kvDefault, ...kv } = asRecord(core.constants(KVL_CONSTANTS.kv));
    expect(kvDefault).toBe(0);
    expect(kv).toEqual(OPTION_CODES.kv);
    const { default: actDefault, i16: removed, ...act } = asRecord(core.constants(KVL_CONSTANTS.act));
    expect([actDefault, removed]).toEqual([0, 3]);
    expect(act).toEqual(OPTION_CODES.act);
    const { default: policyDefault, ...policies } = asRecord(core.constants(KVL_CONSTANTS.cachePolicy));
    expect(policyDefault).toBe(0);
    expect(policies).toEqual(OPTION_CODES.cachePolicy);
  });

  it("has the pack dtypes host/pack/pack-format.ts reads, under the same names", () => {
    const core = Object.fromEntries(Object.entries(asRecord(cores[backend].constants(KVL_CONSTANTS.dtype))).map(([name, value]) => [value, name]));
    expect(core).toEqual(DTYPE_NAMES);
    expect([DTYPE_BF16, DTYPE_F32, DTYPE_Q8_EXPERT, DTYPE_Q8_ROWS, DTYPE_Q4_EXPERT].map((d) => core[d])).toEqual(["BF16", "F32", "Q8_EXPERT", "Q8_ROWS", "Q4_EXPERT"]);
  });

  it("prints kvl_stats' own member names in kvl chat --json (cFieldName)", () => {
    for (const f of cores[backend].structLayout(KVL_STRUCTS.stats).fields) expect(cFieldName(f.name)).toBe(f.cName);
  });

  it("refuses a list it does not have", () => {
    expect(() => cores[backend].constants(99 as never)).toThrow(RangeError);
  });
});
