/**
 * Constrained decoding (issue 37) at the model level, on the tiny random-weight pack whose text is
 * noise — which is what proves the constraint: on native, WebAssembly and a forced 2-instance
 * split, 20 seeds at temperature 1.0 under a nested JSON schema all parse and validate (ajv, a
 * validator independent of the grammar engine); a plain JSON object; a forced tool call that
 * names a declared tool with arguments that validate; a reply cut by max_new_tokens ends
 * "length"; an image with a schema. Without a model: what the schema check refuses (keyword and
 * path named), the tool format's parser on streamed pieces, xgrammar's aborts, and the UTF-8 tables.
 */
import { Ajv } from "ajv";
import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { ChatModel, type Conversation } from "../host/chat-model.js";
import { chooseBackend } from "../host/core/backend.js";
import { ANY_OBJECT_SCHEMA, jsonSchemaGrammar } from "../host/text/grammar/grammar-spec.js";
import { SchemaError, checkSchema } from "../host/text/grammar/schema-check.js";
import { Utf8State, Utf8Tables } from "../host/text/grammar/utf8-mask.js";
import { GrammarEngineError, guarded, xgrammar } from "../host/text/grammar/xgrammar.js";
import { defaultReplyParams, type ReplyParams } from "../host/text/reply-params.js";
import { ToolCallParser, type ToolDef, parseReply, toolCallText, toolGrammar, toolsPrompt } from "../host/text/tool-format.js";
import { nativeBuilt } from "./helpers.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

/** A nested schema with the keywords a form-reading client uses. */
const INVOICE = {
  type: "object",
  properties: {
    vendor: { type: "string", minLength: 1, maxLength: 24 },
    total_cents: { type: "integer", minimum: 0, maximum: 10_000_000 },
    paid: { type: "boolean" },
    currency: { enum: ["EUR", "USD", "VND"] },
    lines: {
      type: "array", minItems: 1, maxItems: 3,
      items: { type: "object", properties: { item: { type: "string", maxLength: 12 }, qty: { type: "integer", minimum: 1, maximum: 99 } }, required: ["item", "qty"], additionalProperties: false },
    },
    note: { anyOf: [{ type: "string", maxLength: 10 }, { type: "null" }] },
  },
  required: ["vendor", "total_cents", "paid", "currency", "lines", "note"],
  additionalProperties: false,
};

