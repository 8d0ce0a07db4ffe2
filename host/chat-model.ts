/**
 * chat-model.ts — a packed model opened for conversations, on the main thread: the RAM plan, the
 * engine worker (engine-client.ts), the tokenizer, the chat template and the image preprocessing
 * config; and Conversation, one KV timeline with its images. What `kvl chat` and `kvl serve` use.
 *
 * Owns: refusing a pack that cannot run (pack-check.ts) before anything is loaded; the act mode
 * (--act-dtype auto resolved for the backend and kernel set, plan/act-mode.ts) and the plan the
 * engine is opened from; the load line both commands print (loadLine); images as the prompt sees them (ChatImage: the file's bytes, its size
 * from the header, grid and media tokens — pixels are decoded only when the image is encoded;
 * an image over the plan's image decode line is refused from its header, when it is attached);
 * the media-token budget an image is preprocessed for (--max-image-tokens, per request in the
 * server: the official in_token_limit rule with a smaller limit); encoding each image once per
 * model (embeddings, rounded to BF16 as the official model feeds them, kept by content in an LRU
 * the size of the plan's "image embeddings" line: image/embedding-cache.ts), with progress
 * events while an image encodes (ImageEvent); the reply's text
 * (UTF-8-safe deltas, stop strings held back and never emitted), its token budget
 * (max_new_tokens within the context), and its report (finish reason, usage, timings).
 * Does not own: the token loop and prefix reuse (generation.ts, in the worker), pixels
 * (image-decode.ts, image-preprocess.ts), rendering (chat-template.ts), the plan's arithmetic
 * (planner.ts).
 */
import { readFileSync } from "node:fs";
import { readFile, stat } from "node:fs/promises";
import { join } from "node:path";

import type { BackendRecord } from "./core/backend.js";
import { type BackendName, type EngineStats, PackReadError, roundToBf16 } from "./core/core-api.js";
import { ChatTemplate } from "./text/chat-template.js";
import { type Message, type Prompt, ImageInput, buildPrompt, mediaKeyStrings, sha256Hex } from "./text/conversation.js";
import { EngineClient, type ClientSession } from "./engine/engine-client.js";
import { DEFAULT_DECODE_LIMITS, type DecodeLimits, checkImage, decodeImageWith, imageHeader } from "./image/image-decode.js";
import { ImageRoom } from "./image/image-room.js";
import { type PreprocessorConfig, gridForSize, loadPreprocessorConfig, mediaTokens, preprocessImage } from "./image/image-preprocess.js";
import { EmbeddingCache, imageContentKey } from "./image/embedding-cache.js";
import { openRunnablePack } from "./pack/pack-check.js";
import { packFileChange, packFileIdentities } from "./pack/pack-files.js";
import { imageLimitsText } from "./image/image-budget.js";
import { type ActMode, actModeFor, actModeText } from "./plan/act-mode.js";
import { MIB } from "./plan/core-bytes.js";
import type { RequestPlanOptions } from "./plan/input-lines.js";
import { type RamPlan, plan } from "./plan/planner.js";
import type { ModelOptions } from "./plan/settings.js";
import { checkGrammar } from "./text/grammar/grammar-spec.js";
import { GrammarEngineError } from "./text/grammar/xgrammar.js";
import { type ReplyParams, seedOrRandom, validateReplyParams } from "./text/reply-params.js";
import { StopMatcher } from "./text/stop-matcher.js";
import { StreamDecoder, Tokenizer } from "./text/tokenizer.js";
import { UserError } from "./system/user-error.js";

export interface ChatModelOptions extends ModelOptions {
  /** The chosen backend (backend.ts chooseBackend): its name, why, and the native kernel set. */
  backend: BackendRecord;
  /** kvl serve: the request bodies the plan must hold (plan/input-lines.ts RequestPlanOptions). */
  requests?: RequestPlanOptions | undefined;
  /** Called while the engine loads with the bytes this process has read so far (Linux) and
   * the bytes the plan expects it to read before it can run. */
  onLoadProgress?: (readBytes: number | null, expectedBytes: number) => void;
}

/** An image as a conversation holds it: its encoded bytes (sha256 is theirs), its size from the
 * file header, the token limit (patches, the official in_token_limit or a smaller one) it is
 * preprocessed for, and the patch grid and media tokens that gives. Its identity for prefix reuse
 * (digest) is the file's sha256, with the limit appended when it is not the pack's own — the same
 * file at another budget is other media. */
