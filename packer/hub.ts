/**
 * hub.ts — the few Hugging Face hub calls `kvl prepare` needs, over plain node:http / node:https.
 *
 * Owns: the endpoint (HF_ENDPOINT, read at call time) and the access token (HF_TOKEN, or the file
 * huggingface_hub's `hf auth login` writes), resolve URLs, the probe and its error messages
 * (unreachable, gated or missing repo, unknown revision, missing file), file metadata from a HEAD
 * that stops at the LFS CDN redirect (size, checksum, commit — as huggingface_hub reads them),
 * bounded Range reads (safetensors headers), and downloads into `NAME.part` that resume with a
 * Range request after an interruption and take their final name only once their checksum matches
 * the hub's (sha256 = the LFS oid in X-Linked-Etag; git blob sha1 = the ETag of a small file).
 * Does not own: which files are fetched and when (prepare.ts), packing.
 *
 * The transport is node:http rather than fetch: connect and idle timeouts, a body cut off
 * mid-transfer and exactly-what-arrived writes are all plain to express here.
 */
import { createHash } from "node:crypto";
import { createReadStream, readFileSync } from "node:fs";
import { mkdir, open, rename, rm, stat } from "node:fs/promises";
import * as http from "node:http";
import * as https from "node:https";
import { homedir } from "node:os";
import { dirname, join } from "node:path";

import { UserError } from "../host/system/user-error.js";
import { type Progress, silentProgress } from "./progress.js";
import { MAX_HEADER_BYTES } from "./safetensors.js";

/** The checkpoint kvl was verified against: what `kvl prepare` downloads unless told otherwise. */
export const PINNED_REPO = "moonshotai/Kimi-VL-A3B-Instruct";
export const PINNED_REVISION = "398eede0903cd983a2bfa0cc634e9ac1d843f375";

const DEFAULT_ENDPOINT = "https://huggingface.co";
const CONNECT_TIMEOUT_MS = 5_000;
const READ_TIMEOUT_MS = 30_000;
/** Consecutive failed attempts (no byte gained) before a download gives up. */
const DOWNLOAD_ATTEMPTS = 4;
const PART_SUFFIX = ".part";

const HEX40 = /^[0-9a-f]{40}$/;
const HEX64 = /^[0-9a-f]{64}$/;
const REDIRECTS = new Set([301, 302, 303, 307, 308]);
const MAX_REDIRECTS = 10;

/** A failure the user can act on (the CLI prints its message alone, without a stack). */
export class HubError extends UserError {
  constructor(message: string) {
    super(message);
    this.name = "HubError";
  }
}

/** No HTTP answer at all (refused, DNS, TLS, timeout, connection dropped): worth retrying. */
class TransportError extends Error {
  override name = "TransportError";
  constructor(message: string, readonly code: string) {
    super(message);
  }
}

/** An HTTP answer that may be different next time (5xx, 429). */
class TransientStatus extends Error {
  override name = "TransientStatus";
}

/** The hub endpoint (HF_ENDPOINT, else huggingface.co), read at each call, not at import. */
export function hubEndpoint(env: NodeJS.ProcessEnv = process.env): string {
  return (env.HF_ENDPOINT || DEFAULT_ENDPOINT).replace(/\/+$/, "");
}

/** The access token as huggingface_hub finds it: HF_TOKEN, then the token file. */
export function hubToken(env: NodeJS.ProcessEnv = process.env): string | null {
  const fromEnv = env.HF_TOKEN || env.HUGGING_FACE_HUB_TOKEN;
  if (fromEnv) return fromEnv.trim();
  const home = env.HF_HOME || join(env.XDG_CACHE_HOME || join(homedir(), ".cache"), "huggingface");
  const file = env.HF_TOKEN_PATH || join(home, "token");
  let text: string;
  try {
    text = readFileSync(file, "utf8").trim();
  } catch {
    return null;
  }
  return text || null;
}

interface Checksum {
  /** sha256 of the bytes (an LFS file), or git's blob sha1 (`blob SIZE\0` + bytes). */
  readonly algorithm: "sha256" | "git-sha1";
  readonly hex: string;
}

interface FileMeta {
  /** Exact byte size, when the hub said it (X-Linked-Size, or Content-Length of a 200). */
  readonly size: number | null;
  readonly checksum: Checksum | null;
  readonly commit: string | null;
  /** Where the bytes are: the CDN location of an LFS file, else the resolve URL. */
  readonly url: string;
}

