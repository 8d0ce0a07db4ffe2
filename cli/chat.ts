/**
 * chat.ts — `kvl chat MODEL ["prompt"]`: one-shot (a prompt, or '-' for stdin) and interactive
 * chat (/reset, /stats, /image PATH, /quit; Ctrl-C stops the reply and keeps the conversation,
 * Ctrl-D quits); --json prints each reply as one JSON line (text, usage, timings, engine stats).
 *
 * Owns: the command's own options (the model options: options.ts addModelOptions), the terminal
 * side — streamed text with control characters made visible (never in --json), progress and then
 * the load line (host/chat-model.ts loadLine), the plan's table only where it helps
 * (--verbose, or a refusal), --show-tokens diagnostics — and the interactive loop: pending
 * images (decoded whole when attached, so a damaged one is refused at /image; attached to the
 * next message only; a stopped turn keeps its own, a failed one drops them and puts the typed
 * text back on the input line). Generation runs in the engine worker, so
 * the main thread takes Ctrl-C at any time, also during a long prefill or right after Enter.
 * Does not own: prompts, images, sampling or stop strings (host/chat-model.ts).
 */
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";

import { type Command, InvalidArgumentError } from "commander";

import { chooseBackend } from "../host/core/backend.js";
import { type ChatImage, ChatModel, type Conversation, type ImageEvent, type ReplyHooks, type ReplyReport, loadLine } from "../host/chat-model.js";
import type { Message } from "../host/text/conversation.js";
import { cFieldName, type EngineStats, PackReadError } from "../host/core/core-api.js";
import { actModeJson } from "../host/plan/act-mode.js";
import { MIB } from "../host/plan/core-bytes.js";
import { DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, type ReplyParams } from "../host/text/reply-params.js";
import { ANY_OBJECT_SCHEMA, type GrammarSpec, jsonSchemaGrammar } from "../host/text/grammar/grammar-spec.js";
import { SchemaError } from "../host/text/grammar/schema-check.js";
import { UserError } from "../host/system/user-error.js";
import { silentProgress, stderrProgress } from "../packer/progress.js";
import { peakRssBytes } from "../host/system/process-memory.js";
import { type ModelCliOptions, addModelOptions, modelSettings, nonNegativeInt, positiveInt } from "./options.js";

const HELP_LINE = "commands: /reset  /stats  /image PATH  /quit   (Ctrl-C stops a reply, Ctrl-D quits)";

interface ChatOptions extends ModelCliOptions {
  maxNew: number;
  temperature: number;
  topP: number;
  topK: number;
  seed?: number;
  stop: string[];
  jsonSchema?: string;
  format?: string;
  system?: string;
  image: string[];
  showTokens?: boolean;
  json?: boolean;
  quiet?: boolean;
  verbose?: boolean;
}

function finiteNumber(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n)) throw new InvalidArgumentError("expected a number");
  return n;
}

function collect(value: string, previous: string[]): string[] {
  return [...previous, value];
}

/** Text for a terminal: control characters other than newline and tab shown as \xNN / \u{...},
 * so a reply cannot move the cursor, clear the screen or retitle the window. */