export class ChatImage extends ImageInput {
  constructor(readonly bytes: Uint8Array, readonly name: string, readonly width: number, readonly height: number,
    readonly grid: [number, number], nTokens: number, readonly inTokenLimit: number, officialLimit: boolean,
    readonly sha256: string = sha256Hex(bytes)) {
    super(nTokens, officialLimit ? sha256 : `${sha256}@${inTokenLimit}`);
  }
}

/** What happens to one image of a turn, for a progress line: "start" before it is looked up,
 * "encoding" about every second while the engine encodes it, "done" when its embeddings are there. */
export interface ImageEvent {
  phase: "start" | "encoding" | "done";
  /** 0-based, in prompt order, and how many images the prompt shows. */
  index: number;
  count: number;
  name: string;
  grid: [number, number];
  mediaTokens: number;
  /** Seconds since this image's turn began looking it up (decode, preprocess and encode). */
  elapsedS: number;
  /** "done": whether the embeddings came from the cache (nothing was encoded). */
  cached: boolean;
}

/** Hooks of one reply beyond its text. */
export interface ReplyHooks {
  onImage?: (event: ImageEvent) => void;
}

/** How often an "encoding" event repeats while the engine encodes an image. */
const IMAGE_PROGRESS_MS = 1000;

type FinishReason = "stop" | "length" | "cancelled";

/** What one reply did. */
export interface ReplyReport {
  reply: string;
  finishReason: FinishReason;
  /** The stop string that ended the reply, if one did. */
  stopSequence: string | null;
  promptTokenIds: number[];
  outputTokenIds: number[];
  usage: { promptTokens: number; completionTokens: number; reusedPromptTokens: number; imagesEncoded: number };
  timings: { prefillS: number; firstTokenS: number; decodeSPerToken: number; visionS: number };
  /** Each image the prompt shows: its file's sha256, grid, media tokens, the token limit it was
   * preprocessed for (patches), whether its embeddings came from the cache, and the seconds its
   * decode + preprocessing + encode took this turn (0 when cached). */
  images: Array<{ sha256: string; grid: [number, number]; mediaTokens: number; inTokenLimit: number; cached: boolean; encodeS: number }>;
}

/** Linux: bytes this process has read through read(2)/pread(2) so far (rchar), else null. */
function processReadBytes(): number | null {
  if (process.platform !== "linux") return null;
  try {
    const line = readFileSync("/proc/self/io", "latin1").split("\n").find((l) => l.startsWith("rchar:"));
    return line ? Number(line.slice(6).trim()) : null;
  } catch {
    return null;
  }
}

/** Image digests remembered as decoding whole: a conversation resends its images every turn. */
const CHECKED_IMAGES_KEPT = 256;

/**
 * What the load line says about the engine's CRC checks of pack data on first read
 * (docs/FORMAT.md "Checks at run time") where they cost more than 3 % of a decode step: on
 * WebAssembly (no carry-less multiply; Node's zlib.crc32) they took 2.5-3.4 % of the first 32
 * decode steps after a short prompt on the full-size model, and under 2 % after that (README
 * "Data checks"); natively (PCLMULQDQ) under 1.5 %, so nothing is said there.
 */
function firstReadCheckNote(backend: BackendName): string | null {
  return backend === "wasm" ? "CRC checks of first reads cost ~3 % of decoding until every expert has been read once" : null;
}

/**
 * The one line `kvl chat` and `kvl serve` print once the model is loaded: the backend and who
 * asked for it, the instances, the kernel set and the act mode with why, the RAM plan against
 * --ram-mib, a server's body and image limits, a smaller image budget (--max-image-tokens), the load time, what the first reads' checks cost
 * where that is noticeable, and (without --verbose) where the plan's table is; then, when the
 * expert cache cannot hold every expert, a second line with what it should expect from a trained
 * model's routing (realistic and worst: plan/routing-outlook.ts; --verbose's table ends with it).
 */
