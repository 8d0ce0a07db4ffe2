/**
 * Structured outputs and tool calls through `kvl serve` (issue 37): the real server on the tiny
 * pack (whose text is noise, so every valid reply is the grammar's doing), driven by the official
 * SDKs — openai (`chat.completions.parse` with a JSON schema, streamed tool calls accumulated by
 * the SDK), @anthropic-ai/sdk (a streamed two-step tool-use loop with a tool_result), ollama-js
 * (`format` and `tools`) — on native, WebAssembly and a forced 2-instance split; every reply and
 * every call validated with ajv against the schema the request gave. On one backend: each bad
 * input is a 400 in its API's shape naming the problem, streamed or not (nothing half-streamed);
 * and `kvl chat --json-schema` / `--format json`, with an image too.
 */
import { writeFileSync } from "node:fs";
import { join } from "node:path";

import type Anthropic from "@anthropic-ai/sdk";
import { Ajv } from "ajv";
import { Ollama } from "ollama";
import type OpenAI from "openai";
import sharp from "sharp";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { nativeBuilt } from "./helpers.js";
import { type LiveServer, runKvl, startServer } from "./support/live-server.js";
import { tempDir, tinyPack } from "./support/pack-fixtures.js";

const MODEL = "kimi-vl-a3b-instruct-q8";
const CTX = 4096;
const ajv = new Ajv({ strict: true });

/** A form-reading schema: nested object, array, enum, bounded strings and integers, a nullable. */
const FORM = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 20 },
    age: { type: "integer", minimum: 0, maximum: 130 },
    kind: { enum: ["person", "company"] },
    emails: { type: "array", items: { type: "string", maxLength: 16 }, maxItems: 2 },
    address: { type: "object", properties: { city: { type: "string", maxLength: 12 }, zip: { type: ["string", "null"], maxLength: 6 } }, required: ["city", "zip"], additionalProperties: false },
  },
  required: ["name", "age", "kind", "emails", "address"],
  additionalProperties: false,
};
const WEATHER = { type: "object", properties: { city: { type: "string", maxLength: 16 }, unit: { enum: ["C", "F"] } }, required: ["city", "unit"], additionalProperties: false };
const ADD = { type: "object", properties: { a: { type: "integer", minimum: -1000, maximum: 1000 }, b: { type: "integer", minimum: -1000, maximum: 1000 } }, required: ["a", "b"], additionalProperties: false };
const VALIDATE = { get_weather: ajv.compile(WEATHER), add: ajv.compile(ADD) } as Record<string, ReturnType<typeof ajv.compile>>;
const OPENAI_TOOLS: OpenAI.ChatCompletionTool[] = [
  { type: "function", function: { name: "get_weather", description: "The weather in a city", parameters: WEATHER } },
  { type: "function", function: { name: "add", description: "Adds two integers", parameters: ADD } },
];
const ANTHROPIC_TOOLS: Anthropic.Tool[] = [
  { name: "get_weather", description: "The weather in a city", input_schema: WEATHER as Anthropic.Tool.InputSchema },
  { name: "add", description: "Adds two integers", input_schema: ADD as Anthropic.Tool.InputSchema },
];

let tmp: { dir: string; cleanup: () => void };
let pack: string;

beforeAll(async () => {
  tmp = tempDir("serve-tools");
  ({ pack } = await tinyPack(tmp.dir, 0));
}, 300_000);

afterAll(() => tmp?.cleanup());

async function png(seed: number): Promise<Buffer> {
  const raw = Buffer.alloc(56 * 56 * 3);
  for (let i = 0; i < raw.length; i++) raw[i] = (i * 31 + seed * 7) % 256;
  return sharp(raw, { raw: { width: 56, height: 56, channels: 3 } }).png().toBuffer();
}

const BACKENDS = [
  ...(nativeBuilt ? [{ label: "native", env: { KVL_BACKEND: "native" } }] : []),
  { label: "wasm", env: { KVL_BACKEND: "wasm" } },
  { label: "wasm, 2 instances", env: { KVL_BACKEND: "wasm", KVL_INSTANCES: "2" } },
];

