#!/usr/bin/env node
// c-layers.mjs — checks that the C core (wasm-core/src) calls in one direction only.
//
//   node scripts/c-layers.mjs      print, per .c file, the other .c files it calls into; exit 1 if
//                                  a file calls into a file of a higher layer, the graph of files
//                                  has a cycle, or a .c file is in no layer
//   node scripts/c-layers.mjs -v   also every call that crosses files (caller -> callee)
//
// The call graph is the compiler's: each wasm-core/src/*.c is compiled to LLVM IR at -O0 (nothing
// inlined, so every call written in the source is there) for the three targets the core is built
// for: Linux (clang), Windows x86-64 (clang against mingw-w64's headers) and WebAssembly (emcc),
// so code behind #ifdef _WIN32 or __EMSCRIPTEN__ is seen too. An edge is any use of a function
// defined with external linkage in another file: a call, or its address taken (a function stored
// in a kernel table is called through it). The static inline functions of headers (platform.h,
// threadpool.h) are each includer's own, not an edge. Calls within one file (mutual recursion
// included) are not checked. Needs clang-14 (or clang) and emcc, which .ci/run installs; only
// node builtins are used.
import { execFile } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const SRC = path.join(ROOT, 'wasm-core', 'src');
const verbose = process.argv.includes('-v');

// The layers, top first. A file may call files of its own layer and of the layers below it,
// never a file of a layer above; `*` in a name matches any characters.
const LAYERS = [
  ['public API', ['engine.c']],
  ['forward passes', ['model.c', 'vision.c']],
  ['engine services', ['engine_errors.c', 'trunk.c']],
  ['caches, stores and pack formats', ['expert_cache.c', 'store.c', 'packing.c']],
  ['threads, kernels, CRC-32 and struct layouts', ['threadpool.c', 'kernels/*.c', 'crc32.c', 'sampler.c', 'layout.c']],
  // platform.h is static inline (each includer's own); what of it needs a .c is here
  ['platform', ['platform_wasm.c']],
];

const run = promisify(execFile);

function fail(msg) {
  console.error(`c-layers: ${msg}`);
  process.exit(1);
}

// The first of names that runs (`NAME --version`), else null.
async function firstTool(names) {
  for (const n of names) {
    try {
      await run(n, ['--version']);
      return n;
    } catch {
      /* not installed */
    }
  }
  return null;
}

// Files by their path below wasm-core/src ('kernels/x86/kernels_avx2.c'), the kernel room's too.
const files = readdirSync(SRC, { recursive: true })
  .map((f) => f.split(path.sep).join('/'))
  .filter((f) => f.endsWith('.c'))
  .sort();
const layerOf = new Map();
for (const [i, [, patterns]] of LAYERS.entries()) {
  for (const p of patterns) {
    const re = new RegExp(`^${p.replace(/\./g, '\\.').replace(/\*/g, '.*')}$`);
    const hits = files.filter((f) => re.test(f));
    if (hits.length === 0) fail(`layer '${LAYERS[i][0]}' names ${p}, which matches no file in wasm-core/src: update LAYERS in scripts/c-layers.mjs`);
    for (const f of hits) if (!layerOf.has(f)) layerOf.set(f, i);
  }
}
const unplaced = files.filter((f) => !layerOf.has(f));
if (unplaced.length) fail(`${unplaced.join(', ')} in no layer: add each to LAYERS in scripts/c-layers.mjs`);

const clang = await firstTool(['clang-14', 'clang']);
if (!clang) fail('clang-14 (or clang) not found (Debian: apt-get install clang-14; .ci/run installs it)');
const emcc = await firstTool(['emcc']);
if (!emcc) fail('emcc not found (Debian: apt-get install emscripten; .ci/run installs it)');

// The builds' own flags (wasm-core/CMakeLists.txt, wasm-core/build-wasm.sh), at -O0.
const INC = ['-Iwasm-core/include', '-Iwasm-core/src'];
const AVX = {
  'kernels/x86/kernels_avx2.c': ['-mavx2', '-mfma', '-mf16c'],
  'kernels/x86/kernels_avx512.c': ['-mavx512f', '-mavx512bw', '-mavx512vl', '-mavx512dq', '-mavx512vnni', '-mavx512bf16', '-mfma', '-mf16c'],
};
const x64 = process.arch === 'x64';
const TARGETS = [
  { name: 'linux', cc: clang, x86: x64,
    flags: ['-std=c11', '-O0', '-D_GNU_SOURCE', '-D_FILE_OFFSET_BITS=64', '-DKVL_BUILDING_DLL', `-DKVL_X86=${x64 ? 1 : 0}`, ...INC] },
  { name: 'windows', cc: clang, x86: true,
    flags: ['--target=x86_64-w64-windows-gnu', '-std=c11', '-O0', '-D_FILE_OFFSET_BITS=64', '-DKVL_BUILDING_DLL', '-DKVL_X86=1', ...INC] },
  { name: 'wasm', cc: emcc, x86: false,
    flags: ['-std=c11', '-O0', '-msimd128', '-pthread', '-D_GNU_SOURCE', '-D_FILE_OFFSET_BITS=64', '-DKVL_X86=0', ...INC] },
];

