#!/usr/bin/env bash
# build.sh — the kernel library as a WebAssembly component, without emscripten (issue 14).
#
# Owns: the wasm32-wasi build of the kernels (Debian's clang + wasi-libc + compiler-rt for wasm32)
# and its conversion to a component of the kvl:kernels world (kernels.wit) with jco, then to
# JavaScript with `jco transpile`.
#   bash wasm-core/wasi/build.sh [OUT_DIR]      default OUT_DIR: build/wasi
# Writes OUT_DIR/kernels.core.wasm (the core module: a WASI preview1 reactor),
# OUT_DIR/kernels.embed.wasm (+ component-type section), OUT_DIR/kernels.component.wasm and
# OUT_DIR/js/ (kernels.js + its core wasm files; needs @bytecodealliance/preview2-shim to run).
# Installs nothing: it says what is missing and stops.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/build/wasi}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$root"

CC="${CC:-clang-14}"
SYSROOT="${WASI_SYSROOT:-/usr}"
JCO="$root/node_modules/.bin/jco"
ADAPTER="$root/node_modules/@bytecodealliance/jco/lib/wasi_snapshot_preview1.reactor.wasm"

missing=()
command -v "$CC" >/dev/null 2>&1 || missing+=("$CC (apt-get install clang-14)")
command -v wasm-ld-14 >/dev/null 2>&1 || command -v wasm-ld >/dev/null 2>&1 ||
    missing+=("wasm-ld (apt-get install lld-14)")
[ -f "$SYSROOT/lib/wasm32-wasi/libc.a" ] || missing+=("wasi-libc in $SYSROOT (apt-get install wasi-libc)")
ls /usr/lib/llvm-14/lib/clang/*/lib/wasi/libclang_rt.builtins-wasm32.a >/dev/null 2>&1 ||
    missing+=("compiler-rt for wasm32 (apt-get install libclang-rt-dev-wasm32)")
[ -x "$JCO" ] || missing+=("jco (npm install: @bytecodealliance/jco is a dev dependency)")
[ -f "$ADAPTER" ] || missing+=("the WASI preview1 reactor adapter shipped with @bytecodealliance/jco ($ADAPTER)")
if [ "${#missing[@]}" -gt 0 ]; then
    echo "wasi/build.sh: missing:" >&2
    printf '  %s\n' "${missing[@]}" >&2
    exit 1
fi

# Same language and warning flags as the other builds; SIMD128, no threads. A reactor: no main,
# _initialize runs the constructors; only the export_name functions of component.c (and memory)
# are exported.
CFLAGS=(--target=wasm32-wasi --sysroot="$SYSROOT" -std=c11 -O2 -msimd128 -Wall -Wextra -Werror
        -D_GNU_SOURCE -DKVL_X86=0 -Iwasm-core/include -Iwasm-core/src)
SOURCES=(wasm-core/src/kernels/kernels_ref.c wasm-core/src/kernels/kernels_select.c wasm-core/src/kernels/wasm/kernels_simd128.c
         wasm-core/src/kernels/kernels_gemm.c wasm-core/src/kernels/kernels_conformance.c wasm-core/wasi/component.c)
"$CC" "${CFLAGS[@]}" "${SOURCES[@]}" -mexec-model=reactor -Wl,-z,stack-size=1048576 \
      -Wl,--strip-debug -o "$out/kernels.core.wasm"

# jco embed reads the WIT through a WASI filesystem that has no preopens unless given one
# (jco-preopen.mjs); jco new and jco transpile work on bytes only.
KVL_WIT_DIR="$here" node --import "$here/jco-preopen.mjs" "$JCO" embed --wit "$here/kernels.wit" \
    --world-name kernels "$out/kernels.core.wasm" -o "$out/kernels.embed.wasm"
"$JCO" new "$out/kernels.embed.wasm" --adapt "wasi_snapshot_preview1=$ADAPTER" \
    -o "$out/kernels.component.wasm"
rm -rf "$out/js"
"$JCO" transpile "$out/kernels.component.wasm" --name kernels -o "$out/js" --quiet
echo "wasi/build.sh: component in $out/kernels.component.wasm, JavaScript in $out/js/kernels.js"
