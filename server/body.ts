/**
 * body.ts — a request's JSON body, read safely: the size limit (413, checked against
 * Content-Length before reading and while reading), UTF-8, a nesting-depth limit (a deeply
 * nested body is a 400, never a stack overflow later), and JSON.parse with messages a person can
 * act on (NaN and Infinity, which some clients write for floats, named with their field).
 *
 * Owns: how many bodies the server holds at once (BodyGate, gateBodies: a request with a body
 * takes a slot before its body is read and gives it back when its answer is done; with no slot
 * free it gets 429, and before the model is ready 503, without its body being read — so the RAM
 * plan's "request bodies" line, slots x limit x the measured factor, bounds them, with a full GC
 * after each large body); reading the body under the limit (one buffer of the declared length,
 * else raw-body), draining what a refused body still sends
 * before the 413 goes out (so a client that reads nothing until it has sent everything gets the
 * answer, not a broken pipe; past a bound the answer goes out first and the rest is still read
 * and dropped, the connection never reset under an unread answer), telling a client that went away mid-body (ClientGone) from bad input,
 * and the scan that finds the depth and bare NaN/Infinity tokens outside strings; the body's read
 * deadlines (ReadDeadlines: no byte for bodyIdleMs, or not complete after bodyTotalMs, is a 408 and
 * the connection closes, so a client that stalls mid-body frees its slot; the headers' deadline is
 * Node's headersTimeout, set in serve.ts); answering a request refused before its body is read
 * (refuseUnread: its body drained, the error in its path's API shape, the log line).
 * Does not own: what the JSON must contain (the dialect modules), the error shapes (errors.ts).
 */
import type { IncomingMessage, RequestListener, ServerResponse } from "node:http";

import getRawBody from "raw-body";

import { collectGarbage } from "../host/system/collect-garbage.js";
import { ApiError, RETRY_AFTER_S, dialectOfPath, errorBody, invalid } from "./errors.js";

/** Deeper nesting than this is refused (the APIs' own bodies nest about 10 levels, tool schemas a few more). */
export const MAX_JSON_DEPTH = 128;

/**
 * How long a request may take to arrive. Every client sends its headers at once and its body
 * without pauses, so a silence is a stalled or hostile client holding a body slot (BodyGate): the
 * defaults free it after 30 s of silence; a whole body gets 300 s (Node's own default for a whole
 * request), time for 20 MiB at about 0.6 Mbit/s.
 */
export interface ReadDeadlines {
  /** Headers complete within this (Node's headersTimeout; a bare 408, the path is not known yet). */
  headersMs: number;
  /** No byte of the body for this long: 408. */
  bodyIdleMs: number;
  /** The body not complete after this long: 408. */
  bodyTotalMs: number;
}

export const DEFAULT_READ_DEADLINES: Readonly<ReadDeadlines> = Object.freeze({ headersMs: 30_000, bodyIdleMs: 30_000, bodyTotalMs: 300_000 });

function seconds(ms: number): string {
  return `${+(ms / 1000).toFixed(3)} s`;
}

/** The client closed the connection before its request or reply was complete. */
export class ClientGone extends Error {
  constructor() {
    super("the client disconnected");
    this.name = "ClientGone";
  }
}

function tooLarge(size: number | null, limit: number): ApiError {
  const what = size === null ? "over the" : `${size} bytes, over the`;
  return new ApiError("too_large", `the request body is ${what} ${limit}-byte limit (--max-body-mib); send smaller images`);
}

/** Requests whose refused body is still being discarded after their answer went out (drain). */
const lingering = new WeakSet<IncomingMessage>();

/**
 * Whether the answer to a refused request may close its connection. Not while its body is still
 * arriving past the drain's bound: closing a socket with unread bytes makes the OS send a reset,
 * which destroys the answer the client has not read yet (an SDK then reports "Connection error."
 * and retries). Such a connection is kept until the body has been discarded (drain).
 */
export function mayCloseAfterRefusal(req: IncomingMessage): boolean {
  return !lingering.has(req);
}