describe.each(BACKENDS)("structured output and tools on $label", ({ env }) => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(pack, ["--max-context", String(CTX)], env);
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  it("openai chat.completions.parse with a JSON schema: 20 seeds at temperature 1.0 all parse and validate", async () => {
    const api = server.openai();
    const validate = ajv.compile(FORM);
    for (let seed = 0; seed < 20; seed++) {
      const r = await api.chat.completions.parse({
        model: MODEL, messages: [{ role: "user", content: "Fill in the form." }], temperature: 1, seed, max_tokens: 600,
        response_format: { type: "json_schema", json_schema: { name: "form", schema: FORM, strict: true } },
      });
      const choice = r.choices[0]!;
      expect(choice.finish_reason, choice.message.content ?? "").toBe("stop");
      expect(choice.message.parsed).not.toBeNull();
      expect(validate(choice.message.parsed), `${choice.message.content} ${JSON.stringify(validate.errors)}`).toBe(true);
    }
  }, 600_000);

  it("openai json_object, and an image with a schema", async () => {
    const api = server.openai();
    const obj = await api.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "JSON" }], temperature: 1, seed: 7, max_tokens: 300, response_format: { type: "json_object" } });
    if (obj.choices[0]!.finish_reason === "stop") {
      const value: unknown = JSON.parse(obj.choices[0]!.message.content!);
      expect(typeof value === "object" && value !== null && !Array.isArray(value)).toBe(true);
    }
    const validate = ajv.compile(FORM);
    const image = `data:image/png;base64,${(await png(1)).toString("base64")}`;
    const r = await api.chat.completions.parse({
      model: MODEL, temperature: 1, seed: 2, max_tokens: 600,
      messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: image } }, { type: "text", text: "Read the form in the picture." }] }],
      response_format: { type: "json_schema", json_schema: { name: "form", schema: FORM, strict: true } },
    });
    expect(r.choices[0]!.finish_reason).toBe("stop");
    expect(validate(r.choices[0]!.message.parsed), r.choices[0]!.message.content ?? "").toBe(true);
    expect(await logLineCount(server, "images=1")).toBeGreaterThanOrEqual(1);
  }, 300_000);

  it("openai forced tool calls: 20 seeds, each names a declared tool with arguments that validate; streamed calls accumulate in the SDK", async () => {
    const api = server.openai();
    for (let seed = 0; seed < 20; seed++) {
      const tool_choice: OpenAI.ChatCompletionToolChoiceOption = seed % 2 ? "required" : { type: "function", function: { name: "add" } };
      const r = await api.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "What is 2 + 3?" }], tools: OPENAI_TOOLS, tool_choice, temperature: 1, seed, max_tokens: 300 });
      const choice = r.choices[0]!;
      expect(choice.finish_reason).toBe("tool_calls");
      const calls = choice.message.tool_calls!;
      expect(calls).toHaveLength(1);
      const call = calls[0]! as OpenAI.ChatCompletionMessageFunctionToolCall;
      expect(call.type).toBe("function");
      expect(call.id).toMatch(/^call_/);
      if (seed % 2 === 0) expect(call.function.name).toBe("add");
      const validate = VALIDATE[call.function.name];
      expect(validate, call.function.name).toBeDefined();
      expect(validate!(JSON.parse(call.function.arguments)), call.function.arguments).toBe(true);
    }
    const stream = api.chat.completions.stream({ model: MODEL, messages: [{ role: "user", content: "Weather in Hanoi?" }], tools: OPENAI_TOOLS, tool_choice: "required", temperature: 1, seed: 5, max_tokens: 300 });
    let argumentPieces = 0;
    stream.on("tool_calls.function.arguments.delta", () => argumentPieces++);
    const final = await stream.finalChatCompletion();
    const call = final.choices[0]!.message.tool_calls![0]! as OpenAI.ChatCompletionMessageFunctionToolCall;
    expect(final.choices[0]!.finish_reason).toBe("tool_calls");
    expect(argumentPieces).toBeGreaterThan(1); // the arguments streamed in pieces, not at once
    expect(VALIDATE[call.function.name]!(JSON.parse(call.function.arguments))).toBe(true);
    // the call and its result in the history: the next turn is answered
    const next = await api.chat.completions.create({
      model: MODEL, temperature: 0, max_tokens: 5, tools: OPENAI_TOOLS, tool_choice: "none",
      messages: [{ role: "user", content: "Weather in Hanoi?" }, final.choices[0]!.message as OpenAI.ChatCompletionMessageParam,
        { role: "tool", tool_call_id: call.id, content: "31 C" }],
    });
    expect(["stop", "length"]).toContain(next.choices[0]!.finish_reason);
    expect(next.choices[0]!.message.tool_calls).toBeUndefined();
  }, 600_000);

  it("anthropic: a streamed two-step tool-use loop with a tool_result; count_tokens counts the tools", async () => {
    const api = server.anthropic();
    const messages: Anthropic.MessageParam[] = [{ role: "user", content: "Weather in Paris, in C?" }];
    const first = api.messages.stream({ model: MODEL, max_tokens: 200, tools: ANTHROPIC_TOOLS, tool_choice: { type: "tool", name: "get_weather" }, messages, temperature: 1 });
    const kinds: string[] = [];
    first.on("streamEvent", (e) => kinds.push(e.type === "content_block_delta" ? e.delta.type : e.type));
    const m1 = await first.finalMessage();
    expect(m1.stop_reason).toBe("tool_use");
    expect(kinds).toContain("input_json_delta");
    const use = m1.content.find((b): b is Anthropic.ToolUseBlock => b.type === "tool_use")!;
    expect(use.name).toBe("get_weather");
    expect(use.id).toMatch(/^toolu_/);
    expect(VALIDATE.get_weather!(use.input), JSON.stringify(use.input)).toBe(true);
    messages.push({ role: "assistant", content: m1.content });
    messages.push({ role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "18 C and sunny" }] });
    const m2 = await api.messages.stream({ model: MODEL, max_tokens: 8, tools: ANTHROPIC_TOOLS, tool_choice: { type: "none" }, messages, temperature: 1 }).finalMessage();
    expect(["end_turn", "max_tokens"]).toContain(m2.stop_reason);
    expect(m2.content.every((b) => b.type === "text")).toBe(true);
    const withTools = await api.messages.countTokens({ model: MODEL, messages, tools: ANTHROPIC_TOOLS });
    const without = await api.messages.countTokens({ model: MODEL, messages });
    expect(withTools.input_tokens).toBeGreaterThan(without.input_tokens + 50);
    // a non-streamed forced call of any tool: every one validates
    for (let seed = 0; seed < 5; seed++) {
      const m = await api.messages.create({ model: MODEL, max_tokens: 200, tools: ANTHROPIC_TOOLS, tool_choice: { type: "any" }, messages: [{ role: "user", content: "Go." }] });
      const block = m.content.find((b): b is Anthropic.ToolUseBlock => b.type === "tool_use")!;
      expect(m.stop_reason).toBe("tool_use");
      expect(VALIDATE[block.name]!(block.input), JSON.stringify(block.input)).toBe(true);
    }
  }, 600_000);

  it("ollama-js: format (a schema, and 'json'), tools, the tool turn in the history, capabilities", async () => {
    const ollama = new Ollama({ host: server.url });
    const validate = ajv.compile(FORM);
    for (let seed = 0; seed < 5; seed++) {
      const r = await ollama.chat({ model: MODEL, messages: [{ role: "user", content: "Fill in the form." }], format: FORM, options: { temperature: 1, seed, num_predict: 600 } });
      expect(r.done_reason).toBe("stop");
      expect(validate(JSON.parse(r.message.content)), r.message.content).toBe(true);
    }
    const g = await ollama.generate({ model: MODEL, prompt: "JSON please", format: "json", options: { temperature: 1, seed: 3, num_predict: 300 } });
    if (g.done_reason === "stop") expect(typeof JSON.parse(String(g.response))).toBe("object");
    for (let seed = 0; seed < 4; seed++) {
      const t = await ollama.chat({ model: MODEL, messages: [{ role: "user", content: "Add 2 and 3." }], tools: OPENAI_TOOLS as never, options: { temperature: 1, seed, num_predict: 60 } });
      for (const call of t.message.tool_calls ?? []) expect(VALIDATE[call.function.name]!(call.function.arguments)).toBe(true);
      expect(t.message.content).not.toContain("<tool_call>"); // a call is never left in the text
    }
    const after = await ollama.chat({
      model: MODEL, tools: OPENAI_TOOLS as never, options: { temperature: 0, num_predict: 4 },
      messages: [{ role: "user", content: "Add 2 and 3." }, { role: "assistant", content: "", tool_calls: [{ function: { name: "add", arguments: { a: 2, b: 3 } } }] },
        { role: "tool", content: "5", tool_name: "add" } as never],
    });
    expect(after.done).toBe(true);
    const show = await ollama.show({ model: MODEL });
    expect(show.capabilities).toEqual(["completion", "vision", "tools"]);
    const tags = (await ollama.list()).models[0] as unknown as { capabilities: string[]; context_length: number };
    expect(tags.capabilities).toEqual(["completion", "vision", "tools"]);
    expect(tags.context_length).toBe(CTX);
  }, 600_000);
});

