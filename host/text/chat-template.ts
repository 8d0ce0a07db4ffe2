/**
 * chat-template.ts — the pack's chat_template.jinja rendered with @huggingface/jinja, as
 * transformers' apply_chat_template renders it with jinja2 (test/fixtures/goldens/tokenizer.json
 * holds those prompts, equal there to the independent test/fixtures/reference/template.py's), and
 * the media expansion of spec §7.2 on token ids.
 *
 * Owns: loading the template (read as Python's read_text does: strict UTF-8, universal newlines;
 * trim_blocks and lstrip_blocks, which @huggingface/jinja always applies), the variables a render
 * sees (messages, add_generation_prompt, the special-token strings bos_token, eos_token, ... from
 * tokenizer_config.json, raise_exception), rendering messages in the HF shape (content as a string
 * or a list of {"type": "text", "text"} / {"type": "image"} items), the UserErrors for a missing
 * or broken template and for messages it refuses, and expandMedia.
 * Does not own: tokenization (tokenizer.ts), turning Messages into template messages and prompt
 * ids (conversation.ts), image preprocessing.
 */
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";

import { Environment, Interpreter, Template } from "@huggingface/jinja";

import { decodeUtf8Strict, isJsonObject, parseJson } from "../system/json-file.js";
import { UserError } from "../system/user-error.js";

/** One item of a list content: {"type": "text", "text": ...}, {"type": "image"}, or any HF shape. */
export interface TemplateContentItem {
  type?: string;
  text?: string;
  [key: string]: unknown;
}

/** A message in the Hugging Face shape chat templates expect. */
export interface TemplateMessage {
  role: string;
  content: string | TemplateContentItem[] | null;
  [key: string]: unknown;
}

const SPECIAL_TOKEN_KEYS = ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"];

/** bos_token, eos_token, ... as plain strings, as HF passes them to templates. */
function specialTokenVars(config: unknown): Record<string, string> {
  const out: Record<string, string> = {};
  if (!isJsonObject(config)) return out;
  for (const key of SPECIAL_TOKEN_KEYS) {
    let value = config[key];
    if (isJsonObject(value)) value = value.content;
    if (typeof value === "string") out[key] = value;
  }
  return out;
}

/** tokenizer_config.json for the template variables; a missing or unreadable file counts as {}
 * (the template renders without them; the tokenizer, which needs the file, says what is wrong). */
function readConfigOrEmpty(path: string): unknown {
  try {
    return parseJson(readFileSync(path));
  } catch {
    return {};
  }
}

function raiseException(message: unknown): never {
  throw new UserError(`chat template refused the conversation: ${typeof message === "string" ? message : String(message)}`);
}

/** jinja2's sandboxed range(): Python's range on integers, at most 100,000 items. */
function pyRange(start: number, stop?: number, step = 1): number[] {
  if (stop === undefined) [start, stop] = [0, start];
  if (step === 0) throw new Error("range() arg 3 must not be zero");
  const n = Math.max(0, Math.ceil((stop - start) / step));
  if (n > 100_000) throw new Error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  return Array.from({ length: n }, (_, i) => start + i * step);
}

const DAYS = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
const MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];

/** Python's datetime.now().strftime(format) in the C locale, for the common directives. */
export function strftimeNow(format: string, now: Date = new Date()): string {
  const pad = (n: number, width = 2): string => String(n).padStart(width, "0");
  const dayOfYear = Math.floor((Date.UTC(now.getFullYear(), now.getMonth(), now.getDate()) - Date.UTC(now.getFullYear(), 0, 1)) / 86_400_000) + 1;
  const hour12 = now.getHours() % 12 || 12;
  const fields: Record<string, () => string> = {
    a: () => DAYS[now.getDay()]!.slice(0, 3), A: () => DAYS[now.getDay()]!,
    b: () => MONTHS[now.getMonth()]!.slice(0, 3), B: () => MONTHS[now.getMonth()]!,
    d: () => pad(now.getDate()), H: () => pad(now.getHours()), I: () => pad(hour12), j: () => pad(dayOfYear, 3),
    m: () => pad(now.getMonth() + 1), M: () => pad(now.getMinutes()), p: () => (now.getHours() < 12 ? "AM" : "PM"),
    S: () => pad(now.getSeconds()), y: () => pad(now.getFullYear() % 100), Y: () => String(now.getFullYear()), "%": () => "%",
  };
  return format.replace(/%(.)/gs, (all, c: string) => fields[c]?.() ?? all);
}

