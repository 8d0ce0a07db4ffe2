#!/usr/bin/env bash
# cgroup-run.sh — runs one command inside a memory cgroup with a hard limit (what a laptop with
# that much free RAM would allow) and reports the group's peak memory, failures and OOM kills.
# Owns only the cgroup it creates (kvl-cap-LIMIT under the caller's own memory cgroup, or at the
# v2 root). Sourced by bench/llamacpp/run.sh for make_cgroup; run directly for a kvl command.
#
# Usage: bench/cgroup-run.sh LIMIT REPORT -- COMMAND [ARGS...]     (root; LIMIT like 4352M)
#   REPORT gets the limit, exit status, wall time and the peak (v2 memory.peak, v1
#   memory.max_usage_in_bytes), which like the limit counts page-cache pages the group faults
#   in, so a capped run cannot hide its file reads in the page cache.
set -uo pipefail

# A memory cgroup with limit $1; prints its directory. cgroup v2 (memory.max) when the unified
# hierarchy has the memory controller; otherwise a v1 memory cgroup nested under our own
# (memory.limit_in_bytes). $2: name prefix (default kvl-cap).
make_cgroup() {
    local limit=$1 name=${2:-kvl-cap} dir
    if grep -qw memory /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        dir=/sys/fs/cgroup/$name-$limit
        mkdir -p "$dir" && echo "$limit" > "$dir/memory.max" && echo 0 > "$dir/memory.swap.max" 2>/dev/null
        echo "$dir"; return
    fi
    local own
    own=$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
    if [ -n "$own" ] && [ -w "/sys/fs/cgroup/memory$own" ]; then
        dir=/sys/fs/cgroup/memory${own%/}/$name-$limit
        mkdir -p "$dir" && echo "$limit" > "$dir/memory.limit_in_bytes" || return 1
        # a fresh peak for this run (v1 keeps the maximum across the group's lifetime)
        echo 0 > "$dir/memory.max_usage_in_bytes" 2>/dev/null
        echo "$dir"; return
    fi
    return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    [ $# -ge 4 ] && [ "$3" = "--" ] || { echo "usage: $0 LIMIT REPORT -- COMMAND [ARGS...]" >&2; exit 2; }
    limit=$1 report=$2
    shift 3
    cg=$(make_cgroup "$limit") || { echo "cgroup-run: no writable memory cgroup; cannot cap memory honestly" >&2; exit 1; }
    start=$(date +%s.%N)
    ( echo "$BASHPID" > "$cg/cgroup.procs" && exec "$@" )
    rc=$?
    {
        echo "limit: $limit ($cg)"
        echo "command: $*"
        echo "exit status: $rc, wall $(echo "$(date +%s.%N) - $start" | bc) s"
        for f in memory.peak memory.max_usage_in_bytes memory.failcnt memory.events; do
            [ -f "$cg/$f" ] && echo "$f: $(tr '\n' ' ' < "$cg/$f")"
        done
        grep -E 'oom_kill ' "$cg/memory.oom_control" 2>/dev/null
    } | tee "$report" >&2
    rmdir "$cg" 2>/dev/null
    exit $rc
fi
