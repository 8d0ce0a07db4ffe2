/**
 * guard.ts — what web pages may do with the server: the Host and Origin rules that keep a page on
 * any site from driving a local server (a cross-site POST, or DNS rebinding to read the answers),
 * and CORS for the origins the user lists. Ollama closed the same two holes with a Host check and
 * an Origin allow-list (OLLAMA_ORIGINS); these rules are stricter (docs/SERVER.md "Web pages").
 *
 * Owns: the Host rule (the Host header must be `localhost`, a loopback address, the address the
 * connection arrived at, the name given to --host, or a name listed with --allow-host; a page that
 * rebinds its own name to this machine still sends its own name), the Origin rule (a request that
 * carries an Origin passes only when it is the server's own page — same host and port, http or
 * https — or listed with --allow-origin; clients that send no Origin, which every non-browser
 * client is, pass), CORS for listed origins (preflights answered 204 with the allowed methods and
 * headers, every answer carrying Access-Control-Allow-Origin), the checks of the two lists'
 * entries, and guardRequests, which runs both rules first: before the API key, the body slot and
 * the body. Content types are not checked: a browser sends an Origin with every POST, so the Origin
 * rule already stops a page's form or no-cors request, and curl's `-d` (form content type) or a
 * fetch without a content type keep working.
 * Does not own: the API key (auth.ts), the error shapes (errors.ts), answering a refused request
 * (body.ts refuseUnread).
 */
import type { IncomingMessage, RequestListener, ServerResponse } from "node:http";
import { BlockList, isIP } from "node:net";

import { UserError } from "../host/system/user-error.js";
import { type ReadDeadlines, refuseUnread } from "./body.js";
import { ApiError } from "./errors.js";

interface GuardOptions {
  /** --host as given: when it is a name (e.g. localhost, box.lan) that name is an allowed Host. */
  bindHost: string;
  /** --allow-host: more Host names (no port); "*" allows any Host. */
  allowHosts: readonly string[];
  /** --allow-origin: origins (scheme://host[:port]) whose pages may use the API; "*" inside one matches any characters. */
  allowOrigins: readonly string[];
}

const LOOPBACK = new BlockList();
LOOPBACK.addSubnet("127.0.0.0", 8, "ipv4");
LOOPBACK.addAddress("::1", "ipv6"); // IPv4-mapped forms (::ffff:127.0.0.1) match the IPv4 rule

/** The methods the routes answer, for preflights. */
const METHODS = "GET, POST, OPTIONS";
/** How long a browser may keep a preflight's answer. */
const PREFLIGHT_MAX_AGE_S = 600;

function ipFamily(address: string): "ipv4" | "ipv6" | null {
  const v = isIP(address);
  return v === 4 ? "ipv4" : v === 6 ? "ipv6" : null;
}

