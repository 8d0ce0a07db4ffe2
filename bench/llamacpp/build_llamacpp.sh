#!/usr/bin/env bash
# Builds CPU-only llama.cpp tools (llama-bench, llama-cli) from the llama.cpp source that the
# llama-cpp-python sdist vendors, so the comparison uses a pinned, reproducible llama.cpp without
# cloning GitHub (only PyPI is reachable). Owns nothing in the repo: source and binaries stay in /tmp.
#
# Usage: bench/llamacpp/build_llamacpp.sh [target ...]      (default: llama-bench llama-cli)
# Env:   LLAMACPP_SDIST  path to llama_cpp_python-*.tar.gz (default /tmp/llamacpp-dl/llama_cpp_python-0.3.36.tar.gz;
#                        fetched from PyPI's simple index, sha256-checked, if absent)
#        LLAMACPP_WORK   work dir (default /tmp/kvl-llamacpp)
set -euo pipefail

SDIST_VERSION=0.3.36
SDIST=${LLAMACPP_SDIST:-/tmp/llamacpp-dl/llama_cpp_python-${SDIST_VERSION}.tar.gz}
WORK=${LLAMACPP_WORK:-/tmp/kvl-llamacpp}
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(llama-bench llama-cli)

if [ ! -f "$SDIST" ]; then
    # The file itself from PyPI's simple index, checked against the index's sha256. Not
    # `pip download --no-binary :all:`: that builds the sdist's metadata and so compiles its
    # build dependencies (cmake) from source, which takes longer than the whole benchmark.
    mkdir -p "$(dirname "$SDIST")"
    link=$(curl -fsSL "https://pypi.org/simple/llama-cpp-python/" |
           grep -o "https://[^\"]*llama_cpp_python-${SDIST_VERSION}\.tar\.gz#sha256=[0-9a-f]*" | head -1)
    [ -n "$link" ] || { echo "llama-cpp-python ${SDIST_VERSION} sdist not found on PyPI" >&2; exit 1; }
    curl -fsSL -o "$SDIST.part" "${link%%#*}"
    echo "${link##*sha256=}  $SDIST.part" | sha256sum -c - >/dev/null
    mv "$SDIST.part" "$SDIST"
fi

SRC_ROOT="$WORK/src/llama_cpp_python-${SDIST_VERSION}"
if [ ! -d "$SRC_ROOT/vendor/llama.cpp" ]; then
    mkdir -p "$WORK/src"
    tar -xzf "$SDIST" -C "$WORK/src"
fi
LLAMA_SRC="$SRC_ROOT/vendor/llama.cpp"

# The sdist carries no .git, so llama.cpp's build-info would say "unknown"; the upstream commit
# is recorded in the sdist's CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@<sha>").
COMMIT=$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$SRC_ROOT/CHANGELOG.md" | cut -d@ -f2 || true)
COMMIT=${COMMIT:-unknown}
echo "llama-cpp-python ${SDIST_VERSION} vendors llama.cpp commit ${COMMIT}"

BUILD="$WORK/build"
cmake -S "$LLAMA_SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMIT="$COMMIT"
# -j2: the machine has 2 cores shared with other jobs.
for t in "${TARGETS[@]}"; do
    cmake --build "$BUILD" --config Release -j2 --target "$t"
done
ls -la "$BUILD"/bin/
"$BUILD/bin/llama-bench" --version 2>&1 | tail -n 2 || true
