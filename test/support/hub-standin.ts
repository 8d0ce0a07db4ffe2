/**
 * hub-standin.ts — a local stand-in for the Hugging Face hub's file endpoints, for the tests of
 * `kvl prepare` (the port of tests/hub_standin.py). Real HTTP on 127.0.0.1, random ports.
 *
 * Owns: serving one directory as repo `repoId` at one commit the way the hub answers
 * huggingface_hub: HEAD/GET `/{repo}/resolve/{revision}/{file}` with X-Repo-Commit, ETag,
 * Content-Length, Accept-Ranges and `Range: bytes=a-b` -> 206 + Content-Range; 404s with the
 * hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound); a gated repo (401 GatedRepo
 * without the right token). Small files answer directly with their git blob sha1 as ETag; LFS
 * files (*.safetensors, *.model) answer with a 302 to a second server, the "CDN", carrying
 * X-Linked-Etag (the sha256, the LFS oid) and X-Linked-Size — the CDN, like S3 with a signed URL,
 * refuses requests that carry an Authorization header. Fault injection on transfers that run to
 * the end of a file (downloads and resumed downloads, not bounded range reads): drop the
 * connection at a byte, answer 5xx, flip a byte, or hold the connection open at a byte; and CDN
 * links that expire (403) like signed URLs.
 * Every request is recorded.
 * Does not own: anything under packer/; nothing here is used outside the tests.
 */
import { createHash } from "node:crypto";
import { createReadStream, readFileSync, realpathSync, statSync } from "node:fs";
import * as http from "node:http";
import type { AddressInfo } from "node:net";
import { join, resolve, sep } from "node:path";

export interface RequestLog {
  readonly server: "hub" | "cdn";
  readonly method: string;
  readonly path: string;
  /** The file the request is about (on the CDN: the file whose oid it names). */
  readonly file: string | null;
  readonly range: string | null;
  readonly authorization: string | null;
  status: number;
}

export interface HubStandinOptions {
  /** The directory served as the repository's files. */
  root: string;
  repoId: string;
  /** The commit every served revision is (the pinned one: a synthesized checkpoint has none). */
  commit: string;
  /** Revision names that resolve to `commit` besides itself. Default ["main"]. */
  aliases?: string[];
  /** Files stored in LFS (served through the CDN redirect). Default: *.safetensors and *.model. */
  isLfs?: (file: string) => boolean;
  /** Gated: 401 GatedRepo unless the request carries `Authorization: Bearer <token>`. */
  requireToken?: string;
}

interface Fault {
  kind: "drop" | "status" | "corrupt" | "hold";
  file: string;
  /** drop / hold / corrupt: the absolute byte offset in the file. */
  at: number;
  status: number;
  times: number;
  onHeld?: () => void;
}

const RESOLVE = /^\/([^/]+\/[^/]+)\/resolve\/([^/]+)\/(.+)$/;
const CDN = /^\/lfs\/([0-9a-f]{64})$/;
const RANGE = /^bytes=(\d+)-(\d*)$/;

export class HubStandin {
  readonly requests: RequestLog[] = [];
  /** Called for every request as it arrives (before it is answered). */
  onRequest: ((entry: RequestLog) => void) | undefined;
  readonly #root: string;
  readonly #opts: HubStandinOptions;
  readonly #hub: http.Server;
  readonly #cdn: http.Server;
  readonly #sha256 = new Map<string, string>();
  readonly #faults: Fault[] = [];
  readonly #held = new Set<http.ServerResponse>();
  /** CDN links carry the generation they were signed in; older ones are refused as expired. */
  #linkGeneration = 0;

  private constructor(options: HubStandinOptions) {
    this.#opts = options;
    this.#root = realpathSync(options.root);
    this.#hub = http.createServer((req, res) => this.#serveHub(req, res));
    this.#cdn = http.createServer((req, res) => this.#serveCdn(req, res));
  }

