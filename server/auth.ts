/**
 * auth.ts — the API key: every endpoint but /healthz needs it when the server has one.
 *
 * Owns: where a key may come from (`x-api-key: KEY`, or `Authorization: Bearer KEY`), the
 * constant-time comparison (SHA-256 of both sides, compared with timingSafeEqual, so neither the
 * key's length nor its bytes leak through timing), the 401s, and which bind addresses count as
 * this machine only (the default 127.0.0.1; anything else without a key gets a warning).
 * Does not own: routing (app.ts), the error shapes (errors.ts).
 */
import { createHash, timingSafeEqual } from "node:crypto";
import type { IncomingHttpHeaders } from "node:http";

import { ApiError } from "./errors.js";

export const DEFAULT_HOST = "127.0.0.1";
const LOOPBACK_HOSTS = new Set(["127.0.0.1", "localhost", "::1"]);

export function isLoopbackHost(host: string): boolean {
  return LOOPBACK_HOSTS.has(host.toLowerCase());
}

function digest(text: string): Buffer {
  return createHash("sha256").update(text, "utf8").digest();
}

/** The key a request presents, or null. */
export function presentedKey(headers: IncomingHttpHeaders): string | null {
  const direct = headers["x-api-key"];
  if (typeof direct === "string") return direct;
  const authorization = headers.authorization;
  if (typeof authorization === "string") {
    const match = /^bearer\s+(.*)$/i.exec(authorization.trim());
    if (match) return match[1]!.trim();
  }
  return null;
}

/** Checks requests against one key (none: every request passes). */
export class KeyCheck {
  readonly #expected: Buffer | null;

  constructor(key: string | null) {
    if (key !== null && key.length === 0) throw new Error("an empty API key");
    this.#expected = key === null ? null : digest(key);
  }

  get enabled(): boolean {
    return this.#expected !== null;
  }

  /** Throws the 401 a request without the right key gets. */
  check(headers: IncomingHttpHeaders): void {
    if (this.#expected === null) return;
    const given = presentedKey(headers);
    if (given === null) {
      throw new ApiError("authentication", "missing API key: send it as 'x-api-key: KEY' or 'Authorization: Bearer KEY'");
    }
    if (!timingSafeEqual(digest(given), this.#expected)) throw new ApiError("authentication", "invalid API key");
  }
}
