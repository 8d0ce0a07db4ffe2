// single-exe.mjs — the single executables of scripts/build-exe.mjs as a user runs them: built,
// copied alone into an empty folder, run from another empty folder with nothing else installed
// (a fresh cache folder for their extracted files), each result compared with the npm install's
// (`node dist/cli/kvl.js`) run in this step:
//   - `kvl doctor` picks the native backend from the prebuilt addon it carries (extracted with its
//     other files), with the kernel set the local build picks on this CPU, and self-tests both backends;
//   - `kvl synth` + `kvl pack` of the tiny model: every file byte-identical to the npm install's;
//   - `kvl chat --json` greedy tokens (text, an image) equal to the npm install's: with no
//     --backend on the carried native addon, and with --backend wasm;
//   - `kvl serve` serves its web page (a file of the extracted folder) and answers a chat request;
//   - the extracted files: one content-addressed folder, written by the first run and reused as it
//     is by every later one (same inodes, no partial folder left), and an unwritable cache folder
//     is a one-line error;
//   - with an addon (build/addon/kvl_core.node, else prebuilds/linux-x64's) copied beside the executable: `kvl doctor` loads
//     that one instead and `kvl chat --backend native` gives the npm install's tokens.
// kvl-linux-x64 natively; kvl-win-x64.exe under Wine (wine.mjs), copied alone into an empty folder
// and run with no KVL_ADDON or NODE_PATH (sharp comes from the executable), its extracted files
// in the Wine prefix's %LOCALAPPDATA%\kvl (whose sea-* folders are deleted first):
//   - `kvl doctor` picks the native backend from the mingw-w64 prebuilt it carries, extracted to
//     %LOCALAPPDATA%\kvl\sea-*, and self-tests both backends;
//   - `kvl chat --json` greedy tokens (text, an image) equal to the npm install's on Linux, with
//     --backend native and wasm; later runs reuse the extracted folder as it is (same inodes);
//   - with a mingw-built kvl_core.node beside it: `kvl doctor` loads that one instead and
//     `kvl chat --backend native` gives the npm install's tokens.
//
//   node test/portability/single-exe.mjs [--win-addon PATH]   (PATH: a mingw-built kvl_core.node;
//                                                              without it, check-mingw.sh builds one)
// Needs dist/, node_modules and the built addon (npm ci), wine and mingw-w64.
// Ends with `single executables: N passed, N failed`; exit status 1 when anything failed.
import { spawn } from "node:child_process";
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import {
  IMAGE, KVL, ROOT, Tally, chatCases, doctorBothBackends, errorLine, hashDiff, parseChat, run, sameTokens, tinyPack, treeHashes,
} from "./lib.mjs";
import { mingwAddon, startWine, stopWine, wineLocalAppData, winPath, wineRun } from "./wine.mjs";

const tally = new Tally("single executables");
const OUT = join(ROOT, "build", "exe");
/** The Linux addon a user would put beside the executable: a local build where there is one, else
 * the committed prebuilt (a clean checkout's npm ci builds none when the prebuilt loads). */
const ADDON = [join(ROOT, "build", "addon", "kvl_core.node"), join(ROOT, "prebuilds", "linux-x64", "kvl_core.node")].find((p) => existsSync(p));

/** The sea-* folders under cacheDir/kvl (extracted or partial) and the inode of each file in them
 * (a rewrite makes new ones). */
function cacheState(cacheDir) {
  const kvl = join(cacheDir, "kvl");
  const entries = readdirSync(kvl).filter((e) => e.startsWith("sea-")).sort();
  const inodes = new Map();
  for (const e of entries) for (const [f] of treeHashes(join(kvl, e))) inodes.set(`${e}/${f}`, statSync(join(kvl, e, f)).ino);
  return { entries, inodes, dirIno: entries.length === 1 ? statSync(join(kvl, entries[0])).ino : null };
}

/** The extracted folder of `first` reused as it was: same folder and file inodes, no other sea-* folder. */
const reused = (first, later) => later.entries.join() === first.entries.join() && later.dirIno === first.dirIno &&
  later.inodes.size === first.inodes.size && [...first.inodes].every(([f, ino]) => later.inodes.get(f) === ino);

/** The npm install's results (`node dist/cli/kvl.js`): the tiny pack, and the greedy chat tokens
 * ("BACKEND text|image") and the text reply on WebAssembly that every executable must give. */
