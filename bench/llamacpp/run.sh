#!/usr/bin/env bash
# Measures llama.cpp (the tool a user would otherwise pick) on this machine with the random
# Kimi-VL-A3B text GGUF from make_gguf.py: (a) model in page cache, pp16/pp512/tg32 with peak RSS;
# (b) decode under a memory cap (cgroup) after evicting the model file from the page cache.
# Owns only its result directory under /tmp; never touches the repo or other helpers' files.
#
# Usage: bench/llamacpp/run.sh            (all steps)
#        STEPS="cap" bench/llamacpp/run.sh (only the capped runs; STEPS is any of: info cached cap)
# Env:   MODEL, LLAMA_BIN, OUT, THREADS (2), CAPS ("6G 8G"), CAP_TG (32; tg8 is dominated by the cold start), CAP_TIMEOUT (s, 1500),
#        REPS (llama-bench -r for the cached run, 3),
#        LB_EXTRA (extra llama-bench args, default "--repack 0": with the default extra buffer
#        types a -DGGML_NATIVE=ON build on this AMX-capable Xeon moves trunk Q8_0 matrices into
#        the AMX buffer and then aborts in ggml_backend_sched_split_graph
#        (GGML_ASSERT(*cur_backend_id != -1)) for this deepseek2 graph; "--repack 0" disables
#        extra buffer types so every weight stays mmap'd), DROP_CACHES=1 to also drop the whole
#        machine's page cache (default: evict only the model file, which is what matters and
#        does not slow down other jobs sharing this machine).
set -uo pipefail

MODEL=${MODEL:-/tmp/kvl-llamacpp/kimi-vl-text-q8_0.gguf}
BIN=${LLAMA_BIN:-/tmp/kvl-llamacpp/build/bin}
OUT=${OUT:-/tmp/kvl-llamacpp/results-$(date -u +%Y%m%dT%H%M%SZ)}
THREADS=${THREADS:-2}
CAPS=${CAPS:-"6G 8G"}
CAP_TG=${CAP_TG:-32}
CAP_TIMEOUT=${CAP_TIMEOUT:-1500}
REPS=${REPS:-3}
STEPS=${STEPS:-"info cached cap"}
LB_EXTRA=${LB_EXTRA:---repack 0}
read -r -a LB_EXTRA_ARR <<< "$LB_EXTRA"
BENCH="$BIN/llama-bench"

die() { echo "run.sh: $*" >&2; exit 1; }
[ -f "$MODEL" ] || die "model $MODEL not found; create it with: python bench/llamacpp/make_gguf.py"
[ -x "$BENCH" ] || die "$BENCH not found; build it with: bench/llamacpp/build_llamacpp.sh"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.tsv"
: > "$SUMMARY"
echo "results go to $OUT"

has_step() { [[ " $STEPS " == *" $1 "* ]]; }

# Prints "test<TAB>t/s" for every result row of a llama-bench markdown table.
bench_rows() {
    awk -F'|' '/^\|/ && $0 !~ /---/ && $0 !~ / t\/s / {
        n = NF - 1; gsub(/^ +| +$/, "", $(n-1)); gsub(/^ +| +$/, "", $n); print $(n-1) "\t" $n }' "$1"
}

# Other jobs share this machine's 2 cores and disk; record how contended it was around each run.
contention() { echo "loadavg $(cut -d' ' -f1-3 /proc/loadavg); cpu PSI $(head -1 /proc/pressure/cpu 2>/dev/null | cut -d' ' -f2-4)"; }

resident() { fincore -b -n -o RES "$MODEL" 2>/dev/null | awk '{printf "%.2f GiB", $1/2^30}'; }

# Evicts just the model file from the page cache (fsync first: dirty pages cannot be dropped).
evict_model() {
    python3 - "$MODEL" <<'EOF'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
EOF
    if [ "${DROP_CACHES:-0}" = 1 ]; then
        sync && echo 3 > /proc/sys/vm/drop_caches || echo "warning: cannot write /proc/sys/vm/drop_caches"
    fi
}

if has_step info; then
    {
        echo "# date (UTC)"; date -u
        echo "# lscpu | head -20"; lscpu | head -20
        echo "# free -g"; free -g
        echo "# df -h /tmp"; df -h /tmp
        echo "# llama.cpp"; "$BENCH" --version 2>&1 | tail -n 2
        echo "# model"; ls -l "$MODEL"
        echo "# load average"; cat /proc/loadavg
    } | tee "$OUT/machine.txt"
fi

