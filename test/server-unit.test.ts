/**
 * kvl serve without a model (port of tests/test_server_api.py): request JSON → messages and
 * ReplyParams, reports → the exact OpenAI, Anthropic and Ollama JSON/SSE/NDJSON shapes,
 * validation, body limits, auth and queueing.
 *
 * A stand-in model (FakeModel below, allowed only in this file) sits behind the real EngineQueue
 * and the real koa app, served on 127.0.0.1 in this process; the official openai and
 * @anthropic-ai/sdk clients talk to it over HTTP.
 */
import { readFileSync, readdirSync } from "node:fs";
import { createServer, request, type Server } from "node:http";
import { type AddressInfo, connect } from "node:net";
import { join } from "node:path";

import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";
import sharp from "sharp";
import { afterEach, describe, expect, it } from "vitest";

import type { ReplyHooks, ReplyReport } from "../host/chat-model.js";
import { ImageInput, type Message, sha256Hex } from "../host/text/conversation.js";
import { checkImage, decodeImage } from "../host/image/image-decode.js";
import { packageRoot } from "../host/system/paths.js";
import { bodySlots } from "../host/plan/input-lines.js";
import { DEFAULT_TEMPERATURE, type ReplyParams } from "../host/text/reply-params.js";
import { UserError } from "../host/system/user-error.js";
import * as anthropic from "../server/anthropic.js";
import { createApp } from "../server/app.js";
import { KeyCheck, presentedKey } from "../server/auth.js";
import { BodyGate, MAX_JSON_DEPTH, type ReadDeadlines, parseJsonText, scanJson } from "../server/body.js";
import { ApiError, anthropicErrorBody, openaiErrorBody } from "../server/errors.js";
import { AccessRules } from "../server/guard.js";
import { ImageData, decodeImageBase64, loadImages, sniffImage } from "../server/images.js";
import type { ServedModel } from "../server/model.js";
import * as ollama from "../server/ollama.js";
import * as openai from "../server/openai.js";
import { EngineQueue } from "../server/queue.js";
import { type StreamShape, imageProgress } from "../server/reply.js";
import { createHttpServer } from "../server/serve.js";

const MODEL = "kimi-vl-a3b-instruct-q8";
const CTX = 256;
const KEY = "sekret";

const PNG = await sharp({ create: { width: 8, height: 6, channels: 3, background: "red" } }).png().toBuffer();

function dataUrl(data: Uint8Array, mediaType = "image/png"): string {
  return `data:${mediaType};base64,${Buffer.from(data).toString("base64")}`;
}

function user(content: unknown): Record<string, unknown> {
  return { role: "user", content };
}

// -- OpenAI request translation ---------------------------------------------------------------
describe("OpenAI requests", () => {
  it("turns text and image parts into messages", () => {
    const req = openai.parseChatRequest({
      model: MODEL,
      messages: [{ role: "developer", content: "be brief" },
        user([{ type: "text", text: "what is" }, { type: "image_url", image_url: { url: dataUrl(PNG) } }, { type: "text", text: "this?" }]),
        { role: "assistant", content: "a square" }, user("sure?")],
    }, CTX);
    expect(req.model).toBe(MODEL);
    expect(req.messages.map((m) => m.role)).toEqual(["system", "user", "assistant", "user"]);
    expect(req.messages[0]!.parts).toEqual(["be brief"]);
    const parts = req.messages[1]!.parts;
    expect(parts[0]).toBe("what is");
    expect(parts[2]).toBe("this?");
    expect(parts[1]).toBeInstanceOf(ImageData);
    expect(Buffer.from((parts[1] as ImageData).bytes).equals(PNG)).toBe(true);
    expect(req.stream).toBe(false);
    expect(req.includeUsage).toBe(false);
  });

  it("reads the sampling fields", () => {
    const req = openai.parseChatRequest({
      model: MODEL, messages: [user("hi")], temperature: 0, top_p: 0.5, seed: 7, max_tokens: 9, max_completion_tokens: 5, stop: "END",
      stream: true, stream_options: { include_usage: true },
    }, CTX);
    const p = req.params;
    expect([p.temperature, p.topP, p.seed, p.stop]).toEqual([0, 0.5, 7n, ["END"]]);
    expect(p.maxNewTokens).toBe(5); // max_completion_tokens wins over the legacy max_tokens
    expect(req.stream && req.includeUsage).toBe(true);
    const listed = openai.parseChatRequest({ model: MODEL, messages: [user("hi")], stop: ["a", "b"], max_tokens: 3 }, CTX);
    expect(listed.params.stop).toEqual(["a", "b"]);
    expect(listed.params.maxNewTokens).toBe(3);
    const defaults = openai.parseChatRequest({ model: MODEL, messages: [user("hi")] }, CTX);
    expect(defaults.params.maxNewTokens).toBe(CTX);
    expect(defaults.params.temperature).toBe(DEFAULT_TEMPERATURE);
    expect(openai.parseChatRequest({ model: MODEL, messages: [user("hi")], seed: -1 }, CTX).params.seed).toBe(2n ** 64n - 1n);
  });

  const bad: Array<[unknown, string]> = [
    [{ messages: [user("hi")] }, "model"],
    [{ model: MODEL }, "messages"],
    [{ model: MODEL, messages: [] }, "messages"],
    [{ model: MODEL, messages: "hi" }, "messages"],
    [{ model: 5, messages: [user("hi")] }, "model"],
    [{ model: MODEL, messages: [{ role: "wizard", content: "x" }] }, "role"],
    [{ model: MODEL, messages: [{ role: "user" }] }, "content"],
    [{ model: MODEL, messages: [user(42)] }, "content"],
    [{ model: MODEL, messages: [user([{ type: "input_audio", input_audio: {} }])] }, "audio"],
    [{ model: MODEL, messages: [user([{ type: "file", file: {} }])] }, "file"],
    [{ model: MODEL, messages: [user([{ type: "video" }])] }, "video"],
    [{ model: MODEL, messages: [user([{ type: "text" }])] }, "text"],
    [{ model: MODEL, messages: [user([{ type: "image_url", image_url: { url: "https://e.com/a.png" } }])] }, "never fetches"],
    [{ model: MODEL, messages: [user([{ type: "image_url", image_url: { url: "data:image/png;base64,!!!" } }])] }, "base64"],
    [{ model: MODEL, messages: [user([{ type: "image_url", image_url: { url: dataUrl(Buffer.from("hello, not an image")) } }])] }, "not a JPEG"],
    [{ model: MODEL, messages: [user([{ type: "image_url", image_url: { url: "data:audio/wav;base64,AAAA" } }])] }, "media type"],
    [{ model: MODEL, messages: [user("hi")], max_tokens: 0 }, "max_tokens"],
    [{ model: MODEL, messages: [user("hi")], max_tokens: -3 }, "max_tokens"],
    [{ model: MODEL, messages: [user("hi")], max_tokens: CTX + 1 }, "max_tokens"],
    [{ model: MODEL, messages: [user("hi")], max_tokens: "10" }, "max_tokens"],
    [{ model: MODEL, messages: [user("hi")], max_completion_tokens: 2.5 }, "max_completion_tokens"],
    [{ model: MODEL, messages: [user("hi")], temperature: "hot" }, "temperature"],
    [{ model: MODEL, messages: [user("hi")], temperature: 3 }, "temperature"],
    [{ model: MODEL, messages: [user("hi")], temperature: Infinity }, "finite"],
    [{ model: MODEL, messages: [user("hi")], temperature: NaN }, "finite"],
    [{ model: MODEL, messages: [user("hi")], top_p: 0 }, "top_p"],
    [{ model: MODEL, messages: [user("hi")], stop: [""] }, "stop"],
    [{ model: MODEL, messages: [user("hi")], stop: 3 }, "stop"],
    [{ model: MODEL, messages: [user("hi")], stream: "yes" }, "stream"],
    [{ model: MODEL, messages: [user("hi")], seed: true }, "seed"],
    [{ model: MODEL, messages: [user("hi")], n: 2 }, "'n'"],
    [{ model: MODEL, messages: [user("hi")], tools: [{ type: "function" }] }, "tools"],
    [{ model: MODEL, messages: [user("hi")], tools: [{ function: { name: "f" } }] }, "tools[0].type must be 'function' (got null)"],
    [{ model: MODEL, messages: [user("hi")], tools: [{ type: "function", function: { name: "f", strict: "yes" } }] }, "tools[0].function.strict"],
    [{ model: MODEL, messages: [{ role: "assistant", content: null, tool_calls: [{ id: "x" }] }] }, "tool"],
    [{ model: MODEL, messages: [{ role: "assistant", content: [{ type: "image_url", image_url: { url: "data:image/png;base64,AAAA" } }] }] }, "user messages"],
    [[1, 2], "JSON object"],
  ];
  it.each(bad)("refuses %j (mentions %s)", (body, mention) => {
    let caught: unknown;
    try {
      openai.parseChatRequest(body, CTX);
    } catch (err) {
      caught = err;
    }
    expect(caught).toBeInstanceOf(ApiError);
    expect((caught as ApiError).status).toBe(400);
    expect((caught as ApiError).message.toLowerCase()).toContain(mention.toLowerCase());
  });
});

