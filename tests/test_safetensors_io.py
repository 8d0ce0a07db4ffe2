"""kvl/safetensors_io.py: reader/writer agree with the reference `safetensors` package, and bad
files give clear UserErrors (file name + what is wrong + what to do)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import save_file as torch_save_file

from kvl.errors import UserError
from kvl.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter, find_revision, write_index

REV = "398eede0903cd983a2bfa0cc634e9ac1d843f375"


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _write_single(dir_: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    torch_save_file(tensors, str(dir_ / "model.safetensors"))
    return dir_


def test_reader_matches_reference_writer(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {
        "a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(3, generator=g),
        "c.conv": torch.randn(2, 3, 4, 4, generator=g).to(torch.bfloat16),
        "d.ids": torch.arange(6, dtype=torch.int64),
    }
    ckpt = SafetensorsCheckpoint(_write_single(tmp_path / "ck", tensors))
    assert sorted(ckpt.tensor_names()) == sorted(tensors)
    assert ckpt.tensor_info("a.weight") == ("BF16", (7, 5))
    assert ckpt.tensor_info("b.bias") == ("F32", (3,))
    assert ckpt.tensor_info("d.ids") == ("I64", (6,))
    assert np.array_equal(ckpt.read("a.weight"), _bf16_bits(tensors["a.weight"]))
    assert ckpt.read("a.weight").dtype == np.uint16
    assert np.array_equal(ckpt.read("b.bias"), tensors["b.bias"].numpy())
    assert np.array_equal(ckpt.read("c.conv"), _bf16_bits(tensors["c.conv"]))
    assert np.array_equal(ckpt.read("d.ids"), np.arange(6))
    assert ckpt.shard_of("a.weight") == "model.safetensors"
    ckpt.close()


def test_writer_output_loads_with_reference_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    bf = rng.integers(0, 0x7F00, size=(4, 6), dtype=np.uint16)
    f32 = rng.standard_normal(5).astype(np.float32)
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, [("w", "BF16", (4, 6)), ("b", "F32", (5,))]) as w:
        w.write("w", bf)
        w.write("b", f32)
    assert not (tmp_path / "x.safetensors.partial").exists()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["b", "w"]
        assert f.get_tensor("w").dtype == torch.bfloat16
        assert np.array_equal(_bf16_bits(f.get_tensor("w")), bf)
        assert np.array_equal(f.get_tensor("b").numpy(), f32)


def test_sharded_index_roundtrip(tmp_path: Path) -> None:
    np_save_file({"x": np.arange(4, dtype=np.float32)}, str(tmp_path / "s1.safetensors"))
    np_save_file({"y": np.ones((2, 2), dtype=np.float32), "z": np.zeros(3, dtype=np.uint8)},
                 str(tmp_path / "s2.safetensors"))
    write_index(tmp_path, {"y": "s2.safetensors", "x": "s1.safetensors", "z": "s2.safetensors"}, 35)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 35
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.tensor_names() == ["y", "x", "z"]  # index order
    assert ckpt.shard_of("x") == "s1.safetensors"
    assert np.array_equal(ckpt.read("x"), np.arange(4, dtype=np.float32))
    assert ckpt.tensor_info("z") == ("U8", (3,))


def test_writer_enforces_order_and_completeness(tmp_path: Path) -> None:
    path = tmp_path / "y.safetensors"
    w = SafetensorsWriter(path, [("a", "F32", (2,)), ("b", "F32", (3,))])
    with pytest.raises(ValueError, match="expected tensor a next"):
        w.write("b", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"expected F32 \[2\]"):
        w.write("a", np.zeros(3, np.float32))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="before tensor b"):
        w.close()
    assert not path.exists()  # an unfinished shard never appears under its final name


def _shard_with_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_truncated_shard_message(tmp_path: Path) -> None:
    np_save_file({"w": np.zeros((100, 100), np.float32)}, str(tmp_path / "model-00003-of-00007.safetensors"))
    write_index(tmp_path, {"w": "model-00003-of-00007.safetensors"}, 40000)
    shard = tmp_path / "model-00003-of-00007.safetensors"
    full = shard.read_bytes()
    shard.write_bytes(full[:-1000])
    with pytest.raises(UserError) as err:
        SafetensorsCheckpoint(tmp_path)
    msg = str(err.value)
    assert "model-00003-of-00007.safetensors is truncated" in msg
    assert "header says 40000 bytes of data, file has 39000" in msg
    assert "re-download" in msg


@pytest.mark.parametrize("case,expect", [
    ("huge_len", "corrupt header"),
    ("not_json", "not valid JSON"),
    ("bad_dtype", "unknown dtype 'Q7'"),
    ("size_mismatch", "needs 24 bytes but data_offsets [0, 20] span 20"),
    ("beyond_end", "is truncated: header says 48 bytes of data, file has 24"),
    ("overlap", "overlap"),
    ("too_short", "too short"),
])
def test_corrupt_headers(tmp_path: Path, case: str, expect: str) -> None:
    path = tmp_path / "model.safetensors"
    good = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    if case == "huge_len":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not_json":
        path.write_bytes(struct.pack("<Q", 5) + b"{nope" + bytes(8))
    elif case == "bad_dtype":
        _shard_with_header(path, {"w": dict(good, dtype="Q7")}, bytes(24))
    elif case == "size_mismatch":
        _shard_with_header(path, {"w": dict(good, data_offsets=[0, 20])}, bytes(24))
    elif case == "beyond_end":
        _shard_with_header(path, {"w": dict(good, data_offsets=[24, 48])}, bytes(24))
    elif case == "overlap":
        _shard_with_header(path, {"w": good, "v": dict(good, data_offsets=[12, 36])}, bytes(36))
    elif case == "too_short":
        path.write_bytes(b"\x01\x02")
    with pytest.raises(UserError) as err:
        SafetensorsCheckpoint(tmp_path)
    assert "model.safetensors" in str(err.value)
    assert expect in str(err.value)


def test_index_problems(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="neither model.safetensors.index.json nor model.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    np_save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s2.safetensors"}, 16)
    with pytest.raises(UserError, match="s2.safetensors is listed in .* but missing"):
        SafetensorsCheckpoint(tmp_path)
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s1.safetensors"}, 16)
    with pytest.raises(UserError, match="does not contain tensor y"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        SafetensorsCheckpoint(tmp_path)


def test_missing_config_is_clear(tmp_path: Path) -> None:
    np_save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="has no config.json"):
        SafetensorsCheckpoint(tmp_path).config()


def test_revision_sources(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    assert find_revision(plain) is None

    explicit = tmp_path / "explicit"
    explicit.mkdir()
    (explicit / "SOURCE_REVISION.txt").write_text(REV + "\n")
    assert find_revision(explicit) == REV

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".kvl_revision").write_text("main\n")
    with pytest.raises(UserError, match="not a 40-hex-digit commit hash"):
        find_revision(bad)

    hub = tmp_path / "hub"
    meta = hub / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(f"{REV}\n\"etag\"\n1700000000.0\n")
    (meta / "model-00001-of-00007.safetensors.metadata").write_text(f"{REV}\nabc\n1.0\n")
    assert find_revision(hub) == REV
    (meta / "tiktoken.model.metadata").write_text("0" * 40 + "\nabc\n1.0\n")
    with pytest.raises(UserError, match="different revisions"):
        find_revision(hub)

    snap = tmp_path / "models--moonshotai--Kimi-VL-A3B-Instruct" / "snapshots" / REV
    snap.mkdir(parents=True)
    assert find_revision(snap) == REV


def test_checkpoint_revision_and_assets(tmp_path: Path) -> None:
    np_save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "tiktoken.model").write_bytes(b"IQ== 0\n")
    (tmp_path / "unrelated.txt").write_text("no")
    (tmp_path / "SOURCE_REVISION.txt").write_text(REV)
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.revision() == REV
    assert ckpt.asset_files() == {"config.json": b'{"a": 1}', "tiktoken.model": b"IQ== 0\n"}
    assert ckpt.config() == {"a": 1}
