/**
 * conversation.ts — messages (text + images) → prompt token ids + where each image's media
 * tokens are.
 *
 * Owns: the Message / ImageInput types (an image is opaque here: the number of media tokens it
 * takes, which the caller computes from its preprocessed patch grid, and an identity, the sha256
 * of its file bytes), the checks on messages (UserErrors naming the message and what is wrong),
 * turning messages into the HF message shape the chat template expects, media expansion with each
 * image's token count and first position, and the per-position identity keys used for prefix
 * reuse (a media position is identified by its image's digest and row, so two different images
 * with the same grid never count as a shared prefix).
 * Does not own: pixels and grids (image preprocessing), the vision forward, the sampling loop,
 * rendering (chat-template.ts), tokenizing (tokenizer.ts).
 */
import { createHash, randomBytes } from "node:crypto";

import { type ChatTemplate, type TemplateContentItem, type TemplateMessage, expandMedia } from "./chat-template.js";
import { jsonText } from "../system/json-file.js";
import type { Tokenizer } from "./tokenizer.js";
import { UserError } from "../system/user-error.js";

const ROLES = ["system", "user", "assistant", "tool"] as const;

/**
 * An image as the prompt sees it. Subclass it (or keep a map by digest) to carry the pixels the
 * vision encoder will need; Prompt.images hands back the same instances.
 */
export class ImageInput {
  /**
   * @param nTokens media tokens the image takes: (grid rows / merge rows) x (grid cols / merge
   *   cols) of its preprocessed patch grid (mediaTokenCount), at least 1
   * @param digest its identity for prefix reuse: the sha256 (hex) of the encoded file's bytes
   */
  constructor(readonly nTokens: number, readonly digest: string) {
    if (!Number.isInteger(nTokens) || nTokens < 1) throw new RangeError(`an image takes a whole number >= 1 of media tokens, not ${nTokens}`);
  }

  /** An image given as its encoded file bytes (JPEG/PNG/WebP/GIF); the digest is their sha256. */
  static fromBytes(data: Uint8Array, nTokens: number): ImageInput {
    return new ImageInput(nTokens, sha256Hex(data));
  }
}

export function sha256Hex(data: Uint8Array): string {
  return createHash("sha256").update(data).digest("hex");
}

/** Media tokens of an image whose preprocessed patch grid is `grid` (rows, cols), merged by `merge`. */
export function mediaTokenCount(grid: readonly [number, number], merge: readonly [number, number]): number {
  return Math.floor(grid[0] / merge[0]) * Math.floor(grid[1] / merge[1]);
}

/** One turn. role: system | user | assistant | tool; parts: text strings and images in order. */
export interface Message<I extends ImageInput = ImageInput> {
  role: string;
  parts: Array<string | I>;
}

interface PromptImage<I extends ImageInput = ImageInput> {
  image: I;
  digest: string;
  nTokens: number;
  /** Position in Prompt.tokens of its first media token; its tokens are start .. start + nTokens - 1. */
  start: number;
}

/** Identity of a media position: which image, which of its rows. */
interface MediaKey {
  readonly digest: string;
  readonly row: number;
}

/** Identity of one prompt position: the token id, or the media row for a media placeholder. */
export type PositionKey = number | MediaKey;

/** A rendered prompt: token ids (media expanded), its images in order, one key per position. */
export interface Prompt<I extends ImageInput = ImageInput> {
  tokens: number[];
  images: Array<PromptImage<I>>;
  keys: PositionKey[];
}

function pyTypeName(value: unknown): string {
  if (value === null || value === undefined) return "NoneType";
  if (typeof value === "string") return "str";
  if (typeof value === "number") return Number.isInteger(value) ? "int" : "float";
  if (typeof value === "boolean") return "bool";
  if (Array.isArray(value)) return "list";
  if (typeof value === "object") return (value as object).constructor?.name ?? "object";
  return typeof value;
}

/** HF-shaped messages: content is a string when the turn is one text part, else a list.
 * `text` maps each text the messages hold before it goes in (buildPrompt: a marker). */