// -- Anthropic request translation -------------------------------------------------------------
describe("Anthropic requests", () => {
  it("reads system blocks, images and sampling fields", () => {
    const req = anthropic.parseMessagesRequest({
      model: MODEL, max_tokens: 12, temperature: 0.3, top_p: 0.9, top_k: 4, stop_sequences: ["\n\nHuman:"], stream: true,
      system: [{ type: "text", text: "rule one", cache_control: { type: "ephemeral" } }, { type: "text", text: "rule two" }],
      tools: [{ name: "ignored", input_schema: { type: "object" } }], metadata: { user_id: "u" },
      messages: [
        user([{ type: "image", source: { type: "base64", media_type: "image/png", data: PNG.toString("base64") } }, { type: "text", text: "describe" }]),
        { role: "assistant", content: [{ type: "text", text: "a bar" }] }, user("and?")],
    }, CTX);
    expect(req.messages.map((m) => m.role)).toEqual(["system", "user", "assistant", "user"]);
    expect(req.messages[0]!.parts.slice(0, 2)).toEqual(["rule one", "rule two"]);
    expect(req.messages[0]!.parts[2]).toMatch(/^\n\n# Tools\n[^]*## ignored\n/); // the declared tool, described after the system text
    expect(req.messages[1]!.parts[0]).toBeInstanceOf(ImageData);
    expect(req.messages[1]!.parts[1]).toBe("describe");
    expect(req.messages[2]!.parts).toEqual(["a bar"]);
    const p = req.params;
    expect([p.maxNewTokens, p.temperature, p.topP, p.topK, p.stop]).toEqual([12, 0.3, 0.9, 4, ["\n\nHuman:"]]);
    expect(req.stream).toBe(true);
    const plain = anthropic.parseMessagesRequest({ model: MODEL, max_tokens: 1, system: "be kind", messages: [user("x")] }, CTX);
    expect(plain.messages[0]).toEqual({ role: "system", parts: ["be kind"] });
  });

  const image = (source: Record<string, unknown>): Record<string, unknown> => ({ type: "image", source });
  const bad: Array<[unknown, string]> = [
    [{ model: MODEL, messages: [user("hi")] }, "max_tokens"],
    [{ model: MODEL, max_tokens: 0, messages: [user("hi")] }, "max_tokens"],
    [{ model: MODEL, max_tokens: CTX + 1, messages: [user("hi")] }, "max_tokens"],
    [{ model: MODEL, max_tokens: 5 }, "messages"],
    [{ model: MODEL, max_tokens: 5, messages: [] }, "messages"],
    [{ max_tokens: 5, messages: [user("hi")] }, "model"],
    [{ model: MODEL, max_tokens: 5, messages: [{ role: "system", content: "x" }] }, "system"],
    [{ model: MODEL, max_tokens: 5, messages: [{ role: "user" }] }, "content"],
    [{ model: MODEL, max_tokens: 5, messages: [user([{ type: "tool_use", id: "t", name: "f", input: {} }])] }, "tool"],
    [{ model: MODEL, max_tokens: 5, messages: [user([{ type: "document" }])] }, "document"],
    [{ model: MODEL, max_tokens: 5, messages: [user([{ type: "audio" }])] }, "audio"],
    [{ model: MODEL, max_tokens: 5, messages: [user([image({ type: "url", url: "https://e.com/x.png" })])] }, "never fetches"],
    [{ model: MODEL, max_tokens: 5, messages: [user([image({ type: "base64", media_type: "image/png", data: "***" })])] }, "base64"],
    [{ model: MODEL, max_tokens: 5, messages: [user([image({ type: "base64", media_type: "image/png", data: Buffer.from("plain text").toString("base64") })])] }, "not a JPEG"],
    [{ model: MODEL, max_tokens: 5, messages: [user([image({ type: "base64", media_type: "application/pdf", data: "AAAA" })])] }, "media_type"],
    [{ model: MODEL, max_tokens: 5, temperature: 1.5, messages: [user("hi")] }, "temperature"],
    [{ model: MODEL, max_tokens: 5, stop_sequences: "x", messages: [user("hi")] }, "stop_sequences"],
    [{ model: MODEL, max_tokens: 5, top_k: -1, messages: [user("hi")] }, "top_k"],
    [{ model: MODEL, max_tokens: 5, system: 7, messages: [user("hi")] }, "system"],
  ];
  it.each(bad)("refuses %j (mentions %s)", (body, mention) => {
    expect(() => anthropic.parseMessagesRequest(body, CTX)).toThrowError(new RegExp(mention.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"), "i"));
  });
});

// -- Ollama request translation -------------------------------------------------------------
describe("Ollama requests", () => {
  it("reads chat messages with images and options; defaults to streaming", () => {
    const req = ollama.parseChatRequest({
      model: `${MODEL}:latest`, keep_alive: "5m",
      messages: [{ role: "system", content: "sys" }, { role: "user", content: "look", images: [PNG.toString("base64")] }],
      options: { temperature: 0, top_p: 0.5, top_k: 3, seed: 9, num_predict: 7, stop: ["x"], num_ctx: 99999, mirostat: 1 },
    }, CTX);
    expect(req.stream).toBe(true);
    expect(req.load).toBeNull();
    expect(req.messages[0]).toEqual({ role: "system", parts: ["sys"] });
    expect(req.messages[1]!.parts[0]).toBeInstanceOf(ImageData);
    expect(req.messages[1]!.parts[1]).toBe("look");
    const p = req.params;
    expect([p.temperature, p.topP, p.topK, p.seed, p.maxNewTokens, p.stop]).toEqual([0, 0.5, 3, 9n, 7, ["x"]]);
    const unlimited = ollama.parseChatRequest({ model: MODEL, messages: [user("x")], options: { num_predict: -1, seed: -1 }, stream: false }, CTX);
    expect(unlimited.params.maxNewTokens).toBe(CTX);
    expect(unlimited.params.seed).toBeNull();
    expect(unlimited.stream).toBe(false);
  });

  it("reads tools without a type (Ollama's own examples leave it out) and ignores function.strict", () => {
    const req = ollama.parseChatRequest({
      model: MODEL, messages: [user("hi")], tools: [{ function: { name: "get_weather", strict: "yes", parameters: { type: "object", properties: { city: { type: "string" } } } } }],
    }, CTX);
    expect(req.tools?.tools).toEqual([{ name: "get_weather", description: "", parameters: { type: "object", properties: { city: { type: "string" } } } }]);
    expect(req.tools?.choice).toEqual({ kind: "auto" });
    expect(ollama.parseChatRequest({ model: MODEL, messages: [user("hi")], tools: [] }, CTX).tools).toBeNull();
  });

  it("reads generate requests; an empty one is a load request", () => {
    const req = ollama.parseGenerateRequest({ model: MODEL, prompt: "why?", system: "be brief", images: [dataUrl(PNG)] }, CTX);
    expect(req.messages.map((m) => m.role)).toEqual(["system", "user"]);
    expect(req.messages[1]!.parts[0]).toBeInstanceOf(ImageData);
    expect(req.messages[1]!.parts[1]).toBe("why?");
    expect(ollama.parseGenerateRequest({ model: MODEL }, CTX).load).toBe("load");
    expect(ollama.parseChatRequest({ model: MODEL, messages: [], keep_alive: 0 }, CTX).load).toBe("unload");
    expect(ollama.isServedModel(`${MODEL}:latest`, MODEL)).toBe(true);
    expect(ollama.isServedModel(`${MODEL}:q4`, MODEL)).toBe(false);
  });

  const bad: Array<[unknown, string]> = [
    [{ messages: [user("hi")] }, "model is required"],
    [{ model: MODEL, messages: "hi" }, "messages"],
    [{ model: MODEL, messages: [{ role: "wizard", content: "x" }] }, "role"],
    [{ model: MODEL, messages: [{ role: "user", content: 5 }] }, "content"],
    [{ model: MODEL, messages: [{ role: "user", content: "x", images: "abc" }] }, "images"],
    [{ model: MODEL, messages: [{ role: "user", content: "x", images: ["***"] }] }, "base64"],
    [{ model: MODEL, messages: [{ role: "assistant", content: "x", images: [PNG.toString("base64")] }] }, "user messages"],
    [{ model: MODEL, messages: [user("hi")], tools: [{ type: "function" }] }, "tools"],
    [{ model: MODEL, messages: [user("hi")], tools: [{ type: "tool", function: { name: "f" } }] }, "tools\\[0\\]\\.type must be 'function' \\(got \"tool\"\\)"],
    [{ model: MODEL, messages: [user("hi")], format: "xml" }, "format"],
    [{ model: MODEL, messages: [user("hi")], think: true }, "thinking"],
    [{ model: MODEL, messages: [user("hi")], options: { num_predict: 0 } }, "num_predict"],
    [{ model: MODEL, messages: [user("hi")], options: { num_predict: CTX + 1 } }, "num_predict"],
    [{ model: MODEL, messages: [user("hi")], options: { temperature: "warm" } }, "temperature"],
    [{ model: MODEL, messages: [user("hi")], options: "fast" }, "options"],
    [{ model: MODEL, messages: [user("hi")], stream: "no" }, "stream"],
  ];
  it.each(bad)("refuses chat %j (mentions %s)", (body, mention) => {
    expect(() => ollama.parseChatRequest(body, CTX)).toThrowError(new RegExp(mention, "i"));
  });

  it.each([
    [{ model: MODEL, prompt: "x", raw: true }, "raw"],
    [{ model: MODEL, prompt: "x", suffix: "y" }, "suffix"],
    [{ model: MODEL, prompt: "x", template: "{{ .Prompt }}" }, "template"],
    [{ model: MODEL, prompt: "x", context: [1, 2] }, "context"],
    [{ model: MODEL, prompt: 5 }, "prompt"],
  ] as Array<[unknown, string]>)("refuses generate %j (mentions %s)", (body, mention) => {
    expect(() => ollama.parseGenerateRequest(body, CTX)).toThrowError(new RegExp(mention, "i"));
  });
});

// -- bodies, images, auth ------------------------------------------------------------------
describe("body, images and keys", () => {
  it("measures nesting outside strings and finds non-JSON numbers with their key", () => {
    expect(scanJson('{"a":[1,{"b":"[[[{{{"}]}', 10).depth).toBe(3);
    expect(scanJson('{"a":"\\"[[[["}', 10).depth).toBe(1);
    expect(scanJson('{"temperature": NaN}', 10).nonFinite).toEqual({ token: "NaN", key: "temperature" });
    expect(scanJson('{"x": [1, -Infinity]}', 10).nonFinite).toEqual({ token: "-Infinity", key: "x" });
    expect(scanJson('{"x": "NaN"}', 10).nonFinite).toBeNull();
    const deep = `${"[".repeat(MAX_JSON_DEPTH + 1)}${"]".repeat(MAX_JSON_DEPTH + 1)}`;
    expect(() => parseJsonText(Buffer.from(deep))).toThrowError(/levels deep/);
    expect(parseJsonText(Buffer.from(`${"[".repeat(MAX_JSON_DEPTH)}${"]".repeat(MAX_JSON_DEPTH)}`))).toBeInstanceOf(Array);
    expect(() => parseJsonText(Buffer.from('{"temperature": NaN}'))).toThrowError(/'temperature' is NaN/);
    expect(() => parseJsonText(Buffer.from([0x7b, 0xff, 0x7d]))).toThrowError(/UTF-8/);
    expect(() => parseJsonText(Buffer.from("  \n"))).toThrowError(/empty/);
    expect(() => parseJsonText(Buffer.from("{nope"))).toThrowError(/not valid JSON/);
  });

  it("checks base64 and image signatures strictly", () => {
    expect(sniffImage(PNG)).toBe("image/png");
    expect(decodeImageBase64(PNG.toString("base64").replace(/(.{20})/g, "$1\n"), "x").bytes.length).toBe(PNG.length);
    expect(() => decodeImageBase64(PNG.toString("base64").slice(0, -1), "x")).toThrowError(/base64/);
    expect(() => decodeImageBase64("", "x")).toThrowError(/empty/);
  });

  it("checks an image whole without keeping it: checkImage refuses exactly what decodeImage refuses", async () => {
    const dir = join(packageRoot, "test", "fixtures", "images");
    let refused = 0;
    for (const name of readdirSync(dir)) {
      const whole = readFileSync(join(dir, name));
      const flipped = Buffer.from(whole);
      for (let i = whole.length >> 1; i < (whole.length >> 1) + 8; i++) flipped[i]! ^= 0xff;
      const variants = [whole, flipped, ...[0.25, 0.5, 0.75].map((f) => whole.subarray(0, Math.floor(whole.length * f))), whole.subarray(0, whole.length - 16)];
      for (const [k, bytes] of variants.entries()) {
        const verdict = (work: Promise<unknown>): Promise<string> => work.then(() => "ok", (err: Error) => (err instanceof UserError ? err.message : `not a UserError: ${err.stack}`));
        const expected = await verdict(decodeImage(bytes));
        expect(await verdict(checkImage(bytes)), `${name} variant ${k}`).toBe(expected);
        if (expected !== "ok") refused++;
      }
    }
    expect(refused).toBeGreaterThan(50); // the cut and flipped files mostly fail: the comparison has teeth
  });

  it("takes the key from x-api-key or a bearer token and compares it whole", () => {
    expect(presentedKey({ "x-api-key": "a" })).toBe("a");
    expect(presentedKey({ authorization: "Bearer  b " })).toBe("b");
    expect(presentedKey({ authorization: "Basic b" })).toBeNull();
    const keys = new KeyCheck(KEY);
    expect(() => keys.check({ "x-api-key": KEY })).not.toThrow();
    for (const wrong of ["", KEY.slice(0, -1), `${KEY}x`, KEY.toUpperCase()]) {
      expect(() => keys.check({ "x-api-key": wrong })).toThrowError(/invalid API key/);
    }
    expect(() => keys.check({})).toThrowError(/missing API key/);
    expect(() => new KeyCheck(null).check({})).not.toThrow();
  });
});

// -- response shapes --------------------------------------------------------------------------
function report(reason: ReplyReport["finishReason"] = "stop", prompt = 30, completion = 4, reused = 11, stop: string | null = null, reply = "hi"): ReplyReport {
  return {
    reply, finishReason: reason, stopSequence: stop, promptTokenIds: [], outputTokenIds: [],
    usage: { promptTokens: prompt, completionTokens: completion, reusedPromptTokens: reused, imagesEncoded: 0 },
    timings: { prefillS: 0.5, firstTokenS: 0.6, decodeSPerToken: 0.25, visionS: 0 }, images: [],
  };
}

/** data: lines → JSON objects, with the literal [DONE] kept as a string. */
function parseOpenAiSse(raw: string): unknown[] {
  expect(raw.endsWith("\n\n")).toBe(true);
  return raw.split("\n\n").slice(0, -1).map((record) => {
    expect(record.startsWith("data: ")).toBe(true);
    const payload = record.slice(6);
    return payload === "[DONE]" ? payload : JSON.parse(payload);
  });
}

function parseAnthropicSse(raw: string): Array<[string, Record<string, unknown>]> {
  return raw.split("\n\n").slice(0, -1).map((record) => {
    const [eventLine, dataLine] = record.split("\n") as [string, string];
    expect(eventLine.startsWith("event: ") && dataLine.startsWith("data: ")).toBe(true);
    return [eventLine.slice(7), JSON.parse(dataLine.slice(6)) as Record<string, unknown>];
  });
}

describe("response shapes", () => {
  it("chat.completion", () => {
    const body = openai.completionBody("chatcmpl-1", 100, MODEL, report("length", 30, 4, 11, null, "hello")) as Record<string, any>;
    expect(body.object).toBe("chat.completion");
    expect(body.model).toBe(MODEL);
    expect(body.choices[0].message).toEqual({ role: "assistant", content: "hello", refusal: null });
    expect(body.choices[0].finish_reason).toBe("length");
    expect(body.usage).toEqual({
      prompt_tokens: 30, completion_tokens: 4, total_tokens: 34, prompt_tokens_details: { cached_tokens: 11 }, completion_tokens_details: { reasoning_tokens: 0 },
    });
    expect(openai.finishReason(report("stop", 1, 1, 0, "X"))).toBe("stop");
  });

  it.each([false, true])("chat.completion.chunk stream (include_usage %s)", (includeUsage) => {
    const stream = new openai.ChunkStream(MODEL, includeUsage, "chatcmpl-9", 5);
    const raw = stream.start() + stream.delta("he") + stream.delta("") + stream.delta("llo") + stream.finish(report("stop"));
    const items = parseOpenAiSse(raw);
    expect(items.at(-1)).toBe("[DONE]");
    const chunks = items.slice(0, -1) as Array<Record<string, any>>;
    for (const c of chunks) expect([c.object, c.id, c.model]).toEqual(["chat.completion.chunk", "chatcmpl-9", MODEL]);
    expect(chunks[0]!.choices[0].delta).toEqual({ role: "assistant", content: "" });
    expect(chunks.slice(1, 3).map((c) => c.choices[0].delta.content)).toEqual(["he", "llo"]);
    expect(chunks[3]!.choices[0]).toMatchObject({ delta: {}, finish_reason: "stop" });
    if (includeUsage) {
      expect(chunks).toHaveLength(5);
      for (const c of chunks.slice(0, 4)) expect(c.usage).toBeNull();
      expect(chunks[4]!.choices).toEqual([]);
      expect(chunks[4]!.usage.prompt_tokens_details.cached_tokens).toBe(11);
    } else {
      expect(chunks).toHaveLength(4);
      for (const c of chunks) expect("usage" in c).toBe(false);
    }
  });

  it("Anthropic message and stop reasons", () => {
    const body = anthropic.messageBody("msg_1", MODEL, report("stop", 30, 4, 11, "###")) as Record<string, any>;
    expect([body.type, body.role]).toEqual(["message", "assistant"]);
    expect(body.content).toEqual([{ type: "text", text: "hi" }]);
    expect([body.stop_reason, body.stop_sequence]).toEqual(["stop_sequence", "###"]);
    expect(body.usage).toEqual({ input_tokens: 19, output_tokens: 4, cache_creation_input_tokens: 0, cache_read_input_tokens: 11 });
    expect(anthropic.stopReason(report("stop"))).toBe("end_turn");
    expect(anthropic.stopReason(report("length"))).toBe("max_tokens");
  });

  it("Anthropic event sequence", () => {
    const stream = new anthropic.MessageStream(MODEL, "msg_7");
    const raw = stream.start(30) + stream.delta("a") + stream.delta("") + anthropic.PING + stream.delta("b") + stream.finish(report("length", 30, 2));
    const events = parseAnthropicSse(raw);
    expect(events.map(([n]) => n)).toEqual(["message_start", "content_block_start", "ping", "content_block_delta", "ping", "content_block_delta",
      "content_block_stop", "message_delta", "message_stop"]);
    for (const [name, data] of events) expect(data.type).toBe(name);
    const start = events[0]![1].message as Record<string, any>;
    expect([start.id, start.content, start.stop_reason, start.usage.input_tokens]).toEqual(["msg_7", [], null, 30]);
    expect(events[1]![1].content_block).toEqual({ type: "text", text: "" });
    expect(events.filter(([n]) => n === "content_block_delta").map(([, d]) => d.delta)).toEqual([{ type: "text_delta", text: "a" }, { type: "text_delta", text: "b" }]);
    const delta = events[7]![1] as Record<string, any>;
    expect(delta.delta).toEqual({ stop_reason: "max_tokens", stop_sequence: null });
    expect(delta.usage.output_tokens).toBe(2);
    expect(delta.usage.input_tokens + delta.usage.cache_read_input_tokens).toBe(30);
  });

  it("Ollama lines and bodies", () => {
    const lines = new ollama.LineStream("chat", MODEL);
    const raw = lines.delta("a") + lines.delta("") + lines.finish(report("length", 30, 4), 2);
    const objs = raw.trim().split("\n").map((l) => JSON.parse(l) as Record<string, any>);
    expect(objs).toHaveLength(2);
    expect(objs[0]).toMatchObject({ model: MODEL, message: { role: "assistant", content: "a" }, done: false });
    expect(objs[1]).toMatchObject({ done: true, done_reason: "length", prompt_eval_count: 30, eval_count: 4, total_duration: 2e9, eval_duration: 1e9 });
    expect(Number.isNaN(Date.parse(objs[0]!.created_at))).toBe(false);
    const gen = ollama.replyBody("generate", MODEL, report("stop", 3, 1, 0, null, "full"), 1) as Record<string, any>;
    expect([gen.response, gen.done, gen.done_reason]).toEqual(["full", true, "stop"]);
  });

  it("error bodies", () => {
    const error = new ApiError("model_not_found", "no such model", "model");
    expect(error.status).toBe(404);
    expect(openaiErrorBody(error)).toEqual({ error: { message: "no such model", type: "invalid_request_error", param: "model", code: "model_not_found" } });
    expect(anthropicErrorBody(error)).toEqual({ type: "error", error: { type: "not_found_error", message: "no such model" } });
    const busy = new ApiError("rate_limit", "busy", null, 3);
    expect(busy.status).toBe(429);
    expect(busy.headers()).toEqual({ "retry-after": "3" });
    expect((anthropicErrorBody(new ApiError("too_large", "big")).error as Record<string, string>).type).toBe("request_too_large");
  });
});

// -- the app over a stand-in model --------------------------------------------------------------
/** Stands in for the model: one token per character (an image: 4, and it must be a PNG), replies
 * with fixed words, reuses the previous prompt's length as the fake KV prefix. */
class FakeModel implements ServedModel {
  static readonly WORDS = ["alpha ", "beta ", "gamma ", "delta"];
  readonly maxContext = CTX;
  readonly vision = true;
  calls: Array<{ messages: readonly Message[]; params: ReplyParams }> = [];
  closed = false;
  previous = 0;
  #cancel = false;
  #running = false;
  #wake: (() => void) | null = null;
  /** When set, each word waits for it (tests hold a reply in the middle). */
  gate: Promise<void> | null = null;
  /** "encoding" events each image of a reply reports before its text (0: none, as a quick encode). */
  encodeEvents = 0;
  /** The largest max_image_tokens a request may give, and what each loaded image was given. */
  readonly maxImageTokens = 256;
  budgets: Array<number | null> = [];

  async loadImage(bytes: Uint8Array, _name?: string, maxImageTokens: number | null = null): Promise<ImageInput> {
    this.budgets.push(maxImageTokens);
    return new FakeImage(sniffImage(bytes) === "image/png", sha256Hex(bytes));
  }

  countTokens(messages: readonly Message[]): number {
    let total = 2;
    for (const m of messages) {
      for (const p of m.parts) {
        if (typeof p === "string") total += p.length;
        else {
          if (!(p instanceof FakeImage) || !p.png) throw new UserError("the image is not a PNG");
          total += 4;
        }
      }
    }
    return total;
  }

  async generate(messages: readonly Message[], params: ReplyParams, onText: (text: string) => void, hooks: ReplyHooks = {}): Promise<ReplyReport> {
    this.calls.push({ messages, params });
    const images = messages.flatMap((m) => m.parts.filter((p) => p instanceof FakeImage));
    for (const [index] of images.entries()) {
      for (let n = 1; n <= this.encodeEvents; n++) {
        await new Promise<void>((r) => setImmediate(r)); // a real encode reports after a second, never at once
        hooks.onImage?.({ phase: "encoding", index, count: images.length, name: "image", grid: [4, 4], mediaTokens: 4, elapsedS: n, cached: false });
        await new Promise<void>((r) => setImmediate(r));
      }
    }
    this.#running = true;
    this.#cancel = false;
    const prompt = this.countTokens(messages);
    const reused = Math.min(this.previous, prompt - 1);
    this.previous = prompt;
    const pieces: string[] = [];
    try {
      for (const word of FakeModel.WORDS.slice(0, params.maxNewTokens)) {
        // each word waits for the gate (or the next turn of the event loop); a cancel wakes it
        const woken = new Promise<void>((r) => {
          this.#wake = r;
        });
        await Promise.race([this.gate ?? new Promise<void>((r) => setImmediate(r)), woken]);
        if (this.#cancel) return report("cancelled", prompt, pieces.length, reused, null, pieces.join(""));
        pieces.push(word);
        onText(word);
      }
      return report(params.maxNewTokens < FakeModel.WORDS.length ? "length" : "stop", prompt, pieces.length, reused, null, pieces.join(""));
    } finally {
      this.#running = false;
    }
  }

  cancel(): void {
    if (!this.#running) return;
    this.#cancel = true;
    this.#wake?.();
  }

  async close(): Promise<void> {
    this.closed = true;
  }
}
class FakeImage extends ImageInput {
  constructor(readonly png: boolean, digest: string) {
    super(4, digest);
  }
}

interface Served {
  url: string;
  model: FakeModel;
  queue: EngineQueue;
  server: Server;
  lines: string[];
}

const opened: Served[] = [];
afterEach(async () => {
  for (const s of opened.splice(0)) {
    s.queue.beginShutdown();
    s.server.closeAllConnections();
    await new Promise((r) => s.server.close(r));
    await s.queue.close();
  }
});

/** `http`: serve through the whole HTTP stack of `kvl serve` (serve.ts createHttpServer: the Host
 * and Origin rules, the body slots, the read deadlines) instead of the bare app. */
interface ServeOptions {
  maxQueue?: number;
  apiKey?: string | null;
  open?: () => Promise<ServedModel>;
  maxBodyBytes?: number;
  http?: { deadlines?: ReadDeadlines; allowOrigins?: string[]; allowHosts?: string[] };
}

async function serve(options: ServeOptions = {}): Promise<Served> {
  const model = new FakeModel();
  const maxQueue = options.maxQueue ?? 2;
  const queue = new EngineQueue(maxQueue, (line) => lines.push(line));
  const lines: string[] = [];
  const config = {
    modelId: MODEL, apiKey: options.apiKey === undefined ? KEY : options.apiKey, maxContext: CTX, maxBodyBytes: options.maxBodyBytes ?? 64 * 1024,
    vision: true, pack: { sizeBytes: 1, digest: "d", modifiedAt: new Date(0).toISOString() }, log: (line: string) => lines.push(line),
    ...(options.http?.deadlines ? { deadlines: options.http.deadlines } : {}),
  };
  const app = createApp(queue, config);
  const http = options.http;
  const server = http
    ? createHttpServer(app.callback(), config, new AccessRules({ bindHost: "127.0.0.1", allowHosts: http.allowHosts ?? [], allowOrigins: http.allowOrigins ?? [] }),
      new BodyGate(bodySlots(maxQueue)), () => queue.requireReady(), (line) => lines.push(line))
    : createServer(app.callback());
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const served = { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, model, queue, server, lines };
  opened.push(served);
  const started = queue.start(options.open ?? (async () => model));
  if (!options.open) await started;
  return served;
}

function oai(s: Served, key = KEY): OpenAI {
  return new OpenAI({ baseURL: `${s.url}/v1`, apiKey: key, maxRetries: 0 });
}

function ant(s: Served, key = KEY): Anthropic {
  return new Anthropic({ baseURL: s.url, apiKey: key, maxRetries: 0 });
}

async function post(s: Served, path: string, body: unknown, headers: Record<string, string> = { "x-api-key": KEY }): Promise<{ status: number; json: any; headers: Headers }> {
  const response = await fetch(`${s.url}${path}`, {
    method: "POST", headers: { "content-type": "application/json", ...headers }, body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await response.text();
  return { status: response.status, json: text ? JSON.parse(text) : null, headers: response.headers };
}

describe("the app over a stand-in model", () => {
  it("OpenAI SDK round trip", async () => {
    const s = await serve();
    const api = oai(s);
    expect((await api.models.list()).data.map((m) => m.id)).toEqual([MODEL]);
    const reply = await api.chat.completions.create({
      model: MODEL, max_tokens: 3, temperature: 0, seed: 1, stop: ["zz"],
      messages: [{ role: "user", content: [{ type: "text", text: "look" }, { type: "image_url", image_url: { url: dataUrl(PNG) } }] }],
    });
    expect(reply.choices[0]!.message.content).toBe("alpha beta gamma ");
    expect(reply.choices[0]!.finish_reason).toBe("length");
    expect(reply.usage!.prompt_tokens).toBe(4 + 4 + 2);
    expect(reply.usage!.completion_tokens).toBe(3);
    const call = s.model.calls.at(-1)!;
    expect(call.messages[0]!.parts[1]).toBeInstanceOf(ImageInput);
    expect([call.params.maxNewTokens, call.params.temperature, call.params.seed, call.params.stop]).toEqual([3, 0, 1n, ["zz"]]);
    const pieces: string[] = [];
    const reasons: Array<string | null> = [];
    let usage: OpenAI.CompletionUsage | undefined;
    const stream = await api.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "look" }], stream: true, stream_options: { include_usage: true } });
    for await (const chunk of stream) {
      if (chunk.choices.length) {
        pieces.push(chunk.choices[0]!.delta.content ?? "");
        reasons.push(chunk.choices[0]!.finish_reason);
      } else {
        usage = chunk.usage ?? undefined;
      }
    }
    expect(pieces.join("")).toBe(FakeModel.WORDS.join(""));
    expect(reasons.at(-1)).toBe("stop");
    expect(usage!.prompt_tokens).toBe(6);
    expect(usage!.prompt_tokens_details!.cached_tokens).toBe(5); // the stand-in reuses the previous prompt
    expect(s.lines.filter((l) => l.startsWith("kvl serve: POST /v1/chat/completions 200"))).toHaveLength(2);
  });

  it("Anthropic SDK round trip", async () => {
    const s = await serve();
    const api = ant(s);
    const reply = await api.messages.create({ model: MODEL, max_tokens: 2, system: "sys", messages: [{ role: "user", content: "hello" }] });
    expect(reply.content[0]).toMatchObject({ type: "text", text: "alpha beta " });
    expect(reply.stop_reason).toBe("max_tokens");
    expect(reply.usage.input_tokens + (reply.usage.cache_read_input_tokens ?? 0)).toBe(3 + 5 + 2);
    const stream = api.messages.stream({ model: MODEL, max_tokens: 10, messages: [{ role: "user", content: "hello" }] });
    let text = "";
    stream.on("text", (t) => {
      text += t;
    });
    const final = await stream.finalMessage();
    expect(text).toBe(FakeModel.WORDS.join(""));
    expect(final.stop_reason).toBe("end_turn");
    expect(final.usage.output_tokens).toBe(4);
    const counted = await api.messages.countTokens({ model: MODEL, messages: [{ role: "user", content: "hello" }] });
    expect(counted.input_tokens).toBe(5 + 2);
  });

  it("Ollama chat and generate over raw fetch", async () => {
    const s = await serve();
    const chat = await post(s, "/api/chat", { model: MODEL, stream: false, messages: [{ role: "user", content: "hey" }], options: { num_predict: 2 } });
    expect(chat.status).toBe(200);
    expect(chat.json).toMatchObject({ model: MODEL, message: { role: "assistant", content: "alpha beta " }, done: true, done_reason: "length", eval_count: 2 });
    const response = await fetch(`${s.url}/api/generate`, { method: "POST", headers: { "x-api-key": KEY }, body: JSON.stringify({ model: `${MODEL}:latest`, prompt: "hey" }) });
    expect(response.headers.get("content-type")).toContain("application/x-ndjson");
    const lines = (await response.text()).trim().split("\n").map((l) => JSON.parse(l) as Record<string, any>);
    expect(lines.filter((l) => !l.done).map((l) => l.response).join("")).toBe(FakeModel.WORDS.join(""));
    expect(lines.at(-1)).toMatchObject({ done: true, done_reason: "stop", model: `${MODEL}:latest` });
    const tags = await fetch(`${s.url}/api/tags`, { headers: { "x-api-key": KEY } }).then((r) => r.json() as Promise<any>);
    expect(tags.models[0].name).toBe(`${MODEL}:latest`);
    const show = await post(s, "/api/show", { model: MODEL });
    expect(show.json.capabilities).toContain("vision");
    const unknown = await post(s, "/api/chat", { model: "llama3", messages: [user("x")] });
    expect(unknown.status).toBe(404);
    expect(unknown.json).toEqual({ error: expect.stringContaining("llama3") });
    const unauthorized = await post(s, "/api/chat", { model: MODEL, messages: [user("x")] }, {});
    expect(unauthorized.status).toBe(401);
    expect(typeof unauthorized.json.error).toBe("string");
  });

  it("auth, limits and errors, each in its API's shape; the server keeps serving", async () => {
    const s = await serve();
    const health = await fetch(`${s.url}/healthz`); // no key needed
    expect(await health.json()).toEqual({ status: "ready" });
    await expect(oai(s, "wrong").models.list()).rejects.toBeInstanceOf(OpenAI.AuthenticationError);
    await expect(ant(s, "wrong").messages.create({ model: MODEL, max_tokens: 1, messages: [{ role: "user", content: "x" }] }))
      .rejects.toBeInstanceOf(Anthropic.AuthenticationError);
    expect((await fetch(`${s.url}/v1/models`)).status).toBe(401);
    expect((await fetch(`${s.url}/v1/models`, { headers: { authorization: `Bearer ${KEY}` } })).status).toBe(200);
    const big = await post(s, "/v1/messages", `{${" ".repeat(70000)}}`);
    expect(big.status).toBe(413);
    expect(big.json.error.type).toBe("request_too_large");
    // no Content-Length (chunked): refused while reading
    const chunks = new ReadableStream<Uint8Array>({
      start(controller) {
        for (let i = 0; i < 20; i++) controller.enqueue(new Uint8Array(8192).fill(0x20));
        controller.close();
      },
    });
    const chunked = await fetch(`${s.url}/v1/chat/completions`, { method: "POST", headers: { "x-api-key": KEY }, body: chunks, duplex: "half" } as RequestInit);
    expect(chunked.status).toBe(413);
    expect((await chunked.json() as any).error.code).toBe("request_too_large");
    const bad = await post(s, "/v1/chat/completions", "{nope");
    expect(bad.status).toBe(400);
    expect(bad.json.error.type).toBe("invalid_request_error");
    const unknown = await post(s, "/v1/messages", { model: "claude-x", max_tokens: 1, messages: [user("x")] });
    expect(unknown.status).toBe(404);
    expect(unknown.json.error.type).toBe("not_found_error");
    await expect(oai(s).chat.completions.create({ model: "gpt-x", messages: [{ role: "user", content: "x" }] })).rejects.toBeInstanceOf(OpenAI.NotFoundError);
    // a content error found while counting (the stand-in's word for an undecodable image)
    const gif = Buffer.concat([Buffer.from("GIF89a"), Buffer.alloc(20)]).toString("base64");
    const decoded = await post(s, "/v1/messages", { model: MODEL, max_tokens: 1, messages: [user([{ type: "image", source: { type: "base64", media_type: "image/gif", data: gif } }])] });
    expect(decoded.status).toBe(400);
    expect(decoded.json.error.message).toContain("PNG");
    const tooLong = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("x".repeat(CTX))] });
    expect(tooLong.status).toBe(400);
    expect(tooLong.json.error.message).toContain("context");
    const nan = await post(s, "/v1/messages", `{"model": "${MODEL}", "max_tokens": 1, "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}`);
    expect(nan.status).toBe(400);
    expect(nan.json.error.message).toMatch(/'temperature' is NaN/);
    const deep = await post(s, "/api/chat", `{"model": "${MODEL}", "x": ${"[".repeat(1000)}${"]".repeat(1000)}}`);
    expect(deep.status).toBe(400);
    expect(deep.json.error).toMatch(/levels deep/);
    const route = await fetch(`${s.url}/v1/nowhere`, { headers: { "x-api-key": KEY } });
    expect(route.status).toBe(404);
    expect((await route.json() as any).error).toBeDefined();
    const method = await fetch(`${s.url}/v1/chat/completions`, { headers: { "x-api-key": KEY } });
    expect(method.status).toBe(405);
    const ok = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("x")], max_tokens: 1 });
    expect(ok.status).toBe(200);
    expect(ok.json.choices[0].message.content).toBe("alpha ");
  });

  it("a body far past the limit (100 MB) still gets its 413: the SDK reports it without retrying, a client that reads only after sending gets it", async () => {
    const s = await serve({ http: {} });
    const HUGE = 100 * 1000 * 1000;
    // the OpenAI SDK with its retries on: a 413 is final, a dropped connection would be retried
    const sdk = new OpenAI({ baseURL: `${s.url}/v1`, apiKey: KEY, maxRetries: 2 });
    const err = await sdk.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "x".repeat(HUGE) }] }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(OpenAI.APIError);
    expect((err as InstanceType<typeof OpenAI.APIError>).status).toBe(413);
    expect((err as InstanceType<typeof OpenAI.APIError>).message).toContain("--max-body-mib");
    expect(s.lines.filter((l) => l.includes(" 413 "))).toHaveLength(1);
    // a raw client that writes its whole body (Content-Length, no Expect) before it reads anything
    const socket = connect((s.server.address() as AddressInfo).port, "127.0.0.1");
    let answer = "";
    socket.on("data", (d: Buffer) => (answer += d.toString("latin1")));
    const closed = new Promise<void>((resolve) => socket.on("close", () => resolve()));
    const socketError = new Promise<unknown>((resolve) => socket.on("error", resolve));
    const write = (chunk: Buffer | string): Promise<void> => new Promise((resolve, reject) => socket.write(chunk, (e) => (e ? reject(e) : resolve())));
    await write(`POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: ${KEY}\r\ncontent-type: application/json\r\ncontent-length: ${HUGE}\r\n\r\n`);
    const block = Buffer.alloc(1 << 20, 0x20);
    for (let sent = 0; sent < HUGE; sent += block.length) await write(block.subarray(0, Math.min(block.length, HUGE - sent)));
    socket.end();
    await Promise.race([closed, socketError]);
    expect(answer).toMatch(/^HTTP\/1\.1 413 /);
    expect(JSON.parse(answer.slice(answer.indexOf("\r\n\r\n") + 4))).toMatchObject({ type: "error", error: { type: "request_too_large" } });
    // and the server goes on
    expect((await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("x")], max_tokens: 1 })).status).toBe(200);
  }, 120_000);

  it("a full queue answers 429 with Retry-After; a client that leaves is skipped or cancelled", async () => {
    const s = await serve({ maxQueue: 1 });
    let open!: () => void;
    s.model.gate = new Promise((r) => {
      open = r;
    });
    const running = new AbortController();
    const first = fetch(`${s.url}/v1/chat/completions`, {
      method: "POST", headers: { "x-api-key": KEY }, signal: running.signal,
      body: JSON.stringify({ model: MODEL, messages: [user("a")], stream: true }),
    });
    await expect.poll(() => s.model.calls.length).toBe(1);
    const waiting = new AbortController();
    const second = fetch(`${s.url}/v1/messages`, {
      method: "POST", headers: { "x-api-key": KEY }, signal: waiting.signal, body: JSON.stringify({ model: MODEL, max_tokens: 2, messages: [user("b")] }),
    });
    await expect.poll(() => s.queue.waiting).toBe(1);
    const full = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("c")] });
    expect(full.status).toBe(429);
    expect(full.json.error.type).toBe("rate_limit_error");
    expect(Number(full.headers.get("retry-after"))).toBeGreaterThan(0);
    await expect(oai(s).chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "c" }] })).rejects.toBeInstanceOf(OpenAI.RateLimitError);
    waiting.abort();
    await second.catch(() => undefined);
    await expect.poll(() => s.queue.waiting).toBe(0);
    expect(s.lines).toContain("kvl serve: skipped a queued request whose client disconnected");
    (await first).body?.cancel().catch(() => undefined);
    running.abort();
    await expect.poll(() => s.lines.some((l) => l.startsWith("kvl serve: generation cancelled after 0 token(s): the client disconnected"))).toBe(true);
    s.model.gate = null;
    open();
    const after = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("d")], max_tokens: 2 });
    expect(after.status).toBe(200);
    expect(s.model.calls).toHaveLength(2); // the skipped request never ran
    await expect.poll(() => s.lines.filter((l) => / 499 /.test(l))).toHaveLength(2);
  });

  it("a non-streaming client that leaves cancels its reply", async () => {
    const s = await serve();
    let open!: () => void;
    s.model.gate = new Promise((r) => {
      open = r;
    });
    const leaving = new AbortController();
    const request = fetch(`${s.url}/v1/chat/completions`, {
      method: "POST", headers: { "x-api-key": KEY }, signal: leaving.signal, body: JSON.stringify({ model: MODEL, messages: [user("a")] }),
    });
    await expect.poll(() => s.model.calls.length).toBe(1);
    leaving.abort();
    await request.catch(() => undefined);
    await expect.poll(() => s.lines.some((l) => l.includes("generation cancelled after 0 token(s)"))).toBe(true);
    open();
    s.model.gate = null;
    const after = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("b")], max_tokens: 1 });
    expect(after.json.choices[0].message.content).toBe("alpha ");
  });

  it("reports loading, then ready", async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const model = new FakeModel();
    const s = await serve({ apiKey: null, open: async () => {
      await gate;
      return model;
    } });
    expect(await (await fetch(`${s.url}/healthz`)).json()).toEqual({ status: "loading" });
    const early = await post(s, "/v1/messages", { model: MODEL, max_tokens: 1, messages: [user("x")] }, {});
    expect(early.status).toBe(503);
    expect(early.json.error.type).toBe("overloaded_error");
    expect(early.json.error.message).toContain("loading");
    expect(early.headers.get("retry-after")).toBeTruthy();
    release();
    await expect.poll(async () => (await (await fetch(`${s.url}/healthz`)).json() as any).status).toBe("ready");
    const late = await post(s, "/v1/messages", { model: MODEL, max_tokens: 1, messages: [user("x")] }, {});
    expect(late.status).toBe(200);
    expect(late.json.content[0].text).toBe("alpha ");
  });

  it("reports a failed load", async () => {
    const s = await serve({ open: async () => {
      throw new UserError("PACK_COMPLETE.json is missing");
    } });
    await expect.poll(() => s.queue.status).toBe("failed");
    const health = await fetch(`${s.url}/healthz`);
    expect(health.status).toBe(503);
    expect(await health.json()).toEqual({ status: "failed", error: "PACK_COMPLETE.json is missing" });
    const chat = await post(s, "/v1/chat/completions", { model: MODEL, messages: [user("x")] });
    expect(chat.status).toBe(503);
    expect(chat.json.error.message).toContain("PACK_COMPLETE");
  });

  it("shutdown ends a running stream with an error event and refuses waiting requests", async () => {
    const s = await serve();
    let open!: () => void;
    s.model.gate = new Promise((r) => {
      open = r;
    });
    const streaming = await fetch(`${s.url}/v1/messages`, {
      method: "POST", headers: { "x-api-key": KEY }, body: JSON.stringify({ model: MODEL, max_tokens: 4, stream: true, messages: [user("a")] }),
    });
    const waiting = post(s, "/v1/chat/completions", { model: MODEL, messages: [user("b")] });
    await expect.poll(() => s.queue.waiting).toBe(1);
    s.queue.beginShutdown();
    open();
    const text = await streaming.text();
    expect(text).toContain("event: error");
    expect(text).toContain("overloaded_error");
    const refused = await waiting;
    expect(refused.status).toBe(503);
  });

  it("images go through the model's loader; its UserErrors are 400s naming the field", async () => {
    const loader = { loadImage: async () => {
      throw new UserError("an image of 9000x9000 pixels is too large");
    } };
    await expect(loadImages([{ role: "user", parts: [new ImageData(PNG, "messages[0].content[1]")] }], loader))
      .rejects.toMatchObject({ status: 400, param: "messages[0].content[1]", message: "messages[0].content[1]: an image of 9000x9000 pixels is too large" });
  });
});

