/**
 * input-lines.ts — the two lines of the RAM plan that depend on input rather than on the model:
 * decoding the largest image the plan admits (chat and serve), and the request bodies a server
 * holds at once (serve).
 *
 * Owns: their settings' checks, their bytes and their notes in the plan's table, the body limit's
 * ceiling and floor, and the body slots a server holds. Does not own: choosing the limits (they
 * are chosen to fit, by the same search as the advice: advice.ts resolveAutoLimits — when
 * --max-body-mib is not given the body limit is the largest whole MiB up to DEFAULT_BODY_BYTES
 * that fits, then the image limit the largest 0.1 MP step up to IMAGE_PIXELS_MAX; each takes its
 * floor when nothing fits, and the plan then refuses with advice; the limits come before the
 * auto trunk cache, which takes what is left: inputs work, a smaller trunk cache only costs
 * speed), what one image decode holds (image-budget.ts), or reading bodies (server/body.ts).
 */
import { IMAGE_PIXELS_FLOOR, IMAGE_PIXELS_MAX, type ResizeShape, imageDecodeBudget, imageLimitsText } from "../image/image-budget.js";
import { UserError } from "../system/user-error.js";
import { MIB, type PackFacts, configInt, mib } from "./core-bytes.js";

/** kvl serve's request options that size the bodies line. */
export interface RequestPlanOptions {
  /** --max-queue: requests that may wait while one runs. */
  maxQueue: number;
  /** --max-body-mib in bytes; absent or null = auto (the most that fits, up to DEFAULT_BODY_BYTES). */
  maxBodyBytes?: number | null;
}

/** The auto body limit's ceiling (the former fixed --max-body-mib default) and floor. */
export const DEFAULT_BODY_BYTES = 20 * MIB;
export const BODY_BYTES_FLOOR = 1 * MIB;
/** Bodies being read or parsed besides the queue's (server/body.ts BodyGate admits this many more). */
const IN_FLIGHT_BODIES = 1;
/**
 * Resident bytes per body byte while a request holds its body: the raw bytes, the decoded text
 * and the parsed object (strings copied once more by JSON.parse; base64 image data decoded to
 * bytes), and the V8 garbage of those copies until the next major GC. Measured by
 * test/server-api.test.ts "request bodies" on a real server (see docs/SERVER.md).
 */
const REQUEST_BODY_FACTOR = 2.5;

/** Bodies a server may hold at once: every waiting request, the running one, and those in flight. */
export function bodySlots(maxQueue: number): number {
  return maxQueue + 1 + IN_FLIGHT_BODIES;
}

export interface ImageBudget {
  /** Pixels of the largest image decoded in strips (JPEG, PNG) that the plan reserves for; what
   * is admitted, per format, is image-budget.ts imagePixelLimit (for JPEG and PNG: these pixels). */
  pixels: number;
  /** Bytes reserved (the imageDecode line). */
  bytes: number;
  /** The preprocessing's patch side and token limit (resize working memory). */
  shape: ResizeShape;
}

export interface RequestBodies {
  /** The largest accepted body (413 above). */
  bodyBytes: number;
  /** Bodies held at once at most (server/body.ts BodyGate's capacity). */
  slots: number;
  /** Bytes reserved (the requests line). */
  bytes: number;
}

/** The request settings of a plan: the queue and the body limit (null = auto, until resolved). */
export interface RequestSettings {
  maxQueue: number;
  bodyBytes: number | null;
}

export function requestSettings(options: RequestPlanOptions | undefined): RequestSettings | null {
  if (!options) return null;
  const { maxQueue } = options;
  const bodyBytes = options.maxBodyBytes ?? null;
  if (!Number.isSafeInteger(maxQueue) || maxQueue < 1) throw new UserError(`--max-queue must be a positive integer, got ${maxQueue}`);
  if (bodyBytes !== null && (!Number.isSafeInteger(bodyBytes) || bodyBytes < 1)) {
    throw new UserError(`the body limit must be a positive number of bytes, got ${bodyBytes}`);
  }
  return { maxQueue, bodyBytes };
}

export function imagePixelsSetting(pixels: number | undefined): number | null {
  if (pixels === undefined) return null;
  if (!Number.isSafeInteger(pixels) || pixels < 1 || pixels > IMAGE_PIXELS_MAX) {
    throw new UserError(`the image limit must be a whole number of pixels in 1..${IMAGE_PIXELS_MAX}, got ${pixels}`);
  }
  return pixels;
}

function resizeShapeOf(facts: PackFacts): ResizeShape {
  if (!facts.preprocessorConfig.ok) throw new UserError(facts.preprocessorConfig.error);
  const config = facts.preprocessorConfig.value as Record<string, unknown>;
  return { patchSize: configInt(config, "patch_size"), inTokenLimit: configInt(config, "in_token_limit") };
}

/** The image decode line of a plan with these settings (null without vision). */
export function imageBudgetOf(facts: PackFacts, s: { readonly loadVision: boolean; readonly imagePixels: number | null }): ImageBudget | null {
  if (!s.loadVision) return null;
  const pixels = s.imagePixels ?? IMAGE_PIXELS_FLOOR;
  const shape = resizeShapeOf(facts);
  return { pixels, bytes: imageDecodeBudget(pixels, shape), shape };
}

/** The request bodies line of a plan with these settings (null when not a server). */
export function requestBodiesOf(s: { readonly requests: RequestSettings | null }): RequestBodies | null {
  if (!s.requests) return null;
  const bodyBytes = s.requests.bodyBytes ?? BODY_BYTES_FLOOR;
  const slots = bodySlots(s.requests.maxQueue);
  return { bodyBytes, slots, bytes: slots * Math.ceil(REQUEST_BODY_FACTOR * bodyBytes) };
}

export function imageDecodeNote(b: ImageBudget): string {
  return `images ${imageLimitsText(b)}`;
}

export function requestBodiesNote(r: RequestBodies): string {
  return `${r.slots} bodies of up to ${mib(r.bodyBytes)} MiB`;
}
