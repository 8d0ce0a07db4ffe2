// wine.mjs — Windows programs under Wine for the portability steps of scripts/test (windows.mjs:
// kvl with node.exe and the quickstart; single-exe.mjs: kvl-win-x64.exe): the Wine prefix, the
// environment, runs with their output in files, and the mingw-built native addon.
//
// Owns: build/portability/wine-prefix (made once per Wine version) and Wine's own gaps, handled
// here and never in kvl:
//   - a new prefix says Windows 7: set to Windows 10 with winecfg (kvl is for Windows 10/11);
//   - Wine 8.0 lacks bcryptprimitives.dll (ProcessPrng), which sharp's libvips imports: a stub
//     built from bcryptprimitives.c goes into the prefix's system32;
//   - node.exe's piped stdio misbehaves (stdin EBADF): stdin is /dev/null or a file, stdout and
//     stderr go to files;
//   - Wine sets %LOCALAPPDATA% from the prefix's profile and ignores one passed in from Linux:
//     wineLocalAppData says where it is.
// Does not own: what runs under Wine or what is checked (the steps), the tally (lib.mjs).
import { spawnSync } from "node:child_process";
import { closeSync, copyFileSync, existsSync, mkdirSync, openSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";

import { CACHE, ROOT, errorLine } from "./lib.mjs";

/** A Linux path as the Windows process sees it (Wine maps drive Z: to /). */
export const winPath = (p) => `Z:${p.replaceAll("/", "\\")}`;

/** Throws "CMD not found: WHY" when CMD is not on PATH. */
export function need(cmd, why) {
  if (spawnSync("sh", ["-c", `command -v ${cmd}`]).status !== 0) throw new Error(`${cmd} not found: ${why}`);
}

/**
 * Wine ready to run Windows programs: wine and mingw-w64 present, the prefix made (Windows 10, the
 * stub). Returns { version, wineEnv }: wineEnv is this process's environment without the variables
 * that would steer kvl (KVL_*, NODE_PATH) or open windows, plus Wine's settings and `env`.
 */
export function startWine(env = {}) {
  need("wine", "install Wine (Debian: apt-get install wine64 wine; .ci/run does)");
  need("x86_64-w64-mingw32-gcc", "install mingw-w64 (Debian: apt-get install gcc-mingw-w64-x86-64)");
  const version = spawnSync("wine", ["--version"], { encoding: "utf8" }).stdout.trim();
  const base = { ...process.env };
  for (const k of ["KVL_BACKEND", "KVL_INSTANCES", "KVL_ADDON", "NODE_PATH", "DISPLAY", "WAYLAND_DISPLAY"]) delete base[k];
  const wineEnv = { ...base, WINEPREFIX: join(CACHE, "wine-prefix"), WINEDEBUG: "-all", WINEDLLOVERRIDES: "mscoree,mshtml=", ...env };
  winePrefix(wineEnv, version);
  return { version, wineEnv };
}

/** The Wine prefix under build/portability/, made once per Wine version: Windows 10, the stub. */
function winePrefix(wineEnv, version) {
  const prefix = wineEnv.WINEPREFIX;
  const marker = join(prefix, "kvl-prefix-ready");
  if (!existsSync(marker) || readFileSync(marker, "utf8") !== version) {
    rmSync(prefix, { recursive: true, force: true });
    mkdirSync(prefix, { recursive: true });
    const boot = spawnSync("wineboot", ["-i"], { env: wineEnv, stdio: "ignore", timeout: 300_000 });
    if (boot.status !== 0) throw new Error(`wineboot -i failed (exit ${boot.status ?? boot.signal})`);
    const ver = spawnSync("winecfg", ["/v", "win10"], { env: wineEnv, stdio: "ignore", timeout: 300_000 });
    if (ver.status !== 0) throw new Error(`winecfg /v win10 failed (exit ${ver.status ?? ver.signal})`);
    writeFileSync(marker, version);
  }
  const dll = join(CACHE, "bcryptprimitives.dll");
  const cc = spawnSync("x86_64-w64-mingw32-gcc", ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-o", dll,
    join(ROOT, "test", "portability", "bcryptprimitives.c"), "-ladvapi32"], { encoding: "utf8" });
  if (cc.status !== 0) throw new Error(`building the bcryptprimitives.dll stub failed: ${errorLine(cc.stderr)}`);
  copyFileSync(dll, join(prefix, "drive_c", "windows", "system32", "bcryptprimitives.dll"));
}

/**
 * The Windows program EXE with ARGS under Wine: stdin from the file `stdin` (else /dev/null),
 * stdout and stderr to files in ctx.work. ctx: { wineEnv, work }. Returns { status, stdout,
 * stderr, stderrPath } (stderr left unread when over 16 MiB: a file trace).
 */
export function wineRun(ctx, exe, args, { env = {}, timeout = 600_000, cwd = ROOT, stdin = null } = {}) {
  const out = join(ctx.work, "wine.stdout");
  const err = join(ctx.work, "wine.stderr");
  const fds = [stdin === null ? null : openSync(stdin, "r"), openSync(out, "w"), openSync(err, "w")];
  let r;
  try {
    r = spawnSync("wine", [exe, ...args], { env: { ...ctx.wineEnv, ...env }, stdio: [fds[0] ?? "ignore", fds[1], fds[2]], timeout, cwd });
  } finally {
    fds.forEach((fd) => fd !== null && closeSync(fd));
  }
  const stderr = statSync(err).size > 16 << 20 ? "" : readFileSync(err, "utf8");
  return { status: r.status ?? (r.error ? String(r.error) : r.signal), stdout: readFileSync(out, "utf8"), stderr, stderrPath: err };
}

/** The prefix's %LOCALAPPDATA% as { win: the Windows path, linux: the folder on this machine }. */
export function wineLocalAppData(ctx) {
  const r = wineRun(ctx, "cmd", ["/c", "echo %LOCALAPPDATA%"]);
  const win = r.stdout.trim();
  const m = /^C:\\(.+)$/i.exec(win);
  if (r.status !== 0 || !m) throw new Error(`cmd /c echo %LOCALAPPDATA% gave ${JSON.stringify(win)} (exit ${r.status})`);
  return { win, linux: join(ctx.wineEnv.WINEPREFIX, "drive_c", ...m[1].split("\\")) };
}

/** Stops the prefix's wineserver (and every program left running in it). */
export function stopWine(wineEnv) {
  spawnSync("wineserver", ["-k"], { env: wineEnv, stdio: "ignore", timeout: 60_000 });
}

/** The mingw-built kvl_core.node: `given` (scripts/test passes the one its mingw step kept), else
 * built by scripts/check-mingw.sh --keep into build/portability/mingw; an absolute path. */
export function mingwAddon(given) {
  let addon = given;
  if (!addon) {
    const dir = join(CACHE, "mingw");
    const built = spawnSync("bash", [join(ROOT, "scripts", "check-mingw.sh"), "--keep", dir], { encoding: "utf8" });
    if (built.status !== 0) throw new Error(`scripts/check-mingw.sh failed: ${errorLine(built.stdout)}`);
    addon = join(dir, "kvl_core.node");
  }
  if (!existsSync(addon)) throw new Error(`no mingw-built addon at ${addon}`);
  // absolute: a relative path would be taken from the working folder of each Windows program
  return resolve(addon);
}