function npmReference(work) {
  const pack = tinyPack(process.execPath, join(work, "npm"));
  const cases = chatCases();
  const reference = {};
  for (const backend of ["wasm", "native"]) {
    for (const c of ["text", "image"]) {
      try {
        const r = run(process.execPath, [KVL, "chat", pack, ...cases[c], "--backend", backend]);
        reference[`${backend} ${c}`] = parseChat(r).tokens;
        if (backend === "native" && c === "text") reference.reply = JSON.parse(r.stdout.trim().split("\n").at(-1)).reply;
      } catch (err) {
        tally.fail(`npm install's chat --backend ${backend}, ${c}`, err.message);
      }
    }
  }
  const kernelSet = JSON.parse(run(process.execPath, [KVL, "doctor", "--json"]).stdout).backend.native.defaultKernelSet;
  return { pack, reference, kernelSet };
}

/** `exe serve PACK` on a free port: GET / is the web page, one greedy chat request gets `want`'s tokens. */
async function serveAnswers(exe, pack, env, cwd, want) {
  const name = "kvl-linux-x64 serve: the web page at /, and a chat request answered with the npm install's tokens";
  const child = spawn(exe, ["serve", pack, "--port", "0", "--threads", "1", "--ram-mib", "1024"], { env: { ...process.env, ...env }, cwd, stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  const exited = new Promise((resolve) => child.on("exit", resolve));
  try {
    const url = await new Promise((resolve, reject) => {
      child.stderr.on("data", (d) => {
        stderr += d;
        const m = /chat in a browser at (http:\/\/127\.0\.0\.1:\d+)\//.exec(stderr);
        if (m) resolve(m[1]);
      });
      child.on("exit", (code) => reject(new Error(`exit ${code}: ${errorLine(stderr)}`)));
    });
    const page = await fetch(`${url}/`).then(async (r) => `${r.status} ${await r.text()}`);
    const reply = await fetch(`${url}/v1/chat/completions`, {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: "kimi-vl-a3b-instruct-q8", messages: [{ role: "user", content: "Say hello." }], temperature: 0, max_tokens: 8 }),
    }).then((r) => r.json());
    tally.check(page.startsWith("200 <!doctype html>") && reply.choices?.[0]?.message?.content === want, name,
      `GET / ${page.slice(0, 40)}; reply ${JSON.stringify(reply.choices?.[0]?.message?.content ?? reply)}, npm ${JSON.stringify(want)}`);
  } catch (err) {
    tally.fail(name, err.message);
  } finally {
    child.kill("SIGTERM");
    await exited;
  }
}