export function loadLine(command: string, model: ChatModel, verbose: boolean): string {
  const record = model.backendRecord;
  const p = model.plan;
  const n = p.instances.length;
  const by = record.requestedBy === "default" ? "" : record.requestedBy === "option" ? " (--backend)" : " (KVL_BACKEND)";
  const bodies = p.requestBodies;
  const limits = bodies ? `; bodies up to ${(bodies.bodyBytes / MIB).toFixed(0)} MiB${p.imageBudget ? `, images ${imageLimitsText(p.imageBudget, "first")}` : ""}` : "";
  const note = firstReadCheckNote(record.chosen);
  const official = model.preprocess?.inTokenLimit;
  const budget = official !== undefined && model.defaultInTokenLimit !== official
    ? `; images downscaled to ~${model.defaultInTokenLimit / (model.preprocess!.mergeKernel[0] * model.preprocess!.mergeKernel[1])} media tokens (--max-image-tokens)` : "";
  return `kvl ${command}: ${record.chosen}${by}, ${n} ${record.chosen === "wasm" ? "instance" : "engine"}${n > 1 ? "s" : ""}, ` +
    `kernels ${model.client.info.kernels}, Linear inputs ${actModeText(model.actMode)}; ` +
    `RAM plan ${(p.total / MIB).toFixed(0)} MiB of ${p.budgetText}${limits}${budget}; loaded in ${model.loadSeconds.toFixed(1)} s` +
    `${note ? `; ${note}` : ""}${verbose ? "" : " (--verbose shows the plan)"}` +
    (p.routingOutlookText && !verbose ? `\nkvl ${command}: ${p.routingOutlookText}` : "");
}

/** The reply's grammar builds (xgrammar's refusal a UserError), checked before anything runs. */
export async function checkReplyGrammar(params: ReplyParams): Promise<void> {
  if (!params.grammar) return;
  try {
    await checkGrammar(params.grammar);
  } catch (err) {
    if (err instanceof GrammarEngineError) throw new UserError(`the grammar engine refuses the schema: ${err.message}`);
    throw err;
  }
}

/** The most media tokens an image may be given a budget of: the pack's own in_token_limit in merged tokens. */
function maxImageTokensOf(config: PreprocessorConfig): number {
  return Math.floor(config.inTokenLimit / (config.mergeKernel[0] * config.mergeKernel[1]));
}

/**
 * The in_token_limit (patches) for a budget of `maxImageTokens` media tokens: the official
 * processor's rule (image-preprocess.ts) is applied with in_token_limit = tokens x merge area, so
 * the image is downscaled as the official processor would downscale it for that limit (then padded
 * to whole merges, which can add a row or column of tokens, as it does at the default). null: the
 * pack's own limit. UserError naming `what` for a budget that is not 1..the pack's own.
 */
function inTokenLimitOf(config: PreprocessorConfig, maxImageTokens: number | null, what: string): number {
  if (maxImageTokens === null) return config.inTokenLimit;
  const most = maxImageTokensOf(config);
  if (!Number.isInteger(maxImageTokens) || maxImageTokens < 1 || maxImageTokens > most) {
    throw new UserError(`${what} must be a whole number from 1 to ${most} (the model's own limit, ${config.inTokenLimit} patches ` +
      `= ${most} media tokens, is the default), got ${maxImageTokens}`);
  }
  return maxImageTokens * config.mergeKernel[0] * config.mergeKernel[1];
}

export class ChatModel {
  /** Digests of images that decoded whole, oldest first (a Set keeps insertion order). */
  readonly #checkedImages = new Set<string>();
  /** Images' embeddings by content, within the plan's "image embeddings" line: that line holds a
   * full context of media rows, so the images of any one prompt always fit together. */
  readonly embeddings: EmbeddingCache;
  /** The image lines' RAM: taken back from the expert cache for each image's decode and encode
   * (natively; the plan lends it while no image is in flight). */
  readonly imageRoom: ImageRoom;

  private constructor(readonly packDir: string, readonly backendRecord: BackendRecord, readonly actMode: ActMode, readonly plan: RamPlan,
    readonly client: EngineClient, readonly tokenizer: Tokenizer, readonly template: ChatTemplate, readonly preprocess: PreprocessorConfig | null,
    readonly loadSeconds: number, readonly packFiles: ReturnType<typeof packFileIdentities>,
    /** The token limit (patches) images are preprocessed for unless a request says otherwise (--max-image-tokens). */
    readonly defaultInTokenLimit: number) {
    this.embeddings = new EmbeddingCache(plan.components.mediaCache);
    this.imageRoom = new ImageRoom((lent) => client.setImageRoomLent(lent));
  }

  /** The most media tokens an image may be given a budget of: the pack's own in_token_limit in merged tokens. */
  get maxImageTokens(): number {
    return this.preprocess ? maxImageTokensOf(this.preprocess) : 0;
  }

