#!/bin/sh
# kernels_ab.sh — A/B of the decode products: WebAssembly SIMD128 (emcc, run under node) against
# the native AVX2 and AVX-512 tables (gcc), same sources, same benchmark (bench/kernels_bench.c
# in its "decode" mode), 1 and 2 threads (the bench's own thread pool; emscripten pthreads in
# wasm).
#
# Usage (from anywhere): sh bench/kernels_ab.sh [--relaxed] [outdir]  (default outdir: /tmp/kvl_kernels_ab)
#   NODE=path/to/node: the Node that runs the wasm builds (default: node; Node 20 gets
#   --experimental-wasm-relaxed-simd for the relaxed one); NATIVE=0: skip the native runs.
#   --relaxed: only simd128 against simd128-relaxed on the Q8 x 8-bit decode (q8i8), in the
#   relaxed build, interleaved on the same data (kernels_bench ab), 1 and 2 threads.
# Needs gcc, emcc (Debian emscripten 3.1.6 is enough), clang-16 (the relaxed build) and node (20
# to 26).
# Prints, per decode product and shape, GB/s of weight bytes (wall clock, best of 4) on
# simd128 (wasm), simd128-relaxed (the relaxed wasm build, where this Node runs it), avx2 and
# avx512 (the level-3 table: "avx512-bf16" on CPUs with AVX512_BF16, whose bf16xb / q8xb run on
# VDPBF16PS), and the ratios simd128 / avx2 and relaxed / simd128 (only q8i8 runs other code in
# the relaxed table; its other rows show the noise). [1408 x 2048] x many
# matrices (~1.1 GB) is DRAM-bound decode (expert size, [11264 x 2048]: dense size, 8x the work per
# thread-pool run); [256 x 2048] x 1 matrix is the in-cache kernel speed.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
relaxed_only=0
if [ "${1:-}" = "--relaxed" ]; then
    relaxed_only=1
    shift
fi
out=${1:-/tmp/kvl_kernels_ab}
mkdir -p "$out/obj"
src="$root/wasm-core/src"

# emcc must use the machine's binaryen, not one that node_modules/.bin may put first on PATH.
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/node_modules/\.bin$' | paste -sd: -)
export PATH

# Debian's emscripten runs its JS optimizer with the machine's node, which needs Debian's acorn.
if [ -z "${NODE_PATH:-}" ] && [ -d /usr/share/nodejs ]; then
    NODE_PATH=/usr/share/nodejs
    export NODE_PATH
fi