/**
 * Reads and discards the rest of a refused body, so the client, which may read nothing until it
 * has sent everything, gets the answer instead of a broken pipe. Resolves when the body has ended,
 * or when no byte of it came for bodyIdleMs (a stalled client gets its answer then; the answer
 * closes the connection). Past `cap` more bytes it resolves at once, so the answer goes out while
 * the body still arrives, and goes on discarding it (no memory held) with the connection kept
 * open (mayCloseAfterRefusal) until it ends; a body still not done after bodyTotalMs, or that
 * pauses for bodyIdleMs then, has its connection destroyed (its answer went out long before).
 */
function drain(req: IncomingMessage, cap: number, deadlines: ReadDeadlines): Promise<void> {
  return new Promise((resolve) => {
    if (req.complete || req.destroyed) {
      resolve();
      return;
    }
    let seen = 0;
    const stop = (): void => {
      clearTimeout(idle);
      clearTimeout(total);
      req.off("data", onData);
    };
    const done = (): void => {
      stop();
      resolve();
    };
    const cut = (): void => {
      stop();
      req.socket.destroy();
      resolve();
    };
    const onData = (chunk: Buffer): void => {
      seen += chunk.length;
      idle.refresh();
      if (seen > cap && !lingering.has(req)) {
        lingering.add(req);
        resolve(); // the answer goes out now; the rest of the body is still read and dropped
      }
    };
    // while lingering, a stall no longer answers (that happened) but ends the connection
    const idle = setTimeout(() => (lingering.has(req) ? cut() : done()), deadlines.bodyIdleMs);
    const total = setTimeout(cut, deadlines.bodyTotalMs);
    req.on("data", onData);
    req.once("end", done);
    req.once("close", done);
    req.once("error", done);
    req.resume();
  });
}

/** How much more of a refused body is read and discarded before the answer goes out anyway. */
function drainCap(maxBytes: number): number {
  return Math.max(maxBytes * 4, 64 << 20);
}

interface Scan {
  depth: number;
  /** The first bare NaN / Infinity / -Infinity outside strings, and the key it follows (if any). */
  nonFinite: { token: string; key: string | null } | null;
}

/** One pass over JSON text outside its strings: the deepest nesting (stopping early past
 * `maxDepth`) and the first non-JSON number token. Strings are skipped with indexOf. */
export function scanJson(text: string, maxDepth: number): Scan {
  let depth = 0;
  let deepest = 0;
  let lastString: [number, number] | null = null;
  let key: string | null = null;
  let nonFinite: Scan["nonFinite"] = null;
  const n = text.length;
  for (let i = 0; i < n; i++) {
    const c = text.charCodeAt(i);
    if (c === 0x22) { // "
      let j = i + 1;
      for (;;) {
        j = text.indexOf('"', j);
        if (j < 0) return { depth: deepest, nonFinite }; // unterminated: JSON.parse says so
        let backslashes = 0;
        for (let k = j - 1; k > i && text.charCodeAt(k) === 0x5c; k--) backslashes++;
        if (backslashes % 2 === 0) break;
        j++;
      }
      lastString = [i, j + 1];
      i = j;
    } else if (c === 0x3a) { // :
      if (lastString) {
        try {
          key = JSON.parse(text.slice(lastString[0], lastString[1])) as string;
        } catch {
          key = null;
        }
      }
    } else if (c === 0x5b || c === 0x7b) { // [ {
      depth++;
      if (depth > deepest) {
        deepest = depth;
        if (deepest > maxDepth) return { depth: deepest, nonFinite };
      }
    } else if (c === 0x5d || c === 0x7d) { // ] }
      depth--;
    } else if (nonFinite === null && (c === 0x4e || c === 0x49 || c === 0x2d)) { // N I -
      for (const token of ["NaN", "Infinity", "-Infinity"]) {
        if (text.startsWith(token, i)) {
          nonFinite = { token, key };
          break;
        }
      }
    }
  }
  return { depth: deepest, nonFinite };
}