  /** The in_token_limit (patches) for a request's budget of media tokens (inTokenLimitOf), or the
   * model's default when the request gives none. */
  inTokenLimitFor(maxImageTokens: number | undefined | null, what: string): number {
    if (!this.preprocess) return 0;
    if (maxImageTokens === undefined || maxImageTokens === null) return this.defaultInTokenLimit;
    return inTokenLimitOf(this.preprocess, maxImageTokens, what);
  }

  /**
   * Refuses a turn (PackReadError) when a pack data file is no longer the one the engine opened:
   * gone, replaced, resized or rewritten (host/pack/pack-files.ts says why it matters). Before
   * each turn, so nothing is read from a changed pack and the conversation stays as it was.
   */
  checkPackFiles(): void {
    const change = packFileChange(this.packFiles);
    if (change === null) return;
    throw new PackReadError(`${change}; kvl reads the pack while it runs, so this turn was not run: reconnect its disk or ` +
      `put the pack back as it was, or restart kvl to use the new files (\`kvl doctor ${this.packDir}\` checks them)`);
  }

  /** Checks the pack, resolves the act mode, plans with it (refusing a budget that does not fit,
   * saying what to lower) and opens the engine in its worker. */
  static async open(packDir: string, options: ChatModelOptions): Promise<ChatModel> {
    await openRunnablePack(packDir);
    const backend = options.backend.chosen;
    // before the plan: the integer modes' trunk rows and workspace are bytes it counts
    const actMode = await actModeFor(options.actDtype, options.backend, backend, options.kernels);
    const ramPlan = await plan(packDir, {
      backend, ramMib: options.ramMib, cacheMib: options.cacheMib ?? null, trunkCacheMib: options.trunkCacheMib,
      maxContext: options.maxContext, loadVision: options.loadVision, threads: options.threads, actDtype: actMode.actDtype, check: true,
      ...(options.instances !== undefined ? { instances: options.instances } : {}),
      ...(options.requests !== undefined ? { requests: options.requests } : {}),
      ...(options.imageMaxPixels !== undefined ? { imageMaxPixels: options.imageMaxPixels } : {}),
    });
    const tokenizer = new Tokenizer(packDir);
    let client: EngineClient | undefined;
    try {
      const template = new ChatTemplate(packDir);
      const config = JSON.parse(readFileSync(join(packDir, "config.json"), "utf8")) as { vision_config?: { merge_kernel_size?: unknown } };
      const merge = config.vision_config?.merge_kernel_size;
      const preprocess = options.loadVision
        ? loadPreprocessorConfig(packDir, Array.isArray(merge) && merge.length === 2 ? [Number(merge[0]), Number(merge[1])] : undefined)
        : null;
      // a bad --max-image-tokens is refused before the engine loads
      const defaultInTokenLimit = preprocess ? inTokenLimitOf(preprocess, options.maxImageTokens ?? null, "--max-image-tokens") : 0;
      const expected = ramPlan.instances.reduce((n, i) => n + i.globals + i.trunkCache, 0);
      const readAtStart = processReadBytes();
      const started = performance.now();
      const timer = options.onLoadProgress
        ? setInterval(() => {
          const now = processReadBytes();
          options.onLoadProgress!(now === null || readAtStart === null ? null : now - readAtStart, expected);
        }, 250)
        : undefined;
      // before the engine opens them: a file changed from here on is noticed at the next turn
      const packFiles = packFileIdentities(packDir);
      try {
        client = await EngineClient.open(backend, packDir, {
          nThreads: ramPlan.nThreads, planned: ramPlan.instances, kernels: options.kernels, actDtype: actMode.actDtype,
          ...(options.backend.chosen === "native" ? { nativeAddon: options.backend.native.path } : {}),
          ...(options.expertLookahead !== undefined ? { expertLookahead: options.expertLookahead } : {}),
        });
      } finally {
        if (timer) clearInterval(timer);
      }
      return new ChatModel(packDir, options.backend, actMode, ramPlan, client, tokenizer, template, preprocess, (performance.now() - started) / 1000, packFiles,
        defaultInTokenLimit);
    } catch (err) {
      tokenizer.close();
      await client?.close().catch(() => undefined);
      throw err;
    }
  }

  get backend(): BackendName {
    return this.plan.backend;
  }

