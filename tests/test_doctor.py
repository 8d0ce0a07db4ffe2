"""`kvl doctor`: PASS on the tiny pack, FAIL naming the problem on corrupted copies."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvl.doctor import available_ram_bytes

REPO = Path(__file__).resolve().parents[1]


def doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "kvl", "doctor", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)


def lines(result: subprocess.CompletedProcess) -> list[str]:
    return result.stdout.strip().splitlines()


def test_doctor_passes_on_tiny_pack(tiny_pack: Path) -> None:
    result = doctor(str(tiny_pack), "--ram-mib", "1024")
    out = lines(result)
    assert result.returncode == 0, result.stdout + result.stderr
    assert out[-1] == "PASS"
    assert sum(1 for line in out if line in ("PASS",) or line.startswith("FAIL")) == 1
    checks = {line.split(":")[0].split(None, 1)[1]: line.split()[0] for line in out[:-1]}
    for name in ("pack", "tensor directory", "native library", "generation"):
        assert checks[name] == "OK", out
    # the synthetic pack is recognised as not the pinned checkpoint
    assert checks["provenance"] == "WARN"
    assert "synthetic" in next(line for line in out if "provenance" in line)
    assert {"direct I/O", "RAM"} <= set(checks)
    generation_line = next(line for line in out if "generation" in line)
    assert "8 greedy tokens" in generation_line or "(stop)" in generation_line


@pytest.fixture
def pack_copy(tiny_pack: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pack"
    shutil.copytree(tiny_pack, copy)
    return copy


def _fail_line(result: subprocess.CompletedProcess) -> str:
    out = lines(result)
    assert result.returncode == 1, result.stdout + result.stderr
    assert out[-1].startswith("FAIL: ")
    assert not any(line == "PASS" for line in out)
    return out[-1]


def test_doctor_fails_on_corrupt_index(pack_copy: Path) -> None:
    data = bytearray((pack_copy / "trunk.idx").read_bytes())
    data[200] ^= 0xFF
    (pack_copy / "trunk.idx").write_bytes(bytes(data))
    assert "trunk.idx" in _fail_line(doctor(str(pack_copy)))


def test_doctor_fails_on_truncated_store(pack_copy: Path) -> None:
    path = pack_copy / "experts.bin"
    os.truncate(path, path.stat().st_size - 4096)
    assert "experts.bin" in _fail_line(doctor(str(pack_copy)))


def test_doctor_fails_on_corrupt_tensor_data(pack_copy: Path) -> None:
    from kvl.packfmt import PackReader

    rec = PackReader(pack_copy).stores["trunk"].records[3]
    with open(pack_copy / "trunk.bin", "r+b") as handle:
        handle.seek(rec.offset)
        byte = handle.read(1)
        handle.seek(rec.offset)
        handle.write(bytes([byte[0] ^ 0x55]))
    line = _fail_line(doctor(str(pack_copy), "--check-data"))
    assert rec.name in line


def test_doctor_fails_when_config_disagrees(pack_copy: Path) -> None:
    config = json.loads((pack_copy / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] += 1
    (pack_copy / "config.json").write_text(json.dumps(config))
    line = _fail_line(doctor(str(pack_copy)))
    assert "tensor directory" in line and "config.json" in line


def test_doctor_fails_without_library(tiny_pack: Path, tmp_path: Path) -> None:
    line = _fail_line(doctor(str(tiny_pack), "--build-dir", str(tmp_path)))
    assert "native library" in line and "build" in line


def test_available_ram_is_measured() -> None:
    available = available_ram_bytes()
    assert available is None or available > 0
    if sys.platform.startswith("linux"):
        assert available is not None
