/**
 * web.ts — the web chat page at `/`: the files of server/web/ (HTML, CSS, one ES module, its icon),
 * served as they are in the repository — there is nothing to build.
 *
 * Owns: which paths are page assets, their content types, and their headers: revalidated on every
 * load (no-cache + ETag, so an upgraded server never serves a stale page), and a content security
 * policy that lets the page load only its own files and talk only to this server (images it shows
 * are data: URLs the user attached).
 * Does not own: what the page does (server/web/chat.js speaks the OpenAI API like any client, so
 * the page needs no route of its own and passes the same key check as every client).
 */
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { join } from "node:path";

import type Koa from "koa";

import { packageRoot } from "../host/system/paths.js";

const WEB_DIR = join(packageRoot, "server", "web");

/** URL path → file in WEB_DIR and its content type. Nothing else is served from the folder. */
const ASSETS: Record<string, { file: string; type: string }> = {
  "/": { file: "index.html", type: "text/html; charset=utf-8" },
  "/chat.js": { file: "chat.js", type: "text/javascript; charset=utf-8" },
  "/chat.css": { file: "chat.css", type: "text/css; charset=utf-8" },
  // the icon: the SVG the page links, and /favicon.ico for clients that ask for it without a link
  // (favicon.svg drawn at 32x32 by sharp, a palette PNG in an ICO container: 438 bytes)
  "/favicon.svg": { file: "favicon.svg", type: "image/svg+xml" },
  "/favicon.ico": { file: "favicon.ico", type: "image/x-icon" },
};

const CONTENT_SECURITY_POLICY = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; " +
  "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

interface Asset {
  body: Buffer;
  type: string;
  etag: string;
}

export class WebPage {
  readonly #assets = new Map<string, Asset>();

  /** Reads the page's files once (a few tens of KB): a missing file fails at startup, not per request. */
  constructor(dir: string = WEB_DIR) {
    for (const [path, { file, type }] of Object.entries(ASSETS)) {
      const body = readFileSync(join(dir, file));
      this.#assets.set(path, { body, type, etag: `"${createHash("sha256").update(body).digest("base64url").slice(0, 27)}"` });
    }
  }

  paths(): string[] {
    return [...this.#assets.keys()];
  }

  /** Answers GET/HEAD of one asset path (a path from paths()). */
  serve(ctx: Koa.Context): void {
    const asset = this.#assets.get(ctx.path);
    if (!asset) throw new Error(`web.ts: ${ctx.path} is not a page asset`);
    ctx.set({
      "cache-control": "no-cache",
      etag: asset.etag,
      "content-security-policy": CONTENT_SECURITY_POLICY,
      "x-content-type-options": "nosniff",
      "referrer-policy": "no-referrer",
    });
    if (ctx.get("if-none-match") === asset.etag) {
      ctx.status = 304;
      return;
    }
    ctx.type = asset.type;
    ctx.body = asset.body;
  }
}