async function logLineCount(server: LiveServer, what: string): Promise<number> {
  await expect.poll(() => server.log().split("\n").filter((l) => l.includes(what)).length, { timeout: 10_000 }).toBeGreaterThanOrEqual(1);
  return server.log().split("\n").filter((l) => l.includes(what)).length;
}

describe("bad structured-output and tool input: a 400 in the API's shape before any 200", () => {
  let server: LiveServer;
  beforeAll(async () => {
    server = await startServer(pack, ["--max-context", String(CTX)], nativeBuilt ? { KVL_BACKEND: "native" } : { KVL_BACKEND: "wasm" });
  }, 180_000);
  afterAll(async () => {
    expect(await server?.stop()).toBe(0);
  });

  const user = { role: "user", content: "hi" };
  const fn = (name: string, parameters: unknown = ADD) => ({ type: "function", function: { name, parameters } });
  const cycle = { $defs: { n: { type: "object", properties: { next: { $ref: "#/$defs/n" } } } }, $ref: "#/$defs/n" };
  const schemaFormat = (schema: unknown) => ({ type: "json_schema", json_schema: { name: "s", schema } });
  const cases: Array<[string, string, Record<string, unknown>, RegExp]> = [
    ["openai", "/v1/chat/completions", { messages: [user], response_format: schemaFormat({ type: "string", format: "email" }) }, /keyword 'format' at the schema's root is not supported/],
    ["openai", "/v1/chat/completions", { messages: [user], response_format: schemaFormat({ type: "string", minLength: 4, maxLength: 1 }) }, /'minLength' 4 is above 'maxLength' 1/],
    ["openai", "/v1/chat/completions", { messages: [user], response_format: schemaFormat(cycle) }, /is a cycle/],
    ["openai", "/v1/chat/completions", { messages: [user], tools: [fn("add"), fn("add")] }, /tool name 'add' is declared twice/],
    ["openai", "/v1/chat/completions", { messages: [user], tools: [fn("add")], tool_choice: { type: "function", function: { name: "mul" } } }, /names tool 'mul', which is not among the declared tools/],
    ["openai", "/v1/chat/completions", { messages: [user, { role: "tool", tool_call_id: "call_nope", content: "5" }] }, /tool_call_id 'call_nope' does not match any tool call/],
    ["openai", "/v1/chat/completions", { messages: [user], tools: [fn("add", { type: "object", properties: { a: { type: "number", maximum: 2.5 } } })] }, /'maximum' .* "type": "integer" only/],
    ["anthropic", "/v1/messages", { max_tokens: 5, messages: [user], tools: [{ name: "a", input_schema: cycle }] }, /tools\[0\]\.input_schema: .* is a cycle/],
    ["anthropic", "/v1/messages", { max_tokens: 5, messages: [user], tools: [{ name: "a", input_schema: ADD }, { name: "a", input_schema: ADD }] }, /tool name 'a' is declared twice/],
    ["anthropic", "/v1/messages", { max_tokens: 5, messages: [user], tools: [{ name: "a", input_schema: ADD }], tool_choice: { type: "tool", name: "b" } }, /names tool 'b'/],
    ["anthropic", "/v1/messages", { max_tokens: 5, messages: [{ role: "user", content: [{ type: "tool_result", tool_use_id: "toolu_x", content: "5" }] }] }, /tool_use_id 'toolu_x' does not match any tool_use block/],
    ["anthropic", "/v1/messages", { max_tokens: 5, messages: [user], tools: [{ type: "web_search_20250305", name: "web_search" }] }, /server tools .* not supported/],
    ["ollama", "/api/chat", { messages: [user], format: { type: "object", properties: { d: { type: "string", pattern: "([a-z]" } } } }, /'pattern' at '\/properties\/d' is not a valid regular expression/],
    ["ollama", "/api/chat", { messages: [user], format: { type: "object", patternProperties: { x: {} } } }, /keyword 'patternProperties'/],
    ["ollama", "/api/chat", { messages: [user], tools: [fn("x"), fn("x")] }, /declared twice/],
    ["ollama", "/api/generate", { prompt: "hi", format: { enum: [] } }, /'enum' at the schema's root must be a non-empty array/],
  ];

  it.each(cases)("%s %s %j → 400 naming it, streamed or not", async (dialect, path, body, message) => {
    for (const stream of [false, true]) {
      const r = await server.post(path, { model: MODEL, ...body, stream }, {});
      expect(r.status, r.text).toBe(400);
      expect(r.headers.get("content-type")).toMatch(/application\/json/);
      const text = dialect === "openai" ? r.json.error.message : dialect === "anthropic" ? r.json.error.message : r.json.error;
      if (dialect === "openai") expect(r.json.error.type).toBe("invalid_request_error");
      if (dialect === "anthropic") expect(r.json.type).toBe("error");
      expect(text).toMatch(message);
    }
  });
});

describe("kvl chat --json-schema and --format json", () => {
  it("the reply is JSON valid under the schema, with an image too; a bad schema file is refused before loading", async () => {
    const dir = tempDir("chat-schema");
    try {
      const schemaFile = join(dir.dir, "form.json");
      writeFileSync(schemaFile, JSON.stringify(FORM));
      const imageFile = join(dir.dir, "form.png");
      writeFileSync(imageFile, await png(4));
      const validate = ajv.compile(FORM);
      const base = ["chat", pack, "Fill in the form.", "--temperature", "1", "--max-new", "600", "--threads", "1", "--quiet"];
      const plain = await runKvl([...base, "--json-schema", schemaFile, "--seed", "1"], {});
      expect(plain.status, plain.stderr).toBe(0);
      expect(validate(JSON.parse(plain.stdout)), plain.stdout).toBe(true);
      const pictured = await runKvl([...base, "--json-schema", schemaFile, "--seed", "2", "--image", imageFile, "--json"], {});
      expect(pictured.status, pictured.stderr).toBe(0);
      const record = JSON.parse(pictured.stdout.trim().split("\n").at(-1)!) as { reply: string; finish_reason: string; images: unknown[] };
      expect(record.finish_reason).toBe("stop");
      expect(record.images).toHaveLength(1);
      expect(validate(JSON.parse(record.reply)), record.reply).toBe(true);
      const anyObject = await runKvl([...base, "--format", "json", "--seed", "3", "--max-new", "200"], {});
      expect(anyObject.status, anyObject.stderr).toBe(0);
      writeFileSync(schemaFile, JSON.stringify({ type: "string", format: "uri" }));
      const bad = await runKvl([...base, "--json-schema", schemaFile], {});
      expect(bad.status).not.toBe(0);
      expect(bad.stderr).toMatch(/keyword 'format' at the schema's root is not supported/);
      expect(bad.stderr).not.toMatch(/\n\s+at /); // one line, no stack trace
    } finally {
      dir.cleanup();
    }
  }, 600_000);
});