/** The name (lowercase, IPv6 without brackets) of a Host header `name[:port]` / `[v6][:port]`; null when malformed. */
function hostName(header: string): string | null {
  const m = /^(\[[0-9a-f:.]+\]|[^\s:/?#@[\]\\]+)(?::\d{1,5})?$/i.exec(header);
  if (!m) return null;
  const name = m[1]!.toLowerCase();
  return name.startsWith("[") ? name.slice(1, -1) : name;
}

/** A Host name as --allow-host takes it: a DNS name or an IP address, no scheme, port or path. */
function checkHostEntry(entry: string): string {
  const raw = entry.trim().toLowerCase();
  if (raw === "*") return raw;
  const name = raw.replace(/^\[(.*)\]$/, "$1");
  if (ipFamily(name) === null && !/^[a-z0-9_-]+(\.[a-z0-9_-]+)*$/.test(name)) {
    throw new UserError(`--allow-host '${entry}' is not a host name; give the name alone, without scheme or port (e.g. --allow-host box.lan)`);
  }
  return name;
}

/** An origin pattern as --allow-origin takes it: "*", "null", or scheme://host[:port] where "*" matches any characters. */
function checkOriginEntry(entry: string): RegExp {
  const origin = entry.trim().toLowerCase();
  const shape = /^[a-z*][a-z0-9+.*-]*:\/\/[^/\s?#]+$/;
  if (origin !== "*" && origin !== "null" && !shape.test(origin)) {
    const trimmed = origin.replace(/^([a-z][a-z0-9+.-]*:\/\/[^/\s?#]+)[/?#].*$/, "$1");
    const hint = trimmed !== origin && shape.test(trimmed) ? `: an origin has no path, write ${trimmed}`
      : ": write it as the page's address without a path, scheme://host[:port] (e.g. http://localhost:3000)";
    throw new UserError(`--allow-origin '${entry}' is not an origin${hint}`);
  }
  return new RegExp(`^${origin.split("*").map((part) => part.replace(/[.+?^${}()|[\]\\]/g, "\\$&")).join(".*")}$`);
}

/** How one request stands with the Origin rule. */
type OriginVerdict = { kind: "none" } | { kind: "same" } | { kind: "listed"; origin: string } | { kind: "refused"; origin: string };

export class AccessRules {
  readonly #names: Set<string>;
  readonly #anyHost: boolean;
  readonly #origins: RegExp[];
  /** The --allow-origin entries as given, for the startup line. */
  readonly listedOrigins: readonly string[];

  /** @throws UserError for a malformed --allow-host or --allow-origin entry */
  constructor(options: GuardOptions) {
    const hosts = options.allowHosts.map(checkHostEntry);
    this.#anyHost = hosts.includes("*");
    this.#names = new Set(["localhost", ...hosts]);
    const bound = options.bindHost.trim().toLowerCase();
    if (bound && ipFamily(bound) === null) this.#names.add(bound);
    this.#origins = options.allowOrigins.map(checkOriginEntry);
    this.listedOrigins = options.allowOrigins.map((o) => o.trim());
  }

  /**
   * Whether a request with this Host header may be answered. No Host (HTTP/1.0) is no browser.
   * `localAddress` is the address the connection arrived at (the socket's local side).
   */
  hostAllowed(header: string | undefined, localAddress: string | undefined): boolean {
    if (header === undefined || this.#anyHost) return true;
    const name = hostName(header);
    if (name === null) return false;
    if (this.#names.has(name)) return true;
    const family = ipFamily(name);
    if (family === null) return false;
    if (LOOPBACK.check(name, family)) return true;
    if (!localAddress) return false;
    const local = localAddress.replace(/^::ffff:(?=\d+\.\d+\.\d+\.\d+$)/i, "");
    const localFamily = ipFamily(local);
    if (localFamily === null) return false;
    const arrived = new BlockList();
    arrived.addAddress(local, localFamily);
    return arrived.check(name, family);
  }

  /** Same origin: the page's scheme is http or https and its host:port is the request's Host. */
  originVerdict(origin: string | undefined, host: string | undefined): OriginVerdict {
    if (origin === undefined) return { kind: "none" };
    const lower = origin.trim().toLowerCase();
    const own = /^https?:\/\/([^/]+)$/.exec(lower);
    if (own && host !== undefined && own[1] === host.toLowerCase()) return { kind: "same" };
    if (this.#origins.some((pattern) => pattern.test(lower))) return { kind: "listed", origin };
    return { kind: "refused", origin };
  }
}

function clip(text: string): string {
  return text.length > 120 ? `${text.slice(0, 120)}...` : text;
}

function hostRefusal(header: string): ApiError {
  const name = hostName(header);
  const allow = name !== null ? ` --allow-host ${name}` : " --allow-host NAME";
  return new ApiError("forbidden", `the Host '${clip(header)}' is not this server's (localhost, a loopback address or the address ` +
    `it was reached at); a web page may be trying to reach it through DNS rebinding. If you reach the server by that name ` +
    `(a proxy, a LAN name), restart kvl serve with${allow}`);
}

function originRefusal(origin: string, host: string | undefined): ApiError {
  const own = host !== undefined ? ` (http://${clip(host)})` : "";
  return new ApiError("forbidden", `requests from web pages at ${clip(origin)} are refused: this server answers only its own page${own} ` +
    `and clients that send no Origin. To let pages at that origin use the API, restart kvl serve with --allow-origin ${clip(origin)}`);
}

/**
 * Wraps the server's request listener with the Host and Origin rules: a refused request gets 403
 * in its path's API shape (its body drained unread, logged), a preflight from a listed origin 204
 * with the CORS headers, and any other request from a listed origin Access-Control-Allow-Origin on
 * whatever answers it (set here, so the 429s and 503s answered before the app carry it too).
 * `deadlines`: how long a refused body is drained (body.ts drain).
 */
export function guardRequests(listener: RequestListener, rules: AccessRules, log: (line: string) => void, deadlines: ReadDeadlines): RequestListener {
  return (req: IncomingMessage, res: ServerResponse) => {
    const host = req.headers.host;
    if (!rules.hostAllowed(host, req.socket.localAddress)) {
      refuseUnread(req, res, hostRefusal(host ?? ""), log, deadlines);
      return;
    }
    const origin = req.headers.origin;
    const verdict = rules.originVerdict(origin, host);
    if (verdict.kind === "refused") {
      refuseUnread(req, res, originRefusal(verdict.origin, host), log, deadlines);
      return;
    }
    if (verdict.kind === "listed") {
      res.setHeader("access-control-allow-origin", verdict.origin);
      res.setHeader("vary", "Origin");
      res.setHeader("access-control-expose-headers", "Retry-After");
      if (req.method === "OPTIONS" && req.headers["access-control-request-method"] !== undefined) {
        const headers: Record<string, string> = {
          "access-control-allow-methods": METHODS,
          "access-control-max-age": String(PREFLIGHT_MAX_AGE_S),
          "content-length": "0",
        };
        const asked = req.headers["access-control-request-headers"];
        if (asked) headers["access-control-allow-headers"] = asked;
        // Chrome's Private Network Access: a public page calling a local server asks for this too
        if (req.headers["access-control-request-private-network"] === "true") headers["access-control-allow-private-network"] = "true";
        res.writeHead(204, headers);
        res.end();
        return;
      }
    }
    listener(req, res);
  };
}
