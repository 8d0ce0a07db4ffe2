#!/usr/bin/env node
// build-prebuilds.mjs — the native addons kvl ships prebuilt, one per platform, where prebuildify
// and node-gyp-build put them: prebuilds/<platform>-<arch>/kvl_core.node. The npm package and both
// single executables carry them, so a user gets the native backend without a compiler.
//
//   npm run build:prebuilds                        both targets
//   node scripts/build-prebuilds.mjs [--target linux-x64|win32-x64]...
//   node scripts/build-prebuilds.mjs --check       exit 1 unless both exist and were built from
//                                                  today's C sources (npm pack's prepack runs it)
//   node scripts/build-prebuilds.mjs --verify DIR  build both into DIR and compare them with the
//                                                  committed ones (npm test)
//
// The prebuilds are committed, as wasm-core/dist is: a checkout (scripts/quickstart on a machine
// without a compiler) and the package get them as they are. Both builds are reproducible: the
// same sources give the same bytes wherever they are built (no debug info or build paths, no
// link timestamp, dlltool's temporary names fixed), which --verify checks.
// linux-x64: the core and the addon compiled by zig's clang (`zig cc`, from the PyPI wheel
// `ziglang`, fetched once into build/portability/) against glibc 2.28, the oldest glibc the Node
// releases we support run on (Node 20-24 need 2.28), so the file loads on Ubuntu 20.04 and RHEL 8
// as well as on this machine (gcc here links against 2.36's symbols); objdump then checks that no
// symbol needs a newer glibc. win32-x64: scripts/check-mingw.sh's mingw-w64 build (node.exe
// delay-loaded, so it also loads into the single executable). Both keep the run-time kernel
// dispatch (scalar, AVX2, AVX-512, AVX-512 BF16 chosen by CPUID), so one file serves every x64 CPU.
// prebuilds/manifest.json records the sources' digest and the toolchain of each.
import { spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { chmodSync, copyFileSync, existsSync, mkdirSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, relative, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const COMMITTED = join(ROOT, "prebuilds");
let OUT = COMMITTED;
const manifestOf = (dir) => join(dir, "manifest.json");
const TARGETS = ["linux-x64", "win32-x64"];
/** zig's clang for the Linux build, pinned (PyPI wheel). */
const ZIG_VERSION = "0.17.1";
/** The newest glibc symbol version the Linux addon may need: Node 20-24's own minimum. */
const GLIBC_BASELINE = "2.28";

class BuildError extends Error {}

function run(cmd, args, what, options = {}) {
  const r = spawnSync(cmd, args, { cwd: ROOT, encoding: "utf8", maxBuffer: 64 << 20, ...options });
  if (r.error) throw new BuildError(`${what}: ${r.error.code === "ENOENT" ? `${cmd} not found` : r.error.message}`);
  if (r.status !== 0) throw new BuildError(`${what} failed (exit ${r.status ?? r.signal}):\n${`${r.stdout}${r.stderr}`.trim().split("\n").slice(-15).join("\n")}`);
  return r.stdout;
}

/** Every file the addon is built from, relative, sorted. */
function sourceFiles() {
  const out = [];
  const walk = (dir) => {
    for (const e of readdirSync(join(ROOT, dir), { withFileTypes: true })) {
      const rel = `${dir}/${e.name}`;
      if (e.isDirectory()) walk(rel);
      else if (/\.(c|h|txt)$/.test(e.name)) out.push(rel);
    }
  };
  for (const dir of ["wasm-core/src", "wasm-core/include", "wasm-core/native"]) walk(dir);
  out.push("CMakeLists.txt", "wasm-core/CMakeLists.txt", "scripts/check-mingw.sh", "scripts/build-prebuilds.mjs");
  return out.sort();
}

/** A digest of the sources: a prebuilt addon from other sources is stale. */
export function sourcesDigest() {
  const all = createHash("sha256");
  for (const f of sourceFiles()) all.update(`${f}\0`).update(readFileSync(join(ROOT, f))).update("\0");
  return all.digest("hex").slice(0, 16);
}

/** zig from the PyPI wheel, unpacked once under build/portability/. */
function zig() {
  const dir = join(ROOT, "build", "portability", `ziglang-${ZIG_VERSION}`);
  const exe = join(dir, "ziglang", "zig");
  if (existsSync(exe)) return exe;
  const wheels = join(dir, "wheel");
  mkdirSync(wheels, { recursive: true });
  run("python3", ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", wheels, `ziglang==${ZIG_VERSION}`],
    `fetching the ziglang ${ZIG_VERSION} wheel from PyPI`);
  const wheel = readdirSync(wheels).find((f) => f.endsWith(".whl"));
  if (!wheel) throw new BuildError(`pip left no ziglang wheel in ${wheels}`);
  run("python3", ["-m", "zipfile", "-e", join(wheels, wheel), dir], "unpacking the ziglang wheel");
  chmodSync(exe, 0o755);
  return exe;
}

/** The load test: a child loads the addon and lists its kernel sets (a bad file kills the child). */
function loadTest(file) {
  const probe = "const a = require(process.argv[1]); console.log(a.kernelSets().map((s) => s.name).join(' ') + '; default ' + a.defaultKernelSet());";
  return run(process.execPath, ["-e", probe, file], `loading ${relative(ROOT, file)}`).trim();
}

/** The highest GLIBC_x.y symbol version the file needs (objdump -T). */
function newestGlibc(file) {
  const versions = [...run("objdump", ["-T", file], "objdump -T").matchAll(/GLIBC_(\d+)\.(\d+)/g)].map((m) => [Number(m[1]), Number(m[2])]);
  versions.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  const v = versions.at(-1);
  return v ? `${v[0]}.${v[1]}` : "none";
}

function buildLinux() {
  const zigExe = zig();
  const work = join(ROOT, "build", "prebuild-linux-x64");
  rmSync(work, { recursive: true, force: true });
  mkdirSync(work, { recursive: true });
  // cmake takes one compiler path: a wrapper that is zig cc for x86_64 Linux with glibc 2.28
  const cc = join(work, "zig-cc");
  // no debug info and no build paths, stripped: the same sources give the same bytes wherever they are built
  writeFileSync(cc, `#!/bin/sh\nexec "${zigExe}" cc -target x86_64-linux-gnu.${GLIBC_BASELINE} -fno-sanitize=undefined -g0 ` +
    `-ffile-prefix-map=${ROOT}=. -ffile-prefix-map=${work}=build -Wl,--strip-all -Wl,--build-id=none "$@"\n`);
  chmodSync(cc, 0o755);
  const env = { ...process.env, CC: cc, ZIG_GLOBAL_CACHE_DIR: join(ROOT, "build", "portability", "zig-cache"), ZIG_LOCAL_CACHE_DIR: join(work, "zig-cache") };
  const include = createRequire(import.meta.url)("node-api-headers").include_dir;
  run("cmake", ["-S", ROOT, "-B", work, "-DKVL_NODE_ADDON=ON", `-DNODE_API_INCLUDE=${include}`, "-DKVL_WERROR=ON", "-DCMAKE_BUILD_TYPE=Release"],
    "cmake configure (zig cc)", { env });
  run("cmake", ["--build", work, "--parallel", "2", "--target", "kvl_node"], "cmake build (zig cc)", { env });
  const built = join(work, "wasm-core", "kvl_core.node");
  if (!existsSync(built)) throw new BuildError(`the zig build produced no ${relative(ROOT, built)}`);
  const glibc = newestGlibc(built);
  const [maj, min] = glibc.split(".").map(Number);
  const [bmaj, bmin] = GLIBC_BASELINE.split(".").map(Number);
  if (glibc !== "none" && (maj > bmaj || (maj === bmaj && min > bmin))) {
    throw new BuildError(`the Linux addon needs GLIBC_${glibc}, newer than the ${GLIBC_BASELINE} baseline`);
  }
  const dest = join(OUT, "linux-x64", "kvl_core.node");
  mkdirSync(dirname(dest), { recursive: true });
  copyFileSync(built, dest);
  const sets = loadTest(dest);
  return { toolchain: `zig ${ZIG_VERSION} cc (clang), -target x86_64-linux-gnu.${GLIBC_BASELINE}`, needs: `GLIBC_${glibc}`, kernel_sets: sets.replace(/; default .*$/, "") };
}

function buildWindows() {
  const dir = join(OUT, "win32-x64");
  mkdirSync(dir, { recursive: true });
  run("bash", [join(ROOT, "scripts", "check-mingw.sh"), "--keep", dir], "scripts/check-mingw.sh (mingw-w64)");
  const gcc = run("x86_64-w64-mingw32-gcc", ["-dumpversion"], "x86_64-w64-mingw32-gcc -dumpversion").trim();
  return { toolchain: `mingw-w64 gcc ${gcc}`, needs: "node.exe (delay-loaded) and system DLLs (scripts/check-mingw.sh lists them)" };
}

function readManifest(dir = OUT) {
  try {
    return JSON.parse(readFileSync(manifestOf(dir), "utf8"));
  } catch {
    return {};
  }
}

function check() {
  const digest = sourcesDigest();
  const manifest = readManifest(COMMITTED);
  const bad = TARGETS.filter((t) => !existsSync(join(COMMITTED, t, "kvl_core.node")) || manifest[t]?.sources !== digest);
  if (bad.length) {
    throw new BuildError(`no prebuilt addon from today's C sources for ${bad.join(", ")} (sources ${digest}): run npm run build:prebuilds first`);
  }
  console.log(`prebuilds: ${TARGETS.join(", ")} built from sources ${digest}`);
}

/** The committed prebuilds against a fresh build in OUT: byte for byte. */
function verify() {
  check();
  const differ = TARGETS.filter((t) => !readFileSync(join(OUT, t, "kvl_core.node")).equals(readFileSync(join(COMMITTED, t, "kvl_core.node"))));
  if (differ.length) throw new BuildError(`prebuilds/${differ.join(", prebuilds/")} differ from a fresh build of the same sources: run npm run build:prebuilds and commit`);
  console.log(`prebuilds: ${TARGETS.join(", ")} byte-identical to a fresh build`);
}

function main() {
  const argv = process.argv.slice(2);
  if (argv.includes("--check")) return check();
  const targets = [];
  let verifying = false;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--target" && TARGETS.includes(argv[i + 1])) targets.push(argv[++i]);
    else if (argv[i] === "--verify" && argv[i + 1]) {
      OUT = resolve(argv[++i]);
      verifying = true;
    } else throw new BuildError(`unknown argument ${argv[i]}: expected --target ${TARGETS.join("|")}, --verify DIR or --check`);
  }
  const digest = sourcesDigest();
  const manifest = readManifest();
  for (const t of targets.length ? targets : TARGETS) {
    const started = Date.now();
    const info = t === "linux-x64" ? buildLinux() : buildWindows();
    manifest[t] = { sources: digest, ...info };
    const file = join(OUT, t, "kvl_core.node");
    console.log(`${relative(ROOT, file).split(sep).join("/")}: ${(statSync(file).size / 1024).toFixed(0)} KiB, ${info.toolchain}, needs ${info.needs}; ` +
      `${((Date.now() - started) / 1000).toFixed(0)} s`);
  }
  mkdirSync(OUT, { recursive: true });
  writeFileSync(manifestOf(OUT), `${JSON.stringify(manifest, null, 2)}\n`);
  if (verifying) verify();
}

try {
  main();
} catch (err) {
  if (!(err instanceof BuildError)) throw err;
  console.error(`build-prebuilds: ${err.message}`);
  process.exitCode = 1;
}