const TOOLS: ToolDef[] = [
  { name: "get_weather", description: "Weather now", parameters: { type: "object", properties: { city: { type: "string", maxLength: 16 }, days: { type: "integer", minimum: 1, maximum: 7 } }, required: ["city", "days"], additionalProperties: false } },
  { name: "add", description: "Adds", parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"], additionalProperties: false } },
];

const ajv = new Ajv({ strict: true });

function params(overrides: Partial<ReplyParams>): ReplyParams {
  return { ...defaultReplyParams(), temperature: 1, maxNewTokens: 400, ...overrides };
}

let tmp: { dir: string; cleanup: () => void };
let pack: string;

beforeAll(async () => {
  tmp = tempDir("structured");
  ({ pack } = await tinyPack(tmp.dir, 0));
}, 300_000);

afterAll(() => tmp?.cleanup());

const SETUPS = [
  ...(nativeBuilt ? [{ label: "native", backend: "native", instances: 1 }] : []),
  { label: "wasm", backend: "wasm", instances: 1 },
  { label: "wasm, 2 instances", backend: "wasm", instances: 2 },
] as const;

describe.each(SETUPS)("constrained replies on $label", ({ backend, instances }) => {
  let chat: ChatModel;
  let conversation: Conversation;

  beforeAll(async () => {
    chat = await ChatModel.open(pack, {
      backend: chooseBackend({ option: backend }), ramMib: 1500, trunkCacheMib: null, maxContext: 4096, threads: 2,
      kernels: "auto", actDtype: "auto", loadVision: true, instances,
    });
    conversation = await chat.newConversation();
  }, 300_000);

  afterAll(async () => {
    await conversation?.close();
    await chat?.close();
  });

  it("20 seeds at temperature 1.0: every reply parses and validates against the schema", async () => {
    const validate = ajv.compile(INVOICE);
    for (let seed = 0; seed < 20; seed++) {
      const report = await conversation.generate([{ role: "user", parts: ["Read the invoice."] }], params({ seed, grammar: jsonSchemaGrammar(INVOICE) }), () => undefined);
      expect(report.finishReason, `seed ${seed}: ${report.reply}`).toBe("stop");
      const value: unknown = JSON.parse(report.reply);
      expect(validate(value), `seed ${seed}: ${report.reply} ${JSON.stringify(validate.errors)}`).toBe(true);
      expect(report.reply).not.toMatch(/\s(?=(?:[^"\\]|\\.)*$)/u); // compact: no whitespace outside strings at the end
    }
  }, 600_000);

  it("json_object: a JSON object every time", async () => {
    for (let seed = 0; seed < 5; seed++) {
      const report = await conversation.generate([{ role: "user", parts: ["JSON please"] }], params({ seed, grammar: jsonSchemaGrammar(ANY_OBJECT_SCHEMA) }), () => undefined);
      if (report.finishReason === "length") continue; // an object with many keys can outrun 400 tokens
      const value: unknown = JSON.parse(report.reply);
      expect(typeof value === "object" && value !== null && !Array.isArray(value), report.reply).toBe(true);
    }
  }, 300_000);

  it("a forced tool call names a declared tool with arguments that validate, on every seed", async () => {
    const validators = new Map(TOOLS.map((t) => [t.name, ajv.compile(t.parameters)]));
    for (let seed = 0; seed < 20; seed++) {
      const choice = seed % 2 === 0 ? { kind: "required" as const } : { kind: "named" as const, name: "add" };
      const report = await conversation.generate(
        [{ role: "system", parts: [toolsPrompt(TOOLS, choice)] }, { role: "user", parts: ["What is the weather in Hanoi?"] }],
        params({ seed, grammar: toolGrammar(TOOLS, choice) }), () => undefined);
      expect(report.finishReason, report.reply).toBe("stop");
      const { text, call } = parseReply(report.reply);
      expect(text).toBe(""); // a forced call starts at the first token
      expect(call, report.reply).not.toBeNull();
      if (choice.kind === "named") expect(call!.name).toBe("add");
      const validate = validators.get(call!.name);
      expect(validate, call!.name).toBeDefined();
      expect(validate!(JSON.parse(call!.arguments)), `${report.reply} ${JSON.stringify(validate!.errors)}`).toBe(true);
      // the format's own bytes, compact (re-serialising would round huge integers, so compare text)
      expect(report.reply).toBe(`<tool_call>{"name":${JSON.stringify(call!.name)},"arguments":${call!.arguments}}</tool_call>`);
      expect(call!.arguments).not.toMatch(/\s(?=(?:[^"\\]|\\.)*$)/u);
    }
  }, 600_000);

  it("max_new_tokens inside the structure ends 'length', and the text is not complete JSON", async () => {
    const report = await conversation.generate([{ role: "user", parts: ["Read the invoice."] }], params({ seed: 3, maxNewTokens: 6, grammar: jsonSchemaGrammar(INVOICE) }), () => undefined);
    expect(report.finishReason).toBe("length");
    expect(report.outputTokenIds).toHaveLength(6);
    expect(() => JSON.parse(report.reply)).toThrow();
  }, 120_000);

  it("an image with a schema", async () => {
    const raw = Buffer.alloc(56 * 56 * 3);
    for (let i = 0; i < raw.length; i++) raw[i] = (i * 37) % 256;
    const image = await chat.loadImage(await sharp(raw, { raw: { width: 56, height: 56, channels: 3 } }).png().toBuffer(), "form.png");
    const validate = ajv.compile(INVOICE);
    for (let seed = 0; seed < 3; seed++) {
      const report = await conversation.generate([{ role: "user", parts: [image, "Give me the invoice's fields."] }], params({ seed, grammar: jsonSchemaGrammar(INVOICE) }), () => undefined);
      expect(report.images).toHaveLength(1);
      expect(report.finishReason).toBe("stop");
      expect(validate(JSON.parse(report.reply)), report.reply).toBe(true);
    }
  }, 300_000);
});

describe("what the schema check refuses, by keyword and path", () => {
  const refused = (schema: unknown): SchemaError => {
    try {
      checkSchema(schema);
    } catch (err) {
      if (err instanceof SchemaError) return err;
      throw err;
    }
    throw new Error(`accepted ${JSON.stringify(schema)}`);
  };

  it("names an unsupported keyword and where it is", () => {
    const err = refused({ type: "object", properties: { when: { type: "string", format: "date-time" } } });
    expect(err.message).toMatch(/keyword 'format' at '\/properties\/when' is not supported/);
    expect(err.path).toBe("/properties/when/format");
  });

  it("refuses unsatisfiable bounds, empty enums, required properties that are forbidden", () => {
    expect(refused({ type: "string", minLength: 5, maxLength: 2 }).message).toMatch(/'minLength' 5 is above 'maxLength' 2/);
    expect(refused({ type: "integer", minimum: 9, maximum: 1 }).message).toMatch(/'minimum' 9 is above 'maximum' 1/);
    expect(refused({ enum: [] }).message).toMatch(/'enum' at the schema's root must be a non-empty array/);
    expect(refused({ type: "object", properties: {}, required: ["x"], additionalProperties: false }).message).toMatch(/names 'x', which additionalProperties: false forbids/);
  });

  it("refuses $ref cycles and references to nothing", () => {
    const tree = { $defs: { node: { type: "object", properties: { child: { $ref: "#/$defs/node" } } } }, $ref: "#/$defs/node" };
    expect(refused(tree).message).toMatch(/\$ref '#\/\$defs\/node' .* is a cycle/);
    expect(refused({ type: "object", properties: { a: { $ref: "#/$defs/missing" } } }).message).toMatch(/names nothing/);
    expect(refused({ $ref: "https://example.com/s.json" }).message).toMatch(/only local references/);
  });

  it("refuses decimal ranges (not enforced exactly) but accepts integer ones", () => {
    expect(refused({ type: "number", minimum: 0.5 }).message).toMatch(/'minimum' .* "type": "integer" only/);
    expect(() => checkSchema({ type: "integer", minimum: 0, maximum: 3 })).not.toThrow();
    expect(() => checkSchema(INVOICE)).not.toThrow();
  });
});

describe("the tool format without a model", () => {
  it("splits a streamed reply into text and one call, whatever the piece boundaries", () => {
    const reply = `Let me check.${toolCallText("get_weather", { city: 'Ha "Noi" }{', days: 2 })}`;
    for (let cut = 1; cut < 9; cut++) {
      const parser = new ToolCallParser();
      const events = [];
      for (let i = 0; i < reply.length; i += cut) events.push(...parser.push(reply.slice(i, i + cut)));
      events.push(...parser.finish());
      const text = events.filter((e) => e.type === "text").map((e) => (e as { text: string }).text).join("");
      const args = events.filter((e) => e.type === "arguments").map((e) => (e as { text: string }).text).join("");
      expect(text).toBe("Let me check.");
      expect(events.filter((e) => e.type === "call")).toEqual([{ type: "call", name: "get_weather" }]);
      expect(JSON.parse(args)).toEqual({ city: 'Ha "Noi" }{', days: 2 });
      expect(events.at(-1)).toEqual({ type: "end" });
    }
  });

  it("text that only looks like the start of a call is text", () => {
    expect(parseReply("a <tool_ call")).toEqual({ text: "a <tool_ call", call: null, started: false });
    expect(parseReply("ends with <tool_")).toEqual({ text: "ends with <tool_", call: null, started: false });
  });

  it("a call cut before its arguments close is not a call", () => {
    const cut = toolCallText("add", { a: 1, b: 2 }).slice(0, -16);
    expect(parseReply(`hi${cut}`)).toMatchObject({ text: "hi", call: null, started: true });
  });
});

describe("xgrammar's own refusals", () => {
  it("an abort becomes a GrammarEngineError with xgrammar's reason, and the next call gets a working instance", async () => {
    const broken = await xgrammar();
    let caught: unknown;
    try {
      // a reference to nothing: xgrammar's converter aborts (the schema check refuses it first in kvl)
      await guarded(() => broken.Testings._jsonSchemaToEBNF(JSON.stringify({ properties: { a: { $ref: "#/nope" } } }), false, -1, [",", ":"], true));
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(GrammarEngineError);
    expect((caught as Error).message).toMatch(/Cannot find field nope/);
    const fresh = await xgrammar();
    expect(fresh).not.toBe(broken);
    expect(await fresh.Testings._jsonSchemaToEBNF('{"type":"boolean"}', false, -1, [",", ":"], true)).toMatch(/root ::= /);
  });
});

describe("the UTF-8 tables", () => {
  it("allow a character split over tokens, refuse bytes that are not UTF-8, and end only at a boundary", () => {
    const tokens = [Uint8Array.of(0x61), Uint8Array.of(0xe4), Uint8Array.of(0xbd, 0xa0), Uint8Array.of(0xf5, 0x80, 0x80, 0x80),
      Uint8Array.of(0xed, 0xa0, 0x80), Uint8Array.of(0x80), new Uint8Array(0)];
    const tables = new Utf8Tables(tokens);
    const allowed = (state: Utf8State): number[] => tokens.map((_, id) => id).filter((id) => ((state.mask[id >>> 5]! >>> (id & 31)) & 1) === 1);
    const s = new Utf8State(tables);
    expect(allowed(s)).toEqual([0, 1, 6]); // 'a', a lead byte, the empty (stop) token
    s.accept(1);
    expect(allowed(s)).toEqual([2, 5]); // continuation bytes only (2 completes 你)
    s.accept(2);
    expect(s.state).toBe(0);
  });
});