/** The globals every render sees (jinja2's and HF apply_chat_template's), before the render's own variables. */
const GLOBALS: Record<string, unknown> = {
  true: true, false: false, none: null, True: true, False: false, None: null,
  range: pyRange, strftime_now: (format: string) => strftimeNow(format), raise_exception: raiseException,
};

/** The model's chat template, loaded from a pack (or checkpoint) directory. */
export class ChatTemplate {
  private readonly template: Template;
  private readonly specialVars: Record<string, string>;

  constructor(modelDir: string) {
    const path = join(modelDir, "chat_template.jinja");
    let isFile = false;
    try {
      isFile = statSync(path).isFile();
    } catch {
      // missing
    }
    if (!isFile) throw new UserError(`${path} is missing; rerun kvl pack`);
    let source: string;
    try {
      source = decodeUtf8Strict(readFileSync(path));
    } catch (err) {
      throw new UserError(`${path} is not UTF-8 text (${(err as Error).message}); rerun kvl pack`);
    }
    // Python's read_text() opens in text mode: \r\n and \r become \n before jinja2 sees the source.
    source = source.replace(/\r\n?/g, "\n");
    try {
      this.template = new Template(source);
    } catch (err) {
      throw new UserError(`${path} is not a valid jinja template (${(err as Error).message})`);
    }
    this.specialVars = specialTokenVars(readConfigOrEmpty(join(modelDir, "tokenizer_config.json")));
  }

  /** The prompt text of messages (HF message objects). */
  render(messages: readonly TemplateMessage[], addGenerationPrompt = true): string {
    // Template.render() would declare its own raise_exception (a plain Error) and refuse ours,
    // so the environment is set up here: the same globals, then the variables.
    const env = new Environment();
    const vars = { ...GLOBALS, ...this.specialVars, messages: [...messages], add_generation_prompt: addGenerationPrompt };
    for (const [name, value] of Object.entries(vars)) env.set(name, value);
    try {
      return new Interpreter(env).run(this.template.parsed).value as string;
    } catch (err) {
      if (err instanceof UserError) throw err;
      throw new UserError(`the chat template failed on these messages (${(err as Error).message})`);
    }
  }
}

/** How many media placeholders ids hold. */
function countMediaPlaceholders(ids: ArrayLike<number>, mediaPad: number): number {
  let found = 0;
  for (let i = 0; i < ids.length; i++) if (ids[i] === mediaPad) found++;
  return found;
}

/**
 * Replaces the i-th media placeholder id by mediaCounts[i] copies of it (spec §7.2).
 *
 * The number of placeholders must equal the number of images: a mismatch means the text itself
 * contained the placeholder string, which would shift every image.
 */
export function expandMedia(ids: ArrayLike<number>, mediaCounts: readonly number[], mediaPad: number): number[] {
  const found = countMediaPlaceholders(ids, mediaPad);
  if (found !== mediaCounts.length) {
    throw new UserError(`the prompt holds ${found} image placeholders but ${mediaCounts.length} images were given; ` +
      "the pack's chat_template.jinja does not write one placeholder per image (text in messages never adds one); repack or fix the template");
  }
  for (const count of mediaCounts) {
    if (!Number.isInteger(count) || count < 0) throw new RangeError(`a media token count must be a whole number >= 0, not ${count}`);
  }
  const out: number[] = [];
  let image = 0;
  for (let i = 0; i < ids.length; i++) {
    const token = ids[i]!;
    if (token === mediaPad) {
      for (let k = mediaCounts[image++]!; k > 0; k--) out.push(mediaPad);
    } else {
      out.push(token);
    }
  }
  return out;
}
