"""`kvl pack`: checkpoint -> kvl runtime directory (docs/FORMAT.md), bounded-memory and resumable.

Owns: validating a source before anything is written, the deterministic layout of all three stores,
the crash-safe work loop (preallocated .bin files, fixed item order, fsync-then-journal), shard
release after durable consumption, and the final atomic index/asset/completion writes.
Does not own: the byte format (kvl/packfmt.py), the expected inventory and hparams
(kvl/modelspec.py), reading checkpoints (kvl/safetensors_io.py, kvl/synth.py), downloads
(kvl/prepare.py).

Crash safety: the full layout (every record's offset) is computed from the source inventory before
any byte is written and stored in DST/.pack-journal/layout.json. Output .bin files are created at
their final size. Items (one tensor or one expert extent) are written with pwrite at fixed offsets;
a batch of items is appended to DST/.pack-journal/done.log only after the .bin files are fsynced.
A rerun with the same source skips journaled items and rewrites the rest, so any SIGKILL followed by
a rerun yields byte-identical output. Indexes, assets and PACK_COMPLETE.json are written last via
temp file + fsync + rename; PACK_COMPLETE.json is the very last.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

import kvl
from kvl import modelspec, packfmt
from kvl.errors import UserError
from kvl.safetensors_io import NUMPY_DTYPES, SafetensorsFile
from kvl.tensor_source import TensorSource

EXPERT_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.mlp\.experts\.(\d+)\."
                       r"(gate_proj|up_proj|down_proj)\.weight$")
ROUTER_BIAS_SUFFIX = ".mlp.gate.e_score_correction_bias"
JOURNAL_LAYOUT = "layout.json"
JOURNAL_DONE = "done.log"
# Journal a batch once this many output bytes (or items) are pending: bounds fsync count and the
# work lost to a crash.
# KVL_PACK_FLUSH_ITEMS lets tests force frequent journal batches on tiny models.
FLUSH_BYTES = 256 << 20
FLUSH_ITEMS = int(os.environ.get("KVL_PACK_FLUSH_ITEMS", "256"))
# Names in DST that are not ours but may legitimately exist before packing (kvl prepare's scratch).
FOREIGN_OK = {".download"}


class InventorySource:
    """A TensorSource over shard files in a directory whose inventory is known in advance (from the
    shards' headers or from a pack journal); shards may be absent until `read` needs them."""

    def __init__(self, directory: Path, config_text: str, assets: dict[str, bytes],
                 inventory: dict[str, tuple[str, tuple[int, ...], str | None]],
                 revision: str | None) -> None:
        self.directory = directory
        self._config_text = config_text
        self._assets = assets
        self._inventory = inventory
        self._revision = revision
        self._open: SafetensorsFile | None = None

    def config(self) -> dict:
        return json.loads(self._config_text)

    def asset_files(self) -> dict[str, bytes]:
        return dict(self._assets)

    def revision(self) -> str | None:
        return self._revision

    def tensor_names(self) -> list[str]:
        return list(self._inventory)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        dtype, shape, _ = self._inventory[name]
        return dtype, tuple(shape)

    def shard_of(self, name: str) -> str | None:
        return self._inventory[name][2]

    def read(self, name: str) -> np.ndarray:
        shard = self._inventory[name][2]
        path = self.directory / str(shard)
        if self._open is None or self._open.path != path:
            if not path.is_file():
                raise UserError(f"{path}: shard needed for {name} is missing; restore the checkpoint "
                                "(it was deleted before the tensors in it were packed)")
            self._open = SafetensorsFile(path)
        if name not in self._open.tensors:
            raise UserError(f"{path.name}: does not contain {name}; the shard does not match the "
                            "checkpoint index")
        return self._open.read(name)

    def release(self, shard: str) -> None:
        if self._open is not None and self._open.path.name == shard:
            self._open = None


# ---------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class Item:
    """One unit of work: a trunk/vision tensor or a (layer, expert) extent."""

    key: str            # record name in the index
    store: str          # trunk / experts / vision
    dtype: int          # packfmt dtype of the record
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    inputs: tuple[str, ...]  # source tensor names


@dataclass
class Layout:
    items: list[Item]            # in work order
    bin_sizes: dict[str, int]
    records: dict[str, list[Item]]  # per store, in offset order
    hparams: dict[str, float]
    config_text: str
    revision: str | None
    shards: dict[str, str | None]   # source tensor -> shard

    def fingerprint(self, inventory: dict[str, tuple[str, tuple[int, ...]]]) -> dict:
        return {
            "format_version": packfmt.FORMAT_VERSION,
            "revision": self.revision,
            "config_sha256": hashlib.sha256(self.config_text.encode("utf-8")).hexdigest(),
            "bin_sizes": self.bin_sizes,
            "items": [[it.key, it.store, it.offset, it.nbytes] for it in self.items],
            "inventory": {name: [dt, list(shape), self.shards.get(name)]
                          for name, (dt, shape) in inventory.items()},
        }


def _store_of(name: str) -> str | None:
    if EXPERT_RE.match(name):
        return "experts"
    if name.startswith(("vision_tower.", "multi_modal_projector.")):
        return "vision"
    if name.startswith("language_model."):
        return "trunk"
    return None


def validate_source(source: TensorSource, allow_revision: bool) -> list[str]:
    """Every reason not to pack this source (empty = fine)."""
    problems: list[str] = []
    revision = source.revision()
    if revision != kvl.PINNED_REVISION and not allow_revision:
        found = revision if revision else "unknown (no revision recorded)"
        problems.append(f"source revision is {found}, but kvl is pinned to {kvl.PINNED_REPO} at "
                        f"{kvl.PINNED_REVISION}; pass --allow-revision to pack it anyway")
    try:
        config = source.config()
    except UserError as exc:
        return problems + [str(exc)]
    problems += modelspec.check_supported(config)
    problems += modelspec.check_source(source)
    for name in source.tensor_names():
        if _store_of(name) is None:
            problems.append(f"{name}: not a text, vision or projector tensor; kvl cannot place it")
    if "config.json" not in source.asset_files():
        problems.append("config.json is missing from the source")
    return problems


def compute_layout(source: TensorSource) -> Layout:
    config = source.config()
    assets = source.asset_files()
    config_text = assets["config.json"].decode("utf-8")
    names = source.tensor_names()
    infos = {n: source.tensor_info(n) for n in names}
    shards = {n: source.shard_of(n) for n in names}
    per_store: dict[str, list[tuple[str, int, tuple[int, ...], tuple[str, ...]]]] = {
        "trunk": [], "experts": [], "vision": []}
    experts: dict[tuple[int, int], dict[str, str]] = {}
    for name in names:
        store = _store_of(name)
        m = EXPERT_RE.match(name)
        if m:
            experts.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = name
            continue
        dtype = packfmt.DTYPE_F32 if name.endswith(ROUTER_BIAS_SUFFIX) else packfmt.DTYPE_BF16
        per_store[str(store)].append((name, dtype, tuple(infos[name][1]), (name,)))
    for (layer, expert) in sorted(experts):
        parts = experts[(layer, expert)]
        inter, hidden = infos[parts["gate_proj"]][1]
        per_store["experts"].append((packfmt.expert_record_name(layer, expert), packfmt.DTYPE_Q8_EXPERT,
                                     (layer, expert, inter, hidden),
                                     (parts["gate_proj"], parts["up_proj"], parts["down_proj"])))
    records: dict[str, list[Item]] = {}
    bin_sizes: dict[str, int] = {}
    for store, entries in per_store.items():
        cursor = 0
        items = []
        for key, dtype, shape, inputs in entries:
            nbytes = packfmt.record_nbytes(dtype, shape)
            items.append(Item(key, store, dtype, shape, cursor, nbytes, inputs))
            cursor = packfmt.align_up(cursor + nbytes, packfmt.BIN_ALIGN)
        records[store] = items
        bin_sizes[store] = cursor
    # Work order: shard by shard (an item belongs to the last shard it needs), so a shard's
    # tensors are all consumed before the next shard is needed.
    shard_names = sorted({s for s in shards.values() if s is not None})
    rank = {s: i for i, s in enumerate(shard_names)}
    store_rank = {"trunk": 0, "vision": 1, "experts": 2}

    def order(it: Item) -> tuple[int, int, int]:
        last = max((rank.get(shards[n], -1) for n in it.inputs), default=-1)  # type: ignore[arg-type]
        return (last, store_rank[it.store], it.offset)

    work = sorted((it for items in records.values() for it in items), key=order)
    return Layout(work, bin_sizes, records, modelspec.hparams(config), config_text,
                  source.revision(), shards)


# ---------------------------------------------------------------------------------------------
# Item data


def _check_array(name: str, arr: np.ndarray, dtype: str, shape: tuple[int, ...]) -> None:
    want = NUMPY_DTYPES[dtype]
    if arr.dtype.str.lstrip("<|") != want.str.lstrip("<|") or tuple(arr.shape) != tuple(shape):
        raise UserError(f"{name}: the source returned {arr.dtype} {list(arr.shape)}, its header says "
                        f"{dtype} {list(shape)} — the checkpoint is corrupt")


def item_bytes(source: TensorSource, item: Item) -> np.ndarray:
    """The item's exact output bytes as a flat uint8 array (no extra copy of large tensors)."""
    arrays = []
    for name in item.inputs:
        dtype, shape = source.tensor_info(name)
        arr = source.read(name)
        _check_array(name, arr, dtype, tuple(shape))
        arrays.append((dtype, arr))
    if item.dtype == packfmt.DTYPE_Q8_EXPERT:
        return packfmt.build_expert_extent(arrays[0][1], arrays[1][1], arrays[2][1])
    dtype, arr = arrays[0]
    if item.dtype == packfmt.DTYPE_F32:
        arr = packfmt.bf16_bits_to_f32(arr) if dtype == "BF16" else arr
        return np.ascontiguousarray(arr, dtype="<f4").reshape(-1).view(np.uint8)
    return np.ascontiguousarray(arr, dtype="<u2").reshape(-1).view(np.uint8)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = packfmt.pwrite(fd, view[: 1 << 30], offset)
        view = view[n:]
        offset += n


def _test_kill_point(point: str) -> None:
    """Test hook: KVL_PACK_TEST_KILL_AT=<point> SIGKILLs this process at that exact point (used by
    tests/test_pack.py to crash at deterministic places)."""
    if os.environ.get("KVL_PACK_TEST_KILL_AT") == point:
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


# ---------------------------------------------------------------------------------------------
# Packing


class ShardHooks(Protocol):
    def acquire(self, shard: str) -> None:
        """Make the shard readable (e.g. download it) before its tensors are read."""

    def release(self, shard: str) -> None:
        """Every tensor of the shard is durably packed; it may be deleted."""


class _DeleteShards:
    def __init__(self, directory: Path, source: TensorSource) -> None:
        self.directory = directory
        self.source = source

    def acquire(self, shard: str) -> None:
        pass

    def release(self, shard: str) -> None:
        release = getattr(self.source, "release", None)
        if release is not None:
            release(shard)
        path = self.directory / shard
        if path.exists():
            path.unlink()
            packfmt.fsync_dir(self.directory)


def _open_source(src: Path, dst: Path) -> tuple[TensorSource, Path]:
    """A TensorSource for a checkpoint directory. If an unfinished pack in DST recorded the
    inventory and some shards were already deleted by --delete-consumed-shards, read from the
    journal's inventory instead (the deleted shards' tensors are already packed)."""
    layout_path = dst / packfmt.JOURNAL_DIR / JOURNAL_LAYOUT
    index_path = src / "model.safetensors.index.json"
    if layout_path.is_file() and index_path.is_file():
        try:
            recorded = json.loads(layout_path.read_text(encoding="utf-8"))
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, OSError):
            recorded, weight_map = None, {}
        shards = set(weight_map.values())
        if recorded and any(not (src / s).exists() for s in shards):
            assets = {n: (src / n).read_bytes() for n in packfmt.ASSET_FILES if (src / n).is_file()}
            inventory = {n: (v[0], tuple(v[1]), v[2]) for n, v in recorded["inventory"].items()}
            return InventorySource(src, assets["config.json"].decode("utf-8"), assets, inventory,
                                   recorded["revision"]), src
    from kvl.safetensors_io import SafetensorsCheckpoint

    return SafetensorsCheckpoint(src), src


