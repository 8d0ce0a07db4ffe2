#!/usr/bin/env bash
# bench/run_all.sh — the exact commands behind bench/RESULTS.md (Linux, root for drop_caches).
#
# Owns: the order of the measurements and where their raw output goes. Nothing is asserted.
# Usage: bench/run_all.sh [PACK] [OUT]      (defaults: /tmp/kvl-full-pack, /tmp/kvl-bench/results)
# Env:   KVL_BENCH_BUILD (CMake build dir, default /tmp/kvl-build-bench), THREADS (default 2),
#        DECODE_TOKENS (16), ACT_DTYPES (Linear-input modes to run, default "f32 bf16"),
#        SKIP_VISION=1, SKIP_TEXT=1.
# The full-size pack comes from: node dist/cli/kvl.js pack --synth-preset full --seed 0 /tmp/kvl-full-pack
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PACK=${1:-/tmp/kvl-full-pack}
OUT=${2:-/tmp/kvl-bench/results}
BUILD=${KVL_BENCH_BUILD:-/tmp/kvl-build-bench}
THREADS=${THREADS:-2}
DECODE_TOKENS=${DECODE_TOKENS:-16}
mkdir -p "$OUT"
export PYTHONPATH="$REPO" KVL_LIB="$BUILD/native/libkvl.so"

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

# 1. builds: the library (Release) and the limits helper
cmake -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log"
cmake --build "$BUILD" -j2 >> "$OUT/build.log"
gcc -std=c11 -O2 -mavx2 -mfma -Wall -Wextra "$REPO/bench/membw.c" -lpthread -o "$OUT/membw"

# 2. physical limits (same run): DRAM streaming read 2 GiB (> 4x the 480 MiB L3 lscpu reports),
#    O_DIRECT extent-sized random reads of experts.bin after dropping the page cache, FMA peak
log_load limits
EXTENT=$(python -c "import sys; from kvl.packfmt import PackReader; \
print(PackReader(sys.argv[1]).stores['experts'].records[0].nbytes)" "$PACK")
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
# the same limits measured the portable way kvl bench uses without --limits (numpy / python)
python - "$PACK" "$EXTENT" > "$OUT/limits_python.jsonl" <<'EOF'
import json, sys
from pathlib import Path
from kvl.bench import _numpy_dram_read, direct_read_bw, drop_page_cache
pack, extent = Path(sys.argv[1]), int(sys.argv[2])
for t in (1, 2):
    print(json.dumps({"mode": "dram", "impl": "numpy", "threads": t,
                      "best_bytes_per_s": _numpy_dram_read(2 << 30, t, 5)}))
for qd in (1, 2):
    drop_page_cache()
    print(json.dumps({"mode": "ssd", "impl": "python", "qd": qd,
                      "bytes_per_s": direct_read_bw(pack / "experts.bin", extent, qd, 256, qd + 7)}))
EOF
cat "$OUT/limits.jsonl" "$OUT/limits_python.jsonl"

if [ "${SKIP_TEXT:-0}" != 1 ]; then
  for act in ${ACT_DTYPES:-f32 bf16}; do
  sfx=$([ "$act" = f32 ] && echo "" || echo "-$act")
  log_load "setting-A $act"
  # 3. setting A: 4 GiB plan, 512 MiB expert cache, experts streamed from SSD; page cache dropped
  #    before each engine open
  python -m kvl bench "$PACK" --ram-mib 4096 --cache-mib 512 --trunk-cache-mib auto \
      --threads "$THREADS" --prompt-lens 16,512 --decode-tokens "$DECODE_TOKENS" --drop-caches \
      --act-dtype "$act" --limits "$OUT/limits.jsonl" --membw "$OUT/membw" \
      --out "$OUT/streaming$sfx.json" | tee "$OUT/streaming$sfx.txt"
  log_load "setting-B $act"
  # 4. setting B: everything resident (all 1664 extents fit in 14000 MiB); cold prompt first,
  #    then a 512-token warm-up prompt fills the caches and the same prompt + decode run warm
  python -m kvl bench "$PACK" --ram-mib 20000 --cache-mib 14000 --trunk-cache-mib auto \
      --threads "$THREADS" --prompt-lens 16,512 --decode-tokens "$DECODE_TOKENS" --drop-caches \
      --warm --warmup-tokens 512 --act-dtype "$act" --limits "$OUT/limits.jsonl" \
      --membw "$OUT/membw" --out "$OUT/inram$sfx.json" | tee "$OUT/inram$sfx.txt"
  done
  python - "$OUT" > "$OUT/tables.md" <<'EOF2'
import json, sys
from pathlib import Path
from kvl.bench import markdown_report
out = Path(sys.argv[1])
runs = []
for sfx, label in (("", "Linear inputs f32 (default)"), ("-bf16", "Linear inputs bf16 (--act-dtype bf16)")):
    for name, setting in (("streaming", "A: 4096 MiB plan, 512 MiB expert cache"),
                          ("inram", "B: all in RAM (20000/14000)")):
        path = out / f"{name}{sfx}.json"
        if path.exists():
            runs.append((f"{setting}, {label}", json.loads(path.read_text())))
print(markdown_report(runs))
EOF2
fi

if [ "${SKIP_VISION:-0}" != 1 ]; then
  log_load vision
  # 5. vision: native vs the PyTorch reference (FP32), same thread count
  drop_caches
  python "$REPO/bench/vision_bench.py" "$PACK" --sizes 448,1024 --threads "$THREADS" --reps 2 \
      --json "$OUT/vision.json" | tee "$OUT/vision.txt"
fi
log_load end
echo "raw results in $OUT"