async function linux(work, npm) {
  const home = join(work, "linux");
  const exeDir = join(home, "bin");
  const cwd = join(home, "cwd");
  const cache = join(home, "cache");
  for (const d of [exeDir, cwd]) mkdirSync(d, { recursive: true });
  const exe = join(exeDir, "kvl-linux-x64");
  copyFileSync(join(OUT, "kvl-linux-x64"), exe);
  const env = { XDG_CACHE_HOME: cache, KVL_ADDON: "" };
  const kvl = (args, extra = {}) => run(exe, args, { env: { ...env, ...extra }, cwd });

  const doctor = kvl(["doctor", "--json"]);
  try {
    const report = JSON.parse(doctor.stdout);
    const why = doctorBothBackends(doctor);
    const n = report.backend.native;
    tally.check(why === null && report.backend.chosen === "native" && n.origin === "prebuilt" && n.defaultKernelSet === npm.kernelSet &&
      n.path.startsWith(join(cache, "kvl", "sea-")) && n.path.endsWith(join("prebuilds", "linux-x64", "kvl_core.node")),
    `kvl-linux-x64 doctor from an empty folder: native backend from the prebuilt addon it carries (${npm.kernelSet}), self-tests on both backends`,
    why ?? `chose ${report.backend.chosen} from ${n.origin} ${n.path}, kernels ${n.defaultKernelSet}`);
  } catch {
    tally.fail("kvl-linux-x64 doctor from an empty folder", `exit ${doctor.status}: ${errorLine(doctor.stderr || doctor.stdout)}`);
    return;
  }
  const first = cacheState(cache);
  tally.check(first.entries.length === 1 && /^sea-[0-9a-f]{16}$/.test(first.entries[0]) && first.inodes.size > 0,
    "the first run extracted its files into one content-addressed folder", `cache holds ${first.entries.join(", ")}`,
    `${first.entries[0]}, ${first.inodes.size} files`);

  const npmPackDir = npm.pack;
  const synth = kvl(["synth", join(home, "tiny", "src"), "--preset", "tiny", "--seed", "0"]);
  const pack = synth.status === 0 ? kvl(["pack", join(home, "tiny", "src"), join(home, "tiny", "pack"), "--allow-revision", "--quiet"]) : synth;
  if (pack.status === 0) {
    const diff = hashDiff(treeHashes(npmPackDir), treeHashes(join(home, "tiny", "pack")));
    tally.check(diff === null, "kvl-linux-x64 synth + pack: every file byte-identical to the npm install's", diff);
  } else {
    tally.fail("kvl-linux-x64 synth + pack", `exit ${pack.status}: ${errorLine(pack.stderr || pack.stdout)}`);
  }

  const cases = chatCases();
  const { reference } = npm;
  for (const [backend, flags] of [["native", []], ["wasm", ["--backend", "wasm"]]]) {
    for (const c of ["text", "image"]) {
      const name = `kvl-linux-x64 chat --json ${flags.join(" ") || "(no --backend: the carried addon)"} (${c}): greedy tokens equal to the npm install's`;
      try {
        const { tokens, io } = parseChat(kvl(["chat", npmPackDir, ...cases[c], ...flags]));
        const want = reference[`${backend} ${c}`] ?? [];
        tally.check(io.backend === backend && sameTokens(tokens, want), name, `got ${tokens.join(",")} on ${io.backend}, npm ${want.join(",")}`);
      } catch (err) {
        tally.fail(name, err.message);
      }
    }
  }

  await serveAnswers(exe, npmPackDir, env, cwd, reference.reply);

  const later = cacheState(cache);
  tally.check(reused(first, later), "later runs reused the extracted folder as it was (same folder and file inodes, no other sea-* folder left)",
    `before ${first.entries.join(", ")} (${first.inodes.size} files), after ${later.entries.join(", ")} (${later.inodes.size} files)`);

  const blocker = join(home, "not-a-folder");
  writeFileSync(blocker, "");
  const refused = kvl(["doctor"], { XDG_CACHE_HOME: join(blocker, "cache") });
  const lines = refused.stderr.trim().split("\n");
  tally.check(refused.status === 1 && lines.length === 1 && lines[0].startsWith("kvl: error: cannot write kvl's files to ") &&
    lines[0].includes("XDG_CACHE_HOME"), "an unwritable cache folder: one line saying so and what to set",
  `exit ${refused.status}: ${refused.stderr.trim()}`);

  // the native addon a user puts beside the executable
  copyFileSync(ADDON, join(exeDir, "kvl_core.node"));
  const both = kvl(["doctor", "--json"]);
  const why = doctorBothBackends(both);
  const besideIt = why === null ? JSON.parse(both.stdout).backend.native : null;
  tally.check(why === null && besideIt.origin === "beside the executable" && besideIt.path === join(exeDir, "kvl_core.node"),
    "with kvl_core.node beside it: kvl doctor loads that one over the carried one, self-tests both backends", why ?? `${besideIt.origin} ${besideIt.path}`);
  const name = "with kvl_core.node beside it: chat --backend native (text, image) tokens equal to the npm install's";
  try {
    const got = ["text", "image"].map((c) => parseChat(kvl(["chat", npmPackDir, ...cases[c], "--backend", "native"])).tokens);
    const want = ["text", "image"].map((c) => reference[`native ${c}`] ?? []);
    tally.check(got.every((t, i) => sameTokens(t, want[i])), name, `got ${got.map((t) => t.join(",")).join(" / ")}, npm ${want.map((t) => t.join(",")).join(" / ")}`);
  } catch (err) {
    tally.fail(name, err.message);
  }
}

/**
 * kvl-win-x64.exe under Wine as a Windows user runs it: copied alone into an empty folder, run
 * from another one, with nothing steering it from Linux (no KVL_ADDON, no NODE_PATH: sharp comes
 * from the executable). Its files go to the prefix's %LOCALAPPDATA%\kvl (Wine ignores a
 * LOCALAPPDATA passed in), so the sea-* folders there are deleted first.
 */
