#!/usr/bin/env bash
# check-mingw.sh — cross-compile the native core for Windows (mingw-w64) with warnings as errors.
#
# Owns: the Windows portability check of wasm-core/src/*.c (each file alone, with the same per-file
# ISA flags as wasm-core/CMakeLists.txt), then linking kvl.dll. Does not own: MSVC builds, running
# anything on Windows. Installs mingw-w64 with apt-get when the cross compiler is missing.
# Then the Node-API addon: wasm-core/native/addon*.c compiled with the same flags against the npm
# package node-api-headers (found with node from the repo root), a delay-load import library for
# node.exe made from its def/*.def with dlltool, and kvl_core.node linked (linker warnings fatal)
# from the core objects + addon objects + native/win_delay_load_hook.c + that import library (so
# it also loads into kvl's single executable, whose name is not node.exe); nm/objdump then check
# that its napi_* are delay-loaded (none in the import table) and it exports
# napi_register_module_v1. Everything built stays in a temp dir, except that
# `--keep DIR` copies the addon to DIR/kvl_core.node (the Windows runs under Wine load it:
# test/portability/windows.mjs, and single-exe.mjs beside kvl-win-x64.exe).
#   bash scripts/check-mingw.sh [--keep DIR]
# Exit status: 0 when every file compiled warning-free, the DLL and the addon linked and the addon
# check passed, 1 otherwise; each failing step is named in the summary.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LC_COLLATE=C # globs in byte order: the link order, hence the bytes, must not depend on the locale
KEEP=""
if [ "${1:-}" = "--keep" ] && [ -n "${2:-}" ]; then KEEP="$2"; fi
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

CFLAGS=(-std=c11 -O2 -Wall -Wextra -Werror -DKVL_BUILDING_DLL -DKVL_X86=1 -ffile-prefix-map="$ROOT"=.
        -I"$ROOT/wasm-core/include" -I"$ROOT/wasm-core/src")
AVX2_FLAGS=(-mavx2 -mfma -mf16c)
AVX512_FLAGS=(-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c)