/** The body's bytes → JSON, or the 400 that says what is wrong with it. */
export function parseJsonText(raw: Buffer, maxDepth = MAX_JSON_DEPTH): unknown {
  let text: string;
  try {
    text = new TextDecoder("utf-8", { fatal: true, ignoreBOM: false }).decode(raw);
  } catch {
    throw invalid("the request body is not UTF-8 JSON");
  }
  if (!text.trim()) throw invalid("the request body is empty; send a JSON object");
  const scan = scanJson(text, maxDepth);
  if (scan.depth > maxDepth) {
    throw invalid(`the request body nests JSON more than ${maxDepth} levels deep; this server accepts at most ${maxDepth}`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    if (scan.nonFinite) {
      const { token, key } = scan.nonFinite;
      const field = key !== null ? `'${key}' is ${token}` : `the body contains ${token}`;
      throw invalid(`the request body is not valid JSON: ${field}, which JSON does not allow; send a finite number (e.g. 0.7)`, key);
    }
    throw invalid(`the request body is not valid JSON (${(err as Error).message})`);
  }
}

/**
 * A body of a declared length read straight into one buffer of that length: raw-body collects
 * the chunks and concatenates them, two copies of the body at once. Errors carry raw-body's types
 * (readJsonBody maps them).
 */
function readKnownLength(req: IncomingMessage, length: number): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const out = Buffer.allocUnsafe(length);
    let got = 0;
    const fail = (type: string, message: string): void => {
      cleanup();
      reject(Object.assign(new Error(message), { type }));
    };
    const onData = (chunk: Buffer): void => {
      if (got + chunk.length > length) {
        fail("request.size.invalid", "request size did not match content length");
        return;
      }
      chunk.copy(out, got);
      got += chunk.length;
    };
    const onEnd = (): void => {
      if (got !== length) {
        fail("request.size.invalid", "request size did not match content length");
        return;
      }
      cleanup();
      resolve(out);
    };
    const onAborted = (): void => fail("request.aborted", "request aborted");
    const onError = (err: Error): void => fail(req.destroyed ? "request.aborted" : "stream.error", err.message);
    const onClose = (): void => {
      if (!req.complete) onAborted();
    };
    const cleanup = (): void => {
      req.off("data", onData);
      req.off("end", onEnd);
      req.off("aborted", onAborted);
      req.off("error", onError);
      req.off("close", onClose);
    };
    req.on("data", onData);
    req.once("end", onEnd);
    req.once("aborted", onAborted);
    req.once("error", onError);
    req.once("close", onClose);
  });
}

/**
 * `reading` (the body being read from `req`) under the deadlines: a 408 ApiError when no byte came
 * for bodyIdleMs or the body is not complete after bodyTotalMs. The read left behind ends when the
 * connection closes (the 408 goes out with Connection: close).
 */
function underDeadlines<T>(req: IncomingMessage, deadlines: ReadDeadlines, reading: Promise<T>): Promise<T> {
  return new Promise((resolve, reject) => {
    const expire = (message: string): void => {
      cleanup();
      reading.catch(() => undefined);
      reject(new ApiError("request_timeout", message));
    };
    const idle = setTimeout(() => expire(`the request body stopped arriving: no byte for ${seconds(deadlines.bodyIdleMs)}; ` +
      "send the whole body without pausing"), deadlines.bodyIdleMs);
    const total = setTimeout(() => expire(`the request body was not complete after ${seconds(deadlines.bodyTotalMs)}; ` +
      "send it faster, or send less (smaller images)"), deadlines.bodyTotalMs);
    const onData = (): void => {
      idle.refresh();
    };
    const cleanup = (): void => {
      clearTimeout(idle);
      clearTimeout(total);
      req.off("data", onData);
    };
    req.on("data", onData); // after the reader's own listener (attached when `reading` began): no chunk is lost
    reading.then((value) => {
      cleanup();
      resolve(value);
    }, (err: unknown) => {
      cleanup();
      reject(err);
    });
  });
}

/** Reads the request's JSON body under `maxBytes` and the deadlines. Throws ApiError (413, 408, 400) or ClientGone. */
export async function readJsonBody(req: IncomingMessage, maxBytes: number, deadlines: ReadDeadlines = DEFAULT_READ_DEADLINES): Promise<unknown> {
  const declared = req.headers["content-length"];
  const length = declared !== undefined && /^\d+$/.test(declared) ? Number(declared) : null;
  if (length !== null && length > maxBytes) {
    await drain(req, drainCap(maxBytes), deadlines);
    throw tooLarge(length, maxBytes);
  }
  let raw: Buffer;
  try {
    raw = await underDeadlines(req, deadlines, length !== null ? readKnownLength(req, length) : getRawBody(req, { limit: maxBytes }));
  } catch (err) {
    if (err instanceof ApiError) throw err;
    const type = (err as { type?: string }).type;
    if (type === "entity.too.large") {
      await drain(req, drainCap(maxBytes), deadlines);
      throw tooLarge(null, maxBytes);
    }
    if (type === "request.aborted" || req.destroyed) throw new ClientGone();
    if (type === "request.size.invalid") throw invalid("the request body is shorter or longer than its Content-Length");
    throw invalid(`cannot read the request body (${(err as Error).message})`);
  }
  return parseJsonText(raw);
}