export function escapeControls(text: string): string {
  return text.replace(/[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u2028\u2029]/g, (c) => {
    const code = c.codePointAt(0)!;
    return code <= 0xff ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}`;
  });
}

/** The stats as --json prints them: kvl_stats' own member names (cFieldName; test/boundary.test.ts
 * checks that these are the core's), each the change since before where given. */
function snakeStats(stats: EngineStats, before?: EngineStats): Record<string, number> {
  const out: Record<string, number> = {};
  for (const camel of Object.keys(stats) as Array<keyof EngineStats>) out[cFieldName(camel)] = stats[camel] - (before?.[camel] ?? 0);
  return out;
}

/** One reply as --json prints it: text, finish reason, usage, timings, the engine's stats. */
function replyJson(model: ChatModel, report: ReplyReport, stats: EngineStats, before: EngineStats): Record<string, unknown> {
  const info = model.client.info;
  return {
    reply: report.reply,
    finish_reason: report.finishReason,
    stop_sequence: report.stopSequence,
    prompt_token_ids: report.promptTokenIds,
    output_token_ids: report.outputTokenIds,
    usage: { prompt_tokens: report.usage.promptTokens, completion_tokens: report.usage.completionTokens,
      reused_prompt_tokens: report.usage.reusedPromptTokens, images_encoded: report.usage.imagesEncoded },
    timings: { prefill_s: report.timings.prefillS, first_token_s: report.timings.firstTokenS,
      decode_s_per_token: report.timings.decodeSPerToken, vision_s: report.timings.visionS },
    cache: snakeStats(stats, before),
    io: { trunk_direct_io: info.trunkDirectIo, expert_direct_io: info.expertDirectIo, vision_direct_io: info.visionDirectIo,
      kernels: info.kernels, act_dtype: info.actDtype, act_mode: actModeJson(model.actMode), threads: info.nThreads, backend: model.backend,
      instances: model.client.ranges.length },
    images: report.images.map((i) => ({ sha256: i.sha256, grid: i.grid, media_tokens: i.mediaTokens, in_token_limit: i.inTokenLimit,
      cached: i.cached, encode_s: i.encodeS })),
    peak_rss_bytes: peakRssBytes(),
    plan_bytes: model.plan.total,
    // the budget the plan is held to and who chose it: --ram-mib N, or auto from the machine's free memory
    ram_budget_mib: model.plan.settings.ramMib,
    ram_budget_chosen_by: model.plan.settings.ramChosenBy,
    ram_budget_detail: model.plan.settings.ramDetail,
    // the plan's image decode line and the largest image (JPEG/PNG) it admits; null without vision
    plan_image_decode_bytes: model.plan.imageBudget?.bytes ?? null,
    plan_image_max_pixels: model.plan.imageBudget?.pixels ?? null,
  };
}

function showTokens(json: Record<string, unknown>): string {
  const r = json as {
    usage: Record<string, number>; prompt_token_ids: number[]; output_token_ids: number[]; finish_reason: string;
    timings: Record<string, number>; cache: Record<string, number>; io: Record<string, string | number | boolean>;
    peak_rss_bytes: number | null; plan_bytes: number; images: Array<{ grid: number[]; media_tokens: number; cached: boolean; encode_s: number }>;
  };
  const how = (direct: unknown): string => (direct ? "direct" : "buffered");
  const lines = [
    `[tokens] prompt ${r.usage.prompt_tokens} (reused ${r.usage.reused_prompt_tokens}): ${r.prompt_token_ids.join(" ")}`,
    `[tokens] output ${r.usage.completion_tokens} (${r.finish_reason}): ${r.output_token_ids.join(" ")}`,
    `[timing] vision ${r.timings.vision_s!.toFixed(3)} s, prefill ${r.timings.prefill_s!.toFixed(3)} s, first token ` +
      `${r.timings.first_token_s!.toFixed(3)} s, next token ${(1000 * r.timings.decode_s_per_token!).toFixed(1)} ms avg`,
    `[cache] trunk ${r.cache.trunk_hits} hits / ${r.cache.trunk_misses} misses / ${(r.cache.trunk_bytes_read! / MIB).toFixed(1)} MiB read; ` +
      `experts ${r.cache.expert_hits} hits / ${r.cache.expert_misses} misses / ${(r.cache.expert_bytes_read! / MIB).toFixed(1)} MiB read`,
    `[io] trunk ${how(r.io.trunk_direct_io)}, experts ${how(r.io.expert_direct_io)}, vision ${how(r.io.vision_direct_io)}; ` +
      `${r.io.backend} (${r.io.instances} instance${r.io.instances === 1 ? "" : "s"}), kernels ${r.io.kernels}, Linear inputs ${r.io.act_dtype}, ${r.io.threads} threads`,
    `[memory] peak RSS ${r.peak_rss_bytes === null ? "n/a" : `${(r.peak_rss_bytes / MIB).toFixed(1)} MiB`} (plan ${(r.plan_bytes / MIB).toFixed(1)} MiB)`,
    ...r.images.map((image, n) => `[image] ${n + 1}: grid ${image.grid[0]}x${image.grid[1]} patches, ${image.media_tokens} media tokens, ` +
      (image.cached ? "embeddings from the cache" : `encoded in ${image.encode_s.toFixed(3)} s`)),
  ];
  return `${lines.join("\n")}\n`;
}

async function openModel(model: string, opts: ChatOptions): Promise<ChatModel> {
  const record = chooseBackend({ option: opts.backend });
  const progress = opts.quiet || opts.json ? silentProgress : stderrProgress(2000);
  let started = false;
  let last = 0;
  try {
    const chat = await ChatModel.open(model, {
      backend: record, ...modelSettings(opts),
      onLoadProgress: (read, expected) => {
        if (read === null || expected <= 0) return;
        if (!started) {
          progress.start(`loading ${model}`, expected);
          started = true;
        }
        const now = Math.min(read, expected);
        if (now > last) progress.add(now - last);
        last = now;
      },
    });
    if (started) progress.stop();
    if (!opts.quiet && !opts.json) {
      process.stderr.write(`${loadLine("chat", chat, opts.verbose ?? false)}\n`);
      if (opts.verbose) process.stderr.write(`${chat.plan.describe()}\n`);
    }
    return chat;
  } catch (err) {
    if (started) progress.stop();
    throw err;
  }
}

function replyParams(opts: ChatOptions): ReplyParams {
  return { temperature: opts.temperature, topP: opts.topP, topK: opts.topK, seed: opts.seed ?? null, maxNewTokens: opts.maxNew, stop: opts.stop,
    grammar: replyGrammar(opts) };
}

/** --json-schema FILE or --format json: the reply is one JSON value (a UserError for a file or
 * schema that cannot be used, before the model loads). */
function replyGrammar(opts: ChatOptions): GrammarSpec | null {
  if (opts.jsonSchema !== undefined && opts.format !== undefined) throw new UserError("give --json-schema or --format, not both");
  if (opts.format !== undefined) {
    if (opts.format !== "json") throw new UserError(`--format must be 'json' (got '${opts.format}'); for a schema use --json-schema FILE`);
    return jsonSchemaGrammar(ANY_OBJECT_SCHEMA);
  }
  if (opts.jsonSchema === undefined) return null;
  let schema: unknown;
  try {
    schema = JSON.parse(readFileSync(opts.jsonSchema, "utf8"));
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    throw new UserError(code === "ENOENT" ? `--json-schema file '${opts.jsonSchema}' not found`
      : `--json-schema file '${opts.jsonSchema}' is not JSON (${(err as Error).message})`);
  }
  try {
    return jsonSchemaGrammar(schema);
  } catch (err) {
    if (err instanceof SchemaError) throw new UserError(`--json-schema ${opts.jsonSchema}: ${err.message}`);
    throw err;
  }
}

function systemMessages(opts: ChatOptions): Array<Message<ChatImage>> {
  return opts.system !== undefined ? [{ role: "system", parts: [opts.system] }] : [];
}

/**
 * What `kvl chat` shows of a turn's images on stderr (nothing with --json or --quiet: --json has
 * them in its report): on a terminal, a progress line redrawn every second while an image
 * encodes (the engine's "encoding" events start after a second, so a quick encode shows none),
 * and for every image, once it is ready, a line with its media tokens and its encode time or
 * that it came from the cache. `err` is where it writes (process.stderr; a test's buffer).
 */
export function imageLines(opts: Pick<ChatOptions, "json" | "quiet">,
  err: { write(text: string): unknown; isTTY?: boolean } = process.stderr): ReplyHooks {
  if (opts.json || opts.quiet) return {};
  const tty = Boolean(err.isTTY);
  let drawn = false;
  return {
    onImage: (e: ImageEvent): void => {
      const which = `[image ${e.index + 1}/${e.count}] ${escapeControls(e.name)}`;
      if (e.phase === "encoding" && tty) {
        err.write(`\r\x1b[K${which}: encoding ${e.mediaTokens} media tokens... ${Math.floor(e.elapsedS)} s`);
        drawn = true;
      } else if (e.phase === "done") {
        if (drawn) err.write("\r\x1b[K");
        drawn = false;
        const how = e.cached ? "embeddings from the cache" : `encoded in ${e.elapsedS.toFixed(1)} s`;
        err.write(`${which}: ${e.mediaTokens} media tokens (grid ${e.grid[0]}x${e.grid[1]}), ${how}\n`);
      }
    },
  };
}

/** Runs one reply, streaming text to stdout unless --json; `stopped` says whether Ctrl-C came
 * before the reply started running (then it is stopped as soon as it does). */
async function runReply(model: ChatModel, conversation: Conversation, messages: Array<Message<ChatImage>>, opts: ChatOptions,
  stopped: () => boolean = () => false): Promise<{ report: ReplyReport; json: Record<string, unknown> }> {
  const before = await model.stats();
  const running = conversation.generate(messages, replyParams(opts), (text) => {
    if (!opts.json) process.stdout.write(escapeControls(text));
  }, imageLines(opts));
  // generate runs synchronously up to its first await, so the conversation is running here
  if (stopped()) conversation.cancel();
  const report = await running;
  const json = replyJson(model, report, await model.stats(), before);
  return { report, json };
}

async function oneShot(model: ChatModel, prompt: string, images: ChatImage[], opts: ChatOptions): Promise<void> {
  const text = prompt === "-" ? readFileSync(0, "utf8") : prompt;
  const conversation = await model.newConversation();
  // Ctrl-C in a one-shot run ends the program, as any command-line tool: the default handler
  const { json } = await runReply(model, conversation, [...systemMessages(opts), { role: "user", parts: [...images, text] }], opts);
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(json)}\n`);
  } else {
    process.stdout.write("\n");
    if (opts.showTokens) process.stderr.write(showTokens(json));
  }
}

