// install-state.mjs — whether this checkout's install is current, so scripts/quickstart.mjs can
// skip `npm ci` (35 of its 40 s on a second run). Plain JavaScript with Node's built-ins only: it
// runs before anything is installed.
//
// Current means: the compiled kvl exists (dist/cli/kvl.js, which npm ci's prepare step builds)
// and npm's own record of what node_modules holds (node_modules/.package-lock.json, written by
// npm ci and npm install) has every package of package-lock.json at its locked version and
// integrity; an optional package may be absent unless it is meant for this platform (Linux's
// node_modules run by Windows' node.exe lacks sharp's win32 binary: not current there).
// Anything else (no node_modules, another lock, a package missing or changed) is not current.
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";

/** This C library on Linux (npm's `libc` field), else null. */
function libc() {
  if (process.platform !== "linux") return null;
  return process.report?.getReport().header.glibcVersionRuntime ? "glibc" : "musl";
}

/** An optional package npm installs here: one whose os and cpu (and libc) name this platform.
 * One without them is optional for other reasons (a peer's), which this does not judge. */
function forThisPlatform(entry) {
  if (!entry.os && !entry.cpu) return false;
  const allows = (list, value) => !list || (list.includes(value) || (list.every((v) => v.startsWith("!")) && !list.includes(`!${value}`)));
  return allows(entry.os, process.platform) && allows(entry.cpu, process.arch) && (!entry.libc || entry.libc.includes(libc()));
}

/** null when the install is current, else why not (a phrase for the quickstart's line). */
export function installOutdated(root) {
  if (!existsSync(join(root, "dist", "cli", "kvl.js"))) return "kvl is not built yet";
  let locked;
  let installed;
  try {
    locked = JSON.parse(readFileSync(join(root, "package-lock.json"), "utf8")).packages;
    installed = JSON.parse(readFileSync(join(root, "node_modules", ".package-lock.json"), "utf8")).packages;
  } catch {
    return "node_modules is missing or was not installed by npm";
  }
  if (typeof locked !== "object" || locked === null || typeof installed !== "object" || installed === null) {
    return "package-lock.json or node_modules/.package-lock.json has no packages";
  }
  for (const [path, want] of Object.entries(locked)) {
    if (path === "") continue;
    const got = installed[path];
    if (got === undefined && want.optional && !forThisPlatform(want)) continue;
    if (got === undefined || got.version !== want.version || got.integrity !== want.integrity) {
      return `${path} is not the locked ${want.version ?? "version"}`;
    }
  }
  return null;
}