/** Bodies from this size on are collected right after their answer (collectGarbage): the copies
 * of a large body (its bytes, the decoded text, the parsed strings) are garbage once its answer is
 * out, and the next bodies would otherwise stack on top of them: with 4 concurrent bodies at the
 * limit, peak RSS grew round by round to 2.7-3.8x slots x limit without it, and stayed at 1.9-2.1x
 * with it (docs/SERVER.md). One full collection of the server's JS heap per large body. */
const LARGE_BODY_BYTES = 1 << 20;

/** A fixed number of slots for requests that hold a body (planner.ts bodySlots). */
export class BodyGate {
  #held = 0;

  constructor(readonly capacity: number) {
    if (!Number.isSafeInteger(capacity) || capacity < 1) throw new RangeError(`body slots must be a positive integer, got ${capacity}`);
  }

  get held(): number {
    return this.#held;
  }

  tryAcquire(): boolean {
    if (this.#held >= this.capacity) return false;
    this.#held++;
    return true;
  }

  release(): void {
    if (this.#held > 0) this.#held--;
  }
}

/**
 * Answers `error` to a request refused before its body is read (no slot, still loading, a Host or
 * Origin the server refuses): the body is drained first (drain: until it ends or stalls), then
 * the error goes out in the path's API shape with Connection: close, and the request gets its log
 * line.
 */
export function refuseUnread(req: IncomingMessage, res: ServerResponse, error: ApiError, log: (line: string) => void,
  deadlines: ReadDeadlines): void {
  const path = (req.url ?? "/").split("?")[0]!;
  const started = performance.now();
  void drain(req, drainCap(0), deadlines).then(() => {
    if (res.writableEnded || res.destroyed) return;
    const body = JSON.stringify(errorBody(dialectOfPath(path), error));
    res.writeHead(error.status, {
      "content-type": "application/json; charset=utf-8", "content-length": String(Buffer.byteLength(body)),
      ...(mayCloseAfterRefusal(req) ? { connection: "close" } : {}), ...error.headers(),
    });
    res.end(body);
    log(`kvl serve: ${req.method} ${path} ${error.status} prompt=- reused=- images=- completion=- ` +
      `${((performance.now() - started) / 1000).toFixed(3)}s (${error.message})`);
  });
}

/**
 * Wraps the app's request listener: a POST (the only method whose routes read a body) first
 * passes `admit` (which throws the ApiError to answer instead, e.g. 503 while loading), then takes
 * a slot of `gate` (429 when none is free) that it keeps until its response closes. A refused
 * request's body is drained unread, answered in its path's dialect and logged.
 */
export function gateBodies(listener: RequestListener, gate: BodyGate, admit: () => void, log: (line: string) => void,
  deadlines: ReadDeadlines): RequestListener {
  return (req: IncomingMessage, res: ServerResponse) => {
    if (req.method !== "POST") {
      listener(req, res);
      return;
    }
    let refusal: ApiError | null = null;
    try {
      admit();
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      refusal = err;
    }
    if (!refusal && !gate.tryAcquire()) {
      refusal = new ApiError("rate_limit", `the server is busy: it already holds ${gate.capacity} requests (those waiting, ` +
        "the running one and those being read); retry shortly (see Retry-After)", null, RETRY_AFTER_S);
    }
    if (refusal) {
      refuseUnread(req, res, refusal, log, deadlines);
      return;
    }
    let released = false;
    const length = req.headers["content-length"];
    const declared = length === undefined ? Number.POSITIVE_INFINITY : Number(length); // chunked: size unknown
    res.once("close", () => {
      if (released) return;
      released = true;
      gate.release();
      if (!(declared < LARGE_BODY_BYTES)) collectGarbage();
    });
    listener(req, res);
  };
}