// -- the HTTP server in front of the app: web pages and slow clients -----------------------------

/** One request over node:http, which (unlike fetch) sends whatever Host header it is given. */
function raw(s: Served, method: string, path: string, headers: Record<string, string>, body?: string):
  Promise<{ status: number; headers: Record<string, string | string[] | undefined>; json: any }> {
  return new Promise((resolve, reject) => {
    const req = request(`${s.url}${path}`, { method, headers, agent: false }, (res) => {
      let text = "";
      res.setEncoding("utf8");
      res.on("data", (chunk: string) => {
        text += chunk;
      });
      res.on("end", () => resolve({ status: res.statusCode!, headers: res.headers, json: text ? JSON.parse(text) : null }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

/** A connection that sends `head` and then nothing: everything it received, once the server closed it. */
function stall(s: Served, head: string): Promise<string> {
  return new Promise((resolve) => {
    const socket = connect((s.server.address() as AddressInfo).port, "127.0.0.1", () => socket.write(head));
    let got = "";
    socket.setEncoding("utf8");
    socket.on("data", (chunk: string) => {
      got += chunk;
    });
    socket.on("error", () => undefined); // a reset after the answer is still a close
    socket.on("close", () => resolve(got));
  });
}

/** An HTTP response's status and JSON body, from the raw text. */
function parseRaw(text: string): { status: number; json: any } {
  const [head = "", body = ""] = text.split("\r\n\r\n");
  return { status: Number(/^HTTP\/1\.1 (\d{3})/.exec(head)?.[1]), json: body ? JSON.parse(body) : null };
}

/** The error of `json` in the API of `path`: type (OpenAI / Anthropic; null for Ollama) and message. */
function errorOf(path: string, json: any): { type: string | null; message: string } {
  if (path.startsWith("/api/")) {
    expect(Object.keys(json)).toEqual(["error"]);
    return { type: null, message: json.error };
  }
  if (path.startsWith("/v1/messages")) {
    expect(json.type).toBe("error");
    return { type: json.error.type, message: json.error.message };
  }
  return { type: json.error.type, message: json.error.message };
}

describe("web pages: the Host and Origin rules", () => {
  it("allows loopback names, the address a request arrived at, --host and --allow-host names; nothing else", () => {
    const rules = new AccessRules({ bindHost: "127.0.0.1", allowHosts: [], allowOrigins: [] });
    for (const host of ["localhost", "LocalHost:8000", "127.0.0.1:8000", "127.9.9.9", "[::1]:8000", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]:80"]) {
      expect(rules.hostAllowed(host, "127.0.0.1"), host).toBe(true);
    }
    for (const host of ["evil.example", "evil.example:8000", "localhost.evil.example", "app.localhost", "10.0.0.5:8000", "2130706433", "", "a b", "x/y", "u@localhost"]) {
      expect(rules.hostAllowed(host, "127.0.0.1"), host).toBe(false);
    }
    expect(rules.hostAllowed(undefined, "127.0.0.1")).toBe(true); // HTTP/1.0 without Host: no browser sends that
    // bound to 0.0.0.0 or a LAN address: the address the connection arrived at, not any other
    expect(rules.hostAllowed("192.168.1.5:8000", "192.168.1.5")).toBe(true);
    expect(rules.hostAllowed("192.168.1.5:8000", "::ffff:192.168.1.5")).toBe(true);
    expect(rules.hostAllowed("192.168.1.6:8000", "192.168.1.5")).toBe(false);
    expect(rules.hostAllowed("[fe80::1]:8000", "fe80::1")).toBe(true);
    const named = new AccessRules({ bindHost: "box.lan", allowHosts: ["proxy.example", "[fd00::2]"], allowOrigins: [] });
    for (const host of ["box.lan:8000", "proxy.example", "PROXY.example:443", "[fd00::2]:1"]) expect(named.hostAllowed(host, "10.0.0.1"), host).toBe(true);
    expect(named.hostAllowed("other.example", "10.0.0.1")).toBe(false);
    expect(new AccessRules({ bindHost: "127.0.0.1", allowHosts: ["*"], allowOrigins: [] }).hostAllowed("anything.example", "127.0.0.1")).toBe(true);
  });

  it("passes the server's own page and listed origins; refuses every other Origin, null included", () => {
    const rules = new AccessRules({ bindHost: "127.0.0.1", allowHosts: [], allowOrigins: ["http://localhost:5173", "chrome-extension://*", "http://127.0.0.1:*"] });
    expect(rules.originVerdict(undefined, "127.0.0.1:8000")).toEqual({ kind: "none" });
    expect(rules.originVerdict("http://127.0.0.1:8000", "127.0.0.1:8000")).toEqual({ kind: "same" });
    expect(rules.originVerdict("https://kvl.example", "kvl.example")).toEqual({ kind: "same" }); // behind a TLS proxy
    expect(rules.originVerdict("http://localhost:5173", "127.0.0.1:8000")).toEqual({ kind: "listed", origin: "http://localhost:5173" });
    expect(rules.originVerdict("chrome-extension://abcdef", "127.0.0.1:8000").kind).toBe("listed");
    expect(rules.originVerdict("http://127.0.0.1:3000", "localhost:8000").kind).toBe("listed");
    for (const origin of ["http://localhost:5174", "https://localhost:5173", "http://evil.example", "null", "http://127.0.0.1.evil.example"]) {
      expect(rules.originVerdict(origin, "127.0.0.1:8000").kind, origin).toBe("refused");
    }
    const none = new AccessRules({ bindHost: "127.0.0.1", allowHosts: [], allowOrigins: [] });
    expect(none.originVerdict("http://127.0.0.1:8001", "127.0.0.1:8000").kind).toBe("refused"); // another port is another origin
    const any = new AccessRules({ bindHost: "127.0.0.1", allowHosts: [], allowOrigins: ["*"] });
    expect(any.originVerdict("null", "127.0.0.1:8000").kind).toBe("listed");
  });

  it("says how to write a malformed --allow-origin or --allow-host", () => {
    const make = (allowOrigins: string[], allowHosts: string[] = []) => () => new AccessRules({ bindHost: "127.0.0.1", allowHosts, allowOrigins });
    expect(make(["http://localhost:3000/"])).toThrowError(new UserError("--allow-origin 'http://localhost:3000/' is not an origin: an origin has no path, write http://localhost:3000"));
    expect(make(["localhost:3000"])).toThrowError(/--allow-origin 'localhost:3000' is not an origin: .*scheme:\/\/host\[:port\]/);
    expect(make([], ["http://box.lan"])).toThrowError(/--allow-host 'http:\/\/box.lan' is not a host name; .*without scheme or port/);
    expect(make([], ["box.lan:8000"])).toThrowError(/--allow-host 'box.lan:8000' is not a host name/);
  });

  it("a forged Host or another origin's page gets 403 in the API's shape before the key and the body; listed origins get CORS", async () => {
    const s = await serve({ http: { allowOrigins: ["http://allowed.example:5173", "chrome-extension://*"] } });
    const host = new URL(s.url).host;
    const chat = JSON.stringify({ model: MODEL, max_tokens: 1, messages: [user("x")] });
    const requests: Array<[string, string]> = [
      ["/v1/chat/completions", chat], ["/v1/messages", JSON.stringify({ model: MODEL, max_tokens: 1, messages: [user("x")] })],
      ["/api/generate", JSON.stringify({ model: MODEL, prompt: "x" })],
    ];
    for (const [path, body] of requests) {
      // no key either: the Host and Origin rules come first, and say how to allow the request
      const forged = await raw(s, "POST", path, { host: "evil.example", "content-type": "text/plain" }, body);
      expect(forged.status, path).toBe(403);
      const hostError = errorOf(path, forged.json);
      expect(hostError.message).toContain("--allow-host evil.example");
      const cross = await raw(s, "POST", path, { host, origin: "http://evil.example:8080", "content-type": "text/plain" }, body);
      expect(cross.status, path).toBe(403);
      expect(cross.headers["access-control-allow-origin"]).toBeUndefined();
      const originError = errorOf(path, cross.json);
      expect(originError.message).toContain("--allow-origin http://evil.example:8080");
      if (path === "/v1/messages") expect(originError.type).toBe("permission_error");
      if (path === "/v1/chat/completions") expect(cross.json.error.code).toBe("forbidden");
    }
    expect((await raw(s, "GET", "/v1/models", { host: "evil.example", "x-api-key": KEY })).status).toBe(403); // reading, through DNS rebinding
    expect((await raw(s, "GET", "/", { host: "evil.example" })).status).toBe(403);
    expect(s.model.calls).toHaveLength(0);
    expect(s.lines.filter((l) => / 403 .*--allow-(host|origin)/.test(l))).toHaveLength(8);

    // the server's own page (same origin), loopback names on any port, and clients without Origin
    const own = await raw(s, "POST", "/v1/chat/completions", { host, origin: `http://${host}`, "content-type": "application/json", "x-api-key": KEY }, chat);
    expect(own.status).toBe(200);
    expect(own.headers["access-control-allow-origin"]).toBeUndefined();
    for (const name of ["localhost:1234", "127.0.0.2", "[::1]:99"]) expect((await raw(s, "GET", "/healthz", { host: name })).status, name).toBe(200);
    // curl -d: a form content type, a JSON body all the same
    const curlish = await raw(s, "POST", "/api/generate", { host, "content-type": "application/x-www-form-urlencoded", "x-api-key": KEY },
      JSON.stringify({ model: MODEL, prompt: "hi", stream: false, options: { num_predict: 1 } }));
    expect(curlish.status).toBe(200);
    expect(curlish.json.response).toBe("alpha ");

    // a listed origin: its preflight is answered, and every answer (a 401 too) is readable by its page
    const allowed = "http://allowed.example:5173";
    const preflight = await raw(s, "OPTIONS", "/v1/chat/completions", {
      host, origin: allowed, "access-control-request-method": "POST", "access-control-request-headers": "authorization, content-type",
    });
    expect(preflight.status).toBe(204);
    expect(preflight.headers).toMatchObject({
      "access-control-allow-origin": allowed, "access-control-allow-methods": "GET, POST, OPTIONS",
      "access-control-allow-headers": "authorization, content-type", vary: "Origin",
    });
    const listed = await raw(s, "POST", "/v1/chat/completions", { host, origin: allowed, "content-type": "application/json", authorization: `Bearer ${KEY}` }, chat);
    expect(listed.status).toBe(200);
    expect(listed.headers["access-control-allow-origin"]).toBe(allowed);
    expect(listed.json.choices[0].message.content).toBe("alpha ");
    const keyless = await raw(s, "POST", "/v1/chat/completions", { host, origin: allowed, "content-type": "application/json" }, chat);
    expect(keyless.status).toBe(401);
    expect(keyless.headers["access-control-allow-origin"]).toBe(allowed);
    const extension = await raw(s, "GET", "/v1/models", { host, origin: "chrome-extension://abcdefgh", "x-api-key": KEY });
    expect(extension.status).toBe(200);
    expect(extension.headers["access-control-allow-origin"]).toBe("chrome-extension://abcdefgh");
    // a preflight from an origin not listed: refused, nothing a browser would accept
    const refused = await raw(s, "OPTIONS", "/v1/chat/completions", { host, origin: "http://evil.example", "access-control-request-method": "POST" });
    expect(refused.status).toBe(403);
    expect(refused.headers["access-control-allow-origin"]).toBeUndefined();
    expect(s.model.calls).toHaveLength(3); // own, curl-like, listed
  });
});

describe("slow clients", () => {
  it("clients that stall mid-body get 408 in their API's shape and free their slots; stalled headers get 408; others are served", async () => {
    const maxQueue = 10;
    const slots = bodySlots(maxQueue);
    const s = await serve({ maxQueue, http: { deadlines: { headersMs: 500, bodyIdleMs: 300, bodyTotalMs: 60_000 } } });
    const host = new URL(s.url).host;
    const paths = ["/v1/chat/completions", "/v1/messages", "/api/chat"];
    // as many as there are body slots: each sends its headers and a few bytes of its body, then nothing
    const stalled = Array.from({ length: slots }, (_, i) => paths[i % paths.length]!).map((path) => ({
      path,
      answer: stall(s, `POST ${path} HTTP/1.1\r\nHost: ${host}\r\nx-api-key: ${KEY}\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{"model": "`),
    }));
    const headless = [stall(s, `POST /v1/chat/completions HTTP/1.1\r\nHost: ${host}\r\n`), stall(s, "GET /v1/mod")];
    // refused before its body is read (a forged Host): its answer goes out once the body stalls
    const refused = stall(s, `POST /v1/messages HTTP/1.1\r\nHost: evil.example\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{"mo`);
    for (const { path, answer } of stalled) {
      const { status, json } = parseRaw(await answer);
      expect(status, path).toBe(408);
      const error = errorOf(path, json);
      expect(error.message).toMatch(/the request body stopped arriving: no byte for 0\.3 s; send the whole body without pausing/);
      if (path !== "/api/chat") expect(error.type).toBe("invalid_request_error");
      if (path === "/v1/chat/completions") expect(json.error.code).toBe("request_timeout");
    }
    // headers that never end: Node's bare 408 (no API is known before the path), connection closed
    for (const answer of headless) expect(await answer).toMatch(/^HTTP\/1\.1 408 Request Timeout\r\n/);
    const forged = parseRaw(await refused);
    expect(forged.status).toBe(403);
    expect(errorOf("/v1/messages", forged.json).type).toBe("permission_error");
    expect(s.lines.filter((l) => / 408 .*stopped arriving/.test(l))).toHaveLength(slots);
    // every slot is free again: normal requests are served, not refused with 429
    const reply = await oai(s).chat.completions.create({ model: MODEL, max_tokens: 2, messages: [{ role: "user", content: "hi" }] });
    expect(reply.choices[0]!.message.content).toBe("alpha beta ");
    const answers = await Promise.all(paths.map((path) => post(s, path, path === "/api/chat"
      ? { model: MODEL, stream: false, messages: [user("x")], options: { num_predict: 1 } }
      : { model: MODEL, max_tokens: 1, messages: [user("x")] })));
    expect(answers.map((a) => a.status)).toEqual([200, 200, 200]);
  });
});

describe("images in requests: max_image_tokens and progress while an image encodes", () => {
  const png = PNG.toString("base64");
  const bodies = (extra: Record<string, unknown>): Array<[string, Record<string, unknown>]> => [
    ["/v1/chat/completions", { model: MODEL, max_tokens: 1, messages: [user([{ type: "image_url", image_url: { url: `data:image/png;base64,${png}` } }, { type: "text", text: "?" }])], ...extra }],
    ["/v1/messages", { model: MODEL, max_tokens: 1, messages: [user([{ type: "image", source: { type: "base64", media_type: "image/png", data: png } }, { type: "text", text: "?" }])], ...extra }],
    ["/v1/messages/count_tokens", { model: MODEL, messages: [user([{ type: "image", source: { type: "base64", media_type: "image/png", data: png } }])], ...extra }],
    ["/api/chat", { model: MODEL, stream: false, messages: [{ role: "user", content: "?", images: [png] }], options: { num_predict: 1 }, ...extra }],
    ["/api/generate", { model: MODEL, stream: false, prompt: "?", images: [png], options: { num_predict: 1 }, ...extra }],
  ];
  const post = (s: Served, path: string, body: unknown): Promise<Response> =>
    fetch(`${s.url}${path}`, { method: "POST", headers: { "x-api-key": KEY, "content-type": "application/json" }, body: JSON.stringify(body) });

  it("every API gives its images the request's max_image_tokens, and the default (null) without it", async () => {
    const s = await serve();
    for (const [path, body] of bodies({ max_image_tokens: 64 })) expect((await post(s, path, body)).status, path).toBe(200);
    expect(s.model.budgets).toEqual([64, 64, 64, 64, 64]);
    s.model.budgets = [];
    for (const [path, body] of bodies({})) expect((await post(s, path, body)).status, path).toBe(200);
    expect(s.model.budgets).toEqual([null, null, null, null, null]);
    // Ollama also takes it among its options
    s.model.budgets = [];
    const [, chat] = bodies({})[3]!;
    expect((await post(s, "/api/chat", { ...chat, options: { num_predict: 1, max_image_tokens: 32 } })).status).toBe(200);
    expect(s.model.budgets).toEqual([32]);
  });

  it.each([[0, "between 1 and"], [1.5, "must be an integer"], ["64", "must be an integer"], [257, "between 1 and 256"]] as const)(
    "max_image_tokens %j is a 400 naming the field in every API", async (value, words) => {
      const s = await serve();
      for (const [path, body] of bodies({ max_image_tokens: value })) {
        const answer = await post(s, path, body);
        expect(answer.status, path).toBe(400);
        const text = await answer.text();
        expect(text, path).toContain("max_image_tokens");
        expect(text, path).toContain(words);
      }
      expect(s.model.calls).toHaveLength(0);
    });

  it("Ollama: max_image_tokens at the top and in options must agree", async () => {
    const s = await serve();
    const [, chat] = bodies({ max_image_tokens: 8 })[3]!;
    const answer = await post(s, "/api/chat", { ...chat, options: { num_predict: 1, max_image_tokens: 16 } });
    expect(answer.status).toBe(400);
    expect(await answer.text()).toContain("give one");
  });

  it("imageProgress: an SSE comment naming the image (OpenAI), Anthropic's ping, nothing in NDJSON or before a second", () => {
    const event = { phase: "encoding" as const, index: 0, count: 2, name: "x", grid: [64, 64] as [number, number], mediaTokens: 1024, elapsedS: 3.7, cached: false };
    const shape = (keepalive: string | null): StreamShape => ({ contentType: "", head: "", delta: () => "", finish: () => "", error: () => "", keepalive });
    expect(imageProgress(shape(openai.KEEPALIVE), event)).toBe(": kvl: encoding image 1/2 (1024 media tokens), 3 s\n\n");
    expect(imageProgress(shape(anthropic.PING), event)).toBe(anthropic.PING);
    expect(imageProgress(shape(null), event)).toBeNull();
    expect(imageProgress(shape(openai.KEEPALIVE), { ...event, phase: "start" })).toBeNull();
    expect(imageProgress(shape(openai.KEEPALIVE), { ...event, phase: "done" })).toBeNull();
  });

  it("a streamed reply whose image encodes for seconds: progress comments (OpenAI), pings (Anthropic), only reply lines (Ollama)", async () => {
    const s = await serve();
    s.model.encodeEvents = 2;
    const [[, oaiBody], [, antBody], , [, ollBody]] = bodies({ stream: true }) as [[string, Record<string, unknown>], [string, Record<string, unknown>],
      [string, Record<string, unknown>], [string, Record<string, unknown>]];
    const oaiText = await (await post(s, "/v1/chat/completions", oaiBody)).text();
    expect(oaiText).toContain(": kvl: encoding image 1/1 (4 media tokens), 1 s\n\n: kvl: encoding image 1/1 (4 media tokens), 2 s\n\n");
    const withoutComments = oaiText.split("\n\n").filter((r) => r && !r.startsWith(":"));
    expect(withoutComments.every((r) => r.startsWith("data: "))).toBe(true);
    const antText = await (await post(s, "/v1/messages", antBody)).text();
    s.model.encodeEvents = 0;
    const quietText = await (await post(s, "/v1/messages", antBody)).text();
    const pings = (t: string): number => t.split("event: ping\n").length - 1;
    expect(pings(antText)).toBe(pings(quietText) + 2);
    s.model.encodeEvents = 2;
    const ollText = await (await post(s, "/api/chat", { ...ollBody, stream: true })).text();
    for (const line of ollText.trim().split("\n")) expect(() => JSON.parse(line)).not.toThrow();
  });
});
