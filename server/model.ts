/**
 * model.ts — what the server needs of a model (ServedModel), and that interface over a real
 * ChatModel with its one Conversation.
 *
 * Owns: the ServedModel contract (images, exact prompt size, one reply at a time with
 * cancellation, close) that the queue and the routes use, so they can be tested over a stand-in;
 * and opening the real one: ChatModel.open + one persistent Conversation (one KV timeline: each
 * request reuses the longest prefix it shares with what the previous one left); refusing, before
 * tokenizing it, text too long for the context by characters alone (the tokenizer's memory would
 * otherwise grow with any body the server accepts). Each image of a request is decoded whole before
 * its reply starts (ChatModel.loadImage), so a bad image is a 400, never an error after a stream's 200.
 * Does not own: anything of the model itself (host/chat-model.ts): prompts, sampling, stop
 * strings, image encoding and prefix reuse all happen there.
 */
import { ChatImage, ChatModel, type ChatModelOptions, type Conversation, type ReplyHooks, type ReplyReport } from "../host/chat-model.js";
import type { ImageInput, Message } from "../host/text/conversation.js";
import type { ReplyParams } from "../host/text/reply-params.js";
import { UserError } from "../host/system/user-error.js";
import type { ImageLoader } from "./images.js";

export interface ServedModel extends ImageLoader {
  readonly maxContext: number;
  readonly vision: boolean;
  /** Exact prompt tokens of messages (images included, generation prompt included); UserError for bad messages. */
  countTokens(messages: readonly Message[]): number;
  /** One reply; the model runs one at a time (the queue makes sure). */
  generate(messages: readonly Message[], params: ReplyParams, onText: (text: string) => void, hooks?: ReplyHooks): Promise<ReplyReport>;
  /** Stops the running reply (it ends "cancelled"); no-op when none runs. */
  cancel(): void;
  close(): Promise<void>;
}

function chatMessages(messages: readonly Message[]): Array<Message<ChatImage>> {
  for (const m of messages) {
    for (const p of m.parts) if (typeof p !== "string" && !(p instanceof ChatImage)) throw new Error("an image not loaded by this model reached it");
  }
  return messages as Array<Message<ChatImage>>;
}

/** The longest token of the vocabulary in UTF-8 bytes (special tokens' names included). */
function longestTokenBytes(chat: ChatModel): number {
  const t = chat.tokenizer;
  let longest = 1;
  for (let id = 0; id < t.nVocab; id++) {
    try {
      longest = Math.max(longest, t.tokenBytes(id).length);
    } catch {
      // an unnamed id of the reserved range: never in a prompt
    }
  }
  return longest;
}

export class ChatServedModel implements ServedModel {
  /** Every token covers at most this many UTF-8 bytes, so text of n UTF-16 units (each at least
   * one UTF-8 byte) is at least n / longestToken tokens. */
  readonly #longestToken: number;

  constructor(readonly chat: ChatModel, readonly conversation: Conversation) {
    this.#longestToken = longestTokenBytes(chat);
  }

  static async open(packDir: string, options: ChatModelOptions): Promise<ChatServedModel> {
    const chat = await ChatModel.open(packDir, options);
    try {
      return new ChatServedModel(chat, await chat.newConversation());
    } catch (err) {
      await chat.close().catch(() => undefined);
      throw err;
    }
  }

  get maxContext(): number {
    return this.chat.plan.maxContext;
  }

  get vision(): boolean {
    return this.chat.preprocess !== null;
  }

  /** The largest max_image_tokens a request may give (the model's own limit). */
  get maxImageTokens(): number {
    return this.chat.maxImageTokens;
  }

  loadImage(bytes: Uint8Array, name: string, maxImageTokens: number | null = null): Promise<ImageInput> {
    return this.chat.loadImage(bytes, name, this.chat.inTokenLimitFor(maxImageTokens, "max_image_tokens"));
  }

  countTokens(messages: readonly Message[]): number {
    let units = 0;
    for (const m of messages) for (const p of m.parts) if (typeof p === "string") units += p.length;
    const atLeast = Math.ceil(units / this.#longestToken);
    if (atLeast >= this.maxContext) {
      throw new UserError(`the conversation's text is ${units} characters, at least ${atLeast} tokens, but the context holds ` +
        `${this.maxContext}; shorten it or restart the server with a larger --max-context`);
    }
    return this.conversation.prompt(chatMessages(messages)).tokens.length;
  }

  generate(messages: readonly Message[], params: ReplyParams, onText: (text: string) => void, hooks: ReplyHooks = {}): Promise<ReplyReport> {
    return this.conversation.generate(chatMessages(messages), params, onText, hooks);
  }

  cancel(): void {
    this.conversation.cancel();
  }

  async close(): Promise<void> {
    try {
      await this.conversation.close();
    } finally {
      await this.chat.close();
    }
  }
}
