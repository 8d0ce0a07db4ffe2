#!/usr/bin/env bash
# measure-limits.sh — this machine's limits for `kvl bench --limits`, as the one-run scripts
# (bench/low-ram.sh, bench/q4-side-by-side.sh) take them: bench/membw.c built into OUT, then
# DRAM (2 GiB, avx2 and avx512), direct reads of PACK's experts.bin after dropping the page cache
# (whole extents at queue depth 2, and 2 MiB pieces at queue depth 4: the figure kvl bench
# divides by) and the FP32 FMA peak, one JSON line each into OUT/limits.jsonl. Root (page-cache
# drops), dist/ built.
#   bash bench/measure-limits.sh PACK OUT [THREADS]
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=${1:?usage: bench/measure-limits.sh PACK OUT [THREADS]}
OUT=${2:?usage: bench/measure-limits.sh PACK OUT [THREADS]}
THREADS=${3:-2}
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
gcc -std=c11 -O2 -mavx2 -mfma -Wall -Wextra bench/membw.c -lpthread -o "$OUT/membw" || exit 1
EXTENT=$(node -e 'import("./dist/host/pack/pack-format.js").then(async ({ PackReader }) =>
  console.log((await PackReader.open(process.argv[1])).stores.get("experts").records[0].nbytes))' "$PACK") || exit 1
: > "$OUT/limits.jsonl"
for isa in avx2 avx512; do "$OUT/membw" dram 2048 "$THREADS" 5 "$isa" >> "$OUT/limits.jsonl"; done
drop_caches; "$OUT/membw" ssd "$PACK/experts.bin" "$EXTENT" 2 256 2 >> "$OUT/limits.jsonl"
drop_caches; "$OUT/membw" ssd "$PACK/experts.bin" 2097152 4 1024 4 >> "$OUT/limits.jsonl"
"$OUT/membw" fma "$THREADS" 2 >> "$OUT/limits.jsonl"
