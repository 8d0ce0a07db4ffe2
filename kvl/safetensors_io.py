"""Sharded safetensors reading (a TensorSource) and bounded-memory writing, without torch.

Owns: header parsing and validation of every shard at open time (so reads later cannot run past a
file), positional tensor reads, the source revision lookup of a checkpoint directory, and a
streaming writer for shards plus the `model.safetensors.index.json` writer.
Does not own: which tensors a model needs (modelspec.py) or what to do with them (pack.py).

numpy has no bfloat16, so BF16 data is handled as uint16 raw bits everywhere.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvl.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ASSET_NAMES = ("config.json", "generation_config.json", "tokenizer_config.json",
               "tiktoken.model", "chat_template.jinja", "preprocessor_config.json")
REVISION_FILES = ("SOURCE_REVISION.txt", ".kvl_revision")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the official limit; a larger value means a corrupt file

# safetensors dtype -> numpy dtype used for the raw bytes (little-endian).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "I16": np.dtype("<i2"), "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "BOOL": np.dtype("u1"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
}
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


def itemsize(dtype: str) -> int:
    return NUMPY_DTYPES[dtype].itemsize


class SafetensorsFile:
    """One validated safetensors file: tensor table and a lazily opened file for positional reads."""

    def __init__(self, path: Path):
        self.path = path
        # name -> dtype, shape, begin, end
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self.data_start = 0
        self._file = None
        self._parse()

    def _fail(self, what: str, todo: str = "re-download it") -> UserError:
        return UserError(f"{self.path.name} {what}; {todo}")

    def _parse(self) -> None:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(f"is truncated: {size} bytes, too short for a safetensors "
                                     "header length")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise self._fail(f"has a corrupt header: header length field says {n} bytes, "
                                     f"file has {size} bytes")
                raw = f.read(n)
        except OSError as exc:
            raise UserError(f"cannot read {self.path}: {exc.strerror or exc}; check the path and "
                            "permissions") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            # RecursionError: json's answer to absurdly nested input (found by test_pack_fuzz.py)
            raise self._fail(f"has a corrupt header: not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail("has a corrupt header: the JSON header is not an object")
        self.data_start = 8 + n
        data_size = size - self.data_start
        max_end = 0
        spans: list[tuple[int, int, str]] = []
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if (not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str)
                    or not isinstance(entry.get("shape"), list)
                    or not isinstance(entry.get("data_offsets"), list)):
                raise self._fail(f"has a corrupt header: entry {key!r} lacks dtype/shape/data_offsets")
            dtype = entry["dtype"]
            if dtype not in NUMPY_DTYPES:
                raise self._fail(f"has tensor {key} with unknown dtype {dtype!r}",
                                 "this checkpoint format is not supported; re-download it")
            shape = entry["shape"]
            offs = entry["data_offsets"]
            if (not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                    or len(offs) != 2
                    or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
                raise self._fail(f"has a corrupt header: tensor {key} has shape {shape!r} and "
                                 f"data_offsets {offs!r}")
            begin, end = offs
            if begin < 0 or end < begin:
                raise self._fail(f"has a corrupt header: tensor {key} has data_offsets "
                                 f"[{begin}, {end}]")
            want = math.prod(shape) * itemsize(dtype)
            if end - begin != want:
                raise self._fail(f"has a corrupt header: tensor {key} ({dtype} {shape}) needs "
                                 f"{want} bytes but data_offsets [{begin}, {end}] span {end - begin}")
            max_end = max(max_end, end)
            spans.append((begin, end, key))
            self.tensors[key] = (dtype, tuple(shape), begin, end)
        if max_end > data_size:
            raise self._fail(f"is truncated: header says {max_end} bytes of data, file has "
                             f"{data_size}")
        spans.sort()
        for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise self._fail(f"has a corrupt header: tensors {k0} and {k1} overlap")

    def read(self, key: str) -> np.ndarray:
        dtype, shape, begin, end = self.tensors[key]
        out = np.empty(shape, NUMPY_DTYPES[dtype])
        if end == begin:
            return out
        if self._file is None:
            # kept open across read() calls for positional reads; closed in close()
            self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115
        # Positional reads into a fresh buffer rather than an mmap of the whole shard: mapped
        # pages would stay resident and push the packer's RSS towards the shard size (~5 GB).
        buf = memoryview(out.reshape(-1).view(np.uint8))
        pos, done = self.data_start + begin, 0
        self._file.seek(pos)
        while done < len(buf):
            n = self._file.readinto(buf[done:])
            if not n:
                raise self._fail("shrank after it was opened")
            done += n
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SafetensorsCheckpoint:
    """A checkpoint directory (sharded with an index, or one model.safetensors) as a TensorSource."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise UserError(f"checkpoint directory {self.dir} does not exist; pass the folder that "
                            "holds config.json and the .safetensors files")
        self._config: dict | None = None
        self._shards: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}  # tensor name -> shard file name, in index order
        index = self.dir / INDEX_NAME
        if index.exists():
            weight_map = self._read_index(index)
            for file in dict.fromkeys(weight_map.values()):
                path = self.dir / file
                if not path.is_file():
                    raise UserError(f"{file} is listed in {INDEX_NAME} but missing from {self.dir}; "
                                    "download it")
                self._shards[file] = SafetensorsFile(path)
            for name, file in weight_map.items():
                if name not in self._shards[file].tensors:
                    raise UserError(f"{file} does not contain tensor {name} that {INDEX_NAME} puts "
                                    "there; re-download the shard and the index")
                self._where[name] = file
        elif (self.dir / SINGLE_NAME).is_file():
            shard = SafetensorsFile(self.dir / SINGLE_NAME)
            self._shards[SINGLE_NAME] = shard
            for name in shard.tensors:
                self._where[name] = SINGLE_NAME
        else:
            raise UserError(f"{self.dir} holds neither {INDEX_NAME} nor {SINGLE_NAME}; pass a "
                            "checkpoint directory (download the model files first)")

    @staticmethod
    def _read_index(index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise UserError(f"{INDEX_NAME} is unreadable ({exc}); re-download it") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise UserError(f"{INDEX_NAME} has no valid weight_map; re-download it")
        for file in weight_map.values():
            if Path(file).name != file:
                raise UserError(f"{INDEX_NAME} names shard {file!r} outside the checkpoint "
                                "directory; re-download the index")
        return weight_map

    # TensorSource protocol
    def config(self) -> dict:
        if self._config is None:
            path = self.dir / "config.json"
            try:
                self._config = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise UserError(f"{self.dir} has no config.json; download it with the "
                                "checkpoint") from None
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise UserError(f"config.json is unreadable ({exc}); re-download it") from None
            if not isinstance(self._config, dict):
                raise UserError("config.json is not a JSON object; re-download it")
        return self._config

    def asset_files(self) -> dict[str, bytes]:
        return {n: (self.dir / n).read_bytes() for n in ASSET_NAMES if (self.dir / n).is_file()}

    def revision(self) -> str | None:
        return find_revision(self.dir)

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        dtype, shape, _, _ = self._shard(name).tensors[name]
        return dtype, shape

    def read(self, name: str) -> np.ndarray:
        return self._shard(name).read(name)

    def shard_of(self, name: str) -> str | None:
        self._shard(name)
        return self._where[name]

    def _shard(self, name: str) -> SafetensorsFile:
        try:
            return self._shards[self._where[name]]
        except KeyError:
            raise UserError(f"tensor {name} is not in the checkpoint at {self.dir}") from None

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_revision(value: str, where: str) -> str:
    value = value.strip().lower()
    if not _HEX40.match(value):
        raise UserError(f"{where} holds {value[:60]!r}, not a 40-hex-digit commit hash; fix or "
                        "delete it")
    return value


def find_revision(directory: Path) -> str | None:
    """The checkpoint's source commit: an explicit revision file, huggingface_hub local_dir
    download metadata, or a `snapshots/<40-hex>` path component; None if none says."""
    for file in REVISION_FILES:
        path = directory / file
        if path.is_file():
            return _check_revision(path.read_text(encoding="utf-8", errors="replace"), str(path))
    meta_dir = directory / ".cache" / "huggingface" / "download"
    if meta_dir.is_dir():
        found: dict[str, str] = {}
        for meta in sorted(meta_dir.rglob("*.metadata")):
            lines = meta.read_text(encoding="utf-8", errors="replace").splitlines()
            if lines and _HEX40.match(lines[0].strip().lower()):
                found[meta.name] = lines[0].strip().lower()
        distinct = set(found.values())
        if len(distinct) > 1:
            raise UserError(f"files in {directory} come from different revisions "
                            f"({', '.join(sorted(distinct))}); re-download them at one revision")
        if distinct:
            return distinct.pop()
    for part in reversed(directory.absolute().parts):
        if _HEX40.match(part):
            return part
    return None


class SafetensorsWriter:
    """Streams one safetensors file: the tensor list is fixed up front, the header is written
    first, then tensors one at a time in that order (memory stays at one tensor). The file appears
    under its final name only after the last tensor, so a crash never leaves a valid-looking shard."""

    def __init__(self, path: str | os.PathLike,
                 tensors: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._order: list[tuple[str, str, tuple[int, ...], int]] = []
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for name, dtype, shape in tensors:
            if dtype not in NUMPY_DTYPES:
                raise ValueError(f"unknown safetensors dtype {dtype!r} for {name}")
            if name in header:
                raise ValueError(f"duplicate tensor name {name}")
            nbytes = math.prod(shape) * itemsize(dtype)
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        self.data_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
        self._tmp = self.path.with_name(self.path.name + ".partial")
        # written by successive write() calls; closed (and renamed into place) in close()
        self._f = open(self._tmp, "wb")  # noqa: SIM115
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        if self._next >= len(self._order):
            raise ValueError(f"{self.path.name}: all tensors already written, got {name}")
        want_name, dtype, shape, nbytes = self._order[self._next]
        if name != want_name:
            raise ValueError(f"{self.path.name}: expected tensor {want_name} next, got {name}")
        arr = np.ascontiguousarray(array)
        if tuple(arr.shape) != shape or arr.dtype.itemsize != itemsize(dtype) or arr.nbytes != nbytes:
            raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {arr.dtype} "
                             f"{list(arr.shape)}")
        self._f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
                      if arr.dtype.byteorder == ">" else memoryview(arr).cast("B"))
        self._next += 1

    def close(self) -> None:
        if self._f.closed:
            return
        if self._next != len(self._order):
            self._f.close()
            missing = self._order[self._next][0]
            raise ValueError(f"{self.path.name}: closed before tensor {missing} was written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_index(directory: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> Path:
    """Writes model.safetensors.index.json (weight_map kept in the given order)."""
    path = Path(directory) / INDEX_NAME
    data = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(weight_map)}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