  static async start(options: HubStandinOptions): Promise<HubStandin> {
    const hub = new HubStandin(options);
    await Promise.all([hub.#hub, hub.#cdn].map((s) => new Promise<void>((ok) => s.listen(0, "127.0.0.1", ok))));
    return hub;
  }

  get endpoint(): string {
    return `http://127.0.0.1:${(this.#hub.address() as AddressInfo).port}`;
  }

  get cdnOrigin(): string {
    return `http://127.0.0.1:${(this.#cdn.address() as AddressInfo).port}`;
  }

  async stop(): Promise<void> {
    for (const res of this.#held) res.destroy();
    this.#held.clear();
    await Promise.all([this.#hub, this.#cdn].map((s) => new Promise<void>((ok) => {
      s.close(() => ok());
      s.closeAllConnections();
    })));
  }

  // ---- faults --------------------------------------------------------------------------------

  /** The next `times` downloads of `file` that reach byte `at` are cut off there. */
  dropAt(file: string, at: number, times = 1): void {
    this.#faults.push({ kind: "drop", file, at, status: 0, times });
  }

  /** The next `times` downloads of `file` answer `status` instead. */
  failWith(file: string, status = 500, times = 1): void {
    this.#faults.push({ kind: "status", file, at: 0, status, times });
  }

  /** The next `times` downloads of `file` that carry byte `at` carry it with its bits flipped. */
  corruptAt(file: string, at: number, times = 1): void {
    this.#faults.push({ kind: "corrupt", file, at, status: 0, times });
  }

  /** The next download of `file` sends bytes up to `at`, then holds the connection open (until
   * stop) without sending more; the promise resolves once those bytes were written out. */
  holdAt(file: string, at: number): Promise<void> {
    return new Promise((resolve) => {
      this.#faults.push({ kind: "hold", file, at, status: 0, times: 1, onHeld: resolve });
    });
  }

  /** Every CDN link handed out so far expires (answers 403), like a signed URL past its time. */
  expireLinks(): void {
    this.#linkGeneration++;
  }

  clearFaults(): void {
    this.#faults.length = 0;
  }

  // ---- what was asked ------------------------------------------------------------------------

  /** GET requests for the bytes of `file` (hub answers and CDN transfers). */
  getsOf(file: string): RequestLog[] {
    return this.requests.filter((r) => r.method === "GET" && r.file === file);
  }

  /** Downloads of `file`: GETs of its data (CDN for LFS files, hub for the others; not the
   * redirects) that run to the end of the file, from the start or resumed; not bounded range
   * reads such as safetensors header reads. */
  transfersOf(file: string): RequestLog[] {
    const lfs = this.#isLfs(file);
    return this.getsOf(file).filter((r) => (lfs ? r.server === "cdn" : r.server === "hub") &&
      (r.range === null || /^bytes=\d+-$/.test(r.range)));
  }

  sha256Of(file: string): string {
    let hex = this.#sha256.get(file);
    if (hex === undefined) {
      hex = createHash("sha256").update(readFileSync(join(this.#root, file))).digest("hex");
      this.#sha256.set(file, hex);
    }
    return hex;
  }

  gitSha1Of(file: string): string {
    const data = readFileSync(join(this.#root, file));
    return createHash("sha1").update(`blob ${data.length}\0`).update(data).digest("hex");
  }

  // ---- serving -------------------------------------------------------------------------------

  #isLfs(file: string): boolean {
    return (this.#opts.isLfs ?? ((f) => /\.(safetensors|model)$/.test(f)))(file);
  }

  #log(server: RequestLog["server"], req: http.IncomingMessage, path: string, file: string | null): RequestLog {
    const entry: RequestLog = {
      server, method: req.method ?? "", path, file,
      range: req.headers.range ?? null, authorization: req.headers.authorization ?? null, status: 0,
    };
    this.requests.push(entry);
    this.onRequest?.(entry);
    return entry;
  }

  #error(res: http.ServerResponse, log: RequestLog, status: number, code: string, message: string, head: boolean): void {
    log.status = status;
    const data = Buffer.from(message);
    res.writeHead(status, {
      "X-Error-Code": code, "X-Error-Message": message,
      "Content-Type": "text/plain", "Content-Length": String(data.length),
    });
    res.end(head ? undefined : data);
  }

  #file(name: string): { path: string; size: number } | null {
    const path = resolve(this.#root, name);
    if (!path.startsWith(this.#root + sep)) return null;
    try {
      const st = statSync(path);
      return st.isFile() ? { path, size: st.size } : null;
    } catch {
      return null;
    }
  }

  #serveHub(req: http.IncomingMessage, res: http.ServerResponse): void {
    const path = new URL(req.url ?? "/", "http://x").pathname;
    const m = RESOLVE.exec(path);
    const file = m ? decodeURIComponent(m[3] as string) : null;
    const log = this.#log("hub", req, path, file);
    const head = req.method === "HEAD";
    if (req.method !== "GET" && !head) return this.#error(res, log, 405, "MethodNotAllowed", "GET or HEAD", head);
    if (this.#opts.requireToken !== undefined && req.headers.authorization !== `Bearer ${this.#opts.requireToken}`) {
      return this.#error(res, log, 401, "GatedRepo",
        `Access to model ${this.#opts.repoId} is restricted. You must have access to it and be authenticated to access it. Please log in.`, head);
    }
    if (!m || decodeURIComponent(m[1] as string) !== this.#opts.repoId) {
      return this.#error(res, log, 404, "RepoNotFound", "Repository not found", head);
    }
    const rev = decodeURIComponent(m[2] as string);
    if (rev !== this.#opts.commit && !(this.#opts.aliases ?? ["main"]).includes(rev)) {
      return this.#error(res, log, 404, "RevisionNotFound", `Invalid rev id: ${rev}`, head);
    }
    const found = this.#file(file as string);
    if (!found) return this.#error(res, log, 404, "EntryNotFound", `${file} does not exist at ${rev}`, head);
    if (this.#isLfs(file as string)) {
      const oid = this.sha256Of(file as string);
      const location = `${this.cdnOrigin}/lfs/${oid}?signature=${this.#linkGeneration}`;
      const body = Buffer.from(`Found. Redirecting to ${location}`);
      log.status = 302;
      res.writeHead(302, {
        Location: location,
        "X-Repo-Commit": this.#opts.commit,
        "X-Linked-Etag": `"${oid}"`,
        "X-Linked-Size": String(found.size),
        ETag: `"${oid}"`,
        "Content-Type": "text/plain; charset=utf-8",
        "Content-Length": String(body.length),
      });
      res.end(head ? undefined : body);
      return;
    }
    this.#serveBytes(req, res, log, file as string, found, {
      "X-Repo-Commit": this.#opts.commit,
      ETag: `"${this.gitSha1Of(file as string)}"`,
    });
  }

  #serveCdn(req: http.IncomingMessage, res: http.ServerResponse): void {
    const url = new URL(req.url ?? "/", "http://x");
    const path = url.pathname;
    const m = CDN.exec(path);
    const oid = m?.[1];
    let file: string | null = null;
    if (oid !== undefined) {
      for (const [name, hex] of this.#sha256) if (hex === oid) file = name;
    }
    const log = this.#log("cdn", req, path, file);
    const head = req.method === "HEAD";
    if (req.headers.authorization) {
      // S3 refuses a signed URL that also carries an Authorization header.
      return this.#error(res, log, 400, "InvalidArgument", "Only one auth mechanism allowed", head);
    }
    if (Number(url.searchParams.get("signature")) < this.#linkGeneration) {
      return this.#error(res, log, 403, "AccessDenied", "Request has expired", head);
    }
    const found = file === null ? null : this.#file(file);
    if (found === null || file === null) return this.#error(res, log, 404, "NoSuchKey", "The specified key does not exist.", head);
    this.#serveBytes(req, res, log, file, found, { ETag: `"${oid}"` });
  }

  #takeFault(file: string, start: number, end: number, kinds: Fault["kind"][]): Fault | null {
    const i = this.#faults.findIndex((f) => f.file === file && kinds.includes(f.kind) && f.times > 0 &&
      (f.kind === "status" || (f.at >= start && f.at <= end)));
    if (i < 0) return null;
    const fault = this.#faults[i] as Fault;
    fault.times--;
    if (fault.times === 0) this.#faults.splice(i, 1);
    return fault;
  }