def pack_checkpoint(src: Path | str | TensorSource, dst: Path | str, *, allow_revision: bool = False,
                    delete_consumed_shards: bool = False, progress: bool = True,
                    shard_hooks: ShardHooks | None = None) -> Path:
    """Pack `src` (a checkpoint directory or a TensorSource) into the runtime directory `dst`.

    Resumable: rerunning after any interruption continues from the journal in dst/.pack-journal.
    """
    dst = Path(dst)
    if isinstance(src, (str, os.PathLike)):
        src_dir = Path(src)
        if not src_dir.is_dir():
            raise UserError(f"{src_dir}: no such checkpoint directory")
        if (dst / packfmt.COMPLETE_FILE).is_file() and not (dst / packfmt.JOURNAL_DIR).exists():
            _say(progress, f"{dst} already holds a complete pack; nothing to do")
            return dst
        source, _ = _open_source(src_dir, dst)
        if delete_consumed_shards and shard_hooks is None:
            shard_hooks = _DeleteShards(src_dir, source)
    else:
        source = src
        if delete_consumed_shards:
            raise UserError("--delete-consumed-shards needs a checkpoint directory as the source")
    return _pack(source, dst, allow_revision=allow_revision, progress=progress, hooks=shard_hooks)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr)


def _prepare_dst(dst: Path, fingerprint: dict, progress: bool) -> set[str]:
    """Create or resume DST; returns the keys of journaled (durably written) items."""
    journal = dst / packfmt.JOURNAL_DIR
    layout_path = journal / JOURNAL_LAYOUT
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst}: exists and is not a directory")
    if layout_path.is_file():
        try:
            recorded = json.loads(layout_path.read_text(encoding="utf-8"))
        except ValueError:
            recorded = None
        if recorded != fingerprint:
            raise UserError(f"{dst}: holds an unfinished pack of a different source or kvl version; "
                            "delete the directory or choose another destination")
        done: set[str] = set()
        done_path = journal / JOURNAL_DONE
        if done_path.is_file():
            raw = done_path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                # A crash mid-append left a torn last line: drop it (its item is simply redone).
                with open(done_path, "r+b") as f:
                    f.truncate(raw.rfind(b"\n") + 1)
                    f.flush()
                    os.fsync(f.fileno())
            text = done_path.read_text(encoding="ascii", errors="replace")
            # A torn last line (crash mid-append) has no newline: ignore it; it is redone.
            for line in text.split("\n")[:-1]:
                parts = line.split(" ")
                if len(parts) == 2 and re.fullmatch(r"[0-9a-f]{8}", parts[1]):
                    done.add(parts[0])
        _say(progress, f"resuming the pack in {dst}: {len(done)} items already written")
        return done
    if dst.is_dir():
        foreign = [p.name for p in dst.iterdir() if p.name not in FOREIGN_OK | {packfmt.JOURNAL_DIR}]
        if foreign:
            raise UserError(f"{dst}: is not empty ({', '.join(sorted(foreign)[:5])}) and holds no "
                            "unfinished pack; choose an empty or new destination")
    journal.mkdir(parents=True, exist_ok=True)
    # The layout is fixed before any .bin byte exists, so every rerun writes the same bytes.
    packfmt.write_atomic(layout_path, json.dumps(fingerprint).encode("utf-8"))
    return set()