failed=()
objs=()
for src in "$ROOT"/wasm-core/src/*.c "$ROOT"/wasm-core/src/kernels/*.c "$ROOT"/wasm-core/src/kernels/x86/*.c; do
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

# ---- the Node-API addon (kvl_core.node) -------------------------------------------------------
DLLTOOL="${MINGW_DLLTOOL:-${CC%gcc}dlltool}"
OBJDUMP="${MINGW_OBJDUMP:-${CC%gcc}objdump}"
addon_srcs=("$ROOT"/wasm-core/native/addon*.c)
addon_objs=()
# each native/addon*.c into $OUT (addon_objs), named ok or FAILED; status 1 when one failed
compile_addon() {
    local src name log status=0
    for src in "${addon_srcs[@]}"; do
        name="native/$(basename "$src")"
        if log="$("$CC" "${CFLAGS[@]}" -I"$napi_inc" -DNAPI_VERSION=8 -c "$src" -o "$OUT/$(basename "${src%.c}").o" 2>&1)"; then
            echo "ok      $name"
            addon_objs+=("$OUT/$(basename "${src%.c}").o")
        else
            echo "FAILED  $name"
            echo "$log" | sed 's/^/        /'
            failed+=("$name")
            status=1
        fi
    done
    return $status
}
napi_inc="$(cd "$ROOT" && node -p "require('node-api-headers').include_dir" 2>/dev/null)"
napi_defs="$(cd "$ROOT" && node -p "Object.values(require('node-api-headers').def_paths).join('\n')" 2>/dev/null)"
if [ ${#failed[@]} -ne 0 ]; then
    echo "skipped the addon (earlier failures)"
elif [ -z "$napi_inc" ] || [ ! -f "$napi_inc/node_api.h" ] || [ -z "$napi_defs" ]; then
    echo "FAILED  addon: node-api-headers not found from $ROOT (node and npm ci needed)"
    failed+=("kvl_core.node (node-api-headers)")
elif ! compile_addon; then
    : # each failed file is named above
else
    # One .def for node.exe: the union of the EXPORTS lists (node_api.def repeats js_native_api's).
    {
        echo "LIBRARY node.exe"
        echo "EXPORTS"
        # awk, not sed: the .def files end without a newline, which sed would glue to the next.
        while IFS= read -r def; do
            awk 'listing { print } /^EXPORTS/ { listing = 1 }' "$def"
        done <<<"$napi_defs" | tr -d '\r' | sed 's/[[:space:]]*$//' | grep -v '^$' | sort -u
    } >"$OUT/node.def"
    # run in $OUT with relative names: dlltool names its symbols after the library's path and its
    # temporary files after the pid, and the addon must be the same bytes wherever it is built
    if ! log="$(cd "$OUT" && "$DLLTOOL" --input-def node.def --dllname node.exe --temp-prefix kvl_node --output-delaylib libnode.a 2>&1)"; then
        echo "FAILED  node.exe import library (dlltool)"
        echo "$log" | sed 's/^/        /'
        failed+=("node.exe import library")
    elif ! log="$("$CC" "${CFLAGS[@]}" -c "$ROOT/wasm-core/native/win_delay_load_hook.c" -o "$OUT/delay_hook.o" 2>&1)"; then
        echo "FAILED  native/win_delay_load_hook.c"
        echo "$log" | sed 's/^/        /'
        failed+=("native/win_delay_load_hook.c")
    # no link timestamp and a fixed image base (auto picks one from the output path): the same
    # sources give the same bytes wherever they are built (prebuilds/win32-x64 is compared)
    elif ! log="$("$CC" -shared -o "$OUT/kvl_core.node" "${objs[@]}" "${addon_objs[@]}" "$OUT/delay_hook.o" "$OUT/libnode.a" \
                  -Wl,--fatal-warnings -Wl,--no-insert-timestamp -Wl,--disable-auto-image-base 2>&1)"; then
        echo "FAILED  linking kvl_core.node"
        echo "$log" | sed 's/^/        /'
        failed+=("kvl_core.node (link)")
    else
        echo "ok      kvl_core.node linked ($(grep -c '^napi_' "$OUT/node.def") napi symbols in the node.exe import library)"
        # The PE tables: node.exe only delay-loaded (GNU ld leaves the delay imports out of the
        # PE directory, so they are counted in the symbol table: one __imp_ slot per napi_*
        # used, the descriptor, the hook), and the module's entry point.
        dump="$("$OBJDUMP" -p "$OUT/kvl_core.node" 2>&1)"
        syms="$("${CC%gcc}nm" "$OUT/kvl_core.node" 2>&1)"
        n_direct="$(awk '/DLL Name:/ { dll = $3 } dll == "node.exe" && $NF ~ /^napi_/ { n++ } END { print n + 0 }' <<<"$dump")"
        n_delayed="$(grep -c ' __imp_napi_' <<<"$syms")"
        other_dlls="$(awk '/DLL Name:/ { print $3 }' <<<"$dump" | sort -u | tr '\n' ' ')"
        exports_entry="$(grep -Eq '\] napi_register_module_v1$' <<<"$dump" && echo present || echo missing)"
        if [ "$n_direct" -eq 0 ] && [ "$n_delayed" -gt 0 ] && grep -q ' __DELAY_IMPORT_DESCRIPTOR_' <<<"$syms" &&
            grep -q ' __pfnDliNotifyHook2$' <<<"$syms" && [ "$exports_entry" = present ]; then
            echo "ok      kvl_core.node delay-loads $n_delayed napi_* from node.exe (hooked to the host executable), exports napi_register_module_v1 (DLLs: $other_dlls)"
        else
            echo "FAILED  kvl_core.node PE check: $n_direct napi_* imported directly from node.exe, $n_delayed delay-loaded; napi_register_module_v1 export $exports_entry"
            failed+=("kvl_core.node (imports/exports)")
        fi
    fi
fi

if [ ${#failed[@]} -eq 0 ] && [ -n "$KEEP" ]; then
    if mkdir -p "$KEEP" && cp "$OUT/kvl_core.node" "$KEEP/kvl_core.node"; then
        echo "ok      kvl_core.node kept as $KEEP/kvl_core.node"
    else
        failed+=("kvl_core.node (copy to $KEEP)")
    fi
fi

if [ ${#failed[@]} -ne 0 ]; then
    echo "check-mingw: FAILED: ${failed[*]}"
    exit 1
fi
echo "check-mingw: all ${#objs[@]} files + ${#addon_srcs[@]} native/addon*.c compiled warning-free, kvl.dll and kvl_core.node linked"
