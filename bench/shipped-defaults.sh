#!/usr/bin/env bash
# shipped-defaults.sh — what a user gets with no flags, from each thing kvl ships, against the old
# defaults (WebAssembly, --ram-mib 4096), in one run on one pack:
#   (a) the npm package: `npm pack` of this checkout installed into an empty folder with no
#       compiler on PATH (the prebuilt addon);
#   (b) build/exe/kvl-linux-x64 copied into an empty folder;
#   (c) build/exe/kvl-win-x64.exe under Wine (node.exe inside: the mingw-w64 prebuilt addon).
# Each runs `kvl bench PACK --prompt-lens 16 --decode-tokens 32 --json` (no model flags: the chat
# plan, --ram-mib auto, the backend auto picks), then the same with `--backend wasm --ram-mib 4096`.
# Prints one table: backend, kernel set, RAM budget and who chose it, decode s/token (median),
# peak RSS. Needs npm run build:exe and npm run build:prebuilds first, and wine for (c).
#   bash bench/shipped-defaults.sh PACK [OUT.jsonl]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK="$(realpath "${1:?usage: bench/shipped-defaults.sh PACK [OUT.jsonl]}")"
OUT="${2:-/tmp/kvl-shipped-defaults.jsonl}"
WORK="$(mktemp -d /tmp/kvl-shipped.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
: > "$OUT"
ARGS=(--prompt-lens 16 --decode-tokens 32 --json)
OLD=(--backend wasm --ram-mib 4096)

# (a) the npm package, installed with node, npm and sh alone on PATH
mkdir -p "$WORK/bin" "$WORK/app"
ln -s "$(command -v node)" "$WORK/bin/node"; ln -s "$(command -v npm)" "$WORK/bin/npm"; ln -s /bin/sh "$WORK/bin/sh"
(cd "$ROOT" && npm pack --silent --pack-destination "$WORK" >/dev/null)
echo '{"name":"bench","private":true}' > "$WORK/app/package.json"
(cd "$WORK/app" && PATH="$WORK/bin" npm install --silent --no-audit --no-fund "$WORK"/kvl-*.tgz)
NPM_KVL="$WORK/app/node_modules/kvl/dist/cli/kvl.js"

# (b) kvl-linux-x64 alone in a folder, its files extracted to a fresh cache
mkdir -p "$WORK/exe"
cp "$ROOT/build/exe/kvl-linux-x64" "$WORK/exe/"

row() { # row LABEL FLAGS-LABEL COMMAND...
    local label=$1 flags=$2
    shift 2
    echo "== $label ($flags)" >&2
    # through a file: Wine's node.exe cannot write to a pipe (EBADF)
    "$@" < /dev/null > "$WORK/row.json" 2> "$WORK/row.err" || { tail -5 "$WORK/row.err" >&2; return 1; }
    node -e '
      const r = JSON.parse(require("fs").readFileSync(0, "utf8"));
      const run = r.runs[0], d = run.decode_after_cold;
      console.log(JSON.stringify({ label: process.argv[1], flags: process.argv[2], backend: run.backend, kernels: run.info.kernels,
        ram_budget_mib: run.ram_budget_mib, chosen_by: run.ram_budget_chosen_by, plan_mib: Math.round(run.plan_total_bytes / 2 ** 20),
        s_per_token: d.s_per_token_median, hit_rate: d.expert_hit_rate ?? null, peak_rss_mib: run.peak_rss_bytes ? Math.round(run.peak_rss_bytes / 2 ** 20) : null }));
    ' "$label" "$flags" < "$WORK/row.json" | tee -a "$OUT"
}

for flags in default old; do
    extra=(); [ "$flags" = old ] && extra=("${OLD[@]}")
    row "(a) npm install, no compiler" "$flags" env -u KVL_ADDON PATH="$WORK/bin" node "$NPM_KVL" bench "$PACK" "${ARGS[@]}" "${extra[@]}"
    row "(b) kvl-linux-x64" "$flags" env -u KVL_ADDON XDG_CACHE_HOME="$WORK/cache" "$WORK/exe/kvl-linux-x64" bench "$PACK" "${ARGS[@]}" "${extra[@]}"
    if command -v wine >/dev/null; then
        cp "$ROOT/build/exe/kvl-win-x64.exe" "$WORK/exe/"
        row "(c) kvl-win-x64.exe under Wine" "$flags" env -u KVL_ADDON WINEPREFIX="$ROOT/build/portability/wine-prefix" WINEDEBUG=-all \
            wine "$WORK/exe/kvl-win-x64.exe" bench "Z:${PACK//\//\\}" "${ARGS[@]}" "${extra[@]}"
    fi
done

node -e '
  const rows = require("fs").readFileSync(process.argv[1], "utf8").trim().split("\n").map(JSON.parse);
  console.log("| shipped as | flags | backend | kernels | RAM budget (chosen by) | plan | decode s/token | hit rate | peak RSS |");
  console.log("|---|---|---|---|---|---|---|---|---|");
  for (const r of rows) console.log(`| ${r.label} | ${r.flags === "old" ? "--backend wasm --ram-mib 4096" : "none"} | ${r.backend} | ${r.kernels} | ` +
    `${r.ram_budget_mib} MiB (${r.chosen_by}) | ${r.plan_mib} MiB | ${r.s_per_token.toFixed(3)} | ${r.hit_rate === null ? "-" : r.hit_rate.toFixed(2)} | ${r.peak_rss_mib ?? "-"} MiB |`);
' "$OUT"
