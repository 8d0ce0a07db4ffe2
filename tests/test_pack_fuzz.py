"""Seeded mutation fuzzing of everything that parses a pack or a checkpoint header.

Owns: deterministic mutations of a copy of the tiny pack (trunk/experts/vision .idx with the index
CRC recomputed and PACK_COMPLETE.json updated, so each mutation reaches the parsers behind those
checks; .bin sizes; config.json; PACK_COMPLETE.json; tokenizer_config.json) and of a tiny
checkpoint shard's safetensors header, and the rule every reader must follow on them: work, or
raise UserError (KvlError is one) with a message — never another exception type, never a crash.
The native engine runs in a subprocess per batch, so a segfault is reported as a failure naming the
mutation instead of killing pytest. Does not own: the per-rule tests of each reader (test_pack.py,
test_safetensors_io.py, wasm-core/tests/test_store*.c).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvl import packfmt
from kvl.errors import UserError
from kvl.safetensors_io import SafetensorsCheckpoint

REPO = Path(__file__).resolve().parent.parent
SEED = int(os.environ.get("KVL_FUZZ_SEED", "20261202"))  # fixed by default: every run is the same
IDX_FILES = ("trunk.idx", "experts.idx", "vision.idx")
BATCHES = 4

# ---------------------------------------------------------------------------------------------
# index helpers (independent of packfmt's encoder: offsets straight from docs/FORMAT.md)


def fix_idx_crc(data: bytes) -> bytes:
    """The index with its CRC field (bytes 36..40, computed with the field zeroed) made valid."""
    if len(data) < 40:
        return data
    out = bytearray(data)
    out[36:40] = b"\0\0\0\0"
    out[36:40] = struct.pack("<I", zlib.crc32(out) & 0xFFFFFFFF)
    return bytes(out)


def _counts(data: bytes) -> tuple[int, int, int]:
    n_hp, n_t, cfg = struct.unpack_from("<III", data, 24)
    return n_hp, n_t, cfg


def _record_offset(data: bytes, i: int) -> int:
    n_hp, _, _ = _counts(data)
    return 128 + 64 * n_hp + 192 * i


def _edge_u64(rng: random.Random, cur: int) -> int:
    return rng.choice([0, 1, cur + 1, max(cur - 1, 0), cur + 4096, max(cur - 4096, 0), 2**64 - 1,
                       2**64 - 4096, 2**32, 2**63 + cur % 2**63, rng.randrange(8) * 4096,
                       rng.getrandbits(64)]) % 2**64


def _edge_u32(rng: random.Random, cur: int) -> int:
    return rng.choice([0, 1, cur + 1, max(cur - 1, 0), 2**32 - 1, 2**31, 2**31 - 1, rng.randrange(6),
                       2 * cur, rng.getrandbits(32)]) % 2**32


def mutate_idx(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One structural or byte-level mutation of an index image (CRC not fixed here)."""
    buf = bytearray(data)
    n_hp, n_t, cfg = _counts(data) if len(data) >= 36 else (0, 0, 0)
    if len(data) < 128 or n_t == 0 or cfg < 2 or len(data) != 128 + 64 * n_hp + 192 * n_t + cfg:
        # an earlier mutation broke the layout: only layout-blind mutations make sense now
        for _ in range(rng.randint(1, 4)):
            if buf:
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return bytes(buf), "bitflip-after"
    i = rng.randrange(n_t)
    rec = _record_offset(data, i)
    kind = rng.choice(["bitflip", "byte", "truncate", "extend", "count", "bin_size", "version",
                       "kind", "reserved", "revision", "offset", "nbytes", "shape", "ndim", "dtype",
                       "name", "flags", "swap", "drop", "dup", "hp_key", "hp_dup", "config"])
    if kind == "bitflip":
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        pos = rng.randrange(len(buf))
        buf[pos] = rng.choice([0, 0xFF, 0x7F, rng.randrange(256)])
    elif kind == "truncate":
        buf = buf[:rng.choice([0, 7, 40, 127, 128, len(buf) - 1, rng.randrange(len(buf))])]
    elif kind == "extend":
        buf += bytes(rng.randrange(256) for _ in range(rng.choice([1, 64, 192, 300])))
    elif kind == "count":
        at = rng.choice([24, 28, 32])
        struct.pack_into("<I", buf, at, _edge_u32(rng, struct.unpack_from("<I", buf, at)[0]))
    elif kind == "bin_size":
        struct.pack_into("<Q", buf, 16, _edge_u64(rng, struct.unpack_from("<Q", buf, 16)[0]))
    elif kind == "version":
        struct.pack_into("<I", buf, 8, _edge_u32(rng, 1))
    elif kind == "kind":
        struct.pack_into("<I", buf, 12, rng.randrange(5))
    elif kind == "reserved":
        buf[80 + rng.randrange(48)] = rng.randrange(1, 256)
    elif kind == "revision":
        buf[40 + rng.randrange(40)] = rng.choice([0x20, 0x80, 0xFF, ord("g"), 0x01])
    elif kind == "offset":
        struct.pack_into("<Q", buf, rec + 168, _edge_u64(rng, struct.unpack_from("<Q", buf, rec + 168)[0]))
    elif kind == "nbytes":
        struct.pack_into("<Q", buf, rec + 176, _edge_u64(rng, struct.unpack_from("<Q", buf, rec + 176)[0]))
    elif kind == "shape":
        at = rec + 136 + 8 * rng.randrange(4)
        value = rng.choice([0, 1, 2**32, 2**63, 2**64 - 1, 2**32 + 1,
                            struct.unpack_from("<Q", buf, at)[0] + 1])
        struct.pack_into("<Q", buf, at, value % 2**64)
    elif kind == "ndim":
        struct.pack_into("<I", buf, rec + 132, rng.choice([0, 1, 2, 3, 4, 5, 2**32 - 1]))
    elif kind == "dtype":
        struct.pack_into("<I", buf, rec + 128, rng.choice([0, 1, 2, 3, 4, 2**32 - 1]))
    elif kind == "name":
        choice = rng.randrange(4)
        if choice == 0:
            buf[rec:rec + 128] = b"n" * 128          # unterminated
        elif choice == 1:
            buf[rec] = 0                            # empty
        elif choice == 2:
            buf[rec + rng.randrange(20)] = 0xC3     # not ASCII
        else:
            other = _record_offset(data, rng.randrange(n_t))
            buf[rec:rec + 128] = data[other:other + 128]  # duplicate name
    elif kind == "flags":
        struct.pack_into("<I", buf, rec + 188, rng.choice([1, 2**31, 2**32 - 1]))
    elif kind == "swap":
        j = _record_offset(data, rng.randrange(n_t))
        width = rng.choice([192, 128])  # whole records, or only the names
        buf[rec:rec + width], buf[j:j + width] = data[j:j + width], data[rec:rec + width]
    elif kind == "drop":  # size-consistent: n_tensors follows
        del buf[rec:rec + 192]
        struct.pack_into("<I", buf, 28, n_t - 1)
    elif kind == "dup":  # size-consistent duplicate record (same name and range)
        end = _record_offset(data, n_t)
        buf[end:end] = data[rec:rec + 192]
        struct.pack_into("<I", buf, 28, n_t + 1)
    elif kind == "hp_key":
        n_hp, _, _ = _counts(data)
        at = 128 + 64 * rng.randrange(n_hp)
        if rng.randrange(2):
            buf[at:at + 56] = b"k" * 56
        else:
            buf[at] = 0
    elif kind == "hp_dup":  # size-consistent duplicate hparam key
        n_hp, _, _ = _counts(data)
        at = 128 + 64 * rng.randrange(n_hp)
        buf[128:128] = data[at:at + 64]
        struct.pack_into("<I", buf, 24, n_hp + 1)
    elif kind == "config":  # size-consistent edit of the embedded config.json text
        _, _, cfg = _counts(data)
        cut = rng.randrange(1, cfg)
        buf = buf[:len(buf) - cut] + (b"\xff\xfe" if rng.randrange(2) else b"")
        struct.pack_into("<I", buf, 32, cfg - cut + (len(buf) - (len(data) - cut)))
    return bytes(buf), f"{kind} rec={i}"