interface HubOptions {
  /** Bearer token sent to the hub's own origin only (never to a CDN it redirects to). */
  token?: string | null;
  /** One line per notable event (resumes, retries, warnings), without a trailing newline. */
  log?: (line: string) => void;
  connectTimeoutMs?: number;
  readTimeoutMs?: number;
  /** Base of the back-off between failed attempts (doubles, at most 8 s). */
  retryDelayMs?: number;
  attempts?: number;
}

interface DownloadOptions {
  progress?: Progress;
  /** Label of the progress bar; default `downloading NAME`. */
  label?: string;
}

interface SafetensorsHeader {
  /** The 8-byte length prefix's value. */
  readonly length: number;
  readonly header: Record<string, unknown>;
}

function normalizeEtag(value: string | undefined): string | null {
  if (!value) return null;
  return value.trim().replace(/^W\//, "").replace(/^"|"$/g, "").toLowerCase();
}

function headerOf(res: http.IncomingMessage, name: string): string | undefined {
  const v = res.headers[name.toLowerCase()];
  return Array.isArray(v) ? v[0] : v;
}

function parseSize(value: string | undefined): number | null {
  if (value === undefined || !/^\d+$/.test(value.trim())) return null;
  const n = Number(value.trim());
  return Number.isSafeInteger(n) ? n : null;
}

/** `bytes a-b/total` of a 206 answer. */
function parseContentRange(value: string | undefined): { start: number; end: number; total: number | null } | null {
  const m = /^bytes (\d+)-(\d+)\/(\d+|\*)$/.exec((value ?? "").trim());
  if (!m) return null;
  return { start: Number(m[1]), end: Number(m[2]), total: m[3] === "*" ? null : Number(m[3]) };
}

function describe(err: unknown): string {
  if (err instanceof Error) {
    const code = (err as NodeJS.ErrnoException).code;
    return code && !err.message.includes(code) ? `${code}: ${err.message}` : err.message;
  }
  return String(err);
}

async function sizeOf(path: string): Promise<number | null> {
  try {
    return (await stat(path)).size;
  } catch {
    return null;
  }
}

/** The checksum of a file on disk, in the algorithm the hub gave. */
export async function fileChecksum(path: string, algorithm: Checksum["algorithm"]): Promise<string> {
  const hash = createHash(algorithm === "sha256" ? "sha256" : "sha1");
  if (algorithm === "git-sha1") hash.update(`blob ${(await stat(path)).size}\0`);
  for await (const chunk of createReadStream(path, { highWaterMark: 4 << 20 })) hash.update(chunk as Buffer);
  return hash.digest("hex");
}

async function syncDir(dir: string): Promise<void> {
  try {
    const fh = await open(dir, "r");
    try {
      await fh.sync();
    } finally {
      await fh.close();
    }
  } catch {
    // Directories cannot be opened for fsync on every platform (Windows); the rename still holds.
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** The hub calls prepare needs, all against one endpoint, repo and revision. */
export class Hub {
  /** The commit the revision resolved to (set by probe); every later URL uses it. */
  commit: string | null = null;
  readonly #token: string | null;
  readonly #log: (line: string) => void;
  readonly #connectMs: number;
  readonly #readMs: number;
  readonly #retryMs: number;
  readonly #attempts: number;
  readonly #origin: string;

  constructor(readonly repo: string, readonly revision: string, readonly base: string, options: HubOptions = {}) {
    this.#token = options.token === undefined ? hubToken() : options.token;
    this.#log = options.log ?? (() => {});
    this.#connectMs = options.connectTimeoutMs ?? CONNECT_TIMEOUT_MS;
    this.#readMs = options.readTimeoutMs ?? READ_TIMEOUT_MS;
    this.#retryMs = options.retryDelayMs ?? 1000;
    this.#attempts = options.attempts ?? DOWNLOAD_ATTEMPTS;
    this.#origin = new URL(base).origin;
  }

  /** huggingface_hub's hf_hub_url for a model repo. */
  url(filename: string): string {
    const rev = encodeURIComponent(this.commit ?? this.revision);
    const file = filename.split("/").map(encodeURIComponent).join("/");
    return `${this.base}/${this.repo}/resolve/${rev}/${file}`;
  }

  #unreachable(err: unknown): HubError {
    return new HubError(`cannot reach ${this.base} (HF_ENDPOINT): ${describe(err)}; check your connection or set HF_ENDPOINT`);
  }

  /** One request, no redirects followed. Rejects with TransportError when nothing answered. */
  #send(method: string, url: URL, headers: Record<string, string>): Promise<http.IncomingMessage> {
    const mod = url.protocol === "https:" ? https : url.protocol === "http:" ? http : null;
    if (mod === null) return Promise.reject(new HubError(`${url.href}: only http and https URLs are supported`));
    return new Promise((resolve, reject) => {
      let settled = false;
      let response: http.IncomingMessage | undefined;
      const req = mod.request(url, { method, headers, agent: false }, (res) => {
        settled = true;
        response = res;
        clearTimeout(connectTimer);
        resolve(res);
      });
      const fail = (err: Error): void => {
        clearTimeout(connectTimer);
        if (settled) return; // after the answer, the body stream reports it
        settled = true;
        const code = (err as NodeJS.ErrnoException).code ?? err.name;
        reject(err instanceof TransportError ? err : new TransportError(err.message, code));
      };
      const connectTimer = setTimeout(() => {
        req.destroy(new TransportError(`no connection within ${this.#connectMs / 1000} s`, "ETIMEDOUT"));
      }, this.#connectMs);
      req.on("socket", (socket) => {
        socket.once("connect", () => clearTimeout(connectTimer));
      });
      // Idle timeout of the socket: also covers a stalled body (the stream then errors).
      req.setTimeout(this.#readMs, () => {
        const err = new TransportError(`no data for ${this.#readMs / 1000} s`, "ETIMEDOUT");
        response?.destroy(err); // the body's reader sees this error, not a bare "aborted"
        req.destroy(err);
      });
      req.on("error", fail);
      req.end();
    });
  }

  /** A request following redirects: all of them (data), or only relative ones (metadata: the
   * answer to a resolve URL of an LFS file is the hub's redirect to its CDN, which carries the
   * checksum and size). The token goes to the hub's origin only. */
  async #request(method: string, url: string, extra: Record<string, string>, follow: "all" | "relative"): Promise<{ res: http.IncomingMessage; url: URL }> {
    let current = new URL(url);
    for (let hops = 0; ; hops++) {
      const headers: Record<string, string> = {
        "user-agent": `kvl; node/${process.versions.node}`,
        "accept-encoding": "identity",
        ...extra,
      };
      if (this.#token && current.origin === this.#origin) headers.authorization = `Bearer ${this.#token}`;
      const res = await this.#send(method, current, headers);
      const location = headerOf(res, "location");
      if (REDIRECTS.has(res.statusCode ?? 0) && location) {
        const relative = location.startsWith("/") && !location.startsWith("//");
        if (follow === "all" || relative) {
          res.resume();
          if (hops >= MAX_REDIRECTS) throw new HubError(`${url}: more than ${MAX_REDIRECTS} redirects`);
          current = new URL(location, current);
          continue;
        }
      }
      return { res, url: current };
    }
  }

  /** Throws the matching error for an answer that is neither 2xx nor a redirect. */
  #check(res: http.IncomingMessage, filename: string): void {
    const status = res.statusCode ?? 0;
    if ((status >= 200 && status < 300) || REDIRECTS.has(status)) return;
    res.resume();
    const code = headerOf(res, "x-error-code") ?? "";
    if (code === "RevisionNotFound") {
      throw new HubError(`revision ${this.revision} of ${this.repo} does not exist on ${this.base}; use --revision ${PINNED_REVISION}`);
    }
    if (code === "RepoNotFound" || code === "GatedRepo" || status === 401 || status === 403) {
      const gated = code === "GatedRepo" ? "; the repository is gated: accept its terms on the hub and set HF_TOKEN" : "";
      throw new HubError(`${this.repo} is not accessible on ${this.base} (HTTP ${status}${code ? `, ${code}` : ""}); ` +
        `check HF_ENDPOINT and your access token (HF_TOKEN)${gated}`);
    }
    if (status === 404) {
      throw new HubError(`${filename} is missing from ${this.repo} at ${this.revision} on ${this.base}`);
    }
    if (status >= 500 || status === 429) {
      throw new TransientStatus(`${this.base} answered HTTP ${status} for ${filename}; try again later`);
    }
    throw new HubError(`${this.base} answered HTTP ${status} for ${filename}; try again later`);
  }

  /** HEAD without following the CDN redirect: size, checksum and commit of one file. */
  async metadata(filename: string): Promise<FileMeta> {
    const { res, url } = await this.#request("HEAD", this.url(filename), {}, "relative");
    res.resume();
    this.#check(res, filename);
    const status = res.statusCode ?? 0;
    const etag = normalizeEtag(headerOf(res, "x-linked-etag")) ?? normalizeEtag(headerOf(res, "etag"));
    const checksum: Checksum | null = etag && HEX64.test(etag) ? { algorithm: "sha256", hex: etag }
      : etag && HEX40.test(etag) ? { algorithm: "git-sha1", hex: etag } : null;
    const size = parseSize(headerOf(res, "x-linked-size")) ?? (status === 200 ? parseSize(headerOf(res, "content-length")) : null);
    const commit = headerOf(res, "x-repo-commit")?.trim().toLowerCase() ?? null;
    const location = headerOf(res, "location");
    const dataUrl = REDIRECTS.has(status) && location ? new URL(location, url).href : url.href;
    return { size, checksum, commit: commit && HEX40.test(commit) ? commit : null, url: dataUrl };
  }

  /** HEAD config.json: proves the endpoint answers and learns the commit of the revision. */
  async probe(): Promise<string> {
    let meta: FileMeta;
    try {
      meta = await this.metadata("config.json");
    } catch (err) {
      if (err instanceof TransportError) throw this.#unreachable(err);
      if (err instanceof TransientStatus) throw new HubError(err.message);
      throw err;
    }
    const commit = meta.commit ?? (HEX40.test(this.revision) ? this.revision : null);
    if (commit === null) {
      throw new HubError(`${this.base} did not say which commit ${this.revision} is; pass a full 40-hex --revision`);
    }
    this.commit = commit;
    return commit;
  }

  /** Whether the file exists at the revision (a 404 EntryNotFound is "no"; other failures throw). */
  async exists(filename: string): Promise<boolean> {
    return this.#retrying(filename, async () => {
      const { res } = await this.#request("HEAD", this.url(filename), {}, "relative");
      res.resume();
      if (res.statusCode === 404 && headerOf(res, "x-error-code") === "EntryNotFound") return false;
      this.#check(res, filename);
      return true;
    });
  }

  /** A few tries of a small call: transport failures and 5xx are retried after a pause. */
  async #retrying<T>(filename: string, call: () => Promise<T>): Promise<T> {
    let last: unknown;
    for (let attempt = 1; attempt <= this.#attempts; attempt++) {
      try {
        return await call();
      } catch (err) {
        if (!(err instanceof TransportError || err instanceof TransientStatus)) throw err;
        last = err;
        if (attempt < this.#attempts) {
          this.#log(`${filename}: ${describe(err)}; retrying (attempt ${attempt + 1}/${this.#attempts})`);
          await sleep(Math.min(this.#retryMs * 2 ** (attempt - 1), 8000));
        }
      }
    }
    if (last instanceof TransportError) throw this.#unreachable(last);
    throw new HubError(describe(last));
  }

  /** Bytes [start, start + length) of a file, by a Range request. */
  async range(filename: string, start: number, length: number): Promise<Buffer> {
    return this.#retrying(filename, async () => {
      const { res } = await this.#request("GET", this.url(filename), { range: `bytes=${start}-${start + length - 1}` }, "all");
      this.#check(res, filename);
      const status = res.statusCode ?? 0;
      // A 200 means the server ignored the Range: skip to `start`, stop reading at the end.
      let skip = status === 200 ? start : 0;
      if (status === 206) {
        const cr = parseContentRange(headerOf(res, "content-range"));
        if (cr && cr.start !== start) {
          res.destroy();
          throw new HubError(`${filename}: asked for bytes from ${start}, the server sent from ${cr.start}`);
        }
      }
      const out = Buffer.alloc(length);
      let got = 0;
      try {
        for await (const raw of res) {
          let chunk = raw as Buffer;
          if (skip > 0) {
            const n = Math.min(skip, chunk.length);
            skip -= n;
            chunk = chunk.subarray(n);
          }
          const n = Math.min(chunk.length, length - got);
          chunk.copy(out, got, 0, n);
          got += n;
          if (got === length) break; // leaving the loop destroys the rest of the stream
        }
      } catch (err) {
        throw new TransportError(describe(err), (err as NodeJS.ErrnoException).code ?? "EPIPE");
      }
      if (got !== length) {
        throw new HubError(`${filename}: expected ${length} bytes at offset ${start}, got ${got}; ` +
          "the file on the hub is truncated or the transfer failed — try again");
      }
      return out;
    });
  }

  /** The JSON header of a safetensors file on the hub, read with two Range requests. */
  async safetensorsHeader(filename: string): Promise<SafetensorsHeader> {
    const prefix = await this.range(filename, 0, 8);
    const n = prefix.readBigUInt64LE(0);
    if (n === 0n || n > BigInt(MAX_HEADER_BYTES)) {
      throw new HubError(`${filename}: header length ${n} is implausible; the file is not safetensors`);
    }
    const length = Number(n);
    const text = (await this.range(filename, 8, length)).toString("utf8");
    let header: unknown;
    try {
      header = JSON.parse(text);
    } catch (err) {
      throw new HubError(`${filename}: unreadable safetensors header (${describe(err)})`);
    }
    if (typeof header !== "object" || header === null || Array.isArray(header)) {
      throw new HubError(`${filename}: unreadable safetensors header (not a JSON object)`);
    }
    return { length, header: header as Record<string, unknown> };
  }

  /**
   * Downloads one file into `dir` (as `dir/NAME`, written as `dir/NAME.part` first) and returns
   * its path. A `.part` left by an interrupted transfer or a killed process is resumed with a
   * Range request; the file takes its final name only once its checksum matches the hub's. A
   * mismatch discards the bytes and downloads the file once more from the start; a second
   * mismatch is refused.
   */
  async download(filename: string, dir: string, options: DownloadOptions = {}): Promise<string> {
    const progress = options.progress ?? silentProgress;
    const label = options.label ?? `downloading ${filename}`;
    const final = join(dir, filename);
    const part = final + PART_SUFFIX;
    await mkdir(dirname(final), { recursive: true });

    let meta: FileMeta | null = null;
    let failures = 0; // consecutive attempts that gained no byte
    let attempts = 0;
    let mismatches = 0;
    let warnedNoChecksum = false;
    let last: unknown = null;
    for (;;) {
      if (failures >= this.#attempts || attempts >= 100 * this.#attempts) {
        throw new HubError(`downloading ${filename} failed ${failures} times in a row (${describe(last)}); ` +
          "rerun kvl prepare to resume where it stopped");
      }
      if (failures > 1) await sleep(Math.min(this.#retryMs * 2 ** (failures - 2), 8000));
      attempts++;
      const written = { bytes: 0 };
      try {
        // Asked afresh every attempt, like huggingface_hub: the CDN location of an LFS file is a
        // signed URL that expires, so a transfer resumed later needs a new one.
        const fresh = await this.metadata(filename);
        if (meta !== null && (fresh.size !== meta.size || fresh.checksum?.hex !== meta.checksum?.hex)) {
          this.#log(`${filename} changed on the hub while downloading; starting it again`);
          await rm(part, { force: true });
        }
        meta = fresh;
        if (this.commit && meta.commit && meta.commit !== this.commit) {
          throw new HubError(`${filename}: the hub answered from commit ${meta.commit}, not ${this.commit}; ` +
            "the revision moved while downloading — rerun kvl prepare");
        }
        if (meta.checksum === null && !warnedNoChecksum) {
          warnedNoChecksum = true;
          this.#log(`warning: ${this.base} gave no checksum for ${filename}; only its size is checked`);
        }
        // A finished file from an earlier run: reuse it if it still matches the hub.
        const finished = await sizeOf(final);
        if (finished !== null) {
          if ((meta.size === null || finished === meta.size) && (await this.#actual(final, meta)) === meta.checksum?.hex) return final;
          this.#log(`${filename}: the file already in ${dir} does not match the hub; downloading it again`);
          await rm(final, { force: true });
        }
        let have = (await sizeOf(part)) ?? 0;
        if (meta.size !== null && have > meta.size) {
          await rm(part, { force: true });
          have = 0;
        }
        if (meta.size === null || have < meta.size) {
          await this.#transfer(filename, meta, part, have, progress, label, written);
          have = (await sizeOf(part)) ?? 0;
          if (meta.size === null) meta = { ...meta, size: have };
        }
        if (have !== meta.size) {
          throw new TransportError(`the transfer ended after ${have} of ${meta.size} bytes`, "ESHORT");
        }
        const actual = await this.#actual(part, meta);
        if (actual === meta.checksum?.hex) {
          const fh = await open(part, "r+");
          try {
            await fh.sync();
          } finally {
            await fh.close();
          }
          await rename(part, final);
          await syncDir(dirname(final));
          return final;
        }
        // Corrupt bytes: they may come from a resumed .part of another version of the file or
        // from the transfer; either way they are discarded, and the file is fetched once more.
        const expected = meta.checksum as Checksum;
        await rm(part, { force: true });
        mismatches++;
        const what = `${filename}: checksum mismatch: the downloaded bytes have ${expected.algorithm} ${actual}, but the hub says ${expected.hex}`;
        if (mismatches >= 2) {
          throw new HubError(`${what} (twice; the second time downloaded from the start): the hub's copy or the ` +
            "connection corrupts data, so kvl refuses to pack it. Nothing was packed from this file and the work " +
            "done so far is kept: rerun kvl prepare to resume from here");
        }
        this.#log(`${what}; discarded, downloading it again from the start`);
        failures = 0;
      } catch (err) {
        if (!(err instanceof TransportError || err instanceof TransientStatus)) throw err;
        last = err;
        failures = written.bytes > 0 ? 1 : failures + 1;
        if (failures < this.#attempts) {
          const have = (await sizeOf(part)) ?? 0;
          this.#log(`transfer of ${filename} interrupted (${describe(err)}); ` +
            `${have > 0 ? `resuming from byte ${have}` : "retrying"} (attempt ${failures + 1}/${this.#attempts})`);
        }
      }
    }
  }

  /** The file's checksum in the hub's algorithm (undefined when the hub gave none). */
  async #actual(path: string, meta: FileMeta): Promise<string | undefined> {
    return meta.checksum === null ? undefined : fileChecksum(path, meta.checksum.algorithm);
  }

  /** One GET from byte `have` on, appended to `part`, counting into `written`. Every byte that
   * arrived is on disk when this returns or throws, so the next attempt resumes exactly there. */
  async #transfer(filename: string, meta: FileMeta, part: string, have: number, progress: Progress, label: string,
    written: { bytes: number }): Promise<void> {
    const { res } = await this.#request("GET", meta.url, have > 0 ? { range: `bytes=${have}-` } : {}, "all");
    const status = res.statusCode ?? 0;
    if (status === 416) {
      // Nothing after `have`: the .part is complete (or longer than the file: start over).
      res.resume();
      if (meta.size === null || have !== meta.size) await rm(part, { force: true });
      return;
    }
    const status4xx = status >= 400 && status < 500;
    if (status4xx && new URL(meta.url).origin !== this.#origin) {
      // The CDN refused its signed URL (expired, most likely): the next attempt asks the hub again.
      res.resume();
      throw new TransientStatus(`the download location of ${filename} answered HTTP ${status}`);
    }
    this.#check(res, filename);
    let start = have;
    if (status === 206) {
      const cr = parseContentRange(headerOf(res, "content-range"));
      if (!cr || cr.start !== have || (meta.size !== null && cr.total !== null && cr.total !== meta.size)) {
        res.destroy();
        await rm(part, { force: true });
        throw new TransportError(`unexpected Content-Range ${headerOf(res, "content-range") ?? "(none)"} for bytes ${have}-`, "ERANGE");
      }
    } else if (status === 200) {
      if (have > 0) this.#log(`${filename}: the server ignored the Range request; downloading from the start`);
      start = 0;
    } else {
      res.destroy();
      throw new TransientStatus(`${filename}: unexpected HTTP ${status} for a download`);
    }
    const size = meta.size ?? (status === 200 ? parseSize(headerOf(res, "content-length")) : parseContentRange(headerOf(res, "content-range"))?.total ?? null);
    const fh = await open(part, start === 0 ? "w" : "a");
    let done = start;
    progress.start(label, size ?? 0, start);
    try {
      for await (const raw of res) {
        let chunk = raw as Buffer;
        if (size !== null && done + chunk.length > size) chunk = chunk.subarray(0, Math.max(0, size - done));
        if (chunk.length === 0) continue;
        try {
          await fh.write(chunk);
        } catch (err) {
          throw new UserError(`cannot write ${part}: ${describe(err)}; free some disk space or choose another destination, ` +
            "then rerun kvl prepare to resume");
        }
        done += chunk.length;
        written.bytes += chunk.length;
        progress.add(chunk.length);
      }
    } catch (err) {
      if (err instanceof UserError) throw err;
      throw new TransportError(describe(err), (err as NodeJS.ErrnoException).code ?? "ECONNRESET");
    } finally {
      progress.stop();
      await fh.close();
    }
  }
}
