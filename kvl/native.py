"""ctypes binding to the kvl native core (wasm-core/include/kvl_core.h), plus thin Pythonic wrappers.

Owns: finding and loading libkvl, the 1:1 ctypes mirror of kvl_core.h (structs, enums, prototypes),
turning status codes into KvlError, and numpy-friendly NativeEngine / NativeSession / Sampler.
Does not own: planning, tokenization, chat logic (kvl/engine.py and up). ctypes releases the GIL
during every foreign call, so NativeSession.cancel() from another thread reaches a running
prefill/step.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterable, Sequence
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_float,
    c_int32,
    c_int64,
    c_size_t,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import Any, Self

import numpy as np

from kvl.errors import UserError

# ---- kvl_core.h constants ---------------------------------------------------------------------------

KVL_ABI_VERSION = 1

KVL_OK = 0
KVL_ERR_IO = 1
KVL_ERR_FORMAT = 2
KVL_ERR_CONFIG = 3
KVL_ERR_NOMEM = 4
KVL_ERR_INVALID_ARG = 5
KVL_ERR_CONTEXT_FULL = 6
KVL_ERR_CANCELLED = 7
KVL_ERR_UNSUPPORTED = 8
KVL_ERR_INTERNAL = 9

KVL_IO_AUTO, KVL_IO_DIRECT, KVL_IO_BUFFERED = 0, 1, 2
KVL_KERNELS_AUTO, KVL_KERNELS_SCALAR, KVL_KERNELS_AVX2, KVL_KERNELS_AVX512 = 0, 1, 2, 3
KVL_KV_DEFAULT, KVL_KV_F32, KVL_KV_BF16 = 0, 1, 2
KVL_ACT_DEFAULT, KVL_ACT_F32, KVL_ACT_BF16 = 0, 1, 2
KVL_LOGITS_NONE, KVL_LOGITS_LAST, KVL_LOGITS_ALL = 0, 1, 2

IO_MODES = {"auto": KVL_IO_AUTO, "direct": KVL_IO_DIRECT, "buffered": KVL_IO_BUFFERED}
KERNELS = {"auto": KVL_KERNELS_AUTO, "scalar": KVL_KERNELS_SCALAR, "avx2": KVL_KERNELS_AVX2,
           "avx512": KVL_KERNELS_AVX512}
KV_DTYPES = {"default": KVL_KV_DEFAULT, "f32": KVL_KV_F32, "bf16": KVL_KV_BF16}
# Inputs of the Linear layers: f32 exact (default), bf16 opt-in fast prefill (kvl_core.h KVL_ACT_*).
ACT_DTYPES = {"default": KVL_ACT_DEFAULT, "f32": KVL_ACT_F32, "bf16": KVL_ACT_BF16}
LOGITS_MODES = {"none": KVL_LOGITS_NONE, "last": KVL_LOGITS_LAST, "all": KVL_LOGITS_ALL}


# ---- structs -------------------------------------------------------------------------------------

class EngineOptions(Structure):
    _fields_ = [
        ("n_threads", c_int32),
        ("expert_cache_bytes", c_uint64),
        ("trunk_cache_bytes", c_int64),
        ("io_mode", c_int32),
        ("kernels", c_int32),
        ("kv_dtype", c_int32),
        ("load_vision", c_int32),
        ("act_dtype", c_int32),
        ("layer_begin", c_int32), ("layer_end", c_int32),
    ]


class EngineInfo(Structure):
    _fields_ = [
        ("vocab_size", c_int32), ("hidden_size", c_int32), ("n_layers", c_int32),
        ("n_heads", c_int32), ("kv_lora_rank", c_int32), ("qk_rope_head_dim", c_int32),
        ("n_routed_experts", c_int32), ("num_experts_per_tok", c_int32),
        ("max_position_embeddings", c_int32),
        ("vision_hidden_size", c_int32), ("vision_merge_h", c_int32), ("vision_merge_w", c_int32),
        ("vision_patch_size", c_int32),
        ("media_placeholder_token_id", c_int32),
        ("n_threads", c_int32),
        ("trunk_direct_io", c_int32), ("expert_direct_io", c_int32), ("vision_direct_io", c_int32),
        ("kernels", c_char * 16),
        ("kv_dtype", c_char * 8),
        ("global_bytes", c_uint64),
        ("trunk_cache_bytes", c_uint64),
        ("expert_cache_bytes", c_uint64),
        ("engine_workspace_bytes", c_uint64),
        ("expert_extent_bytes", c_uint64),
        ("act_dtype", c_char * 8),
        ("layer_begin", c_int32), ("layer_end", c_int32),
    ]


class Stats(Structure):
    _fields_ = [
        ("expert_hits", c_uint64), ("expert_misses", c_uint64), ("expert_bytes_read", c_uint64),
        ("expert_stall_ns", c_uint64),
        ("trunk_hits", c_uint64), ("trunk_misses", c_uint64), ("trunk_bytes_read", c_uint64),
        ("trunk_stall_ns", c_uint64),
        ("vision_bytes_read", c_uint64),
        ("tokens_prefilled", c_uint64), ("tokens_decoded", c_uint64),
    ]


class SessionOptions(Structure):
    _fields_ = [("max_context", c_int32), ("max_batch", c_int32)]


class SamplerState(Structure):
    _fields_ = [("temperature", c_float), ("top_k", c_int32), ("top_p", c_float),
                ("rng_state", c_uint64)]


_engine_p = c_void_p
_session_p = c_void_p
_f32p = POINTER(c_float)
_i32p = POINTER(c_int32)


def _declare(lib: ctypes.CDLL) -> None:
    def fn(name: str, restype: Any, *argtypes: Any) -> None:
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    fn("kvl_strerror", c_char_p, c_int32)
    fn("kvl_abi_version", c_int32)
    fn("kvl_engine_open", c_int32, c_char_p, POINTER(EngineOptions), POINTER(_engine_p),
       c_char_p, c_size_t)
    fn("kvl_engine_free", None, _engine_p)
    fn("kvl_engine_get_info", c_int32, _engine_p, POINTER(EngineInfo))
    fn("kvl_engine_get_stats", c_int32, _engine_p, POINTER(Stats))
    fn("kvl_engine_reset_stats", None, _engine_p)
    fn("kvl_engine_last_error", c_char_p, _engine_p)
    fn("kvl_session_bytes", c_int32, _engine_p, POINTER(SessionOptions), POINTER(c_uint64))
    fn("kvl_session_new", c_int32, _engine_p, POINTER(SessionOptions), POINTER(_session_p))
    fn("kvl_session_free", None, _session_p)
    fn("kvl_session_position", c_int32, _session_p)
    fn("kvl_session_truncate", c_int32, _session_p, c_int32)
    fn("kvl_session_prefill", c_int32, _session_p, _i32p, c_int32, _f32p, c_int32, c_int32, _f32p)
    fn("kvl_session_step", c_int32, _session_p, c_int32, _f32p)
    fn("kvl_session_cancel", None, _session_p)
    fn("kvl_sampler_seed", None, POINTER(SamplerState), c_uint64)
    fn("kvl_sample", c_int32, POINTER(SamplerState), _f32p, c_int32, _i32p)
    fn("kvl_vision_bytes", c_int32, _engine_p, _i32p, c_int32, POINTER(c_uint64))
    fn("kvl_vision_encode", c_int32, _engine_p, _f32p, _i32p, c_int32, _f32p)


# ---- library lookup --------------------------------------------------------------------------------

def _library_names() -> list[str]:
    if sys.platform == "win32":
        return ["kvl.dll", "libkvl.dll"]
    if sys.platform == "darwin":
        return ["libkvl.dylib"]
    return ["libkvl.so"]


def library_candidates() -> list[Path]:
    """Where load_library() looks, in order: $KVL_LIB, the kvl package folder, <repo>/build/wasm-core/."""
    out: list[Path] = []
    env = os.environ.get("KVL_LIB")
    if env:
        out.append(Path(env))
    package_dir = Path(__file__).resolve().parent
    repo_build = package_dir.parent / "build" / "wasm-core"
    for folder in (package_dir, repo_build):
        out.extend(folder / name for name in _library_names())
    return out


_LIB: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    """Load (once) and return libkvl; raises KvlError with the places searched if it is absent."""
    global _LIB
    if _LIB is not None:
        return _LIB
    env = os.environ.get("KVL_LIB")
    if env and not Path(env).is_file():
        raise KvlError(KVL_ERR_IO, f"KVL_LIB={env} does not exist; point it at a built libkvl "
                                   "or unset it")
    tried = library_candidates()
    for path in tried:
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            abi = lib.kvl_abi_version()
            if abi != KVL_ABI_VERSION:
                raise KvlError(KVL_ERR_UNSUPPORTED, f"{path} has ABI version {abi}, this binding "
                                                    f"expects {KVL_ABI_VERSION}; rebuild the library")
            _LIB = lib
            return lib
    raise KvlError(KVL_ERR_IO, "the kvl native library was not found (looked at: "
                   + ", ".join(str(p) for p in tried)
                   + "); build it with `cmake -S . -B build && cmake --build build` or set KVL_LIB")


class KvlError(UserError):
    """A failed native call: status code (kvl_status) and the library's detail message.

    A UserError, so the CLI prints the message (which names the file or argument at fault)
    without a traceback."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


