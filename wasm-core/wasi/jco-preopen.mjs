// jco-preopen.mjs — preloaded (node --import) into `jco embed` by build.sh.
//
// jco runs wasm-tools as a WASI component on @bytecodealliance/preview2-shim, and shim 0.26
// gives guests no filesystem by default, so `jco embed --wit PATH` (1.35.0) panics with
// "No such file or directory". This grants it the one directory it must read: the WIT's
// (KVL_WIT_DIR, an absolute path, visible to the guest under the same path).
import { _setPreopens } from "@bytecodealliance/preview2-shim/filesystem";

const dir = process.env.KVL_WIT_DIR;
if (dir) _setPreopens({ [dir]: dir });
