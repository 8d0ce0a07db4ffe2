#!/usr/bin/env bash
# low-ram.sh — issue 38's one run: the low-RAM table against its bounds. Q8 and Q4 routed experts,
# each under a 4 GiB + 256 MiB memory cgroup (native and WebAssembly) and an 8 GiB + 256 MiB one
# (native), with kvl's defaults inside the cap (--ram-mib auto, the chat plan, adaptive cache,
# read-ahead auto) and three routings per cap: the random-weight model's own, the calibrated trace
# (routing a trained model would produce, bench/routing-trace.ts) and uniform (the worst case).
# The compute a token needs comes from the same packs decoding all in RAM in the same run.
# Needs root (page-cache drops, cgroups), dist/, the native addon and two packs of the same
# model that differ only in --expert-dtype.
#   bash bench/low-ram.sh Q8PACK Q4PACK [OUT]      (OUT default /tmp/kvl-low-ram)
#   env: THREADS (2), DECODE (32 timed tokens), WARMUP (32 warm-up tokens), TOKENS (trace length, 2000)
# Prints the table (Markdown, bench/low-ram-table.ts); raw JSON and cgroup reports land in OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
Q8=${1:?usage: bench/low-ram.sh Q8PACK Q4PACK [OUT]}
Q4=${2:?usage: bench/low-ram.sh Q8PACK Q4PACK [OUT]}
OUT=${3:-/tmp/kvl-low-ram}
THREADS=${THREADS:-2} DECODE=${DECODE:-32} WARMUP=${WARMUP:-32} TOKENS=${TOKENS:-2000}
mkdir -p "$OUT"
step() { echo "low-ram: $(date -u +%H:%M:%S) (load $(cut -d" " -f1-3 /proc/loadavg)) $*" >&2; }

step limits
bash bench/measure-limits.sh "$Q8" "$OUT" "$THREADS" || exit 1

step "calibrated trace ($TOKENS tokens)"
npx vite-node bench/routing-trace-cli.ts generate "$OUT/calibrated.jsonl" --pack "$Q8" --tokens "$TOKENS" > "$OUT/calibrated.stats" || exit 1

common=(--threads "$THREADS" --limits "$OUT/limits.jsonl" --prompt-lens 16 --decode-tokens "$DECODE" --warm --warmup-tokens "$WARMUP" --json)
for dtype in q8 q4; do
    pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
    step "in RAM, $dtype, both backends"
    node dist/cli/kvl.js bench "$pack" --backend both --ram-mib 20000 "${common[@]}" --out "$OUT/ram-$dtype.json" \
        > /dev/null 2> "$OUT/ram-$dtype.err" || step "FAILED (see $OUT/ram-$dtype.err)"
done
# This disk's direct-read rate moves by 10-35 % between minutes (2026-12-06: 1.9 to 2.8 GB/s on
# the same file within a quarter of an hour), so each row runs alone, one routing per process,
# between two probes of the rate at the figure's setting (2 MiB pieces, queue depth 4, page cache
# dropped), into NAME.disk.jsonl: the table divides that row's bytes by their mean.
probe() { sync; echo 3 > /proc/sys/vm/drop_caches; "$OUT/membw" ssd "$1/experts.bin" 2097152 4 1024 4 >> "$2"; }
row() { # row NAME PACK CAP BACKEND ROUTING [kvl bench flags...]
    local name=$1 pack=$2 cap=$3 backend=$4 routing=$5
    shift 5
    step "$cap cgroup, $name"
    : > "$OUT/$name.disk.jsonl"
    probe "$pack" "$OUT/$name.disk.jsonl"
    bash bench/cgroup-run.sh "$cap" "$OUT/$name.report" -- node dist/cli/kvl.js bench "$pack" --backend "$backend" \
        --drop-caches --routing "$routing" "${common[@]}" "$@" --out "$OUT/$name.json" \
        > /dev/null 2> "$OUT/$name.err" || step "FAILED (see $OUT/$name.report)"
    probe "$pack" "$OUT/$name.disk.jsonl"
}
for cap in 4352M 8448M; do
    for backend in native wasm; do
        [ "$cap" = 8448M ] && [ "$backend" = wasm ] && continue
        for dtype in q8 q4; do
            pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
            row "cap$cap-$dtype-$backend-model" "$pack" "$cap" "$backend" model
            row "cap$cap-$dtype-$backend-calibrated" "$pack" "$cap" "$backend" "trace:$OUT/calibrated.jsonl"
            row "cap$cap-$dtype-$backend-uniform" "$pack" "$cap" "$backend" uniform
        done
    done
done
# the cache policy's targets: hit rate at least plain LRU's on the calibrated trace, and nothing
# slower than the old default (frequency) under the model's routing (native, 4 GiB)
for dtype in q8 q4; do
    pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
    row "cap4352M-$dtype-native-policies" "$pack" 4352M native "trace:$OUT/calibrated.jsonl,model" --cache-policy lru,frequency
done
# what the chat plan's image reservation costs a text-only user: kvl chat --no-vision's plan gives
# the expert cache what the vision tower, its image decode and embeddings would hold (native, 4 GiB)
for dtype in q8 q4; do
    pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
    row "cap4352M-$dtype-native-textonly" "$pack" 4352M native "trace:$OUT/calibrated.jsonl,uniform" --plan chat-text
done
npx vite-node bench/low-ram-table.ts "$OUT"
