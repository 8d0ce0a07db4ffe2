#!/usr/bin/env node
// build-addon.mjs — build the Node-API addon (the native backend) with cmake.
//
//   node scripts/build-addon.mjs              (npm run build:native) a failure exits 1
//   node scripts/build-addon.mjs --optional   (npm's install script) a failure prints one line
//                                             saying kvl runs on WebAssembly, and exits 0
//
// Configures <repo>/CMakeLists.txt into build/addon with KVL_NODE_ADDON=ON against the headers of
// the npm package node-api-headers, builds the kvl_node target, copies the result to the stable
// path build/addon/kvl_core.node, and loads it once in a child process (a missing symbol or a bad
// instruction kills the child, not this script). Nothing is downloaded. Only node builtins and
// node-api-headers are used.
import { spawnSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, readdirSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const BUILD_DIR = path.join(ROOT, 'build', 'addon');
const OUTPUT = path.join(BUILD_DIR, 'kvl_core.node');
const LOG = path.join(BUILD_DIR, 'build.log');
const optional = process.argv.includes('--optional');

class BuildError extends Error {}

const logChunks = [];

// Runs a command; in --optional mode its output goes to the log (printed only by name on failure),
// otherwise it streams to this terminal.
function run(cmd, args, what) {
  logChunks.push(`$ ${cmd} ${args.join(' ')}\n`);
  const r = spawnSync(cmd, args, {
    cwd: ROOT,
    stdio: optional ? ['ignore', 'pipe', 'pipe'] : 'inherit',
    encoding: 'utf8',
    maxBuffer: 64 << 20,
  });
  if (optional) logChunks.push(r.stdout ?? '', r.stderr ?? '');
  if (r.error) {
    if (r.error.code === 'ENOENT') throw new BuildError(`${cmd} not found`);
    throw new BuildError(`${what}: ${r.error.message}`);
  }
  if (r.status !== 0) {
    const out = `${r.stdout ?? ''}${r.stderr ?? ''}`;
    if (/No CMAKE_C_COMPILER could be found|Could not find compiler|CMAKE_C_COMPILER not set|is not able to compile a simple test program/.test(out))
      throw new BuildError('no working C compiler found');
    throw new BuildError(`${what} failed (exit ${r.status ?? r.signal})`);
  }
}

// The newest kvl_core.node under dir, other than the stable copy itself.
function findBuilt(dir) {
  let best = null;
  const walk = (d) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      const p = path.join(d, e.name);
      if (e.isDirectory()) {
        if (e.name !== 'CMakeFiles') walk(p);
      } else if (e.name === 'kvl_core.node' && p !== OUTPUT) {
        const t = statSync(p).mtimeMs;
        if (!best || t > best.t) best = { p, t };
      }
    }
  };
  walk(dir);
  return best?.p ?? null;
}

function build() {
  let include;
  try {
    include = createRequire(import.meta.url)('node-api-headers').include_dir;
  } catch {
    throw new BuildError('the npm package node-api-headers is not installed (run npm ci)');
  }
  mkdirSync(BUILD_DIR, { recursive: true });
  // Never leave an addon from older sources behind a failed build: the host would run it.
  rmSync(OUTPUT, { force: true });

  run('cmake', ['--version'], 'cmake --version');
  // npm ci shows nothing else while the compile runs (in --optional mode its output goes to the log)
  console.log(`kvl: building the native addon with cmake (about half a minute)${optional ? '; without it kvl runs on WebAssembly' : ''}…`);
  run('cmake', ['-S', ROOT, '-B', BUILD_DIR, '-DKVL_NODE_ADDON=ON', `-DNODE_API_INCLUDE=${include}`,
    '-DCMAKE_BUILD_TYPE=Release'], 'cmake configure');
  run('cmake', ['--build', BUILD_DIR, '--parallel', '2', '--target', 'kvl_node', '--config', 'Release'],
    'cmake build');

  const built = findBuilt(BUILD_DIR);
  if (!built) throw new BuildError(`the build produced no kvl_core.node under ${BUILD_DIR}`);
  // Copy then rename: a process that has the old file loaded keeps its (unlinked) copy intact.
  const tmp = `${OUTPUT}.${process.pid}.tmp`;
  copyFileSync(built, tmp);
  renameSync(tmp, OUTPUT);

  // Load it once in a child: an unresolved symbol or an unsupported instruction kills the child.
  const probe = 'const a = require(process.argv[1]);' +
    "if (a.backend !== 'native' || !Array.isArray(a.kernelSets()) || typeof a.abiVersion() !== 'number')" +
    " throw new Error('unexpected exports');" +
    "console.log('abi ' + a.abiVersion() + ', kernel sets: ' + a.kernelSets().map(s => s.name + (s.supported ? '' : ' (unsupported)')).join(', ') + '; default ' + a.defaultKernelSet());";
  logChunks.push(`$ node -e <load probe> ${OUTPUT}\n`);
  const r = spawnSync(process.execPath, ['-e', probe, OUTPUT], { encoding: 'utf8' });
  logChunks.push(r.stdout ?? '', r.stderr ?? '');
  if (r.status !== 0) {
    rmSync(OUTPUT, { force: true });
    const why = (r.stderr || '').split('\n').find((l) => /Error|error|undefined symbol/.test(l)) ?? `exit ${r.status ?? r.signal}`;
    if (!optional) process.stderr.write(r.stderr ?? '');
    throw new BuildError(`the built addon does not load: ${why.trim()}`);
  }
  return r.stdout.trim();
}

// npm's install script in an installed package: the prebuilt addon for this platform serves
// (host/system/paths.ts finds it) unless it does not load here or KVL_BUILD_FROM_SOURCE=1 asks for
// a local build, so an install needs no compiler.
const PREBUILT = path.join(ROOT, 'prebuilds', `${process.platform}-${process.arch}`, 'kvl_core.node');
if (optional && process.env.KVL_BUILD_FROM_SOURCE !== '1' && existsSync(PREBUILT)) {
  const r = spawnSync(process.execPath, ['-e', 'require(process.argv[1]).kernelSets()', PREBUILT], { encoding: 'utf8' });
  if (r.status === 0) {
    console.log(`kvl: using the prebuilt native addon (${path.relative(ROOT, PREBUILT)}); KVL_BUILD_FROM_SOURCE=1 builds it here instead`);
    process.exit(0);
  }
  console.log(`kvl: the prebuilt native addon does not load here (${(r.stderr || '').trim().split('\n')[0]}); building one`);
}

try {
  const summary = build();
  if (optional) writeFileSync(LOG, logChunks.join(''));
  console.log(`kvl: native addon built (${summary})`);
  console.log(OUTPUT);
} catch (err) {
  if (!(err instanceof BuildError) && !optional) throw err;
  let logNote = '';
  if (optional) {
    try {
      mkdirSync(BUILD_DIR, { recursive: true });
      writeFileSync(LOG, logChunks.join(''));
      logNote = ` (log: ${path.relative(ROOT, LOG)})`;
    } catch { /* the log is a courtesy */ }
    console.log(`kvl: native addon not built: ${err.message}${logNote}; kvl will run on WebAssembly. ` +
      'For the native backend install cmake and a C compiler, then run `npm run build:native`.');
    process.exit(0);
  }
  console.error(`kvl: native addon build failed: ${err.message}`);
  process.exit(1);
}
