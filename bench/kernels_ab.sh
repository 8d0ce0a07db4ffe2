#!/bin/sh
# kernels_ab.sh — A/B of the decode products: WebAssembly SIMD128 (emcc, run under node) against
# the native AVX2 and AVX-512 tables (gcc), same sources, same benchmark (bench/kernels_bench.c
# in its "decode" mode), 1 and 2 threads (the bench's own thread pool; emscripten pthreads in
# wasm).
#
# Usage (from anywhere): sh bench/kernels_ab.sh [outdir]     (default outdir: /tmp/kvl_kernels_ab)
# Needs gcc, emcc (Debian emscripten 3.1.6 is enough) and node (20 to 26).
# Prints, per decode product and shape, GB/s of weight bytes (wall clock, best of 4) on
# simd128 (wasm), avx2 and avx512 (the level-3 table: "avx512-bf16" on CPUs with AVX512_BF16,
# whose bf16xb / q8xb run on VDPBF16PS), and the ratio simd128 / avx2. [1408 x 2048] x many
# matrices (~1.1 GB) is DRAM-bound decode (expert size, [11264 x 2048]: dense size, 8x the work per
# thread-pool run); [256 x 2048] x 1 matrix is the in-cache kernel speed.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
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

echo "building native (gcc -O3; ISA flags per file as in wasm-core/CMakeLists.txt)..." >&2
CFLAGS="-std=c11 -O3 -DKVL_X86=1 -D_GNU_SOURCE -I$src"
gcc $CFLAGS -c "$src/kernels_ref.c" -o "$out/obj/kernels_ref.o"
gcc $CFLAGS -c "$src/kernels_select.c" -o "$out/obj/kernels_select.o"
gcc $CFLAGS -c "$src/threadpool.c" -o "$out/obj/threadpool.o"
gcc $CFLAGS -mavx2 -mfma -mf16c -c "$src/kernels_avx2.c" -o "$out/obj/kernels_avx2.o"
gcc $CFLAGS -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c \
    -c "$src/kernels_avx512.c" -o "$out/obj/kernels_avx512.o"
gcc $CFLAGS "$root/bench/kernels_bench.c" "$out"/obj/*.o -lm -lpthread -o "$out/kernels_bench"

echo "building wasm (emcc -O3 -msimd128, 2 pthreads)..." >&2
emcc -std=c11 -O3 -msimd128 -pthread -sPTHREAD_POOL_SIZE=2 -sENVIRONMENT=node,worker \
    -sEXIT_RUNTIME=1 -sALLOW_MEMORY_GROWTH=1 -sMAXIMUM_MEMORY=4GB -Wno-pthreads-mem-growth \
    -I"$src" "$src/kernels_ref.c" "$src/kernels_select.c" "$src/kernels_simd128.c" \
    "$src/threadpool.c" "$root/bench/kernels_bench.c" -o "$out/kernels_bench.js"

# emscripten 3.1.6's loader prefers fetch() when it exists, which fails for a file path on
# Node >= 18: hide it (wasm-core/tests/no-fetch.cjs; Node 24+ rejects --no-experimental-fetch).
echo "running simd128 (wasm)..." >&2
node -r "$root/wasm-core/tests/no-fetch.cjs" "$out/kernels_bench.js" simd128 decode > "$out/simd128.txt"
echo "running avx2..." >&2
"$out/kernels_bench" avx2 decode > "$out/avx2.txt"
echo "running avx512 (level 3)..." >&2
"$out/kernels_bench" 3 decode > "$out/avx512.txt"

awk '
FNR == 1 { f++ }
/^RESULT / {
    key = $3 " " $4 " " $5
    if (!(key in seen)) { seen[key] = 1; order[++n] = key }
    v[f, key] = $6
    if (f == 3) name3 = $2
}
END {
    printf "decode GB/s of weight bytes (wall, best of 4); avx512 = table %s\n", name3
    printf "%-7s %-16s %3s %9s %8s %8s %13s\n", "kind", "shape", "thr", "simd128", "avx2", "avx512", "simd128/avx2"
    for (i = 1; i <= n; i++) {
        split(order[i], k, " ")
        a = v[1, order[i]]; b = v[2, order[i]]; c = v[3, order[i]]
        printf "%-7s %-16s %3s %9s %8s %8s %13s\n", k[1], k[2], k[3], a, b, c, (b > 0 ? sprintf("%.2f", a / b) : "-")
    }
}' "$out/simd128.txt" "$out/avx2.txt" "$out/avx512.txt" | tee "$out/table.txt"
echo "thread pool fork/join cost (an empty task), which the small matrices pay per product:"
for f in simd128 avx2 avx512; do grep "fork/join" "$out/$f.txt" | sed "s/^ */  $f: /"; done