node=${NODE:-node}
native=${NATIVE:-1}
[ "$relaxed_only" = 0 ] || native=0
if [ "$native" != 0 ]; then
    echo "building native (gcc -O3; ISA flags per file as in wasm-core/CMakeLists.txt)..." >&2
    CFLAGS="-std=c11 -O3 -DKVL_X86=1 -D_GNU_SOURCE -I$src"
    gcc $CFLAGS -c "$src/kernels/kernels_ref.c" -o "$out/obj/kernels_ref.o"
    gcc $CFLAGS -c "$src/kernels/kernels_select.c" -o "$out/obj/kernels_select.o"
    gcc $CFLAGS -c "$src/threadpool.c" -o "$out/obj/threadpool.o"
    gcc $CFLAGS -mavx2 -mfma -mf16c -c "$src/kernels/x86/kernels_avx2.c" -o "$out/obj/kernels_avx2.o"
    gcc $CFLAGS -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c \
        -c "$src/kernels/x86/kernels_avx512.c" -o "$out/obj/kernels_avx512.o"
    gcc $CFLAGS "$root/bench/kernels_bench.c" "$out"/obj/*.o -lm -lpthread -o "$out/kernels_bench"
fi

# The plain build, and the relaxed one (-DKVL_WASM_RELAXED=1 plus kernels_relaxed.c compiled as
# wasm-core/build-wasm.sh compiles it for the core).
echo "building wasm (emcc -O3 -msimd128, 2 pthreads; and the relaxed build)..." >&2
WASM_FLAGS="-std=c11 -O3 -msimd128 -pthread -sPTHREAD_POOL_SIZE=2 -sENVIRONMENT=node,worker
    -sEXIT_RUNTIME=1 -sALLOW_MEMORY_GROWTH=1 -sMAXIMUM_MEMORY=4GB -Wno-pthreads-mem-growth -I$src"
WASM_SRC="$src/kernels/kernels_ref.c $src/kernels/kernels_select.c $src/kernels/wasm/kernels_simd128.c $src/threadpool.c $root/bench/kernels_bench.c"
[ "$relaxed_only" = 1 ] || emcc $WASM_FLAGS $WASM_SRC -o "$out/kernels_bench.js"
bash "$root/wasm-core/build-wasm.sh" --relaxed-object "$out/kernels_relaxed.o"
emcc $WASM_FLAGS -DKVL_WASM_RELAXED=1 "$out/kernels_relaxed.o" $WASM_SRC -o "$out/kernels_bench_relaxed.js"

# emscripten 3.1.6's loader prefers fetch() when it exists, which fails for a file path on
# Node >= 18: hide it (wasm-core/tests/no-fetch.cjs; Node 24+ rejects --no-experimental-fetch).
# Node 20 has relaxed SIMD behind a flag that later Nodes reject.
relaxed_flag=""
if "$node" --v8-options | grep -q -- '--experimental-wasm-relaxed-simd'; then
    relaxed_flag=--experimental-wasm-relaxed-simd
fi
if [ "$relaxed_only" = 1 ]; then
    echo "Node $("$node" --version) $relaxed_flag: q8i8 decode, simd128 against simd128-relaxed (GB/s of weights, best of interleaved rounds)"
    "$node" $relaxed_flag -r "$root/wasm-core/tests/no-fetch.cjs" "$out/kernels_bench_relaxed.js" \
        ab simd128 simd128-relaxed q8i8 | tee "$out/relaxed-ab.txt"
    exit 0
fi
echo "running simd128 (wasm, Node $("$node" --version))..." >&2
"$node" -r "$root/wasm-core/tests/no-fetch.cjs" "$out/kernels_bench.js" simd128 decode > "$out/simd128.txt"
echo "running simd128-relaxed (wasm)..." >&2
if ! "$node" $relaxed_flag -r "$root/wasm-core/tests/no-fetch.cjs" "$out/kernels_bench_relaxed.js" \
        simd128-relaxed decode > "$out/relaxed.txt" 2> "$out/relaxed.err"; then
    echo "  this Node does not run the relaxed build: $(grep -m1 -i error "$out/relaxed.err" | cut -c1-160)" >&2
    : > "$out/relaxed.txt"
fi
if [ "$native" != 0 ]; then
    echo "running avx2..." >&2
    "$out/kernels_bench" avx2 decode > "$out/avx2.txt"
    echo "running avx512 (level 3)..." >&2
    "$out/kernels_bench" 3 decode > "$out/avx512.txt"
else
    : > "$out/avx2.txt"
    : > "$out/avx512.txt"
fi

# files in the order simd128, relaxed, avx2, avx512; any may be empty (told apart by name)
awk '
{ f = FILENAME ~ /simd128\.txt$/ ? 1 : FILENAME ~ /relaxed\.txt$/ ? 2 : FILENAME ~ /avx2\.txt$/ ? 3 : 4 }
/^RESULT / {
    key = $3 " " $4 " " $5
    if (!(key in seen)) { seen[key] = 1; order[++n] = key }
    v[f, key] = $6
    if (f == 4) name4 = $2
}
function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2f", a / b) : "-" }
END {
    printf "decode GB/s of weight bytes (wall, best of 4); avx512 = table %s\n", name4
    printf "%-7s %-16s %3s %9s %9s %8s %8s %13s %16s\n", "kind", "shape", "thr", "simd128", "relaxed", "avx2", "avx512", "simd128/avx2", "relaxed/simd128"
    for (i = 1; i <= n; i++) {
        split(order[i], k, " ")
        a = v[1, order[i]]; r = v[2, order[i]]; b = v[3, order[i]]; c = v[4, order[i]]
        printf "%-7s %-16s %3s %9s %9s %8s %8s %13s %16s\n", k[1], k[2], k[3], a, (r == "" ? "-" : r), (b == "" ? "-" : b), (c == "" ? "-" : c), ratio(a, b), ratio(r, a)
    }
}' "$out/simd128.txt" "$out/relaxed.txt" "$out/avx2.txt" "$out/avx512.txt" | tee "$out/table.txt"
echo "thread pool fork/join cost (an empty task), which the small matrices pay per product:"
for f in simd128 relaxed avx2 avx512; do grep "fork/join" "$out/$f.txt" | sed "s/^ */  $f: /"; done