def _read_done_crcs(dst: Path) -> dict[str, int]:
    crcs: dict[str, int] = {}
    path = dst / packfmt.JOURNAL_DIR / JOURNAL_DONE
    if path.is_file():
        for line in path.read_text(encoding="ascii", errors="replace").split("\n")[:-1]:
            parts = line.split(" ")
            if len(parts) == 2 and re.fullmatch(r"[0-9a-f]{8}", parts[1]):
                crcs[parts[0]] = int(parts[1], 16)
    return crcs


def _pack(source: TensorSource, dst: Path, *, allow_revision: bool, progress: bool,
          hooks: ShardHooks | None) -> Path:
    if (dst / packfmt.COMPLETE_FILE).is_file() and (dst / packfmt.JOURNAL_DIR).is_dir():
        # Killed after the completion marker was written but before the journal was removed.
        shutil.rmtree(dst / packfmt.JOURNAL_DIR)
        packfmt.fsync_dir(dst)
        return dst
    if (dst / packfmt.COMPLETE_FILE).is_file():
        _say(progress, f"{dst} already holds a complete pack; nothing to do")
        return dst
    problems = validate_source(source, allow_revision)
    if problems:
        listing = "\n  - ".join(problems)
        raise UserError(f"cannot pack this source ({len(problems)} problem(s)):\n  - {listing}")
    layout = compute_layout(source)
    inventory = {n: (dt, tuple(shape)) for n in source.tensor_names()
                 for dt, shape in [source.tensor_info(n)]}
    fingerprint = json.loads(json.dumps(layout.fingerprint(inventory)))
    done = _prepare_dst(dst, fingerprint, progress)
    journal = dst / packfmt.JOURNAL_DIR

    for store, size in layout.bin_sizes.items():
        bin_path = dst / f"{store}.bin"
        if done and (not bin_path.is_file() or bin_path.stat().st_size != size):
            # The journal outlived its .bin file (deleted or replaced): its items must be redone.
            _say(progress, f"{bin_path.name} is missing or resized; rewriting its items")
            done -= {it.key for it in layout.records[store]}
    fds: dict[str, int] = {}
    try:
        for store, size in layout.bin_sizes.items():
            fd = os.open(dst / f"{store}.bin", os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
            fds[store] = fd
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # sparse: padding reads as zero and is never written
        _run_items(source, dst, layout, done, fds, progress, hooks)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)

    crcs = _read_done_crcs(dst)
    _test_kill_point("final:start")
    assets = source.asset_files()
    for name in packfmt.ASSET_FILES:
        if name in assets:
            packfmt.write_atomic(dst / name, assets[name])
    rev_text = (layout.revision or "unknown") + "\n"
    packfmt.write_atomic(dst / packfmt.SOURCE_REVISION_FILE, rev_text.encode("ascii"))
    files: dict[str, dict[str, int]] = {}
    for store, kind in packfmt.STORE_KINDS.items():
        records = [packfmt.TensorRecord(it.key, it.dtype, it.shape, it.offset, it.nbytes, crcs[it.key])
                   for it in layout.records[store]]
        data = packfmt.encode_index(kind, layout.bin_sizes[store], layout.hparams, records,
                                    layout.config_text, layout.revision)
        packfmt.write_atomic(dst / f"{store}.idx", data)
        files[f"{store}.bin"] = {"size": layout.bin_sizes[store]}
        files[f"{store}.idx"] = {"size": len(data), "crc32": zlib.crc32(data) & 0xFFFFFFFF}
        _test_kill_point(f"final:{store}.idx")
    for leftover in dst.glob("*.tmp"):  # from a crash inside an earlier run's write_atomic
        ours = set(files) | set(packfmt.ASSET_FILES) | {packfmt.SOURCE_REVISION_FILE, packfmt.COMPLETE_FILE}
        if leftover.name[:-4] in ours:
            leftover.unlink()
    complete = {"format_version": packfmt.FORMAT_VERSION, "source_revision": layout.revision,
                "files": files}
    packfmt.write_atomic(dst / packfmt.COMPLETE_FILE, (json.dumps(complete, indent=1) + "\n").encode())
    _test_kill_point("final:complete")
    shutil.rmtree(journal)
    packfmt.fsync_dir(dst)
    _say(progress, f"packed into {dst}")
    return dst