/** "1 image", "2 images". */
function plural(n: number, noun: string): string {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

function emit(opts: ChatOptions, obj: Record<string, unknown>, text: string): void {
  if (opts.json) process.stdout.write(`${JSON.stringify(obj)}\n`);
  else process.stderr.write(`${text}\n`);
}

async function interactive(model: ChatModel, images: ChatImage[], opts: ChatOptions): Promise<void> {
  const tty = Boolean(process.stdin.isTTY);
  const conversation = await model.newConversation();
  const rl = createInterface({ input: process.stdin, output: tty ? process.stdout : undefined, terminal: tty, historySize: 200 });
  // the iterator before any await: lines (and the end of a piped stdin) read before it exists are lost
  const lines = rl[Symbol.asyncIterator]();
  let history: Array<Message<ChatImage>> = systemMessages(opts);
  let pending: ChatImage[] = [...images];
  let replying = false;
  // Ctrl-C stops the turn of the last line sent, also before its reply runs: a line readline has
  // read but the loop has not taken yet (Enter and Ctrl-C in one read), or one still being prepared
  let unread = 0;
  let stopRequested = false;
  rl.on("line", () => unread++);
  const onInterrupt = (): void => {
    if (replying || unread > 0) {
      stopRequested = true;
      conversation.cancel();
      return;
    }
    const attached = pending.length ? `; ${plural(pending.length, "image")} attached to your next message` : "";
    process.stderr.write(`\n(use /quit or Ctrl-D to leave${attached})\n`);
    if (tty) rl.prompt();
  };
  rl.on("SIGINT", onInterrupt); // a terminal: readline sees Ctrl-C as input
  process.on("SIGINT", onInterrupt); // a pipe: the signal itself
  if (!opts.json) process.stderr.write(`${HELP_LINE}\n`);
  try {
    if (tty) {
      rl.setPrompt("> ");
      rl.prompt();
    }
    for (;;) {
      const next = await lines.next();
      if (next.done) break;
      unread--;
      const line = next.value;
      const text = line.trim();
      // a Ctrl-C after a command (or an empty line), with no message sent after it, stops nothing
      if ((!text || text.startsWith("/")) && unread === 0) stopRequested = false;
      if (!text) {
        if (tty) rl.prompt();
        continue;
      }
      if (text.startsWith("/")) {
        const space = text.indexOf(" ");
        const command = space < 0 ? text : text.slice(0, space);
        const rest = space < 0 ? "" : text.slice(space + 1).trim();
        if (command === "/quit" || command === "/exit") break;
        if (command === "/reset") {
          await conversation.reset();
          history = systemMessages(opts);
          pending = [];
          emit(opts, { event: "reset" }, "(conversation cleared)");
        } else if (command === "/stats") {
          const images = model.embeddings;
          const stats = { ...snakeStats(await model.stats()), session_tokens: conversation.position, peak_rss_bytes: peakRssBytes(),
            image_cache_hits: images.counts.hits, image_cache_misses: images.counts.misses, image_cache_images: images.size, image_cache_bytes: images.bytes };
          emit(opts, { event: "stats", stats }, Object.entries(stats).map(([k, v]) => `${k}=${v}`).join("  "));
        } else if (command === "/image") {
          if (!rest) {
            process.stderr.write("usage: /image PATH\n");
          } else {
            try {
              pending.push(await model.loadImage(rest));
              emit(opts, { event: "image", pending_images: pending.length }, `(image attached to your next message; ${pending.length} pending)`);
            } catch (err) {
              if (!(err instanceof UserError)) throw err;
              emit(opts, { event: "error", error: err.message }, `error: ${err.message}`);
            }
          }
        } else {
          process.stderr.write(`unknown command ${command}; ${HELP_LINE}\n`);
        }
        if (tty) rl.prompt();
        continue;
      }
      const message: Message<ChatImage> = { role: "user", parts: [...pending, line] };
      replying = true;
      let result: { report: ReplyReport; json: Record<string, unknown> };
      try {
        result = await runReply(model, conversation, [...history, message], opts, () => stopRequested);
      } catch (err) {
        if (!(err instanceof UserError)) throw err;
        // the turn is not taken (its images could not be encoded, or the engine refused it); the
        // images are dropped so the next turn can run, and the typed text is kept for the retry:
        // back on the input line of a terminal
        const dropped = pending.length;
        pending = [];
        if (dropped) {
          const kept = tty ? "your message is back on the input line: Enter sends it without the image, or edit it first"
            : "your message was not sent; send it again";
          emit(opts, { event: "error", error: err.message, dropped_images: true, unsent_message: line },
            `error: ${err.message}\n(${plural(dropped, "image")} dropped; ${kept})`);
        } else {
          emit(opts, { event: "error", error: err.message }, `error: ${err.message}`);
        }
        if (tty) {
          rl.prompt();
          // a pack that could not be read (its disk gone, a file changed): the same text can be
          // sent again once the pack is back
          if (dropped || err instanceof PackReadError) rl.write(line);
        }
        continue;
      } finally {
        replying = false;
        stopRequested = false;
      }
      // a stopped turn stays in the conversation as the model saw it, with its images; none of
      // them goes with the next message
      const stoppedWith = result.report.finishReason === "cancelled" ? pending.length : 0;
      pending = [];
      history = [...history, message, { role: "assistant", parts: [result.report.reply] }];
      if (opts.json) {
        process.stdout.write(`${JSON.stringify({ event: "reply", ...result.json })}\n`);
      } else {
        process.stdout.write(result.report.finishReason === "cancelled" ? " [stopped]\n" : "\n");
        const its = stoppedWith === 1 ? "its image" : `its ${stoppedWith} images`;
        if (stoppedWith) process.stderr.write(`(the stopped turn keeps ${its}; nothing is attached to your next message)\n`);
        if (opts.showTokens) process.stderr.write(showTokens(result.json));
      }
      if (tty) rl.prompt();
    }
  } finally {
    process.off("SIGINT", onInterrupt);
    rl.close();
  }
}

export function addChatCommand(program: Command): void {
  const command = program
    .command("chat")
    .description("chat with a packed model: one-shot with a prompt, else interactive")
    .argument("<model>", "packed model directory (from kvl pack / kvl prepare)")
    .argument("[prompt]", "one-shot prompt ('-' reads stdin); omit for an interactive chat");
  addModelOptions(command)
    .option("--max-new <n>", "max new tokens", positiveInt, DEFAULT_MAX_NEW_TOKENS)
    .option("--temperature <t>", "sampling temperature, 0 = greedy", finiteNumber, DEFAULT_TEMPERATURE)
    .option("--top-p <p>", "nucleus sampling (0 or 1 = off)", finiteNumber, 1)
    .option("--top-k <k>", "top-k sampling (0 = off)", nonNegativeInt, 0)
    .option("--seed <n>", "sampler seed (default: random)", nonNegativeInt)
    .option("--stop <text>", "stop string (repeatable)", collect, [])
    .option("--json-schema <file>", "the reply is JSON valid under the JSON schema in FILE (constrained decoding)")
    .option("--format <json>", "json: the reply is one JSON object (constrained decoding)")
    .option("--system <text>", "system prompt (default: the template's)")
    .option("--image <path>", "attach an image to the (first) user message (repeatable)", collect, [])
    .option("--show-tokens", "print token ids, timings, cache/I-O statistics and peak RSS")
    .option("--json", "print one JSON object per reply instead of streaming text")
    .option("--quiet", "print nothing but the reply (no load line)")
    .option("--verbose", "also print the RAM plan's table")
    .action(async (model: string, prompt: string | undefined, opts: ChatOptions) => {
      if (opts.image.length && !opts.vision) throw new UserError("--image needs the vision tower; drop --no-vision");
      replyParams(opts); // a bad --json-schema or --format is refused before the model loads
      // a one-shot prompt without --image can take no image: the vision tower and the plan's image
      // lines would only take RAM from the caches (0.66 GiB of a 4 GiB plan; natively most of it is
      // lent to the expert cache anyway, but not the image embeddings' line, and not on WebAssembly).
      // Image options given anyway keep vision, so their values are still checked as always.
      const textOnly = prompt !== undefined && opts.image.length === 0 && opts.maxImageMp === undefined &&
        opts.maxImageTokens === undefined;
      const chat = await openModel(model, textOnly ? { ...opts, vision: false } : opts);
      try {
        const images: ChatImage[] = [];
        for (const path of opts.image) images.push(await chat.loadImage(path));
        if (prompt !== undefined) await oneShot(chat, prompt, images, opts);
        else await interactive(chat, images, opts);
      } finally {
        await chat.close();
      }
    });
}
