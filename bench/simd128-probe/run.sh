#!/bin/sh
# run.sh — builds decode_variants.c with Debian's clang-16 / wasm-ld-16 (relaxed SIMD needs
# LLVM >= 16; emscripten 3.1.6 is LLVM 14) and times it under node with relaxed SIMD enabled
# (behind a flag in Node 20; on by default from Node 22, whose V8 no longer has the flag and
# rejects it). Usage: sh bench/simd128-probe/run.sh [outdir]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-/tmp/kvl-simd128-probe}
mkdir -p "$out"
clang-16 --target=wasm32 -O3 -msimd128 -mrelaxed-simd -c "$here/decode_variants.c" -o "$out/decode_variants.o"
wasm-ld-16 --no-entry --export-memory -z stack-size=1048576 --stack-first "$out/decode_variants.o" -o "$out/decode_variants.wasm"
relaxed=""
if node --v8-options | grep -q -- '--experimental-wasm-relaxed-simd'; then relaxed=--experimental-wasm-relaxed-simd; fi
node $relaxed "$here/run.mjs" "$out/decode_variants.wasm"
echo "the same, TurboFan only (no Liftoff):"
node $relaxed --no-liftoff "$here/run.mjs" "$out/decode_variants.wasm"
