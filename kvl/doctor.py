"""`kvl doctor MODEL`: checks a packed model, the native library and this machine.

Owns: running each check, printing one `OK|WARN|FAIL  name: detail` line per check, and the
final verdict line (`PASS`, or `FAIL: <what to fix>`); exit code 0 on PASS, 1 on FAIL.
Checks: pack indexes/stores (packfmt.verify: sizes, offsets, alignment, CRCs of the indexes),
the tensor directory against config.json (modelspec), pinned-revision provenance, the native
library and its kernels, direct I/O where the model lives, available RAM against the default
plan, and a short real greedy generation.
Does not own: any of the checked machinery.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvl.errors import UserError

MIB = 1 << 20
GENERATION_TOKENS = 8


@dataclass
class Check:
    status: str  # OK | WARN | FAIL
    name: str
    detail: str
    fix: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="packed model directory")
    parser.add_argument("--build-dir", default=None,
                        help="CMake build directory holding the native library to check")
    parser.add_argument("--check-data", action="store_true",
                        help="also verify the CRC of every tensor (reads the whole pack)")
    parser.add_argument("--ram-mib", type=int, default=4096, help="RAM budget to check (4096)")


def library_in_build_dir(build_dir: Path) -> Path | None:
    names = ("libkvl.so", "libkvl.dylib", "kvl.dll", "libkvl.dll")
    for folder in (build_dir / "wasm-core", build_dir, build_dir / "wasm-core" / "Release",
                   build_dir / "Release"):
        for name in names:
            if (folder / name).is_file():
                return folder / name
    return None


def available_ram_bytes() -> int | None:
    """Memory the OS can give without swapping (Linux MemAvailable; Windows ullAvailPhys)."""
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    if sys.platform == "win32":
        class MemoryStatusEx(ctypes.Structure):
            _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                        ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                        ("ullTotalPageFile", ctypes.c_ulonglong),
                        ("ullAvailPageFile", ctypes.c_ulonglong),
                        ("ullTotalVirtual", ctypes.c_ulonglong),
                        ("ullAvailVirtual", ctypes.c_ulonglong),
                        ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]
        status = MemoryStatusEx()
        status.dwLength = ctypes.sizeof(MemoryStatusEx)
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
            return int(status.ullAvailPhys)
        return None
    try:  # other POSIX: free pages only (an underestimate)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pack(model: Path, check_data: bool) -> tuple[list[Check], object | None]:
    from kvl import packfmt

    try:
        reader = packfmt.verify(model, check_data_crc=check_data)
    except UserError as exc:
        return [Check("FAIL", "pack", str(exc), str(exc))], None
    stores = ", ".join(f"{n} {len(i.records)} tensors" for n, i in reader.stores.items())
    crc = "data CRCs checked" if check_data else "index CRCs checked (--check-data for tensors)"
    return [Check("OK", "pack", f"{stores}; {crc}")], reader


def check_directory(model: Path, reader) -> Check:
    """The pack's tensors, shapes, dtypes and hparams against its config.json."""
    from kvl import modelspec, packfmt

    try:
        config = json.loads((model / "config.json").read_text("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        return Check("FAIL", "tensor directory", f"config.json unreadable ({exc})",
                     "restore config.json (rerun kvl pack)")
    problems: list[str] = []
    if json.loads(reader.config_text) != config:
        problems.append("config.json differs from the config stored in the indexes")
    try:
        expected = modelspec.expected_tensors(config)
        expected_hp = modelspec.hparams(config)
    except UserError as exc:
        return Check("FAIL", "tensor directory", str(exc), "use a Kimi-VL config.json")
    for key, value in expected_hp.items():
        if reader.hparams.get(key) != value:
            problems.append(f"hparam {key} = {reader.hparams.get(key)}, config says {value}")
    dense = {}
    for store in ("trunk", "vision"):
        dense.update({r.name: r for r in reader.stores[store].records})
    expert_names = {r.name: r for r in reader.stores["experts"].records}
    for name, (_, shape) in expected.items():
        if ".mlp.experts." in name:
            continue
        rec = dense.get(name)
        if rec is None:
            problems.append(f"missing tensor {name}")
            continue
        want = {packfmt.DTYPE_F32} if name.endswith("e_score_correction_bias") else {
            packfmt.DTYPE_BF16}
        if rec.dtype not in want or tuple(rec.shape) != tuple(shape):
            problems.append(f"{name}: dtype {rec.dtype} shape {list(rec.shape)}, "
                            f"expected {list(shape)}")
    extra = set(dense) - set(expected)
    if extra:
        problems.append(f"{len(extra)} unexpected tensors, e.g. {sorted(extra)[0]}")
    text = modelspec.text_dims(config)
    n_moe = text.num_hidden_layers - text.first_k_dense_replace
    if len(expert_names) != n_moe * text.n_routed_experts:
        problems.append(f"experts.idx has {len(expert_names)} extents, expected "
                        f"{n_moe * text.n_routed_experts}")
    for rec in expert_names.values():
        if tuple(rec.shape)[2:] != (text.moe_intermediate_size, text.hidden_size):
            problems.append(f"{rec.name}: shape {list(rec.shape)} does not match config")
            break
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return Check("FAIL", "tensor directory", "; ".join(problems[:3]) + more,
                     "the pack does not match its config.json; rerun kvl pack")
    return Check("OK", "tensor directory",
                 f"{len(dense)} dense tensors and {len(expert_names)} expert extents match "
                 "config.json")


def check_provenance(model: Path, reader) -> Check:
    from kvl import PINNED_REVISION

    try:
        revision = (model / "SOURCE_REVISION.txt").read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return Check("FAIL", "provenance", "SOURCE_REVISION.txt missing or unreadable",
                     "rerun kvl pack (or kvl prepare)")
    index_rev = reader.revision
    if index_rev and index_rev != revision:
        return Check("FAIL", "provenance", f"SOURCE_REVISION.txt says {revision}, the indexes say "
                     f"{index_rev}", "the pack was modified; rerun kvl pack")
    if revision == PINNED_REVISION:
        return Check("OK", "provenance", f"pinned revision {revision}")
    if len(revision) != 40 or any(c not in "0123456789abcdef" for c in revision.lower()):
        return Check("WARN", "provenance", f"synthetic or unknown source ({revision!r}), not the "
                     f"pinned revision {PINNED_REVISION[:12]}: outputs are not the real model's")
    return Check("WARN", "provenance", f"source revision {revision} is not the pinned "
                 f"{PINNED_REVISION}; kvl is verified against the pinned one (use kvl prepare)")


def check_native(model: Path) -> tuple[list[Check], dict | None]:
    try:
        from kvl import native
    except Exception as exc:  # noqa: BLE001 - any import/load failure is the finding
        return [Check("FAIL", "native library", f"cannot load ({exc})",
                      "build it (cmake -S . -B build && cmake --build build) or set KVL_LIB")], None
    try:
        engine = native.NativeEngine(str(model), expert_cache_bytes=0, trunk_cache_bytes=-1,
                                     load_vision=True)
    except Exception as exc:  # noqa: BLE001
        return [Check("FAIL", "native library", f"the engine refused the pack ({exc})",
                      f"fix the pack ({exc})")], None
    try:
        info = engine.info()
    finally:
        engine.close()
    hint = (" (BF16 dot products: --act-dtype bf16 processes prompts ~1.5x faster, with BF16 "
            "rounding)" if info.get("kernels") == "avx512-bf16" else "")
    checks = [Check("OK", "native library",
                    f"loaded; kernels {info.get('kernels')}{hint}, Linear inputs "
                    f"{info.get('act_dtype')}, {info.get('n_threads')} threads")]
    direct = {k: bool(info.get(f"{k}_direct_io")) for k in ("trunk", "expert", "vision")}
    if all(direct.values()):
        checks.append(Check("OK", "direct I/O", f"works in {model}"))
    else:
        buffered = ", ".join(k for k, v in direct.items() if not v)
        checks.append(Check("WARN", "direct I/O", f"{buffered} reads are buffered: the filesystem "
                            f"of {model} refuses direct I/O, so the page cache holds model data "
                            "outside the RAM plan; move the model to ext4/xfs/NTFS for a hard cap"))
    return checks, info


def check_ram(model: Path, ram_mib: int) -> Check:
    from kvl.planner import plan

    try:
        ram_plan = plan(model, ram_mib=ram_mib, check=True)
    except UserError as exc:
        return Check("FAIL", "RAM", f"the default plan does not fit --ram-mib {ram_mib}: "
                     f"{str(exc).splitlines()[0]}", f"raise --ram-mib (see {exc})")
    available = available_ram_bytes()
    if available is None:
        return Check("WARN", "RAM", f"plan {ram_plan.total / MIB:.0f} MiB; available RAM unknown "
                     "on this system")
    detail = (f"plan {ram_plan.total / MIB:.0f} MiB of --ram-mib {ram_mib}, "
              f"{available / MIB:.0f} MiB available")
    if available < ram_plan.total:
        return Check("WARN", "RAM", detail + ": close other programs or run with a lower --ram-mib")
    return Check("OK", "RAM", detail)


def check_generation(model: Path, ram_mib: int) -> Check:
    from kvl.conversation import Message
    from kvl.engine import Engine
    from kvl.generate import Done, SamplingParams

    try:
        with Engine(model, ram_mib=ram_mib, max_context=512) as engine:
            chat = engine.new_chat()
            started = time.perf_counter()
            done = None
            for event in chat.generate([Message("user", ["Say hello."])],
                                       SamplingParams(temperature=0,
                                                      max_new_tokens=GENERATION_TOKENS)):
                if isinstance(event, Done):
                    done = event
            elapsed = time.perf_counter() - started
            vocab = engine.info()["vocab_size"]
            ids = chat.last_output_tokens
    except Exception as exc:  # noqa: BLE001 - the failure itself is the finding
        return Check("FAIL", "generation", f"{type(exc).__name__}: {exc}",
                     f"generation failed ({exc})")
    if done is None or any(not 0 <= i < vocab for i in ids):
        return Check("FAIL", "generation", f"bad output ids {ids}", "report this as a kvl bug")
    return Check("OK", "generation", f"{done.completion_tokens} greedy tokens "
                 f"({done.finish_reason}) in {elapsed:.2f} s, first token "
                 f"{done.timings['first_token_s']:.2f} s")


def run_checks(model: Path, build_dir: Path | None, check_data: bool, ram_mib: int
               ) -> list[Check]:
    checks: list[Check] = []
    if build_dir is not None:
        library = library_in_build_dir(build_dir)
        if library is None:
            checks.append(Check("FAIL", "native library", f"no libkvl in {build_dir}",
                                f"build it: cmake --build {build_dir}"))
            return checks
        os.environ["KVL_LIB"] = str(library)
    pack_checks, reader = check_pack(model, check_data)
    checks += pack_checks
    if reader is None:
        return checks
    checks.append(check_directory(model, reader))
    checks.append(check_provenance(model, reader))
    if any(c.status == "FAIL" for c in checks):
        return checks
    native_checks, info = check_native(model)
    checks += native_checks
    checks.append(check_ram(model, ram_mib))
    if info is not None:
        checks.append(check_generation(model, ram_mib))
    return checks


def run(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not model.is_dir():
        raise UserError(f"{model}: no such model directory")
    build_dir = Path(args.build_dir) if args.build_dir else None
    checks = run_checks(model, build_dir, args.check_data, args.ram_mib)
    for check in checks:
        print(f"{check.status:<4}  {check.name}: {check.detail}", flush=True)
    failed = [c for c in checks if c.status == "FAIL"]
    if failed:
        print("FAIL: " + "; ".join(f"{c.name}: {c.fix or c.detail}" for c in failed))
        return 1
    print("PASS")
    return 0