function windows(work, npm, winAddon) {
  const wine = startWine();
  try {
    const ctx = { work, wineEnv: wine.wineEnv };
    const home = join(work, "windows");
    const exeDir = join(home, "bin");
    const cwd = join(home, "cwd");
    for (const d of [exeDir, cwd]) mkdirSync(d, { recursive: true });
    const exe = join(exeDir, "kvl-win-x64.exe");
    copyFileSync(join(OUT, "kvl-win-x64.exe"), exe);
    const local = wineLocalAppData(ctx);
    const kvlDir = join(local.linux, "kvl");
    for (const e of existsSync(kvlDir) ? readdirSync(kvlDir) : []) if (e.startsWith("sea-")) rmSync(join(kvlDir, e), { recursive: true, force: true });
    const kvl = (args) => wineRun(ctx, exe, args, { cwd });
    const beside = winPath(join(exeDir, "kvl_core.node"));

    const doctor = kvl(["doctor", "--json"]);
    try {
      const report = JSON.parse(doctor.stdout);
      const why = doctorBothBackends(doctor);
      const { native, wasm } = report.backend;
      tally.check(why === null && report.backend.platform === "win32 x64" && report.backend.chosen === "native" && native.origin === "prebuilt" &&
        native.defaultKernelSet === npm.kernelSet && native.path.startsWith(`${local.win}\\kvl\\sea-`) &&
        native.path.endsWith("\\prebuilds\\win32-x64\\kvl_core.node") && wasm.dist.startsWith(`${local.win}\\kvl\\sea-`),
      `kvl-win-x64.exe doctor under Wine from an empty folder: native backend from the mingw-w64 prebuilt it carries (${npm.kernelSet}), ` +
        "extracted to %LOCALAPPDATA%\\kvl\\sea-*, self-tests on both backends",
      why ?? `on ${report.backend.platform} chose ${report.backend.chosen} from ${native.origin} ${native.path} (${native.defaultKernelSet}), WebAssembly core from ${wasm.dist}`);
    } catch {
      tally.fail("kvl-win-x64.exe doctor under Wine from an empty folder", `exit ${doctor.status}: ${errorLine(doctor.stderr || doctor.stdout)}`);
      return;
    }
    const first = cacheState(local.linux);
    tally.check(first.entries.length === 1 && /^sea-[0-9a-f]{16}$/.test(first.entries[0]) && first.inodes.size > 0,
      "kvl-win-x64.exe: the first run extracted its files into one content-addressed folder", `%LOCALAPPDATA%\\kvl holds ${first.entries.join(", ")}`,
      `${first.entries[0]}, ${first.inodes.size} files`);

    const cases = chatCases(winPath(IMAGE));
    const chat = (backend) => {
      const name = `kvl-win-x64.exe chat --json --backend ${backend} (text, image): greedy tokens equal to the npm install's on Linux`;
      try {
        const got = ["text", "image"].map((c) => parseChat(kvl(["chat", winPath(npm.pack), ...cases[c], "--backend", backend])));
        const want = ["text", "image"].map((c) => npm.reference[`${backend} ${c}`] ?? []);
        tally.check(got.every((r, i) => r.io.backend === backend && sameTokens(r.tokens, want[i])), name,
          `got ${got.map((r) => `${r.tokens.join(",")} on ${r.io.backend}`).join(" / ")}, npm ${want.map((t) => t.join(",")).join(" / ")}`);
      } catch (err) {
        tally.fail(name, err.message);
      }
    };
    chat("native");
    chat("wasm");

    // a mingw-built addon a user puts beside the executable wins over the carried one
    copyFileSync(winAddon, join(exeDir, "kvl_core.node"));
    const both = kvl(["doctor", "--json"]);
    const why = doctorBothBackends(both);
    const loaded = why === null ? JSON.parse(both.stdout).backend.native : null;
    tally.check(why === null && loaded.path === beside && loaded.origin === "beside the executable",
      "kvl-win-x64.exe with a mingw-built kvl_core.node beside it: kvl doctor loads that one, self-tests both backends",
      why ?? `addon loaded from ${loaded.origin} ${loaded.path}`);
    chat("native");

    const later = cacheState(local.linux);
    tally.check(reused(first, later), "kvl-win-x64.exe: later runs reused the extracted folder as it was (same folder and file inodes)",
      `before ${first.entries.join(", ")} (${first.inodes.size} files), after ${later.entries.join(", ")} (${later.inodes.size} files)`);
  } finally {
    stopWine(wine.wineEnv);
  }
}

const work = mkdtempSync(join(tmpdir(), "kvl-single-exe-"));
try {
  const build = run(process.execPath, [join(ROOT, "scripts", "build-exe.mjs")]);
  if (build.status !== 0) throw new Error(`scripts/build-exe.mjs: exit ${build.status}: ${errorLine(build.stderr || build.stdout)}`);
  for (const line of build.stdout.trim().split("\n")) console.log(line);
  const npm = npmReference(work);
  await linux(work, npm);
  try {
    const i = process.argv.indexOf("--win-addon");
    windows(work, npm, mingwAddon(i > 0 ? process.argv[i + 1] : null));
  } catch (err) {
    tally.fail("kvl-win-x64.exe under Wine: setup", err.message);
  }
} catch (err) {
  tally.fail("setup", err.message);
} finally {
  rmSync(work, { recursive: true, force: true });
}
tally.finish();
