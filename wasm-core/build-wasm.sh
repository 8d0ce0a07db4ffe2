#!/usr/bin/env bash
# build-wasm.sh — the WebAssembly build of the C core (SIMD128 + pthreads) with Debian's emscripten.
#
# Owns: the emcc flags of the committed build in wasm-core/dist/ (kvl_core.cjs loader,
# kvl_core.worker.js for its pthreads, kvl_core.wasm, EMCC_VERSION), of its relaxed-SIMD twin
# (kvl_core_relaxed.cjs, .worker.js, .wasm), and of the C tests compiled to WebAssembly.
#   bash wasm-core/build-wasm.sh            rebuild wasm-core/dist/
#   bash wasm-core/build-wasm.sh OUT_DIR    build into OUT_DIR (the reproducibility check)
#   bash wasm-core/build-wasm.sh --tests OUT_DIR
#                                           the C tests that run under WebAssembly, as OUT_DIR/*.js,
#                                           and OUT_DIR/relaxed/test_kernels.js (relaxed build: it
#                                           needs a Node whose WebAssembly has relaxed SIMD)
#   bash wasm-core/build-wasm.sh --relaxed-object OUT.o
#                                           kernels_relaxed.c as the relaxed link takes it (for
#                                           bench/kernels_ab.sh)
# Every exported function is the public API of include/kvl_core.h; the public API is all the host
# calls. The build is deterministic (relative paths, no debug info, no timestamps), so the bytes
# in dist/ are what these sources give; the emcc and clang versions are recorded beside them.
# kvl_core_relaxed.wasm is the same link with -DKVL_WASM_RELAXED=1 plus kernels_relaxed.c, which
# emscripten 3.1.6 (LLVM 14) cannot compile: Debian's clang-16 compiles it to an object for
# emcc's link (wasm-ld 14 takes it). Its relaxed instructions pass through emcc's binaryen 108,
# which knows only the old numbering of relaxed SIMD, so the object and the linked module are
# checked to hold i16x8.relaxed_dot_i8x16_i7x16_s (0x112, numbered alike in both) and no other
# relaxed opcode. The host loads it only where relaxed SIMD validates and a self-test passes.
# Pitfalls (design.md): emcc's JS optimizer needs Debian's acorn (NODE_PATH=/usr/share/nodejs)
# when node is not Debian's; the generated loader fetch()es the .wasm on Node >= 18, so the host
# passes the bytes itself (wasmBinary).
set -euo pipefail
cd "$(dirname "$0")/.."
export NODE_PATH="${NODE_PATH:-/usr/share/nodejs}"
# Under `npm run`/`npm test` node_modules/.bin leads PATH, and jco brings binaryen's npm build
# (another wasm-opt), which emcc would pick up: different bytes, and a loader that does not match
# its .wasm (seen here). emcc gets the machine's toolchain only.
PATH="$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/node_modules/\.bin$' | paste -sd: -)"
export PATH

if ! command -v emcc >/dev/null 2>&1; then
    echo "build-wasm: emcc not found (Debian: apt-get install emscripten)" >&2
    exit 1
fi
RELAXED_CC=clang-16
RELAXED_OBJDUMP=llvm-objdump-16
for tool in "$RELAXED_CC" "$RELAXED_OBJDUMP"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build-wasm: $tool not found (Debian: apt-get install clang-16 llvm-16)" >&2
        exit 1
    fi
done

# Same language and warning flags as the native build; SIMD128 everywhere (kernels_simd128.c is
# the table the wasm build selects), pthreads for the core's thread pool.
CFLAGS=(-std=c11 -O3 -msimd128 -pthread -Wall -Wextra -Werror
        -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 -DKVL_X86=0
        -Iwasm-core/include -Iwasm-core/src)