  /** Reads an image file (or takes encoded bytes), sizes it from its header for the token limit
   * (inTokenLimitFor: the model's default, or a request's) and checks that it decodes whole
   * (checkImage, once per digest); its pixels are kept only when a conversation first encodes it.
   * UserError for anything that is not a usable image. */
  async loadImage(source: string | Uint8Array, name = typeof source === "string" ? source : "image data",
    inTokenLimit = this.defaultInTokenLimit): Promise<ChatImage> {
    if (!this.preprocess) throw new UserError("this model was opened without vision (--no-vision); images are not accepted");
    const config = { ...this.preprocess, inTokenLimit };
    let bytes: Uint8Array;
    if (typeof source === "string") {
      let size: number;
      try {
        const st = await stat(source);
        if (st.isDirectory()) throw new UserError(`image file '${source}' is a directory; give the path of an image file`);
        size = st.size;
      } catch (err) {
        if (err instanceof UserError) throw err;
        const code = (err as NodeJS.ErrnoException).code;
        throw new UserError(code === "ENOENT" ? `image file '${source}' not found` : `cannot read image file '${source}' (${(err as Error).message})`);
      }
      if (size > DEFAULT_DECODE_LIMITS.maxFileBytes) {
        throw new UserError(`image file '${source}' is ${size} bytes, over the ${DEFAULT_DECODE_LIMITS.maxFileBytes}-byte limit for images; downscale or recompress it`);
      }
      bytes = await readFile(source);
    } else {
      bytes = source;
    }
    // over the plan's image decode line: refused here, from the header, before it joins a message
    let width: number;
    let height: number;
    try {
      ({ width, height } = await imageHeader(bytes, this.decodeLimits(), typeof source === "string" ? `image file '${source}'` : undefined));
    } catch (err) {
      if (err instanceof UserError && typeof source !== "string" && !err.message.startsWith(`${name}:`)) throw new UserError(`${name}: ${err.message}`);
      throw err;
    }
    let grid: [number, number];
    try {
      grid = gridForSize(width, height, config);
    } catch (err) {
      if (err instanceof UserError) throw new UserError(`${name}: ${err.message}`);
      throw err;
    }
    const image = new ChatImage(bytes, name, width, height, grid, mediaTokens(grid, this.preprocess.mergeKernel), inTokenLimit,
      inTokenLimit === this.preprocess.inTokenLimit);
    // decoded whole once now (keeping no pixels), so a damaged image is refused when it is given —
    // before a server's stream has started, before a chat turn joins the history — never when
    // the turn that carries it is encoded
    if (!this.#checkedImages.has(image.sha256)) {
      await this.imageRoom.hold(() => checkImage(bytes, this.decodeLimits()));
      this.#checkedImages.add(image.sha256);
      if (this.#checkedImages.size > CHECKED_IMAGES_KEPT) this.#checkedImages.delete(this.#checkedImages.values().next().value!);
    }
    return image;
  }

  /** The decoder's limits: the hard ones, and the RAM plan's image decode budget (image-budget.ts). */
  decodeLimits(): DecodeLimits {
    const budget = this.plan.imageBudget;
    return budget ? { ...DEFAULT_DECODE_LIMITS, budget: { bytes: budget.bytes, shape: budget.shape } } : DEFAULT_DECODE_LIMITS;
  }

  async newConversation(): Promise<Conversation> {
    return new Conversation(this, await this.client.newSession(this.plan.sessionOptions));
  }

  stats(): Promise<EngineStats> {
    return this.client.stats();
  }

  async close(): Promise<void> {
    try {
      await this.client.close();
    } finally {
      this.tokenizer.close();
    }
  }
}

/** One conversation: a session's KV (its images' embeddings are the model's, by content). */
export class Conversation {
  #running = false;
  #cancelled = false;
  #position = 0;

  constructor(readonly model: ChatModel, readonly session: ClientSession) {}

  /** Tokens the session's KV holds after the last reply. */
  get position(): number {
    return this.#position;
  }

  /** Renders, tokenizes and media-expands messages (the generation prompt included). */
  prompt(messages: ReadonlyArray<Message<ChatImage>>): Prompt<ChatImage> {
    return buildPrompt(messages, this.model.template, this.model.tokenizer);
  }