def _run_items(source: TensorSource, dst: Path, layout: Layout, done: set[str], fds: dict[str, int],
               progress: bool, hooks: ShardHooks | None) -> None:
    journal_path = dst / packfmt.JOURNAL_DIR / JOURNAL_DONE
    # Shard bookkeeping: a shard is released once every item reading from it is journaled.
    pending_by_shard: dict[str, set[str]] = {}
    for it in layout.items:
        for name in it.inputs:
            shard = layout.shards.get(name)
            if shard is not None and it.key not in done:
                pending_by_shard.setdefault(shard, set()).add(it.key)
    all_shards = sorted({s for s in layout.shards.values() if s is not None})
    released: set[str] = set()
    acquired: set[str] = set()

    def release_finished() -> None:
        if hooks is None:
            return
        for shard in all_shards:
            if shard not in released and not pending_by_shard.get(shard):
                hooks.release(shard)
                released.add(shard)

    release_finished()  # shards fully consumed by an earlier, interrupted run

    total = sum(it.nbytes for it in layout.items)
    initial = sum(it.nbytes for it in layout.items if it.key in done)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                   desc="packing", file=sys.stderr)
    pending: list[tuple[Item, int]] = []
    pending_bytes = 0
    touched: set[str] = set()
    written = 0
    flushes = 0

    def flush() -> None:
        nonlocal pending_bytes, flushes
        if not pending:
            return
        for store in touched:
            os.fsync(fds[store])
        touched.clear()
        with open(journal_path, "a", encoding="ascii") as f:
            f.write("".join(f"{it.key} {crc:08x}\n" for it, crc in pending))
            f.flush()
            os.fsync(f.fileno())
        for it, _ in pending:
            for name in it.inputs:
                shard = layout.shards.get(name)
                if shard is not None:
                    pending_by_shard.get(shard, set()).discard(it.key)
        pending.clear()
        pending_bytes = 0
        flushes += 1
        _test_kill_point(f"flush:{flushes}")
        release_finished()

    try:
        for it in layout.items:
            if it.key in done:
                continue
            if hooks is not None:
                for name in it.inputs:
                    shard = layout.shards.get(name)
                    if shard is not None and shard not in acquired:
                        # Everything from earlier shards is durable before the next shard arrives
                        # (keeps kvl prepare's scratch space at about one shard).
                        flush()
                        hooks.acquire(shard)
                        acquired.add(shard)
            data = item_bytes(source, it)
            if data.nbytes != it.nbytes:
                raise UserError(f"{it.key}: produced {data.nbytes} bytes, layout expects {it.nbytes}")
            _pwrite_all(fds[it.store], data, it.offset)
            touched.add(it.store)
            pending.append((it, zlib.crc32(data) & 0xFFFFFFFF))
            pending_bytes += data.nbytes
            written += 1
            _test_kill_point(f"item:{written}")
            if bar is not None:
                bar.update(data.nbytes)
            del data
            if pending_bytes >= FLUSH_BYTES or len(pending) >= FLUSH_ITEMS:
                flush()
        flush()
    finally:
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", nargs="?", metavar="SRC",
                        help="checkpoint directory (omit with --synth-preset)")
    parser.add_argument("dst", nargs="?", metavar="DST", help="output runtime directory")
    parser.add_argument("--allow-revision", action="store_true",
                        help=f"pack a source whose revision is not the pinned {kvl.PINNED_REVISION[:12]}…")
    parser.add_argument("--delete-consumed-shards", action="store_true",
                        help="delete each source shard once everything taken from it is durably packed")
    parser.add_argument("--synth-preset", choices=("tiny", "full"),
                        help="pack a synthesized random model directly (no shards written)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --synth-preset")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    paths = [p for p in (args.src, args.dst) if p is not None]
    if args.synth_preset:
        if len(paths) != 1:
            raise UserError("with --synth-preset give only DST (the source is synthesized)")
        from kvl.synth import SynthSource, preset_config

        source = SynthSource(preset_config(args.synth_preset), seed=args.seed)
        # A synthesized model has no hub revision by construction; asking for it is the consent.
        pack_checkpoint(source, Path(paths[0]), allow_revision=True, progress=not args.quiet)
        return 0
    if len(paths) != 2:
        raise UserError("expected SRC DST (a checkpoint directory and an output directory)")
    pack_checkpoint(Path(paths[0]), Path(paths[1]), allow_revision=args.allow_revision,
                    delete_consumed_shards=args.delete_consumed_shards, progress=not args.quiet)
    return 0
