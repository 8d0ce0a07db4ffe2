#!/usr/bin/env bash
# q4-side-by-side.sh — issue 31's one run: kvl with Q8 and Q4 routed experts, native and
# WebAssembly, in RAM and under a 4 GiB + 256 MiB memory cgroup (expert read-ahead off, then auto),
# and llama.cpp's 4-bit-expert GGUF in the page cache and under the same cap. Needs root (page
# cache drops, cgroups), dist/ and the native addon; two packs of the same model that differ only
# in --expert-dtype; llama.cpp from bench/llamacpp (skipped when GGUF is absent).
#   bash bench/q4-side-by-side.sh Q8PACK Q4PACK [OUT]      (OUT default /tmp/kvl-q4-side-by-side)
#   env: GGUF (default /tmp/kvl-llamacpp/kimi-vl-text-q4_0-experts.gguf), THREADS (2), CAP (4352M),
#        DECODE (32 tokens)
# Prints the side-by-side table (Markdown); every raw JSON and cgroup report lands in OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
Q8=${1:?usage: bench/q4-side-by-side.sh Q8PACK Q4PACK [OUT]}
Q4=${2:?usage: bench/q4-side-by-side.sh Q8PACK Q4PACK [OUT]}
OUT=${3:-/tmp/kvl-q4-side-by-side}
GGUF=${GGUF:-/tmp/kvl-llamacpp/kimi-vl-text-q4_0-experts.gguf}
THREADS=${THREADS:-2} CAP=${CAP:-4352M} DECODE=${DECODE:-32}
mkdir -p "$OUT"
drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
step() { echo "q4-side-by-side: $(date -u +%H:%M:%S) $*" >&2; }

step limits
bash bench/measure-limits.sh "$Q4" "$OUT" "$THREADS" || exit 1

common=(--threads "$THREADS" --limits "$OUT/limits.jsonl" --json)
for dtype in q8 q4; do
    pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
    step "in RAM, $dtype, both backends"
    # --membw re-measures DRAM right before and after each decode (not under the cap: its 2 GiB
    # buffer would count against the cgroup)
    node dist/cli/kvl.js bench "$pack" --backend both --ram-mib 20000 --prompt-lens 512 --decode-tokens "$DECODE" \
        --warm --warmup-tokens 512 --membw "$OUT/membw" "${common[@]}" --out "$OUT/ram-$dtype.json" > /dev/null 2> "$OUT/ram-$dtype.err" ||
        step "FAILED (see $OUT/ram-$dtype.err)"
done
for backend in native wasm; do
    for dtype in q8 q4; do
        pack=$([ "$dtype" = q8 ] && echo "$Q8" || echo "$Q4")
        for lookahead in off auto; do
            name=cap-$dtype-$backend-$lookahead
            step "$CAP cgroup, $dtype, $backend, --expert-lookahead $lookahead"
            drop_caches
            bash bench/cgroup-run.sh "$CAP" "$OUT/$name.report" -- node dist/cli/kvl.js bench "$pack" --backend "$backend" \
                --ram-mib 4096 --prompt-lens 16 --decode-tokens "$DECODE" --warm --warmup-tokens 512 \
                --expert-lookahead "$lookahead" "${common[@]}" --out "$OUT/$name.json" > /dev/null 2> "$OUT/$name.err" ||
                step "FAILED (see $OUT/$name.report)"
        done
    done
done
if [ -f "$GGUF" ]; then
    step "llama.cpp, $(basename "$GGUF")"
    MODEL=$GGUF CAPS=$CAP CAP_TG=$DECODE THREADS=$THREADS OUT="$OUT/llamacpp" bash bench/llamacpp/run.sh > "$OUT/llamacpp.txt" 2>&1
else
    step "no $GGUF: llama.cpp skipped (bench/llamacpp/make_gguf.py --expert-type q4_0 writes it)"
fi

node - "$OUT" <<'JS'
const { existsSync, readFileSync } = require("node:fs");
const out = process.argv[2];
const load = (name) => existsSync(`${out}/${name}.json`) ? JSON.parse(readFileSync(`${out}/${name}.json`, "utf8")).runs : [];
const ram = { q8: load("ram-q8"), q4: load("ram-q4") };
const cols = [["native", "q8"], ["native", "q4"], ["wasm", "q8"], ["wasm", "q4"]];
const inRam = (b, d) => ram[d].find((r) => r.backend === b);
const capped = (b, d, la) => load(`cap-${d}-${b}-${la}`)[0];
const f = (x, n = 3) => (x == null ? "-" : x.toFixed(n));
const gib = (x) => (x / 2 ** 30).toFixed(2);
const rows = [
  ["in RAM: decode s/token (tok/s)", (b, d) => { const r = inRam(b, d); return r && `${f(r.decode_warm.s_per_token_median)} (${f(r.decode_warm.tokens_per_s, 1)})`; }],
  ["in RAM: x the DRAM bound (GB of weights a token)", (b, d) => { const r = inRam(b, d); return r && `${f(r.decode_warm.ratio, 2)}x (${f(r.decode_warm.ram_bytes_per_token / 1e9, 2)})`; }],
  ["in RAM: 512-token prompt, warm (tok/s)", (b, d) => { const r = inRam(b, d); return r && f(r.warm_prompt.prefill_tokens_per_s, 1); }],
  ["in RAM: peak RSS / plan (GiB)", (b, d) => { const r = inRam(b, d); return r && `${gib(r.peak_rss_bytes)} / ${gib(r.plan_total_bytes)}`; }],
];
for (const la of ["off", "auto"]) {
  rows.push([`4 GiB cap, read-ahead ${la}: decode s/token (tok/s)`, (b, d) => { const r = capped(b, d, la); return r && `${f(r.decode_warm.s_per_token_median)} (${f(r.decode_warm.tokens_per_s, 1)})`; }]);
  rows.push([`4 GiB cap, read-ahead ${la}: disk wait share, GB read a token, hit rate`, (b, d) => {
    const r = capped(b, d, la); if (!r) return null; const x = r.decode_warm;
    return `${(100 * x.expert_stall_share).toFixed(0)} %, ${f(x.ssd_bytes_per_token / 1e9)}, ${f(x.expert_hit_rate, 2)}`; }]);
}
rows.push(["4 GiB cap, read-ahead auto: read-ahead used / issued", (b, d) => { const r = capped(b, d, "auto"); const l = r?.decode_warm.expert_lookahead; return l && `${l.used} / ${l.issued}`; }]);
rows.push(["4 GiB cap, read-ahead auto: peak RSS / plan (GiB)", (b, d) => { const r = capped(b, d, "auto"); return r && `${gib(r.peak_rss_bytes)} / ${gib(r.plan_total_bytes)}`; }]);
console.log(`| | ${cols.map(([b, d]) => `kvl ${b} ${d}`).join(" | ")} |`);
console.log(`|---|${cols.map(() => "---").join("|")}|`);
for (const [label, cell] of rows) console.log(`| ${label} | ${cols.map(([b, d]) => cell(b, d) ?? "failed").join(" | ")} |`);
const summary = `${out}/llamacpp/summary.tsv`;
if (existsSync(summary)) console.log(`\nllama.cpp (${out}/llamacpp):\n${readFileSync(summary, "utf8")}`);
JS
