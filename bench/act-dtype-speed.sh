#!/usr/bin/env bash
# act-dtype-speed.sh — the speed half of the `--act-dtype` mode table (bench/RESULTS.md "Every
# --act-dtype mode"; the accuracy half is bench/act-dtype-accuracy.ts): each mode on each backend
# and kernel set, one after the other in one run, the model in RAM (so the products, not the disk,
# set the pace), warm (a 512-token warm-up prompt reads every expert it touches first): a 512-token
# prompt and 16 greedy tokens decoded after it.
#   bash bench/act-dtype-speed.sh PACK [OUT]     (needs dist/: npx tsc -p .)
#   env: RAM_MIB (default 20000), SETS (default "native:auto native:avx2 wasm:auto"),
#        MODES (default "f32 bf16 i16x1 i8")
# Prints one Markdown table: decode s/token (median) and prompt tok/s, per set and mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=${1:?usage: bench/act-dtype-speed.sh PACK [OUT]}
OUT=${2:-/tmp/kvl-act-dtype-speed}
RAM_MIB=${RAM_MIB:-20000}
SETS=${SETS:-native:auto native:avx2 wasm:auto}
MODES=${MODES:-f32 bf16 i16x1 i8}
mkdir -p "$OUT"
for set in $SETS; do
    backend=${set%%:*}
    kernels=${set#*:}
    for mode in $MODES; do
        echo "act-dtype-speed: $backend $kernels $mode" >&2
        node dist/cli/kvl.js bench "$PACK" --backend "$backend" --kernels "$kernels" --act-dtype "$mode" \
            --ram-mib "$RAM_MIB" --prompt-lens 512 --decode-tokens 16 --warm --warmup-tokens 512 --json --out "$OUT/$backend-$kernels-$mode.json" >/dev/null
    done
done
node - "$OUT" $SETS -- $MODES <<'JS'
const { readFileSync } = require("node:fs");
const args = process.argv.slice(2);
const out = args[0];
const sep = args.indexOf("--");
const sets = args.slice(1, sep);
const modes = args.slice(sep + 1);
console.log("| backend | kernels | mode | decode s/token (median of 16, warm) | 512-token prompt tok/s (warm) |");
console.log("|---|---|---|---|---|");
for (const set of sets) {
  const [backend, kernels] = set.split(":");
  for (const mode of modes) {
    const r = JSON.parse(readFileSync(`${out}/${backend}-${kernels}-${mode}.json`, "utf8"));
    const run = r.runs.find((x) => x.prompt_tokens === 512);
    const used = run.info.kernels ?? kernels;
    console.log(`| ${backend} | ${used} | ${mode} | ${run.decode_warm.s_per_token_median.toFixed(3)} | ${run.warm_prompt.prefill_tokens_per_s.toFixed(1)} |`);
  }
}
JS