  #serveBytes(req: http.IncomingMessage, res: http.ServerResponse, log: RequestLog, file: string,
    found: { path: string; size: number }, extra: Record<string, string>): void {
    const head = req.method === "HEAD";
    const { size } = found;
    let start = 0;
    let end = size - 1;
    let status = 200;
    const wanted = req.headers.range;
    if (wanted) {
      const rm = RANGE.exec(wanted.trim());
      if (!rm || Number(rm[1]) >= Math.max(size, 1)) {
        log.status = 416;
        res.writeHead(416, { "Content-Range": `bytes */${size}`, "Content-Length": "0" });
        res.end();
        return;
      }
      start = Number(rm[1]);
      end = rm[2] ? Math.min(Number(rm[2]), size - 1) : size - 1;
      status = 206;
    }
    // Faults act on transfers that run to the end of the file: downloads, not header reads.
    const toEnd = !head && end === size - 1;
    const statusFault = toEnd ? this.#takeFault(file, start, end, ["status"]) : null;
    if (statusFault) return this.#error(res, log, statusFault.status, "", "Internal Error (injected)", head);
    const cut = toEnd ? this.#takeFault(file, start, end, ["drop", "hold"]) : null;
    const corrupt = toEnd ? this.#takeFault(file, start, end, ["corrupt"]) : null;
    const length = Math.max(end - start + 1, 0);
    log.status = status;
    res.writeHead(status, {
      ...extra,
      "Accept-Ranges": "bytes",
      "Content-Length": String(length),
      "Content-Type": "application/octet-stream",
      ...(status === 206 ? { "Content-Range": `bytes ${start}-${end}/${size}` } : {}),
    });
    if (head || length === 0) {
      res.end();
      return;
    }
    const stop = cut ? cut.at : end + 1; // exclusive
    const stream = createReadStream(found.path, { start, end: stop - 1, highWaterMark: 64 << 10 });
    let pos = start;
    stream.on("data", (raw) => {
      let chunk = raw as Buffer;
      if (corrupt && corrupt.at >= pos && corrupt.at < pos + chunk.length) {
        chunk = Buffer.from(chunk);
        chunk[corrupt.at - pos] = (chunk[corrupt.at - pos] as number) ^ 0xff;
      }
      pos += chunk.length;
      if (!res.write(chunk)) {
        stream.pause();
        res.once("drain", () => stream.resume());
      }
    });
    stream.on("error", () => res.destroy());
    stream.on("end", () => {
      if (cut === null) {
        res.end();
      } else if (cut.kind === "drop") {
        // Drop the connection mid-body, as a flaky network would (after the bytes went out).
        const socket = res.socket;
        if (socket) socket.end(() => socket.destroy());
        else res.destroy();
      } else {
        this.#held.add(res);
        const socket = res.socket;
        const held = cut.onHeld ?? (() => {});
        // Resolve once the bytes left this process (the kernel has them).
        if (socket && socket.writableLength > 0) socket.once("drain", held);
        else held();
      }
    });
  }
}