def set_hparam(data: bytes, key: str, value: float) -> bytes:
    """The index with one hparam's value replaced (CRC not fixed here)."""
    n_hp, _, _ = _counts(data)
    buf = bytearray(data)
    for k in range(n_hp):
        at = 128 + 64 * k
        if buf[at:at + 56].split(b"\0", 1)[0] == key.encode("ascii"):
            struct.pack_into("<d", buf, at + 56, value)
            return bytes(buf)
    raise KeyError(key)


def hparam_keys(data: bytes) -> list[str]:
    n_hp, _, _ = _counts(data)
    return [data[128 + 64 * k:128 + 64 * k + 56].split(b"\0", 1)[0].decode("ascii") for k in range(n_hp)]


# ---------------------------------------------------------------------------------------------
# mutated pack directories


@dataclass
class Case:
    label: str
    files: dict[str, bytes] = field(default_factory=dict)     # replaced files (full contents)
    sparse: dict[str, int] = field(default_factory=dict)      # replaced by a zero file of this size
    update_complete: bool = True                              # PACK_COMPLETE follows the edits
    remove: tuple[str, ...] = ()


def _complete_for(base: Path, case: Case) -> bytes:
    complete = json.loads((base / packfmt.COMPLETE_FILE).read_text("utf-8"))
    for name, entry in complete["files"].items():
        if name in case.files:
            entry["size"] = len(case.files[name])
            if "crc32" in entry:
                entry["crc32"] = zlib.crc32(case.files[name]) & 0xFFFFFFFF
        elif name in case.sparse:
            entry["size"] = case.sparse[name]
    return json.dumps(complete, indent=1).encode("utf-8")