export function toTemplateMessages(messages: readonly Message[], text: (s: string) => string = (s) => s): TemplateMessage[] {
  const out: TemplateMessage[] = [];
  messages.forEach((message: unknown, index) => {
    if (typeof message !== "object" || message === null || !Array.isArray((message as Message).parts)) {
      throw new UserError(`message ${index} is a ${pyTypeName(message)}, expected Message ({role, parts})`);
    }
    const { role, parts } = message as Message;
    if (!(ROLES as readonly unknown[]).includes(role)) {
      throw new UserError(`message ${index} has role ${jsonText(role)}; use one of ${ROLES.join(", ")}`);
    }
    if (parts.length === 1 && typeof parts[0] === "string") {
      out.push({ role, content: text(parts[0]) });
      return;
    }
    const items: TemplateContentItem[] = [];
    for (const part of parts) {
      if (typeof part === "string") {
        items.push({ type: "text", text: text(part) });
      } else if (part instanceof ImageInput) {
        if (role !== "user" && role !== "system") {
          throw new UserError(`message ${index} (${role}) has an image; images are only accepted in user or system messages`);
        }
        items.push({ type: "image" });
      } else {
        throw new UserError(`message ${index} has a part of type ${pyTypeName(part)}; parts are text strings or ImageInput`);
      }
    }
    out.push({ role, content: items });
  });
  return out;
}

/** The images of messages, in prompt order. */
function messageImages<I extends ImageInput>(messages: ReadonlyArray<Message<I>>): I[] {
  return messages.flatMap((m) => m.parts.filter((p): p is I => p instanceof ImageInput));
}

/** Renders, tokenizes and media-expands messages. */
export function buildPrompt<I extends ImageInput>(messages: ReadonlyArray<Message<I>>, template: ChatTemplate, tokenizer: Tokenizer,
  options: { addGenerationPrompt?: boolean } = {}): Prompt<I> {
  if (messages.length === 0) throw new UserError("the conversation is empty; send at least one message");
  // Every text of the messages goes into the render as a marker and comes out as plain text
  // (Tokenizer.encodeRendered): a special-token string typed by a user or sent in a request is
  // never a special id; only the template inserts those. The markers are private-use characters
  // around a random nonce, which no text can guess.
  const nonce = randomBytes(12).toString("hex");
  const marked: string[] = [];
  const templateMessages = toTemplateMessages(messages, (s) => `\uE000${nonce}:${marked.push(s) - 1}\uE001`);
  const rendered = template.render(templateMessages, options.addGenerationPrompt ?? true);
  const images: Array<PromptImage<I>> = messageImages(messages).map((image) => ({ image, digest: image.digest, nTokens: image.nTokens, start: -1 }));
  const pad = tokenizer.mediaPad;
  const tokens = expandMedia(tokenizer.encodeRendered(rendered, marked, new RegExp(`\uE000${nonce}:(\\d+)\uE001`)), images.map((i) => i.nTokens), pad);
  const keys: PositionKey[] = new Array<PositionKey>(tokens.length);
  let current = -1;
  let row = 0;
  for (let p = 0; p < tokens.length; p++) {
    const token = tokens[p]!;
    if (token === pad) {
      if (current < 0 || row === images[current]!.nTokens) {
        current++;
        row = 0;
        images[current]!.start = p;
      }
      keys[p] = { digest: images[current]!.digest, row: row++ };
    } else {
      keys[p] = token;
    }
  }
  return { tokens, images, keys };
}

/** The two positions hold the same thing (same token, or the same row of the same image). */
function sameKey(a: PositionKey, b: PositionKey): boolean {
  if (typeof a === "number" || typeof b === "number") return a === b;
  return a.digest === b.digest && a.row === b.row;
}

/** Length of the longest common prefix of two key sequences (how much of a session's KV to reuse). */
export function commonPrefix(a: readonly PositionKey[], b: readonly PositionKey[]): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    if (!sameKey(a[i]!, b[i]!)) return i;
  }
  return n;
}

/** One string per media position, in prompt order (`digest:row`): the media keys of a
 * GenerationRequest (host/engine/generation.ts), which compares keys as strings. */
export function mediaKeyStrings(prompt: Prompt): string[] {
  const out: string[] = [];
  for (const key of prompt.keys) if (typeof key !== "number") out.push(`${key.digest}:${key.row}`);
  return out;
}
