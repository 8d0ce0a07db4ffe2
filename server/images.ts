/**
 * images.ts — images as the HTTP APIs send them (OpenAI data URLs, Anthropic base64 sources,
 * Ollama base64 strings) → the model's images (ChatModel.loadImage).
 *
 * Owns: strict base64 (whitespace allowed, as clients wrap lines; anything else outside the
 * alphabet, or bad padding, is a 400), data-URL parsing (base64 only; http(s) URLs are refused,
 * the server never fetches), the accepted media types and the magic-number check (JPEG, PNG,
 * WebP, GIF), and turning a request's messages with ImageData parts into model messages, each
 * UserError of the model's image loading (a truncated header, too many pixels, a grid it cannot
 * make, pixel data that does not decode: model.ts decodes each image whole before the reply) a
 * 400 naming the field.
 * Does not own: decoding pixels or sizing images (host/image/image-decode.ts via ChatModel.loadImage).
 */
import type { ImageInput, Message } from "../host/text/conversation.js";
import { UserError } from "../host/system/user-error.js";
import { invalid } from "./errors.js";

export const IMAGE_MEDIA_TYPES = ["image/jpeg", "image/png", "image/webp", "image/gif"] as const;

/** An image of a request, still encoded; `where` names it in errors (e.g. messages[0].content[1]);
 * maxImageTokens: the request's max_image_tokens (withImageBudget), null for the server's default. */
export class ImageData {
  maxImageTokens: number | null = null;

  constructor(readonly bytes: Uint8Array, readonly where: string) {}
}

/** The request field every API accepts (an extension): the media tokens each of its images may become. */
export const MAX_IMAGE_TOKENS_FIELD = "max_image_tokens";

/**
 * A request's max_image_tokens (already checked to be a positive integer, or null) given to each
 * of its images, so loadImages sizes them for it; returns the messages.
 */
export function withImageBudget(messages: RequestMessage[], maxImageTokens: number | null): RequestMessage[] {
  for (const m of messages) for (const p of m.parts) if (p instanceof ImageData) p.maxImageTokens = maxImageTokens;
  return messages;
}

/** A message as a request gives it: text and still-encoded images. */
export interface RequestMessage {
  role: string;
  parts: Array<string | ImageData>;
}

/** What can turn encoded bytes into a model image (ChatModel.loadImage), sized for a budget of
 * media tokens (null: the server's --max-image-tokens or the model's own); maxImageTokens: the
 * largest budget it accepts (the model's own limit). */
export interface ImageLoader {
  loadImage(bytes: Uint8Array, name: string, maxImageTokens?: number | null): Promise<ImageInput>;
  readonly maxImageTokens?: number;
}

/** The media type the bytes' magic number says, or null when it is no supported image. */
export function sniffImage(data: Uint8Array): string | null {
  const starts = (...sig: number[]): boolean => sig.every((b, i) => data[i] === b);
  if (starts(0xff, 0xd8, 0xff)) return "image/jpeg";
  if (starts(0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a)) return "image/png";
  const ascii = (from: number, to: number): string => String.fromCharCode(...data.subarray(from, to));
  if (data.length >= 12 && ascii(0, 4) === "RIFF" && ascii(8, 12) === "WEBP") return "image/webp";
  if (data.length >= 6 && (ascii(0, 6) === "GIF87a" || ascii(0, 6) === "GIF89a")) return "image/gif";
  return null;
}

const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

/** Strict base64 → bytes of a supported image; 400 naming `where` otherwise. */
export function decodeImageBase64(text: string, where: string): ImageData {
  // some clients wrap base64 at 76 columns; a copy without whitespace only when there is some
  // (each copy of a body-sized string is resident until the next GC: the plan's request line)
  const compact = /\s/.test(text) ? text.replace(/\s+/g, "") : text;
  if (!compact) throw invalid(`${where}: the image data is empty`, where);
  if (!BASE64.test(compact) || compact.length % 4 !== 0) throw invalid(`${where}: the image data is not valid base64`, where);
  const bytes: Uint8Array = Buffer.from(compact, "base64"); // its own memory (not Node's pool, past 4 KiB): no second copy
  if (sniffImage(bytes) === null) throw invalid(`${where}: the decoded data is not a JPEG, PNG, WebP or GIF image`, where);
  return new ImageData(bytes, where);
}

/** OpenAI's image_url.url: a base64 data URL of a supported type. */
export function decodeDataUrl(url: string, where: string): ImageData {
  if (/^https?:\/\//i.test(url)) {
    throw invalid(`${where}: this server never fetches URLs; send the image inline as a data URL (data:image/png;base64,...)`, where);
  }
  if (!url.startsWith("data:")) throw invalid(`${where}: image_url.url must be a data URL (data:image/jpeg|png|webp;base64,...)`, where);
  const comma = url.indexOf(",");
  const header = comma < 0 ? url.slice(5) : url.slice(5, comma);
  const [mediaType = "", ...options] = header.split(";");
  if (comma < 0 || !options.includes("base64")) {
    throw invalid(`${where}: the data URL must be base64-encoded (data:<media type>;base64,<data>)`, where);
  }
  if (!(IMAGE_MEDIA_TYPES as readonly string[]).includes(mediaType.toLowerCase())) {
    throw invalid(`${where}: unsupported media type '${mediaType}'; send one of ${IMAGE_MEDIA_TYPES.join(", ")}`, where);
  }
  return decodeImageBase64(url.slice(comma + 1), where);
}

/** Request messages → model messages: each image through the loader (a UserError is a 400). */
export async function loadImages(messages: readonly RequestMessage[], loader: ImageLoader): Promise<Message[]> {
  const out: Message[] = [];
  for (const message of messages) {
    const parts: Array<string | ImageInput> = [];
    for (const part of message.parts) {
      if (typeof part === "string") {
        parts.push(part);
        continue;
      }
      const most = loader.maxImageTokens;
      if (part.maxImageTokens !== null && most !== undefined && part.maxImageTokens > most) {
        throw invalid(`'${MAX_IMAGE_TOKENS_FIELD}' must be between 1 and ${most} (this model's own limit, the default), got ${part.maxImageTokens}`,
          MAX_IMAGE_TOKENS_FIELD);
      }
      try {
        parts.push(await loader.loadImage(part.bytes, part.where, part.maxImageTokens));
      } catch (err) {
        if (!(err instanceof UserError)) throw err;
        const text = err.message.startsWith(`${part.where}:`) ? err.message : `${part.where}: ${err.message}`;
        throw invalid(text, part.where);
      }
    }
    out.push({ role: message.role, parts });
  }
  return out;
}
