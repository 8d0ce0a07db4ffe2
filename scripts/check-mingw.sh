#!/usr/bin/env bash
# check-mingw.sh — cross-compile the native core for Windows (mingw-w64) with warnings as errors.
#
# Owns: the Windows portability check of native/src/*.c (each file alone, with the same per-file
# ISA flags as native/CMakeLists.txt), then linking kvl.dll. Does not own: MSVC builds, running
# anything on Windows. Installs mingw-w64 with apt-get when the cross compiler is missing.
# Exit status: 0 when every file compiled warning-free and the DLL linked, 1 otherwise; each
# failing file is named in the summary.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CC="${MINGW_CC:-x86_64-w64-mingw32-gcc}"
OUT="$(mktemp -d /tmp/kvl-mingw.XXXXXX)"
trap 'rm -rf "$OUT"' EXIT

if ! command -v "$CC" >/dev/null 2>&1; then
    echo "check-mingw: $CC not found, installing mingw-w64"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    if ! $SUDO apt-get install -y mingw-w64 >/dev/null 2>&1; then
        # Only refresh the package lists when the install failed for lack of them.
        $SUDO apt-get update >/dev/null && $SUDO apt-get install -y mingw-w64 >/dev/null || {
            echo "check-mingw: could not install mingw-w64 (apt-get install -y mingw-w64)" >&2
            exit 1
        }
    fi
fi

CFLAGS=(-std=c11 -O2 -Wall -Wextra -Werror -DKVL_BUILDING_DLL -DKVL_X86=1
        -I"$ROOT/native/include" -I"$ROOT/native/src")
AVX2_FLAGS=(-mavx2 -mfma -mf16c)
AVX512_FLAGS=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c)

failed=()
objs=()
for src in "$ROOT"/native/src/*.c; do
    name="$(basename "$src")"
    extra=()
    case "$name" in
        kernels_avx2.c) extra=("${AVX2_FLAGS[@]}") ;;
        kernels_avx512.c) extra=("${AVX512_FLAGS[@]}") ;;
    esac
    obj="$OUT/${name%.c}.o"
    if log="$("$CC" "${CFLAGS[@]}" "${extra[@]}" -c "$src" -o "$obj" 2>&1)"; then
        echo "ok      $name"
        objs+=("$obj")
    else
        echo "FAILED  $name"
        echo "$log" | sed 's/^/        /'
        failed+=("$name")
    fi
done

if [ ${#failed[@]} -eq 0 ]; then
    if log="$("$CC" -shared -o "$OUT/kvl.dll" "${objs[@]}" -Wl,--out-implib,"$OUT/libkvl.dll.a" 2>&1)"; then
        echo "ok      kvl.dll linked"
    else
        echo "FAILED  linking kvl.dll"
        echo "$log" | sed 's/^/        /'
        failed+=("kvl.dll (link)")
    fi
else
    echo "skipped linking kvl.dll (compile failures)"
fi

if [ ${#failed[@]} -ne 0 ]; then
    echo "check-mingw: FAILED: ${failed[*]}"
    exit 1
fi
echo "check-mingw: all ${#objs[@]} files compiled warning-free, kvl.dll linked"