  /** Stops the running reply at once (Ctrl-C, a client that left): it ends "cancelled", the KV
   * keeps what was complete. No-op when nothing runs. */
  cancel(): void {
    if (!this.#running) return;
    this.#cancelled = true;
    this.session.cancel();
  }

  /** Forgets the conversation: KV and keys (image embeddings stay in the model's cache, by content). */
  async reset(): Promise<void> {
    await this.session.reset();
    this.#position = 0;
  }

  async close(): Promise<void> {
    await this.session.close();
  }

  /**
   * The embeddings of every image the prompt shows, by digest: from the model's cache (by
   * content: a resent file is found by its digest and token limit without decoding; other bytes
   * are decoded and preprocessed, then found if their pixels are), else encoded and kept there.
   * The prompt's cached images are marked recent first, so encoding the others never evicts them.
   */
  async #encodeImages(prompt: Prompt<ChatImage>, onImage: ((event: ImageEvent) => void) | undefined):
    Promise<{ rows: Map<string, Float32Array>; encoded: number; seconds: Map<string, number> }> {
    const cache = this.model.embeddings;
    for (const { image } of prompt.images) {
      const key = cache.keyOfFile(image.sha256, image.inTokenLimit);
      if (key !== undefined) cache.touch(key);
    }
    const config = this.model.preprocess;
    const rows = new Map<string, Float32Array>();
    const seconds = new Map<string, number>();
    let encoded = 0;
    for (const [index, { image }] of prompt.images.entries()) {
      if (rows.has(image.digest)) continue;
      if (this.#cancelled) break;
      if (!config) throw new UserError("this model was opened without vision (--no-vision); images are not accepted");
      const started = performance.now();
      const event = (phase: ImageEvent["phase"], cached = false): void => onImage?.({
        phase, index, count: prompt.images.length, name: image.name, grid: [...image.grid], mediaTokens: image.nTokens,
        elapsedS: (performance.now() - started) / 1000, cached,
      });
      event("start");
      const known = cache.keyOfFile(image.sha256, image.inTokenLimit);
      let found = known === undefined ? undefined : cache.get(known);
      if (found === undefined) {
        // the decode and the encode run in the image lines' RAM, taken back from the expert cache
        found = await this.model.imageRoom.hold(async (): Promise<Float32Array> => {
          const limited = { ...config, inTokenLimit: image.inTokenLimit };
          const { pixelValues, grid } = await decodeImageWith(image.bytes, this.model.decodeLimits(), (decoded) => preprocessImage(decoded, limited));
          if (grid[0] !== image.grid[0] || grid[1] !== image.grid[1]) {
            throw new UserError(`${image.name}: the decoded image gives a ${grid[0]}x${grid[1]} patch grid, its header promised ` +
              `${image.grid[0]}x${image.grid[1]}; the file is inconsistent, re-export it`);
          }
          const key = imageContentKey(pixelValues, grid);
          cache.rememberFile(image.sha256, image.inTokenLimit, key);
          // the same pixels from another file (one lookup counted per image: a known key was looked up)
          const same = key !== known ? cache.get(key) : undefined;
          if (same !== undefined) return same;
          const timer = onImage ? setInterval(() => event("encoding"), IMAGE_PROGRESS_MS) : undefined;
          let out: Float32Array;
          try {
            out = await this.model.client.encodeImages(pixelValues, Int32Array.from(grid));
          } finally {
            if (timer) clearInterval(timer);
          }
          const hidden = this.model.client.info.hiddenSize;
          if (out.length !== image.nTokens * hidden) {
            throw new Error(`vision produced ${out.length / hidden} rows for ${image.nTokens} media tokens (grid ${grid.join("x")})`);
          }
          const rowsOfImage = roundToBf16(out);
          cache.set(key, rowsOfImage);
          encoded++;
          seconds.set(image.digest, (performance.now() - started) / 1000);
          return rowsOfImage;
        });
      }
      rows.set(image.digest, found);
      event("done", !seconds.has(image.digest));
    }
    return { rows, encoded, seconds };
  }

  /**
   * Streams the assistant's reply to `messages` (the whole conversation so far; the KV of what
   * the session already holds is reused): onText gets each piece of text as soon as it is
   * certain (never part of a stop string, never half a UTF-8 character).
   */
  async generate(messages: ReadonlyArray<Message<ChatImage>>, params: ReplyParams, onText: (text: string) => void,
    hooks: ReplyHooks = {}): Promise<ReplyReport> {
    validateReplyParams(params);
    if (this.#running) throw new UserError("this conversation is already generating a reply");
    this.model.checkPackFiles();
    const started = performance.now();
    const prompt = this.prompt(messages);
    const maxContext = this.model.plan.maxContext;
    if (prompt.tokens.length >= maxContext) {
      throw new UserError(`the conversation is ${prompt.tokens.length} tokens, the context holds ${maxContext}; shorten it or raise --max-context`);
    }
    this.#running = true;
    this.#cancelled = false;
    const timings = { prefillS: 0, firstTokenS: 0, decodeSPerToken: 0, visionS: 0 };
    const images: ReplyReport["images"] = prompt.images.map((i) => ({ sha256: i.image.sha256, grid: [...i.image.grid] as [number, number],
      mediaTokens: i.nTokens, inTokenLimit: i.image.inTokenLimit, cached: false, encodeS: 0 }));
    try {
      await checkReplyGrammar(params); // after #running is set: a cancel meanwhile still counts
      const visionStart = performance.now();
      const { rows, encoded: imagesEncoded, seconds } = await this.#encodeImages(prompt, hooks.onImage);
      timings.visionS = (performance.now() - visionStart) / 1000;
      // an image shown twice is encoded once: the first showing reports the encode, later ones
      // (and images found in the cache) are cached; one a cancel left unencoded is neither
      const reported = new Set<string>();
      prompt.images.forEach(({ digest }, n) => {
        const s = seconds.get(digest);
        const first = s !== undefined && !reported.has(digest);
        if (first) reported.add(digest);
        images[n] = { ...images[n]!, cached: rows.has(digest) && !first, encodeS: first ? s : 0 };
      });
      const base = { promptTokenIds: prompt.tokens, images, stopSequence: null };
      if (this.#cancelled) {
        return { ...base, reply: "", finishReason: "cancelled", outputTokenIds: [], timings,
          usage: { promptTokens: prompt.tokens.length, completionTokens: 0, reusedPromptTokens: 0, imagesEncoded } };
      }
      const hidden = this.model.client.info.hiddenSize;
      const mediaKeys = mediaKeyStrings(prompt);
      let media: Float32Array | null = null;
      if (mediaKeys.length) {
        media = new Float32Array(mediaKeys.length * hidden);
        let row = 0;
        for (const { digest, nTokens } of prompt.images) {
          media.set(rows.get(digest)!.subarray(0, nTokens * hidden), row * hidden);
          row += nTokens;
        }
      }
      const tokenizer = this.model.tokenizer;
      const decoder = new StreamDecoder(tokenizer);
      const matcher = new StopMatcher(params.stop);
      const pieces: string[] = [];
      const output: number[] = [];
      let stopSequence: string | null = null;
      const emit = (text: string): void => {
        if (!text) return;
        pieces.push(text);
        onText(text);
      };
      const result = await this.session.generate({
        prompt: Int32Array.from(prompt.tokens), mediaKeys, media,
        sampler: { temperature: params.temperature, topK: params.topK, topP: params.topP },
        seed: seedOrRandom(params.seed), maxNewTokens: Math.min(params.maxNewTokens, maxContext - prompt.tokens.length),
        stopIds: Int32Array.from(tokenizer.stopIds), bannedIds: tokenizer.unsampleableIds(), grammar: params.grammar,
      }, (token) => {
        if (stopSequence !== null) return; // stepped past a stop string before the worker saw the flag
        output.push(token);
        if (output.length === 1) timings.firstTokenS = (performance.now() - started) / 1000;
        const { text, stop } = matcher.push(decoder.push(token));
        emit(text);
        if (stop !== null) {
          stopSequence = stop;
          this.session.stop();
        }
      });
      if (stopSequence === null) emit(matcher.push(decoder.flush()).text + matcher.flush());
      timings.prefillS = result.timings.prefillS;
      timings.decodeSPerToken = result.timings.decodeSPerToken;
      const finishReason: FinishReason = stopSequence !== null ? "stop"
        : result.finishReason === "stopped" || result.finishReason === "cancelled" ? "cancelled" : result.finishReason;
      this.#position = await this.session.position();
      return {
        ...base, reply: pieces.join(""), finishReason, stopSequence, outputTokenIds: output, timings,
        usage: { promptTokens: prompt.tokens.length, completionTokens: output.length, reusedPromptTokens: result.reusedPromptTokens, imagesEncoded },
      };
    } finally {
      this.#running = false;
    }
  }
}
