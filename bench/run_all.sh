#!/usr/bin/env bash
# bench/run_all.sh — the exact commands behind bench/RESULTS.md (Linux, root for drop_caches).
#
# Owns: the order of the measurements and where their raw output goes. Nothing is asserted.
# Usage: bench/run_all.sh [PACK] [OUT]      (defaults: /tmp/kvl-full-pack, /tmp/kvl-bench/results)
# Env:   THREADS (default 2), DECODE_TOKENS (16), ACT_DTYPES (Linear-input modes to run, default
#        "f32 bf16"), BACKENDS (kvl bench --backend: native, wasm or both; default both),
#        SKIP_VISION=1, SKIP_TEXT=1.
# Runs over the compiled TypeScript (npm ci builds dist/ and the native addon).
# The full-size pack comes from: node dist/cli/kvl.js pack --synth-preset full --seed 0 /tmp/kvl-full-pack
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PACK=${1:-/tmp/kvl-full-pack}
OUT=${2:-/tmp/kvl-bench/results}
THREADS=${THREADS:-2}
DECODE_TOKENS=${DECODE_TOKENS:-16}
BACKENDS=${BACKENDS:-both}
KVL="node $REPO/dist/cli/kvl.js"
mkdir -p "$OUT"

drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# other processes compete for 2 cores: log the load average and the busiest processes per phase
log_load() {
  { echo "$(date -u +%T) $1 loadavg: $(cat /proc/loadavg)"
    ps -eo pcpu,rss,comm --sort=-pcpu | sed -n 2,4p; } >> "$OUT/load.txt"
}
: > "$OUT/load.txt"

# 0. the machine
{
  date -u +"%Y-%m-%d %H:%M UTC"
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|L2|L3|Flags)' | cut -c1-200
  free -m
  df -h "$PACK"
  lsblk -d -o NAME,SIZE,ROTA,MODEL 2>/dev/null || true
  git -C "$REPO" log -1 --format='repo HEAD %h %s'
} > "$OUT/machine.txt"

# 1. builds: the TypeScript host and the native addon (npm run build), and the limits helper
(cd "$REPO" && npx tsc -p tsconfig.json && node scripts/build-addon.mjs) > "$OUT/build.log"
gcc -std=c11 -O2 -mavx2 -mfma -Wall -Wextra "$REPO/bench/membw.c" -lpthread -o "$OUT/membw"

# 2. physical limits (same run): DRAM streaming read 2 GiB (> 4x the 480 MiB L3 lscpu reports),
#    O_DIRECT extent-sized random reads of experts.bin after dropping the page cache, FMA peak
log_load limits
EXTENT=$(node -e 'import("'"$REPO"'/dist/host/pack/pack-format.js").then(async ({ PackReader }) =>
  console.log((await PackReader.open(process.argv[1])).stores.get("experts").records[0].nbytes))' "$PACK")
: > "$OUT/limits.jsonl"
for t in 1 2; do
  for isa in avx2 avx512; do "$OUT/membw" dram 2048 "$t" 5 "$isa" >> "$OUT/limits.jsonl"; done
done
for qd in 1 2; do
  drop_caches
  "$OUT/membw" ssd "$PACK/experts.bin" "$EXTENT" "$qd" 256 "$qd" >> "$OUT/limits.jsonl"
done
# the engine's own pattern: each extent split into ~2 MiB pieces, 4 reader threads
drop_caches
"$OUT/membw" ssd "$PACK/experts.bin" 2097152 4 1024 4 >> "$OUT/limits.jsonl"
for t in 1 2; do "$OUT/membw" fma "$t" 2 >> "$OUT/limits.jsonl"; done
cat "$OUT/limits.jsonl"

if [ "${SKIP_TEXT:-0}" != 1 ]; then
  for act in ${ACT_DTYPES:-f32 bf16}; do
  sfx=$([ "$act" = f32 ] && echo "" || echo "-$act")
  log_load "setting-A $act"
  # 3. setting A: 4 GiB plan, the caches as the planner gives them by default (the trunk, then
  #    what is left to the expert cache; CACHE_MIB=512 for the fixed cache used before `1797a6a`),
  #    experts streamed from SSD; page cache dropped before each engine open
  $KVL bench "$PACK" --backend "$BACKENDS" --ram-mib 4096 --cache-mib "${CACHE_MIB:-auto}" --trunk-cache-mib auto \
      --threads "$THREADS" --prompt-lens 16,512 --decode-tokens "$DECODE_TOKENS" --drop-caches \
      --act-dtype "$act" --limits "$OUT/limits.jsonl" --membw "$OUT/membw" \
      --out "$OUT/streaming$sfx.json" | tee "$OUT/streaming$sfx.txt"
  log_load "setting-B $act"
  # 4. setting B: everything resident (all 1664 extents fit in 14000 MiB); cold prompt first,
  #    then a 512-token warm-up prompt fills the caches and the same prompt + decode run warm
  $KVL bench "$PACK" --backend "$BACKENDS" --ram-mib 20000 --cache-mib 14000 --trunk-cache-mib auto \
      --threads "$THREADS" --prompt-lens 16,512 --decode-tokens "$DECODE_TOKENS" --drop-caches \
      --warm --warmup-tokens 512 --act-dtype "$act" --limits "$OUT/limits.jsonl" \
      --membw "$OUT/membw" --out "$OUT/inram$sfx.json" | tee "$OUT/inram$sfx.txt"
  done
  node --input-type=module - "$OUT" > "$OUT/tables.md" <<EOF2
import { existsSync, readFileSync } from "node:fs";
import { markdownReport } from "$REPO/dist/cli/bench.js";
const out = process.argv[2];
const runs = [];
for (const [sfx, label] of [["", "Linear inputs f32 (default)"], ["-bf16", "Linear inputs bf16 (--act-dtype bf16)"]]) {
  for (const [name, setting] of [["streaming", "A: 4096 MiB plan, 512 MiB expert cache"], ["inram", "B: all in RAM (20000/14000)"]]) {
    const path = \`\${out}/\${name}\${sfx}.json\`;
    if (existsSync(path)) runs.push([\`\${setting}, \${label}\`, JSON.parse(readFileSync(path, "utf8"))]);
  }
}
console.log(markdownReport(runs));
EOF2
fi

if [ "${SKIP_VISION:-0}" != 1 ]; then
  log_load vision
  # 5. vision: MoonViT + projector on native and WebAssembly, same thread count
  drop_caches
  node "$REPO/bench/vision-bench.mjs" "$PACK" --sizes 448,1024 --threads "$THREADS" --reps 2 \
      --json "$OUT/vision.json" | tee "$OUT/vision.txt"
fi
log_load end
echo "raw results in $OUT"
