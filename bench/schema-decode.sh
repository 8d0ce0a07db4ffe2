#!/usr/bin/env bash
# schema-decode.sh — decode s/token with and without a JSON schema, in one run, on each backend:
# the cost of constrained decoding (the grammar's token mask over the full vocabulary, applied in
# the engine worker before each sample) as a user of `kvl chat --json-schema` sees it.
#   bash bench/schema-decode.sh PACK [TOKENS]     (default 48 tokens; kvl's defaults otherwise)
# Prints one line per run: backend, schema or not, decode s/token, tokens decoded, finish reason.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK="${1:?usage: bench/schema-decode.sh PACK [TOKENS]}"
TOKENS="${2:-48}"
WORK="$(mktemp -d /tmp/kvl-schema-decode.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/invoice.json" <<'EOF'
{"type":"object","properties":{"vendor":{"type":"string","maxLength":40},"date":{"type":"string","maxLength":10},
 "items":{"type":"array","items":{"type":"object","properties":{"name":{"type":"string","maxLength":30},
 "qty":{"type":"integer","minimum":1,"maximum":999},"cents":{"type":"integer","minimum":0,"maximum":99999999}},
 "required":["name","qty","cents"],"additionalProperties":false},"maxItems":20},"total_cents":{"type":"integer","minimum":0,"maximum":999999999}},
 "required":["vendor","date","items","total_cents"],"additionalProperties":false}
EOF
for backend in native wasm; do
    for mode in free schema; do
        extra=(); [ "$mode" = schema ] && extra=(--json-schema "$WORK/invoice.json")
        node "$ROOT/dist/cli/kvl.js" chat "$PACK" "Read this invoice and give me its fields." --backend "$backend" --max-new "$TOKENS" \
            --temperature 0 --json --quiet "${extra[@]}" < /dev/null > "$WORK/out.json"
        node -e '
          const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8").trim().split("\n").at(-1));
          console.log(`${process.argv[2]}\t${process.argv[3]}\tdecode ${r.timings.decode_s_per_token.toFixed(4)} s/token\t` +
            `${r.usage.completion_tokens} tokens\t${r.finish_reason}\t${r.io.kernels}`);
        ' "$WORK/out.json" "$backend" "$mode"
    done
done