def materialize(base: Path, root: Path, case: Case) -> Path:
    """A pack directory: symlinks to the base pack's files, except the mutated ones."""
    out = root / re.sub(r"[^A-Za-z0-9._=+-]", "_", case.label)
    out.mkdir(parents=True)
    files = dict(case.files)
    if case.update_complete and packfmt.COMPLETE_FILE not in files:
        files[packfmt.COMPLETE_FILE] = _complete_for(base, case)
    for src in base.iterdir():
        if src.name in case.remove:
            continue
        if src.name in files:
            (out / src.name).write_bytes(files[src.name])
        elif src.name in case.sparse:
            with open(out / src.name, "wb") as f:
                f.truncate(case.sparse[src.name])
        else:
            _link(src, out / src.name)
    return out


def _link(src: Path, dst: Path) -> None:
    """Share an unmutated file (trunk.bin is tens of MB): symlink, else hard link, else copy."""
    try:
        os.symlink(src, dst)
    except OSError:  # e.g. Windows without the symlink privilege
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)


def build_cases(base: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    idx = {name: (base / name).read_bytes() for name in IDX_FILES}
    # index mutations, CRC recomputed so the validation behind the CRC check runs (a few stay stale)
    for n in range(100):
        name = IDX_FILES[n % 3]
        data = idx[name]
        labels = []
        for _ in range(rng.choice([1, 1, 2])):
            data, what = mutate_idx(data, rng)
            labels.append(what)
        stale = rng.randrange(15) == 0
        if not stale:
            data = fix_idx_crc(data)
        cases.append(Case(f"{n:03d} {name} {'+'.join(labels)}{' stale-crc' if stale else ''}",
                          {name: data}))
    # the same hparam value in every index, so the engine's hparam validation is what decides
    keys = hparam_keys(idx["trunk.idx"])
    values = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 2.0**31, 2.0**31 - 1,
              2.0**32, 0.5, 3.0, 1e-30, -0.0]
    # first the values that once crashed or reached undefined behaviour in engine.c, then random ones
    fixed = [("text.intermediate_size", 0.0), ("text.hidden_size", float("nan")),
             ("text.num_hidden_layers", 1e30), ("text.vocab_size", 2.5)]
    for n in range(40):
        key, value = fixed[n] if n < len(fixed) else (keys[rng.randrange(len(keys))], rng.choice(values))
        files = {name: fix_idx_crc(set_hparam(idx[name], key, value)) for name in IDX_FILES}
        cases.append(Case(f"{100 + n:03d} hparam {key}={value!r}", files))
    # .bin sizes: small stores copied and resized (header following or not), trunk.bin sparse
    for n in range(12):
        name = rng.choice(["experts.bin", "vision.bin", "trunk.bin"])
        size = (base / name).stat().st_size
        new = rng.choice([0, size - 4096, size + 4096, size + 1, size - 1, size // 2 // 4096 * 4096])
        follow = name != "trunk.bin" and rng.randrange(2) == 0
        case = Case(f"{140 + n:03d} {name} size {new}{' header-follows' if follow else ''}")
        if name == "trunk.bin":
            case.sparse[name] = new
        else:
            raw = (base / name).read_bytes()
            case.files[name] = raw[:new] + b"\0" * max(0, new - len(raw))
        if follow:
            stem = name.replace(".bin", ".idx")
            buf = bytearray(idx[stem])
            struct.pack_into("<Q", buf, 16, new)
            case.files[stem] = fix_idx_crc(bytes(buf))
        cases.append(case)
    # PACK_COMPLETE.json itself
    complete_raw = (base / packfmt.COMPLETE_FILE).read_bytes()
    complete = json.loads(complete_raw)
    variants: list[tuple[str, bytes]] = [
        ("empty", b""), ("not-json", b"{\"format_version\": 1, "), ("list", b"[1, 2]"),
        ("null", b"null"), ("string", b"\"done\""), ("deep", b"[" * 100000 + b"]" * 100000),
        ("not-utf8", b"\xff\xfe{}"), ("files-list", json.dumps({**complete, "files": [1]}).encode()),
        ("files-null", json.dumps({**complete, "files": None}).encode()),
        ("files-str", json.dumps({**complete, "files": "x"}).encode()),
        ("no-files", json.dumps({"format_version": 1}).encode()),
        ("version-2", json.dumps({**complete, "format_version": 2}).encode()),
        ("version-str", json.dumps({**complete, "format_version": "1"}).encode()),
        ("version-list", json.dumps({**complete, "format_version": [1]}).encode()),
        ("entry-int", json.dumps({**complete, "files": {**complete["files"], "trunk.idx": 7}}).encode()),
        ("entry-list", json.dumps({**complete, "files": {**complete["files"], "trunk.bin": [1]}}).encode()),
        ("crc-str", json.dumps({**complete, "files": {**complete["files"],
                                                        "experts.idx": {"size": 1, "crc32": "x"}}}).encode()),
        ("missing-vision", json.dumps({**complete, "files": {k: v for k, v in complete["files"].items()
                                                              if not k.startswith("vision")}}).encode()),
    ]
    for n in range(6):
        raw = bytearray(complete_raw)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        variants.append((f"bytes{n}", bytes(raw)))
    for n, (label, raw) in enumerate(variants):
        cases.append(Case(f"{160 + n:03d} PACK_COMPLETE {label}", {packfmt.COMPLETE_FILE: raw},
                          update_complete=False))
    cases.append(Case("190 PACK_COMPLETE missing", remove=(packfmt.COMPLETE_FILE,), update_complete=False))
    cases.append(Case("191 trunk.idx missing", remove=("trunk.idx",)))
    cases.append(Case("192 experts.bin missing", remove=("experts.bin",)))
    # config.json and tokenizer_config.json: copied verbatim by the packer; readers of the pack
    # must not trip over them
    for name in ("config.json", "tokenizer_config.json"):
        raw = (base / name).read_bytes()
        for n, mutated in enumerate([b"", b"[]", b"{", raw[:len(raw) // 2], b"\xff" + raw,
                                     b"[" * 50000 + b"]" * 50000]):
            cases.append(Case(f"{193 + n if name == 'config.json' else 199 + n:03d} {name} variant{n}",
                              {name: mutated}))
    return cases


# ---------------------------------------------------------------------------------------------
# the checks, run in a subprocess per batch

WORKER = textwrap.dedent(r"""
    import json, sys, traceback
    from kvl.errors import UserError

    def outcome(fn):
        try:
            fn()
            return "ok"
        except UserError as exc:
            return "user" if str(exc).strip() else "user-without-message"
        except BaseException as exc:
            return "bad " + type(exc).__name__ + ": " + "".join(
                traceback.format_exception_only(type(exc), exc)).strip()[:300]

    def python_reader(pack):
        from kvl import packfmt
        packfmt.verify(pack)
        reader = packfmt.PackReader(pack)
        for store, index in reader.stores.items():
            for rec in index.records[:3] + index.records[-2:]:
                reader.raw(store, rec)

    def native(pack, vision):
        import numpy as np
        from kvl.native import NativeEngine
        with NativeEngine(pack, n_threads=1, load_vision=vision) as eng:
            vocab = eng.vocab_size
            with eng.new_session(max_context=8, max_batch=4) as s:
                logits = s.prefill([1 % vocab, 2 % vocab, 3 % vocab])
                s.step(int(logits.argmax()) % vocab)
            info = eng.info()
            patch, mh, mw = info["vision_patch_size"], info["vision_merge_h"], info["vision_merge_w"]
            if vision and 0 < patch <= 64 and 0 < mh <= 4 and 0 < mw <= 4:  # else too big to try
                grid = np.asarray([[2 * mh, 2 * mw]], dtype=np.int32)
                eng.vision_bytes(grid)
                eng.vision_encode(np.zeros((4 * mh * mw, 3, patch, patch), np.float32), grid)

    for pack in sys.argv[1:]:
        print("START " + pack, flush=True)
        result = {"pack": pack,
                  "python": outcome(lambda: python_reader(pack)),
                  "native": outcome(lambda: native(pack, False)),
                  "native+vision": outcome(lambda: native(pack, True))}
        print("RESULT " + json.dumps(result), flush=True)
""")


def run_batch(packs: list[Path]) -> dict[str, dict[str, str]]:
    """Runs the checks on each pack in one subprocess; a crash is reported against its pack."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    remaining = list(packs)
    results: dict[str, dict[str, str]] = {}
    while remaining:
        proc = subprocess.run([sys.executable, "-c", WORKER, *map(str, remaining)], env=env,
                              capture_output=True, text=True, timeout=300)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
                results[result.pop("pack")] = result
                started = None
        if proc.returncode == 0:
            break
        # the process died inside `started`: record it and go on with the packs after it
        culprit = started or str(remaining[0])
        errors = [ln for ln in proc.stderr.splitlines() if "runtime error" in ln or "ERROR:" in ln]
        detail = "\n".join(errors[:3]) if errors else proc.stderr.strip()[-600:]
        results[culprit] = {"process": f"died with status {proc.returncode}: {detail}"}
        done = {Path(p) for p in results}
        remaining = [p for p in remaining if p not in done]
    return results


@pytest.fixture(scope="module")
def fuzz_results(tiny_pack: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pack-fuzz")
    rng = random.Random(SEED)
    cases = build_cases(tiny_pack, rng)
    dirs = {materialize(tiny_pack, root, case): case for case in cases}
    base_dir = materialize(tiny_pack, root, Case("unmutated"))
    ordered = [base_dir, *dirs]
    size = -(-len(ordered) // BATCHES)
    results: dict[str, dict[str, str]] = {}
    for start in range(0, len(ordered), size):
        results.update(run_batch(ordered[start:start + size]))
    return base_dir, dirs, results


def test_unmutated_copy_passes_every_check(fuzz_results) -> None:
    """Otherwise every mutation below could be 'rejected' for a reason that has nothing to do with it."""
    base_dir, _, results = fuzz_results
    assert results[str(base_dir)] == {"python": "ok", "native": "ok", "native+vision": "ok"}


def test_mutated_packs_work_or_raise_user_error(fuzz_results) -> None:
    _, dirs, results = fuzz_results
    failures = []
    tally: dict[str, int] = {}
    for path, case in dirs.items():
        got = results.get(str(path), {"process": "no result"})
        for check, status in got.items():
            tally[f"{check}:{status.split(' ')[0]}"] = tally.get(f"{check}:{status.split(' ')[0]}", 0) + 1
            if status not in ("ok", "user"):
                failures.append(f"{case.label}: {check}: {status}")
    print(f"{len(dirs)} mutated packs; outcomes: {dict(sorted(tally.items()))}")
    assert not failures, "\n".join(failures)
    # the mutations must reach both outcomes, or they test nothing
    assert tally.get("python:user", 0) >= len(dirs) // 2
    assert tally.get("native:user", 0) >= len(dirs) // 2
    assert tally.get("native:ok", 0) >= 5


def _edited_trunk(base: Path, label: str, edit) -> Case:
    buf = bytearray((base / "trunk.idx").read_bytes())
    _, n_t, _ = _counts(bytes(buf))
    edit(buf, _record_offset(bytes(buf), n_t - 1))
    return Case(label, {"trunk.idx": fix_idx_crc(bytes(buf))})


def test_python_and_native_readers_agree_on_rules_of_the_format(tiny_pack: Path, tmp_path: Path) -> None:
    """Indexes that break a FORMAT.md rule store.c enforces: the Python reader must refuse them too
    (before this test it accepted each of these)."""

    def shape_wraps(buf: bytearray, rec: int) -> None:  # 2 * 2**32 * 2**32 wraps to 0 in int64
        struct.pack_into("<II4QQQ", buf, rec + 128, 1, 2, 2**32, 2**32, 0, 0,
                         struct.unpack_from("<Q", buf, rec + 168)[0], 0)

    def zero_dim(buf: bytearray, rec: int) -> None:
        struct.pack_into("<II4QQQ", buf, rec + 128, 1, 2, 0, 5, 0, 0,
                         struct.unpack_from("<Q", buf, rec + 168)[0], 0)

    cases = [
        _edited_trunk(tiny_pack, "shape-product-wraps", shape_wraps),
        _edited_trunk(tiny_pack, "zero-dimension", zero_dim),
        _edited_trunk(tiny_pack, "reserved-byte", lambda buf, rec: buf.__setitem__(100, 1)),
        _edited_trunk(tiny_pack, "empty-name", lambda buf, rec: buf.__setitem__(rec, 0)),
        _edited_trunk(tiny_pack, "empty-hparam-key", lambda buf, rec: buf.__setitem__(128, 0)),
        _edited_trunk(tiny_pack, "revision-control-char",
                      lambda buf, rec: buf.__setitem__(slice(40, 80), b"0" * 39 + b"\n")),
    ]
    for value in (float("inf"), float("nan")):  # in every index, so they still agree
        cases.append(Case(f"hparam-{value}", {
            name: fix_idx_crc(set_hparam((tiny_pack / name).read_bytes(), "text.rms_norm_eps", value))
            for name in IDX_FILES}))
    dirs = {materialize(tiny_pack, tmp_path, case): case for case in cases}
    results = run_batch(list(dirs))
    for path, case in dirs.items():
        assert results[str(path)]["python"] == "user", case.label
        assert results[str(path)]["native"] == "user", case.label


# ---------------------------------------------------------------------------------------------
# safetensors headers


def _shard_header(path: Path) -> tuple[int, bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw, 0)
    return n, raw[8:8 + n], raw[8 + n:]


def _header_variants(header: dict, raw_header: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    names = [k for k in header if k != "__metadata__"]
    out: list[tuple[str, bytes]] = []

    def with_entry(label: str, key: str, value: object) -> None:
        h = json.loads(json.dumps(header))
        h[rng.choice(names)][key] = value
        out.append((label, json.dumps(h).encode()))

    for value in (-1, 1.5, True, "3", None, [1, [2]], 2**70, 0):
        with_entry(f"shape-dim {value!r}", "shape", [value, 4])
    for value in ([], [0], [0, 1, 2], [-8, 0], [8, 0], ["0", "8"], [2**70, 2**70 + 8], None, "x",
                  [0.0, 8.0], [True, 9]):
        with_entry(f"offsets {value!r}", "data_offsets", value)
    for value in ("BF16", "F32", "I8", "Q4", "", 7, None):
        with_entry(f"dtype {value!r}", "dtype", value)
    with_entry("entry list", "shape", {"x": 1})
    for label, h in (("list", []), ("null", None), ("int", 5), ("entry-null", {**header, names[0]: None}),
                     ("entry-str", {**header, names[0]: "x"}),
                     ("metadata-list", {**header, "__metadata__": [1]}), ("empty", {})):
        out.append((label, json.dumps(h).encode()))
    a, b = rng.sample(names, 2)
    swapped = json.loads(json.dumps(header))
    swapped[a]["data_offsets"], swapped[b]["data_offsets"] = (header[b]["data_offsets"],
                                                              header[a]["data_offsets"])
    out.append((f"offsets swapped {a} {b}", json.dumps(swapped).encode()))
    overlap = json.loads(json.dumps(header))
    overlap[b]["data_offsets"] = list(header[a]["data_offsets"])
    overlap[b]["shape"], overlap[b]["dtype"] = header[a]["shape"], header[a]["dtype"]
    out.append((f"overlap {a} {b}", json.dumps(overlap).encode()))
    out.append(("deep nesting", b"[" * 100000 + b"]" * 100000))
    out.append(("not utf8", b"\xff" + raw_header[1:]))
    for n in range(12):
        raw = bytearray(raw_header)
        for _ in range(rng.randint(1, 3)):
            value = rng.choice([0, 0xFF, ord('"'), ord("}"), ord("9"), rng.randrange(256)])
            raw[rng.randrange(len(raw))] = value  # value drawn first, as when this was one statement
        out.append((f"bytes{n}", bytes(raw)))
    return out


def test_safetensors_header_mutations(tiny_ckpt: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    shards = sorted(p for p in tiny_ckpt.glob("*.safetensors"))
    shard = min(shards, key=lambda p: p.stat().st_size)  # the smallest shard: cheap to copy
    n, raw_header, data = _shard_header(shard)
    header = json.loads(raw_header)
    cases: list[tuple[str, bytes]] = []
    for label, new_header in _header_variants(header, raw_header, rng):
        cases.append((label, struct.pack("<Q", len(new_header)) + new_header + data))
    whole = shard.read_bytes()
    for value in (0, 1, n - 1, n + 1, 2**63, 2**64 - 1, len(whole), len(whole) - 8, 100 * 1024 * 1024 + 1):
        cases.append((f"header length {value}", struct.pack("<Q", value) + whole[8:]))
    cases.append(("truncated 5 bytes", whole[:5]))
    cases.append(("data truncated", whole[:-1]))
    cases.append(("empty", b""))
    failures = []
    outcomes = {"ok": 0, "user": 0}
    for k, (label, content) in enumerate(cases):
        ckpt = tmp_path / f"c{k}"
        ckpt.mkdir()
        for src in tiny_ckpt.iterdir():
            if src.name == shard.name:
                (ckpt / src.name).write_bytes(content)
            else:
                _link(src, ckpt / src.name)
        try:
            with SafetensorsCheckpoint(ckpt) as source:
                for name in source.tensor_names():
                    if source.shard_of(name) == shard.name:
                        arr = source.read(name)
                        dtype, shape = source.tensor_info(name)
                        assert tuple(arr.shape) == tuple(shape), (label, name)
            outcomes["ok"] += 1
        except UserError as exc:
            outcomes["user"] += 1
            if not str(exc).strip():
                failures.append(f"{label}: UserError without a message")
        except Exception as exc:  # noqa: BLE001 — the point is to catch whatever escapes
            failures.append(f"{label}: {type(exc).__name__}: {exc}"[:300])
        shutil.rmtree(ckpt)
    print(f"{len(cases)} safetensors mutations: {outcomes}")
    assert not failures, "\n".join(failures)
    assert outcomes["user"] >= len(cases) // 2 and outcomes["ok"] >= 1