if has_step cached; then
    echo "== (a) model in page cache: cat > /dev/null, then llama-bench -p 16,512 -n 32 -t $THREADS -r $REPS $LB_EXTRA"
    cat "$MODEL" > /dev/null
    echo "model resident before: $(resident)" | tee "$OUT/a_resident.txt"
    cmd=("$BENCH" -m "$MODEL" -p 16,512 -n 32 -t "$THREADS" -r "$REPS" -o md "${LB_EXTRA_ARR[@]}")
    echo "+ /usr/bin/time -v ${cmd[*]}" | tee "$OUT/a_cmd.txt"
    echo "before: $(contention)" | tee -a "$OUT/a_cmd.txt"
    /usr/bin/time -v -o "$OUT/a_time.txt" "${cmd[@]}" > "$OUT/a_bench.md" 2> "$OUT/a_bench.err"
    echo "exit status $?" >> "$OUT/a_cmd.txt"
    echo "after: $(contention)" | tee -a "$OUT/a_cmd.txt"
    echo "model resident after: $(resident)" | tee -a "$OUT/a_resident.txt"
    cat "$OUT/a_bench.md"
    rss_kib=$(awk -F: '/Maximum resident set size/ {gsub(/ /, "", $2); print $2}' "$OUT/a_time.txt")
    echo "peak RSS: ${rss_kib} KiB ($(awk -v k="$rss_kib" 'BEGIN{printf "%.2f GiB", k/2^20}'))"
    bench_rows "$OUT/a_bench.md" | while IFS=$'\t' read -r test ts; do
        printf 'page cache\t%s\t%s\t%s KiB\n' "$test" "$ts" "$rss_kib" >> "$SUMMARY"
    done
fi

# A memory cgroup holding the capped run (cgroup v2 memory.max, else v1 memory.limit_in_bytes;
# both charge page-cache pages to the group that faults them): make_cgroup LIMIT NAME.
# shellcheck source=bench/cgroup-run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../cgroup-run.sh"

if has_step cap; then
    for cap in $CAPS; do
        echo "== (b) memory cap $cap: evict model from page cache, llama-bench -p 0 -n $CAP_TG -r 1 in the cgroup"
        cg=$(make_cgroup "$cap" kvl-llamacpp) || die "no writable memory cgroup (v2 memory.max or v1 memory.limit_in_bytes); cannot cap memory honestly"
        echo "cgroup: $cg (limit $(cat "$cg/memory.max" 2>/dev/null || cat "$cg/memory.limit_in_bytes"))" | tee "$OUT/b_${cap}_cmd.txt"
        evict_model
        echo "model resident before: $(resident)" | tee -a "$OUT/b_${cap}_cmd.txt"
        cmd=(timeout "$CAP_TIMEOUT" "$BENCH" -m "$MODEL" -p 0 -n "$CAP_TG" -r 1 -t "$THREADS" -o md "${LB_EXTRA_ARR[@]}")
        echo "+ ${cmd[*]}" | tee -a "$OUT/b_${cap}_cmd.txt"
        echo "before: $(contention)" | tee -a "$OUT/b_${cap}_cmd.txt"
        start=$(date +%s)
        ( echo "$BASHPID" > "$cg/cgroup.procs" && exec /usr/bin/time -v -o "$OUT/b_${cap}_time.txt" "${cmd[@]}" ) \
            > "$OUT/b_${cap}_bench.md" 2> "$OUT/b_${cap}_bench.err"
        rc=$?
        wall=$(( $(date +%s) - start ))
        {
            echo "exit status $rc (124 = timeout), wall ${wall}s"
            echo "after: $(contention)"
            for f in memory.peak memory.max_usage_in_bytes memory.failcnt memory.events; do
                [ -f "$cg/$f" ] && echo "$f: $(tr '\n' ' ' < "$cg/$f")"
            done
            grep -E 'oom_kill ' "$cg/memory.oom_control" 2>/dev/null
            grep -E 'Maximum resident|Major \(requiring I/O\)|Elapsed' "$OUT/b_${cap}_time.txt" 2>/dev/null
        } | tee -a "$OUT/b_${cap}_cmd.txt"
        cat "$OUT/b_${cap}_bench.md"
        rows=$(bench_rows "$OUT/b_${cap}_bench.md")
        cap_rss=$(awk -F: '/Maximum resident set size/ {gsub(/ /, "", $2); print $2}' "$OUT/b_${cap}_time.txt" 2>/dev/null)
        if [ -n "$rows" ]; then
            echo "$rows" | while IFS=$'\t' read -r test ts; do
                printf 'cap %s\t%s\t%s\t%s KiB\n' "$cap" "$test" "$ts" "${cap_rss:--}" >> "$SUMMARY"
            done
        else
            printf 'cap %s\ttg%s\tno result (exit %s after %ss)\t-\n' "$cap" "$CAP_TG" "$rc" "$wall" >> "$SUMMARY"
        fi
        rmdir "$cg" 2>/dev/null || echo "note: could not remove $cg"
    done
fi

echo
echo "== summary (threads=$THREADS, model $(basename "$MODEL"), $(du -h --apparent-size "$MODEL" | cut -f1))"
printf '%-14s %-8s %-22s %s\n' condition test "tok/s" "peak RSS"
while IFS=$'\t' read -r cond test ts rss; do
    printf '%-14s %-8s %-22s %s\n' "$cond" "$test" "$ts" "$rss"
done < "$SUMMARY"