// Functions defined in one LLVM IR module, and the functions each of them (or a global's
// initializer, as `(table NAME)`) refers to.
function parseIR(text) {
  const defs = new Map(); // name -> external linkage?
  const refs = []; // [from, to]
  let fn = null;
  const scan = (from, line) => {
    for (const m of line.matchAll(/@("([^"]+)"|[A-Za-z_.$][\w.$]*)/g)) {
      const to = m[2] ?? m[1];
      if (!to.startsWith('llvm.')) refs.push([from, to]);
    }
  };
  for (const line of text.split('\n')) {
    if (fn === null) {
      const d = /^define\s+([^@]*)@("([^"]+)"|[\w.$]+)\(/.exec(line);
      if (d) {
        fn = d[3] ?? d[2];
        defs.set(fn, !/\b(internal|private)\b/.test(d[1]));
      } else if (line.startsWith('@')) {
        const g = /^@("([^"]+)"|[\w.$]+)\s*=/.exec(line);
        if (g) scan(`(table ${g[2] ?? g[1]})`, line.slice(g[0].length));
      }
    } else if (line === '}') {
      fn = null;
    } else {
      scan(fn, line);
    }
  }
  return { defs, refs };
}

const tmp = mkdtempSync(path.join(os.tmpdir(), 'kvl-c-layers-'));
const jobs = [];
for (const t of TARGETS)
  for (const f of files) {
    if (AVX[f] && !t.x86) continue;
    jobs.push({ t, f, out: path.join(tmp, `${t.name}-${f.replaceAll('/', '+')}.ll`) });
  }
const errors = [];
let next = 0;
const workers = Array.from({ length: Math.max(1, os.availableParallelism?.() ?? os.cpus().length) }, async () => {
  while (next < jobs.length) {
    const j = jobs[next++];
    const args = [...j.t.flags, ...(AVX[j.f] ?? []), '-S', '-emit-llvm', path.join('wasm-core', 'src', j.f), '-o', j.out];
    try {
      await run(j.t.cc, args, { cwd: ROOT, maxBuffer: 16 << 20 });
      j.ir = parseIR(readFileSync(j.out, 'utf8'));
    } catch (e) {
      errors.push(`${j.t.cc} (${j.t.name}) ${j.f}: ${(e.stderr || e.message).trim().split('\n').slice(0, 5).join('\n')}`);
    }
  }
});
await Promise.all(workers);
rmSync(tmp, { recursive: true, force: true });
if (errors.length) fail(`compiling to LLVM IR failed:\n${errors.join('\n')}`);

// file -> file -> [caller -> callee, ...] over all targets
const edges = new Map(files.map((f) => [f, new Map()]));
for (const t of TARGETS) {
  const mine = jobs.filter((j) => j.t === t);
  const home = new Map(); // externally defined function -> its file
  for (const j of mine)
    for (const [name, external] of j.ir.defs) {
      if (!external) continue;
      if (home.has(name)) fail(`${name} is defined in both ${home.get(name)} and ${j.f} (${t.name})`);
      home.set(name, j.f);
    }
  for (const j of mine)
    for (const [from, to] of j.ir.refs) {
      if (j.ir.defs.has(to)) continue; // its own (a static of this file shadows any other)
      const g = home.get(to);
      if (!g || g === j.f) continue;
      const calls = edges.get(j.f);
      if (!calls.has(g)) calls.set(g, new Set());
      calls.get(g).add(`${from} -> ${to}`);
    }
}

const problems = [];
for (const [f, calls] of edges)
  for (const [g, list] of calls)
    if (layerOf.get(g) < layerOf.get(f))
      problems.push(`${f} (${LAYERS[layerOf.get(f)][0]}) calls ${g} (${LAYERS[layerOf.get(g)][0]}), a higher layer: ${[...list].sort().join(', ')}`);

// a cycle of files, as a path, or null (depth-first search; the graph is small)
function findCycle() {
  const state = new Map(); // 1 on the stack, 2 done
  const stack = [];
  const visit = (f) => {
    state.set(f, 1);
    stack.push(f);
    for (const g of edges.get(f).keys()) {
      if (state.get(g) === 1) return [...stack.slice(stack.indexOf(g)), g];
      if (!state.has(g)) {
        const c = visit(g);
        if (c) return c;
      }
    }
    stack.pop();
    state.set(f, 2);
    return null;
  };
  for (const f of files) if (!state.has(f)) {
    const c = visit(f);
    if (c) return c;
  }
  return null;
}
const cycle = findCycle();
if (cycle) problems.push(`the files call in a circle: ${cycle.join(' -> ')}`);

console.log(`C core layers (top first; a file calls its own layer and those below):`);
for (const [i, [name]] of LAYERS.entries())
  console.log(`  ${i + 1}. ${name}: ${files.filter((f) => layerOf.get(f) === i).join(', ')}`);
console.log('calls into other files (Linux, Windows and WebAssembly builds):');
const width = Math.max(...files.map((f) => f.length));
for (const f of files) {
  const calls = edges.get(f);
  const targets = [...calls.keys()].sort((a, b) => layerOf.get(a) - layerOf.get(b) || a.localeCompare(b));
  console.log(`  ${f.padEnd(width)} -> ${targets.length ? targets.join(', ') : '(none)'}`);
  if (verbose) for (const g of targets) for (const c of [...calls.get(g)].sort()) console.log(`      ${g}: ${c}`);
}
if (problems.length) {
  for (const p of problems) console.error(`c-layers: ${p}`);
  process.exit(1);
}
console.log(`c-layers: ${files.length} files, no call into a higher layer, no cycle`);
