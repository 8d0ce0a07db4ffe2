"""The kvl runtime-directory ("pack") format of docs/FORMAT.md, as the Python front end still reads it.

Owns: the on-disk constants, index (.idx) encoding/decoding, the expert-extent layout math, the
Python `PackReader` (used by the Python tests, the planner and the bench).
It goes with the Python front end (issue: text engine on the TypeScript host). Does not own: writing
packs (the TypeScript packer: packer/pack.ts, host/pack-format.ts), nor the C reader
(wasm-core/src/store.c); all three agree byte for byte.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvl.errors import UserError

FORMAT_VERSION = 1
IDX_MAGIC = b"KVLIDX01"
HEADER_BYTES = 128
HPARAM_RECORD_BYTES = 64
TENSOR_RECORD_BYTES = 192
HPARAM_KEY_BYTES = 56
TENSOR_NAME_BYTES = 128
BIN_ALIGN = 4096
SUBBLOCK_ALIGN = 64
MAX_NDIM = 4

STORE_TRUNK = 1
STORE_EXPERTS = 2
STORE_VISION = 3
STORE_NAMES: dict[int, str] = {STORE_TRUNK: "trunk", STORE_EXPERTS: "experts", STORE_VISION: "vision"}
STORE_KINDS: dict[str, int] = {name: kind for kind, name in STORE_NAMES.items()}

DTYPE_BF16 = 1
DTYPE_F32 = 2
DTYPE_Q8_EXPERT = 3
DTYPE_NAMES: dict[int, str] = {DTYPE_BF16: "BF16", DTYPE_F32: "F32", DTYPE_Q8_EXPERT: "Q8_EXPERT"}
DTYPE_ITEMSIZE: dict[int, int] = {DTYPE_BF16: 2, DTYPE_F32: 4}

# Files copied verbatim from the source checkpoint (those that exist).
ASSET_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tiktoken.model",
               "chat_template.jinja", "preprocessor_config.json")
SOURCE_REVISION_FILE = "SOURCE_REVISION.txt"
COMPLETE_FILE = "PACK_COMPLETE.json"
JOURNAL_DIR = ".pack-journal"

_HEADER = struct.Struct("<8sIIQIIII40s48s")
_HPARAM = struct.Struct("<56sd")
_TENSOR = struct.Struct("<128sII4QQQII")
_CRC_FIELD_OFFSET = 36
assert _HEADER.size == HEADER_BYTES and _HPARAM.size == HPARAM_RECORD_BYTES
assert _TENSOR.size == TENSOR_RECORD_BYTES

INCOMPLETE_HINT = "the pack is incomplete; rerun kvl pack"


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------------------------
# Expert extents


@dataclass(frozen=True)
class ExpertLayout:
    """Byte offsets of the sub-blocks inside one (layer, expert) extent, relative to its start."""

    intermediate: int
    hidden: int
    gate_q: int
    up_q: int
    down_q: int
    gate_s: int
    up_s: int
    down_s: int
    nbytes: int


def expert_layout(intermediate: int, hidden: int) -> ExpertLayout:
    i, h = intermediate, hidden
    gate_q = 0
    up_q = align_up(gate_q + i * h, SUBBLOCK_ALIGN)
    down_q = align_up(up_q + i * h, SUBBLOCK_ALIGN)
    gate_s = align_up(down_q + h * i, SUBBLOCK_ALIGN)
    up_s = align_up(gate_s + 4 * i, SUBBLOCK_ALIGN)
    down_s = align_up(up_s + 4 * i, SUBBLOCK_ALIGN)
    return ExpertLayout(i, h, gate_q, up_q, down_q, gate_s, up_s, down_s, down_s + 4 * h)


def expert_record_name(layer: int, expert: int) -> str:
    return f"language_model.model.layers.{layer}.mlp.experts.{expert}"


# ---------------------------------------------------------------------------------------------
# Numerics


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw BF16 bits (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize_rows_q8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


# ---------------------------------------------------------------------------------------------
# Index encoding


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int = 0


@dataclass
class StoreIndex:
    kind: int
    bin_size: int
    hparams: dict[str, float]
    records: list[TensorRecord]
    config_text: str
    revision: str | None
    by_name: dict[str, TensorRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {r.name: r for r in self.records}


def record_nbytes(dtype: int, shape: tuple[int, ...]) -> int:
    if dtype == DTYPE_Q8_EXPERT:
        return expert_layout(shape[2], shape[3]).nbytes
    # exact Python integers: np.prod(int64) wrapped around for hostile shapes (e.g. [2**32, 2**32]
    # gave 0, so a 0-byte record passed), which store.c rejects
    return DTYPE_ITEMSIZE[dtype] * math.prod(int(d) for d in shape)


def encode_index(kind: int, bin_size: int, hparams: dict[str, float], records: list[TensorRecord],
                 config_text: str, revision: str | None) -> bytes:
    """The complete .idx file bytes, CRC included."""
    config_bytes = config_text.encode("utf-8")
    rev = (revision or "").encode("ascii")
    if rev and len(rev) != 40:
        raise ValueError(f"source revision must be 40 hex characters, got {revision!r}")
    parts = [_HEADER.pack(IDX_MAGIC, FORMAT_VERSION, kind, bin_size, len(hparams), len(records),
                          len(config_bytes), 0, rev.ljust(40, b"\0"), b"\0" * 48)]
    for key, value in hparams.items():
        raw = key.encode("ascii")
        if len(raw) >= HPARAM_KEY_BYTES:
            raise ValueError(f"hparam key too long: {key}")
        parts.append(_HPARAM.pack(raw, float(value)))
    for rec in records:
        raw = rec.name.encode("ascii")
        if len(raw) >= TENSOR_NAME_BYTES:
            raise ValueError(f"tensor name too long for the index: {rec.name}")
        shape = tuple(rec.shape) + (0,) * (MAX_NDIM - len(rec.shape))
        parts.append(_TENSOR.pack(raw, rec.dtype, len(rec.shape), *shape, rec.offset, rec.nbytes,
                                  rec.crc32 & 0xFFFFFFFF, 0))
    parts.append(config_bytes)
    data = bytearray(b"".join(parts))
    struct.pack_into("<I", data, _CRC_FIELD_OFFSET, zlib.crc32(data) & 0xFFFFFFFF)
    return bytes(data)


def _cstr(raw: bytes, what: str, where: str) -> str:
    end = raw.find(b"\0")
    if end < 0:
        raise UserError(f"{where}: {what} is not NUL-terminated — the index is corrupt; rerun kvl pack")
    try:
        return raw[:end].decode("ascii")
    except UnicodeDecodeError:
        raise UserError(f"{where}: {what} is not ASCII — the index is corrupt; rerun kvl pack") from None


def decode_index(data: bytes, where: str, expected_kind: int | None = None) -> StoreIndex:
    """Parse and fully validate .idx bytes; `where` names the file in error messages."""
    corrupt = "the index is corrupt; rerun kvl pack"
    if len(data) < HEADER_BYTES:
        raise UserError(f"{where}: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header — "
                        f"{corrupt}")
    (magic, version, kind, bin_size, n_hparams, n_tensors, config_bytes, crc, rev_raw,
     _reserved) = _HEADER.unpack_from(data, 0)
    if magic != IDX_MAGIC:
        raise UserError(f"{where}: bad magic {magic!r} (expected {IDX_MAGIC!r}) — not a kvl index; "
                        "rerun kvl pack")
    if version != FORMAT_VERSION:
        raise UserError(f"{where}: format version {version}, this kvl reads version {FORMAT_VERSION}; "
                        "repack with this kvl version")
    if kind not in STORE_NAMES:
        raise UserError(f"{where}: unknown store kind {kind} — {corrupt}")
    if expected_kind is not None and kind != expected_kind:
        raise UserError(f"{where}: store kind {STORE_NAMES[kind]}, expected {STORE_NAMES[expected_kind]} — "
                        f"{corrupt}")
    expected_size = (HEADER_BYTES + HPARAM_RECORD_BYTES * n_hparams + TENSOR_RECORD_BYTES * n_tensors
                     + config_bytes)
    if len(data) != expected_size:
        raise UserError(f"{where}: expected {expected_size} bytes from its header, found {len(data)} — "
                        f"{corrupt}")
    check = bytearray(data)
    struct.pack_into("<I", check, _CRC_FIELD_OFFSET, 0)
    actual_crc = zlib.crc32(check) & 0xFFFFFFFF
    if actual_crc != crc:
        raise UserError(f"{where}: CRC mismatch (stored {crc:08x}, computed {actual_crc:08x}) — {corrupt}")
    if bin_size % BIN_ALIGN:
        raise UserError(f"{where}: bin_size {bin_size} is not a multiple of {BIN_ALIGN} — {corrupt}")
    # The checks below mirror store.c's, so both readers accept exactly the same indexes.
    if any(_reserved):
        raise UserError(f"{where}: reserved header bytes are not zero — written by an incompatible "
                        "packer; rerun kvl pack")
    if rev_raw == b"\0" * 40:
        revision = None
    else:
        if not all(0x21 <= b <= 0x7E for b in rev_raw):
            raise UserError(f"{where}: source revision is not 40 printable ASCII characters — {corrupt}")
        revision = rev_raw.decode("ascii")
    pos = HEADER_BYTES
    hparams: dict[str, float] = {}
    for i in range(n_hparams):
        key_raw, value = _HPARAM.unpack_from(data, pos)
        pos += HPARAM_RECORD_BYTES
        key = _cstr(key_raw, f"hparam record {i} key", where)
        if not key:
            raise UserError(f"{where}: hparam record {i} has an empty key — {corrupt}")
        if key in hparams:
            raise UserError(f"{where}: hparam {key!r} appears twice — {corrupt}")
        if not math.isfinite(value):  # the packer writes config numbers only; inf/NaN broke readers
            raise UserError(f"{where}: hparam {key!r} = {value} is not a finite number — {corrupt}")
        hparams[key] = value
    records: list[TensorRecord] = []
    prev_end = 0
    seen: set[str] = set()
    for i in range(n_tensors):
        fields = _TENSOR.unpack_from(data, pos)
        pos += TENSOR_RECORD_BYTES
        name = _cstr(fields[0], f"tensor record {i} name", where)
        if not name:
            raise UserError(f"{where}: tensor record {i} has an empty name — {corrupt}")
        dtype, ndim = fields[1], fields[2]
        dims = fields[3:7]
        offset, nbytes, rec_crc, flags = fields[7:11]
        label = f"{where}: tensor {name!r}"
        if name in seen:
            raise UserError(f"{label} appears twice — {corrupt}")
        seen.add(name)
        if dtype not in DTYPE_NAMES:
            raise UserError(f"{label} has unknown dtype {dtype} — {corrupt}")
        if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
            raise UserError(f"{label} has an invalid shape (ndim {ndim}, dims {list(dims)}) — {corrupt}")
        shape = tuple(int(d) for d in dims[:ndim])
        if dtype != DTYPE_Q8_EXPERT and not all(shape):
            raise UserError(f"{label} has a zero dimension in shape {list(shape)} — {corrupt}")
        if dtype == DTYPE_Q8_EXPERT and (ndim != 4 or not shape[2] or not shape[3]):
            raise UserError(f"{label}: Q8 expert records need shape [layer, expert, I, H] with "
                            f"I, H > 0, found {list(shape)} — {corrupt}")
        if flags != 0:
            raise UserError(f"{label} has nonzero flags {flags} — {corrupt}")
        if offset % BIN_ALIGN:
            raise UserError(f"{label} offset {offset} is not a multiple of {BIN_ALIGN} — {corrupt}")
        want = record_nbytes(dtype, shape)
        if nbytes != want:
            raise UserError(f"{label} is {nbytes} bytes but its dtype and shape need {want} — {corrupt}")
        if offset < prev_end:
            raise UserError(f"{label} at offset {offset} overlaps or precedes the previous record "
                            f"(which ends at {prev_end}) — {corrupt}")
        if offset + nbytes > bin_size:
            raise UserError(f"{label} ends at {offset + nbytes}, past bin_size {bin_size} — {corrupt}")
        prev_end = offset + nbytes
        records.append(TensorRecord(name, dtype, shape, offset, nbytes, rec_crc))
    try:
        config_text = data[pos:pos + config_bytes].decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{where}: embedded config.json is not UTF-8 — {corrupt}") from None
    return StoreIndex(kind, bin_size, hparams, records, config_text, revision)


# ---------------------------------------------------------------------------------------------
# Durable file writes


def pread(fd: int, nbytes: int, offset: int) -> bytes:
    """os.pread where it exists (POSIX); seek + read elsewhere (Windows; callers are single-threaded)."""
    if hasattr(os, "pread"):
        return os.pread(fd, nbytes, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, nbytes)


def _read_exact(fd: int, offset: int, nbytes: int, where: str) -> bytes:
    chunks = []
    done = 0
    while done < nbytes:
        chunk = pread(fd, min(nbytes - done, 64 << 20), offset + done)
        if not chunk:
            raise UserError(f"{where}: short read at offset {offset + done} — {INCOMPLETE_HINT}")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


class PackReader:
    """Opens and validates a pack directory; reads tensors for the tests, the planner and the bench."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise UserError(f"{self.dir}: no such pack directory; create one with kvl pack or kvl prepare")
        complete_path = self.dir / COMPLETE_FILE
        if not complete_path.is_file():
            raise UserError(f"{self.dir}: {COMPLETE_FILE} is missing — {INCOMPLETE_HINT}")
        try:
            complete = json.loads(complete_path.read_text(encoding="utf-8"))
            files = complete["files"]
            complete_version = complete["format_version"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            # RecursionError: json's answer to absurdly nested input, which is not a ValueError
            raise UserError(f"{complete_path}: unreadable ({exc}) — {INCOMPLETE_HINT}") from None
        # Type-check what the loop below calls .get() on: a mangled marker must be a UserError,
        # not an AttributeError (found by tests/test_pack_fuzz.py).
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise UserError(f"{complete_path}: 'files' is not a table of file entries — {INCOMPLETE_HINT}")
        if complete_version != FORMAT_VERSION:
            raise UserError(f"{complete_path}: format version {complete_version}, this kvl reads "
                            f"version {FORMAT_VERSION}; repack with this kvl version")
        self.complete = complete
        self.stores: dict[str, StoreIndex] = {}
        for kind, name in STORE_NAMES.items():
            idx_path = self.dir / f"{name}.idx"
            bin_path = self.dir / f"{name}.bin"
            if not idx_path.is_file():
                raise UserError(f"{idx_path.name}: missing from {self.dir} — {INCOMPLETE_HINT}")
            data = idx_path.read_bytes()
            meta = files.get(idx_path.name, {})
            if meta.get("size") != len(data) or meta.get("crc32") != (zlib.crc32(data) & 0xFFFFFFFF):
                raise UserError(f"{idx_path.name}: does not match {COMPLETE_FILE} (size/CRC differ) — "
                                "the pack was modified or is corrupt; rerun kvl pack")
            index = decode_index(data, idx_path.name, kind)
            if not bin_path.is_file():
                raise UserError(f"{bin_path.name}: missing from {self.dir} — {INCOMPLETE_HINT}")
            found = bin_path.stat().st_size
            if found != index.bin_size:
                raise UserError(f"{bin_path.name}: expected {index.bin_size} bytes, found {found} — "
                                f"{INCOMPLETE_HINT}")
            if files.get(bin_path.name, {}).get("size") != found:
                raise UserError(f"{bin_path.name}: size {found} differs from {COMPLETE_FILE} — "
                                f"{INCOMPLETE_HINT}")
            self.stores[name] = index
        first = self.stores["trunk"]
        for name, index in self.stores.items():
            if index.hparams != first.hparams or index.config_text != first.config_text:
                raise UserError(f"{name}.idx: hparams/config differ from trunk.idx — the stores come "
                                "from different packs; rerun kvl pack")
            if index.revision != first.revision:
                raise UserError(f"{name}.idx: source revision {index.revision} differs from trunk.idx "
                                f"({first.revision}); rerun kvl pack")
        self.hparams = first.hparams
        self.config_text = first.config_text
        self.revision = first.revision

    @property
    def config(self) -> dict:
        return json.loads(self.config_text)

    def _find(self, name: str) -> tuple[str, TensorRecord]:
        for store, index in self.stores.items():
            rec = index.by_name.get(name)
            if rec is not None:
                return store, rec
        raise KeyError(name)

    def record(self, name: str) -> TensorRecord:
        return self._find(name)[1]

    def raw(self, store: str, rec: TensorRecord) -> bytes:
        path = self.dir / f"{store}.bin"
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            return _read_exact(fd, rec.offset, rec.nbytes, path.name)
        finally:
            os.close(fd)

    def tensor(self, name: str) -> np.ndarray:
        """A trunk/vision tensor: uint16 raw BF16 bits or float32, in the checkpoint's shape."""
        store, rec = self._find(name)
        if rec.dtype == DTYPE_Q8_EXPERT:
            raise ValueError(f"{name} is an expert extent; use expert()")
        dtype = np.dtype("<u2") if rec.dtype == DTYPE_BF16 else np.dtype("<f4")
        return np.frombuffer(self.raw(store, rec), dtype=dtype).reshape(rec.shape)

    def tensor_f32(self, name: str) -> np.ndarray:
        data = self.tensor(name)
        return bf16_bits_to_f32(data) if data.dtype == np.uint16 else data.astype(np.float32)

    def expert_quantized(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """q (int8) and scale (float32) arrays of one extent: gate_q, up_q, down_q, gate_s, ..."""
        rec = self.stores["experts"].by_name[expert_record_name(layer, expert)]
        inter, hidden = rec.shape[2], rec.shape[3]
        lay = expert_layout(inter, hidden)
        buf = np.frombuffer(self.raw("experts", rec), dtype=np.uint8)

        def q(off: int, rows: int, cols: int) -> np.ndarray:
            return buf[off:off + rows * cols].view(np.int8).reshape(rows, cols)

        def s(off: int, n: int) -> np.ndarray:
            return buf[off:off + 4 * n].view("<f4")

        return {"gate_q": q(lay.gate_q, inter, hidden), "up_q": q(lay.up_q, inter, hidden),
                "down_q": q(lay.down_q, hidden, inter), "gate_s": s(lay.gate_s, inter),
                "up_s": s(lay.up_s, inter), "down_s": s(lay.down_s, hidden)}

    def expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Dequantized float32 gate_proj, up_proj, down_proj of one routed expert."""
        parts = self.expert_quantized(layer, expert)
        return {proj: dequantize_rows_q8(parts[f"{short}_q"], parts[f"{short}_s"])
                for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))}