SOURCES=()
for src in wasm-core/src/*.c wasm-core/src/kernels/*.c wasm-core/src/kernels/wasm/*.c; do
    case "$src" in *kernels_relaxed.c) continue ;; esac # the relaxed link adds it (relaxed_object)
    SOURCES+=("$src")
done

# kernels_relaxed.c -> $1 with clang-16, for emscripten's target and sysroot (its headers), with
# the features every object of the link has (atomics and bulk memory: the memory is shared)
# plus relaxed SIMD; then the opcode check above.
relaxed_object() {
    "$RELAXED_CC" --target=wasm32-unknown-emscripten --sysroot="$(em-config CACHE)/sysroot" -std=c11 -O3 \
        -msimd128 -mrelaxed-simd -matomics -mbulk-memory -mmutable-globals -msign-ext \
        -Wall -Wextra -Werror -D_GNU_SOURCE -D_FILE_OFFSET_BITS=64 -DKVL_X86=0 \
        -Iwasm-core/include -Iwasm-core/src -c wasm-core/src/kernels/wasm/kernels_relaxed.c -o "$1"
    check_relaxed_opcodes "$1"
}
# $1 (an object or a module) holds 0x112 and no other relaxed-SIMD opcode (0xfd 0x100-0x113)
check_relaxed_opcodes() {
    local found
    found="$("$RELAXED_OBJDUMP" -d "$1" | grep -oE '^ *[0-9a-f]+: fd [89][0-9a-f] 02( |$)' |
             awk '{print $2, $3, $4}' | sort -u | paste -sd,)"
    if [ "$found" != "fd 92 02" ]; then
        echo "build-wasm: $1: relaxed-SIMD opcodes [$found], expected exactly 0x112 (fd 92 02):" \
             "binaryen 108 misreads the others (see the header)" >&2
        exit 1
    fi
}
# Memory does not grow (growth under pthreads makes every JS view of it stale and slow): the host
# creates each instance's shared memory at its planned size, at most 4 GiB (the wasm32 limit),
# and passes it in as wasmMemory; 64 MiB is the size when it passes none.
# The module declares a 4 GiB maximum so that an imported memory of any size up to that links;
# the host gives each memory maximum = initial, so it cannot actually grow (a failed grow is a
# NULL from malloc), hence -Wno-pthreads-mem-growth.
LINK=(-pthread -sPTHREAD_POOL_SIZE=Module.kvlPthreads -sINITIAL_MEMORY=64MB -sALLOW_MEMORY_GROWTH=1
      -sMAXIMUM_MEMORY=4GB -Wno-pthreads-mem-growth -sTOTAL_STACK=1MB
      -sENVIRONMENT=node,worker -sEXIT_RUNTIME=0)

if [ "${1:-}" = "--relaxed-object" ]; then
    relaxed_object "${2:?usage: build-wasm.sh --relaxed-object OUT.o}"
    exit 0
fi

if [ "${1:-}" = "--tests" ]; then
    out="${2:?usage: build-wasm.sh --tests OUT_DIR}"
    mkdir -p "$out/relaxed"
    # Tests that need no files of their own (the store tests write packs: they run natively).
    # A fixed pool (the last -s wins over LINK's Module.kvlPthreads, which no test sets): with
    # none, main() on its proxied pthread never started and Node exited 0 having run nothing.
    TEST_LINK=(-sPTHREAD_POOL_SIZE=4 -sPROXY_TO_PTHREAD -sEXIT_RUNTIME=1)
    for t in test_kernels test_threadpool test_sampler test_packing test_crc32; do
        emcc "${CFLAGS[@]}" "${SOURCES[@]}" "wasm-core/tests/$t.c" "${LINK[@]}" "${TEST_LINK[@]}" -o "$out/$t.js"
    done
    # the kernel tests once more on the relaxed build (both of its SIMD tables), in a folder of
    # their own: only a Node with relaxed SIMD runs them
    relaxed_object "$out/relaxed/kernels_relaxed.o"
    emcc "${CFLAGS[@]}" -DKVL_WASM_RELAXED=1 "$out/relaxed/kernels_relaxed.o" "${SOURCES[@]}" \
         wasm-core/tests/test_kernels.c "${LINK[@]}" "${TEST_LINK[@]}" -o "$out/relaxed/test_kernels.js"
    echo "build-wasm: tests in $out"
    exit 0
fi

out="${1:-wasm-core/dist}"
mkdir -p "$out"
exports="$(grep -o 'KVL_API [^(]*(' wasm-core/include/kvl_core.h | grep -v 'declspec\|attribute' |
           sed -E 's/.*[ *]([a-z_0-9]+)\($/"_\1"/' | tr '\n' ',')"
# A library inside the host's process: the loader must not install process-wide
# uncaughtException / unhandledRejection handlers (one more per instance, and they would rethrow
# the host's own errors); the core never calls exit().
# link_core NAME [EXTRA...]: $out/NAME.{cjs,worker.js,wasm} from SOURCES plus EXTRA
link_core() {
    local name="$1"
    shift
    emcc "${CFLAGS[@]}" "$@" "${SOURCES[@]}" "${LINK[@]}" \
         -sMODULARIZE=1 -sEXPORT_NAME=createKvlCore -sNODEJS_CATCH_EXIT=0 -sNODEJS_CATCH_REJECTION=0 \
         -sEXPORTED_FUNCTIONS="[${exports}\"_malloc\",\"_free\"]" \
         -sEXPORTED_RUNTIME_METHODS='["UTF8ToString","stringToUTF8","lengthBytesUTF8"]' \
         -o "$out/$name.cjs"
}
link_core kvl_core
# The relaxed twin. It has a loader of its own: the loader holds addresses in the module's data
# (one more table there moves them), and names its worker after itself. kernels_relaxed.o is
# built in a scratch folder; nothing of its path reaches the output.
scratch="$(mktemp -d "${TMPDIR:-/tmp}/kvl-wasm-relaxed.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
relaxed_object "$scratch/kernels_relaxed.o"
link_core kvl_core_relaxed -DKVL_WASM_RELAXED=1 "$scratch/kernels_relaxed.o"
check_relaxed_opcodes "$out/kvl_core_relaxed.wasm"
# emscripten 3.1.6's ES-module output does not run on Node (it uses __dirname), so the loader is
# CommonJS; this folder says so, as the package around it is "type": "module".
printf '{ "type": "commonjs" }\n' > "$out/package.json"
# sed reads all of it: head would close the pipe early and emcc (python) dies of SIGPIPE under pipefail
{ emcc --version | sed -n 1p; "$RELAXED_CC" --version | sed -n 1p; } > "$out/EMCC_VERSION"
echo "build-wasm: $out/kvl_core.cjs + kvl_core.wasm ($(stat -c %s "$out/kvl_core.wasm") bytes)," \
     "kvl_core_relaxed.cjs + kvl_core_relaxed.wasm ($(stat -c %s "$out/kvl_core_relaxed.wasm") bytes)"