def _status_text(lib: ctypes.CDLL, status: int) -> str:
    raw = lib.kvl_strerror(status)
    return raw.decode("utf-8", "replace") if raw else f"status {status}"


# ---- wrappers ------------------------------------------------------------------------------------------

def _f32_ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(_f32p)


def _i32_ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(_i32p)


class _NativeHandle:
    """Owns one C handle: freed by close(), on leaving a `with` block, or when collected."""

    _lib: Any
    _handle: int | None
    _free_fn: str  # the kvl_core.h function that frees this kind of handle

    def close(self) -> None:
        if self._handle is not None:
            getattr(self._lib, self._free_fn)(self._handle)
            self._handle = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class NativeEngine(_NativeHandle):
    """An opened pack: kvl_engine_open with keyword options (see kvl_core.h kvl_engine_options)."""

    _free_fn = "kvl_engine_free"

    def __init__(self, pack_dir: str | os.PathLike[str], *, n_threads: int = 0,
                 expert_cache_bytes: int = 0, trunk_cache_bytes: int = 0, io_mode: str = "auto",
                 kernels: str = "auto", kv_dtype: str = "default", load_vision: bool = False,
                 act_dtype: str = "default") -> None:
        self._lib = load_library()
        self._handle: int | None = None
        for label, value, table in (("io_mode", io_mode, IO_MODES), ("kernels", kernels, KERNELS),
                                    ("kv_dtype", kv_dtype, KV_DTYPES),
                                    ("act_dtype", act_dtype, ACT_DTYPES)):
            if value not in table:
                raise KvlError(KVL_ERR_INVALID_ARG,
                               f"{label}={value!r} is not one of {', '.join(table)}")
        if expert_cache_bytes < 0:
            raise KvlError(KVL_ERR_INVALID_ARG,
                           f"expert_cache_bytes={expert_cache_bytes} must be >= 0 (0 = default)")
        opts = EngineOptions(n_threads=int(n_threads), expert_cache_bytes=int(expert_cache_bytes),
                             trunk_cache_bytes=int(trunk_cache_bytes), io_mode=IO_MODES[io_mode],
                             kernels=KERNELS[kernels], kv_dtype=KV_DTYPES[kv_dtype],
                             load_vision=1 if load_vision else 0,
                             act_dtype=ACT_DTYPES[act_dtype])
        handle = _engine_p()
        err = ctypes.create_string_buffer(1024)
        status = self._lib.kvl_engine_open(os.fsencode(str(pack_dir)), ctypes.byref(opts),
                                           ctypes.byref(handle), err, len(err))
        if status != KVL_OK:
            detail = err.value.decode("utf-8", "replace") or _status_text(self._lib, status)
            raise KvlError(status, f"cannot open pack {pack_dir}: {detail}")
        self._handle = handle.value
        self.pack_dir = Path(pack_dir)
        self._info = self.info()

    # -- plumbing
    def _h(self) -> int:
        if self._handle is None:
            raise KvlError(KVL_ERR_INVALID_ARG, "the engine is closed")
        return self._handle

    def _check(self, status: int, what: str) -> None:
        if status != KVL_OK:
            raw = self._lib.kvl_engine_last_error(self._handle) if self._handle else None
            detail = raw.decode("utf-8", "replace") if raw else ""
            raise KvlError(status, f"{what}: {detail or _status_text(self._lib, status)}")

    # -- API
    def info(self) -> dict[str, Any]:
        info = EngineInfo()
        self._check(self._lib.kvl_engine_get_info(self._h(), ctypes.byref(info)), "engine info")
        out: dict[str, Any] = {}
        for name, _ in EngineInfo._fields_:
            value = getattr(info, name)
            out[name] = value.decode("ascii") if isinstance(value, bytes) else int(value)
        return out

    def stats(self) -> dict[str, int]:
        st = Stats()
        self._check(self._lib.kvl_engine_get_stats(self._h(), ctypes.byref(st)), "engine stats")
        return {name: int(getattr(st, name)) for name, _ in Stats._fields_}

    def reset_stats(self) -> None:
        self._lib.kvl_engine_reset_stats(self._h())

    @property
    def vocab_size(self) -> int:
        return int(self._info["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self._info["hidden_size"])

    def session_bytes(self, max_context: int = 4096, max_batch: int = 256) -> int:
        opts = SessionOptions(max_context=int(max_context), max_batch=int(max_batch))
        out = c_uint64()
        self._check(self._lib.kvl_session_bytes(self._h(), ctypes.byref(opts), ctypes.byref(out)),
                    "session size")
        return int(out.value)

    def new_session(self, max_context: int = 4096, max_batch: int = 256) -> NativeSession:
        opts = SessionOptions(max_context=int(max_context), max_batch=int(max_batch))
        handle = _session_p()
        self._check(self._lib.kvl_session_new(self._h(), ctypes.byref(opts), ctypes.byref(handle)),
                    "new session")
        return NativeSession(self, handle.value, int(max_context))

    def vision_bytes(self, grids: np.ndarray | Sequence[Sequence[int]]) -> int:
        g = np.ascontiguousarray(np.asarray(grids, dtype=np.int32).reshape(-1, 2))
        out = c_uint64()
        self._check(self._lib.kvl_vision_bytes(self._h(), _i32_ptr(g), g.shape[0], ctypes.byref(out)),
                    "vision size")
        return int(out.value)

    def vision_encode(self, pixel_values: np.ndarray, grids: np.ndarray) -> np.ndarray:
        px = np.ascontiguousarray(pixel_values, dtype=np.float32)
        g = np.ascontiguousarray(np.asarray(grids, dtype=np.int32).reshape(-1, 2))
        patch = int(self._info["vision_patch_size"])
        if px.ndim != 4 or px.shape[1:] != (3, patch, patch):
            raise KvlError(KVL_ERR_INVALID_ARG,
                           f"pixel_values must be float32 [N, 3, {patch}, {patch}], got {px.shape}")
        if int((g[:, 0].astype(np.int64) * g[:, 1]).sum()) != px.shape[0]:
            raise KvlError(KVL_ERR_INVALID_ARG, f"grids {g.tolist()} cover "
                           f"{int((g[:, 0] * g[:, 1]).sum())} patches but pixel_values has "
                           f"{px.shape[0]}")
        mh, mw = int(self._info["vision_merge_h"]), int(self._info["vision_merge_w"])
        if mh <= 0 or mw <= 0 or np.any(g[:, 0] % mh) or np.any(g[:, 1] % mw):
            raise KvlError(KVL_ERR_INVALID_ARG,
                           f"every grid must be a multiple of the merge kernel {mh}x{mw}: {g.tolist()}")
        rows = int((g[:, 0].astype(np.int64) * g[:, 1] // (mh * mw)).sum())
        out = np.empty((rows, self.hidden_size), dtype=np.float32)
        self._check(self._lib.kvl_vision_encode(self._h(), _f32_ptr(px), _i32_ptr(g), g.shape[0],
                                                _f32_ptr(out)), "vision encode")
        return out


class NativeSession(_NativeHandle):
    """One KV timeline of an engine. Close sessions before their engine."""

    _free_fn = "kvl_session_free"

    def __init__(self, engine: NativeEngine, handle: int, max_context: int) -> None:
        self._engine = engine
        self._lib = engine._lib
        self._handle: int | None = handle
        self.max_context = max_context
        self._vocab = engine.vocab_size

    def _h(self) -> int:
        if self._handle is None:
            raise KvlError(KVL_ERR_INVALID_ARG, "the session is closed")
        if self._engine._handle is None:
            raise KvlError(KVL_ERR_INVALID_ARG, "the session's engine is closed")
        return self._handle

    @property
    def position(self) -> int:
        return int(self._lib.kvl_session_position(self._h()))

    def prefill(self, tokens: Iterable[int] | np.ndarray, media_embeds: np.ndarray | None = None,
                logits: str = "last") -> np.ndarray | None:
        """Append tokens; returns [vocab] ("last"), [n, vocab] ("all") or None ("none")."""
        if logits not in LOGITS_MODES:
            raise KvlError(KVL_ERR_INVALID_ARG, f"logits={logits!r} must be one of "
                                                f"{', '.join(LOGITS_MODES)}")
        toks = np.ascontiguousarray(np.asarray(list(tokens) if not isinstance(tokens, np.ndarray)
                                               else tokens, dtype=np.int64))
        if toks.ndim != 1:
            raise KvlError(KVL_ERR_INVALID_ARG, f"tokens must be one-dimensional, got {toks.shape}")
        if toks.size and (toks.min() < -2**31 or toks.max() >= 2**31):
            raise KvlError(KVL_ERR_INVALID_ARG, "token ids must fit in int32")
        t32 = np.ascontiguousarray(toks.astype(np.int32))
        n = int(t32.shape[0])
        media_ptr, n_media = None, 0
        if media_embeds is not None:
            media = np.ascontiguousarray(media_embeds, dtype=np.float32)
            if media.ndim != 2 or media.shape[1] != self._engine.hidden_size:
                raise KvlError(KVL_ERR_INVALID_ARG, f"media_embeds must be float32 "
                               f"[n, {self._engine.hidden_size}], got {media.shape}")
            media_ptr, n_media = _f32_ptr(media), int(media.shape[0])
        mode = LOGITS_MODES[logits]
        out: np.ndarray | None = None
        if mode == KVL_LOGITS_LAST:
            out = np.empty(self._vocab, dtype=np.float32)
        elif mode == KVL_LOGITS_ALL:
            out = np.empty((n, self._vocab), dtype=np.float32)
        status = self._lib.kvl_session_prefill(self._h(), _i32_ptr(t32), n, media_ptr, n_media, mode,
                                               _f32_ptr(out) if out is not None else None)
        self._engine._check(status, "prefill")
        return out

    def step(self, token: int) -> np.ndarray:
        """Append one token; returns a fresh [vocab] logits array."""
        tok = int(token)
        if not -2**31 <= tok < 2**31:
            raise KvlError(KVL_ERR_INVALID_ARG, f"token id {tok} does not fit in int32")
        out = np.empty(self._vocab, dtype=np.float32)
        self._engine._check(self._lib.kvl_session_step(self._h(), tok, _f32_ptr(out)), "step")
        return out

    def truncate(self, n_tokens: int) -> None:
        self._engine._check(self._lib.kvl_session_truncate(self._h(), int(n_tokens)), "truncate")

    def cancel(self) -> None:
        """Ask a prefill/step running in another thread to stop (it raises KvlError CANCELLED)."""
        if self._handle is not None:
            self._lib.kvl_session_cancel(self._handle)


class Sampler:
    """kvl_sample: greedy when temperature <= 0, else temperature -> top-k -> top-p -> draw."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0) -> None:
        self._lib = load_library()
        self._state = SamplerState(temperature=float(temperature), top_k=int(top_k),
                                   top_p=float(top_p), rng_state=0)
        self._lib.kvl_sampler_seed(ctypes.byref(self._state), int(seed) & (2**64 - 1))
        self._work = np.empty(0, dtype=np.int32)

    def sample(self, logits: np.ndarray) -> int:
        scratch = np.array(logits, dtype=np.float32, copy=True).reshape(-1)
        vocab = int(scratch.shape[0])
        if vocab == 0:
            raise KvlError(KVL_ERR_INVALID_ARG, "cannot sample from an empty logits vector")
        if self._work.shape[0] < vocab:
            self._work = np.empty(vocab, dtype=np.int32)
        return int(self._lib.kvl_sample(ctypes.byref(self._state), _f32_ptr(scratch), vocab,
                                        _i32_ptr(self._work)))
