"""kvl/packfmt.py and kvl/pack.py: format, quantisation, fidelity, crash safety, bad inputs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvl import packfmt
from kvl.errors import UserError
from kvl.pack import pack_checkpoint
from kvl.safetensors_io import SafetensorsCheckpoint

REPO = Path(__file__).resolve().parents[1]
OTHER_REVISION = "0123456789abcdef0123456789abcdef01234567"


# ------------------------------------------------------------------------------------------------
# Independent references (written from docs/FORMAT.md, sharing no code with kvl/)


def reference_q8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row with Python's round() (round half to even) on float32 quotients."""
    rows, cols = w.shape
    q = np.zeros((rows, cols), dtype=np.int8)
    scales = np.zeros(rows, dtype=np.float32)
    for r in range(rows):
        amax = max(abs(float(v)) for v in w[r])
        scale = np.float32(amax) / np.float32(127)
        scales[r] = scale
        if scale == 0:
            continue
        for c in range(cols):
            value = round(float(np.float32(w[r, c]) / scale))
            q[r, c] = max(-127, min(127, value))
    return q, scales


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def a64(x: int) -> int:
    return (x + 63) // 64 * 64


# ------------------------------------------------------------------------------------------------
# Quantisation and BF16 helpers


def test_q8_matches_independent_reference() -> None:
    rng = np.random.default_rng(7)
    w = bits_to_f32(bf16_bits(rng.standard_normal((13, 37)) * 0.05))
    w[3] = 0.0                                 # an all-zero row
    w[5, :] = 0.0
    w[5, 0] = -1e-30                           # a tiny row
    w[7, :5] = [127.0, 0.5, 1.5, 2.5, -2.5]    # scale exactly 1: ties go to even
    w[7, 5:] = 0.25
    q, s = packfmt.quantize_rows_q8(w)
    q_ref, s_ref = reference_q8(w)
    assert q.dtype == np.int8 and s.dtype == np.float32
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(q, q_ref)
    assert list(q[7, :5]) == [127, 0, 2, 2, -2]
    assert not q[3].any() and s[3] == 0


def test_q8_error_bound() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 200)).astype(np.float32)
    q, s = packfmt.quantize_rows_q8(w)
    err = np.abs(w - q.astype(np.float32) * s[:, None])
    assert (err <= s[:, None] * (0.5 + 1e-4)).all()
    assert np.abs(q).max() == 127


def test_bf16_helpers_agree_with_ml_dtypes() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10,
                        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 3.0e38, 1e-40], np.float32)])
    bits = packfmt.f32_to_bf16_bits(x)
    np.testing.assert_array_equal(bits, bf16_bits(x))
    np.testing.assert_array_equal(packfmt.bf16_bits_to_f32(bits), bits_to_f32(bits))


# ------------------------------------------------------------------------------------------------
# Index encoding


def sample_records() -> list[packfmt.TensorRecord]:
    return [packfmt.TensorRecord("a.weight", packfmt.DTYPE_BF16, (3, 5), 0, 30, 11),
            packfmt.TensorRecord("b.bias", packfmt.DTYPE_F32, (7,), 4096, 28, 22),
            packfmt.TensorRecord("c", packfmt.DTYPE_BF16, (2, 2, 2, 2), 8192, 32, 0xFFFFFFFF)]


def test_index_round_trip() -> None:
    hp = {"text.hidden_size": 64.0, "text.rms_norm_eps": 1e-5, "media_placeholder_token_id": 163605.0}
    config = '{"model_type": "kimi_vl", "name": "caf\u00e9"}'
    data = packfmt.encode_index(packfmt.STORE_TRUNK, 12288, hp, sample_records(), config, "ab" * 20)
    assert len(data) == 128 + 64 * 3 + 192 * 3 + len(config.encode())
    assert data[:8] == b"KVLIDX01"
    # The CRC field covers the file with itself zeroed.
    stored = struct.unpack_from("<I", data, 36)[0]
    assert stored == zlib.crc32(data[:36] + b"\0\0\0\0" + data[40:])
    idx = packfmt.decode_index(data, "trunk.idx", packfmt.STORE_TRUNK)
    assert idx.records == sample_records()
    assert idx.hparams == hp and idx.config_text == config and idx.revision == "ab" * 20
    assert idx.bin_size == 12288 and idx.kind == packfmt.STORE_TRUNK


@pytest.mark.parametrize("mutate, message", [
    (lambda recs: [recs[0], packfmt.TensorRecord("b.bias", 2, (7,), 4000, 28, 0), recs[2]],
     "multiple of 4096"),
    (lambda recs: [recs[0], recs[2], recs[1]], "overlaps"),
    (lambda recs: recs[:2] + [packfmt.TensorRecord("c", 1, (2, 2, 2, 2), 12288, 32, 0)], "past bin_size"),
    (lambda recs: [packfmt.TensorRecord("a.weight", 1, (3, 5), 0, 31, 0)] + recs[1:], "need 30"),
])
def test_index_rejects_bad_records(mutate, message: str) -> None:
    data = packfmt.encode_index(packfmt.STORE_TRUNK, 12288, {}, mutate(sample_records()), "{}", None)
    with pytest.raises(UserError, match=message):
        packfmt.decode_index(data, "trunk.idx", packfmt.STORE_TRUNK)


def test_index_rejects_flipped_byte_and_truncation() -> None:
    data = bytearray(packfmt.encode_index(packfmt.STORE_VISION, 12288, {"x": 1.0}, sample_records(), "{}",
                                          None))
    data[200] ^= 0x01
    with pytest.raises(UserError, match=r"vision\.idx: CRC mismatch"):
        packfmt.decode_index(bytes(data), "vision.idx")
    with pytest.raises(UserError, match="expected .* bytes from its header"):
        packfmt.decode_index(bytes(data[:-3]), "vision.idx")
    bad_magic = b"NOTANIDX" + bytes(data[8:])
    with pytest.raises(UserError, match="bad magic"):
        packfmt.decode_index(bad_magic, "vision.idx")


# ------------------------------------------------------------------------------------------------
# Pack fidelity


def test_pack_matches_source(tiny_ckpt: Path, tiny_pack: Path) -> None:
    src = SafetensorsCheckpoint(tiny_ckpt)
    reader = packfmt.verify(tiny_pack, check_data_crc=True)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    tc = config["text_config"]
    inter, hidden = tc["moe_intermediate_size"], tc["hidden_size"]
    assert reader.config == config
    assert reader.hparams["text.hidden_size"] == hidden
    assert reader.hparams["text.moe_intermediate_size"] == inter
    assert reader.hparams["media_placeholder_token_id"] == config["media_placeholder_token_id"]
    for name in ("config.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja",
                 "generation_config.json", "preprocessor_config.json"):
        assert (tiny_pack / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name
    assert not (tiny_pack / ".pack-journal").exists()

    seen_experts = set()
    for name in src.tensor_names():
        parts = name.split(".")
        if ".mlp.experts." in name:
            seen_experts.add((int(parts[3]), int(parts[6])))
            continue
        dtype, shape = src.tensor_info(name)
        data = src.read(name)
        rec = reader.record(name)
        assert rec.shape == tuple(shape)
        if name.endswith("e_score_correction_bias"):
            assert rec.dtype == packfmt.DTYPE_F32
            want = bits_to_f32(data) if dtype == "BF16" else data
            np.testing.assert_array_equal(reader.tensor(name), want)
        else:
            assert rec.dtype == packfmt.DTYPE_BF16
            np.testing.assert_array_equal(reader.tensor(name), data)  # bit-exact BF16
        store = "vision" if name.startswith(("vision_tower.", "multi_modal_projector.")) else "trunk"
        assert name in reader.stores[store].by_name
    n_moe = sum(1 for layer in range(tc["num_hidden_layers"]) if layer >= tc["first_k_dense_replace"])
    assert len(seen_experts) == n_moe * tc["n_routed_experts"]
    assert len(reader.stores["experts"].records) == len(seen_experts)
    for layer, expert in sorted(seen_experts):
        got = reader.expert(layer, expert)
        quant = reader.expert_quantized(layer, expert)
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            name = f"language_model.model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
            w = bits_to_f32(src.read(name))
            q_ref, s_ref = reference_q8(w) if (layer, expert) == (1, 0) else packfmt.quantize_rows_q8(w)
            np.testing.assert_array_equal(quant[f"{short}_s"], s_ref)
            np.testing.assert_array_equal(quant[f"{short}_q"], q_ref)
            scale = quant[f"{short}_s"][:, None]
            # s/2 in exact arithmetic; float32 division/multiplication add a few ulps of 127*s
            assert (np.abs(w - got[proj]) <= scale * (0.5 + 1e-4)).all()


def test_layout_and_alignment(tiny_ckpt: Path, tiny_pack: Path) -> None:
    reader = packfmt.PackReader(tiny_pack)
    tc = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]
    inter, hidden = tc["moe_intermediate_size"], tc["hidden_size"]
    # Extent layout straight from docs/FORMAT.md.
    up = a64(inter * hidden)
    down = a64(up + inter * hidden)
    gate_s = a64(down + hidden * inter)
    up_s = a64(gate_s + 4 * inter)
    down_s = a64(up_s + 4 * inter)
    extent_bytes = down_s + 4 * hidden
    for store, index in reader.stores.items():
        bin_size = (tiny_pack / f"{store}.bin").stat().st_size
        assert bin_size == index.bin_size and bin_size % 4096 == 0
        end = 0
        for rec in index.records:
            assert rec.offset % 4096 == 0 and rec.offset >= end
            end = rec.offset + rec.nbytes
            assert end <= bin_size
        if store == "experts":
            keys = [(r.shape[0], r.shape[1]) for r in index.records]
            assert keys == sorted(keys)  # layer-major, expert-minor
            assert all(r.nbytes == extent_bytes and r.shape[2:] == (inter, hidden) for r in index.records)
            offsets = [r.offset for r in index.records]
            assert offsets == [i * ((extent_bytes + 4095) // 4096 * 4096) for i in range(len(offsets))]
    # padding between extents and sub-blocks is zero
    rec = reader.stores["experts"].records[0]
    raw = np.frombuffer(reader.raw("experts", rec), np.uint8)
    assert not raw[inter * hidden:up].any() and not raw[gate_s + 4 * inter:up_s].any()
    with open(tiny_pack / "experts.bin", "rb") as f:
        f.seek(rec.offset + rec.nbytes)
        gap = f.read(reader.stores["experts"].records[1].offset - rec.offset - rec.nbytes)
    assert gap == b"\0" * len(gap)
    complete = json.loads((tiny_pack / "PACK_COMPLETE.json").read_text())
    assert complete["format_version"] == 1
    for store in ("trunk", "experts", "vision"):
        idx = (tiny_pack / f"{store}.idx").read_bytes()
        assert complete["files"][f"{store}.idx"] == {"size": len(idx), "crc32": zlib.crc32(idx)}


def test_synth_preset_pack_equals_packed_checkpoint(tiny_pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "direct"
    run_kvl("pack", "--quiet", "--synth-preset", "tiny", "--seed", "0", str(out))
    packfmt.verify(out, check_data_crc=True)
    for store in ("trunk", "experts", "vision"):
        assert (out / f"{store}.bin").read_bytes() == (tiny_pack / f"{store}.bin").read_bytes()


# ------------------------------------------------------------------------------------------------
# Crash safety


def run_kvl(*args: str, env_extra: dict[str, str] | None = None, check: bool = True
            ) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-m", "kvl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def clean_pack(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("clean") / "pack"
    pack_checkpoint(tiny_ckpt, out, allow_revision=True, progress=False)
    return tree_bytes(out)


def copy_ckpt(tiny_ckpt: Path, dest: Path) -> Path:
    shutil.copytree(tiny_ckpt, dest)
    return dest


@pytest.mark.parametrize("kill_points", [
    ["item:1"], ["item:5", "item:5"], ["flush:1"], ["flush:3", "item:2"],
    ["final:start"], ["final:trunk.idx"], ["final:vision.idx"], ["final:complete"],
])
def test_sigkill_then_rerun_is_byte_identical(tiny_ckpt: Path, clean_pack: dict[str, bytes],
                                              tmp_path: Path, kill_points: list[str]) -> None:
    out = tmp_path / "pack"
    for point in kill_points:
        proc = run_kvl("pack", "--quiet", "--allow-revision", str(tiny_ckpt), str(out), check=False,
                       env_extra={"KVL_PACK_TEST_KILL_AT": point, "KVL_PACK_FLUSH_ITEMS": "8"})
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert not (out / "PACK_COMPLETE.json").exists() or point == "final:complete"
        with pytest.raises(UserError):
            packfmt.verify(out) if point != "final:complete" else _raise_user_error()
    run_kvl("pack", "--quiet", "--allow-revision", str(tiny_ckpt), str(out))
    assert tree_bytes(out) == clean_pack


def _raise_user_error() -> None:
    raise UserError("complete marker present; nothing to check here")


def test_external_sigkill_while_writing(tiny_ckpt: Path, clean_pack: dict[str, bytes],
                                       tmp_path: Path) -> None:
    """A real kill -9 from outside once the journal shows progress, then a rerun."""
    out = tmp_path / "pack"
    env = dict(os.environ, PYTHONPATH=str(REPO), KVL_PACK_FLUSH_ITEMS="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvl", "pack", "--quiet", "--allow-revision",
                             str(tiny_ckpt), str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done_log = out / ".pack-journal" / "done.log"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if done_log.exists() and done_log.stat().st_size > 0:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    run_kvl("pack", "--quiet", "--allow-revision", str(tiny_ckpt), str(out))
    assert tree_bytes(out) == clean_pack


def journaled_inputs(out: Path, tiny_ckpt: Path) -> set[str]:
    """Source tensor names whose items are in the journal."""
    done = {line.split(" ")[0] for line in
            (out / ".pack-journal" / "done.log").read_text().split("\n")[:-1]}
    names = set()
    weight_map = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for name in weight_map:
        key = name.rsplit(".", 2)[0] if ".mlp.experts." in name else name
        if key in done:
            names.add(name)
    return names


def test_delete_consumed_shards_only_after_durable(tiny_ckpt: Path, clean_pack: dict[str, bytes],
                                                   tmp_path: Path) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    out = tmp_path / "pack"
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    saw_partial = False
    for flush_no in (1, 2, 3, 4):
        proc = run_kvl("pack", "--quiet", "--allow-revision", "--delete-consumed-shards", str(src),
                       str(out), check=False,
                       env_extra={"KVL_PACK_TEST_KILL_AT": f"flush:{flush_no}", "KVL_PACK_FLUSH_ITEMS": "16"})
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        durable = journaled_inputs(out, src)
        for shard in shards:
            tensors = {n for n, s in weight_map.items() if s == shard}
            if not (src / shard).exists():
                assert tensors <= durable, f"{shard} deleted before all its tensors were journaled"
            elif not tensors <= durable:
                saw_partial = True
    assert saw_partial, "no kill point left a shard with unpacked tensors"
    assert any((src / s).exists() for s in shards) or (out / "PACK_COMPLETE.json").exists()
    run_kvl("pack", "--quiet", "--allow-revision", "--delete-consumed-shards", str(src), str(out))
    assert tree_bytes(out) == clean_pack
    assert not any((src / s).exists() for s in shards)
    assert (src / "config.json").exists() and (src / "model.safetensors.index.json").exists()


# ------------------------------------------------------------------------------------------------
# Bad inputs


def refuse(src: Path, dst: Path, match: str, allow_revision: bool = True) -> str:
    with pytest.raises(UserError, match=match) as info:
        pack_checkpoint(src, dst, allow_revision=allow_revision, progress=False)
    assert not dst.exists() or not any(dst.glob("*.bin")), "wrote output for a refused source"
    return str(info.value)


def test_refuses_unpinned_or_unknown_revision(tiny_ckpt: Path, tmp_path: Path) -> None:
    msg = refuse(tiny_ckpt, tmp_path / "a", "--allow-revision", allow_revision=False)
    assert "unknown" in msg and "398eede0903cd983a2bfa0cc634e9ac1d843f375" in msg
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    (src / "SOURCE_REVISION.txt").write_text(OTHER_REVISION + "\n")
    msg = refuse(src, tmp_path / "b", OTHER_REVISION, allow_revision=False)
    assert "--allow-revision" in msg
    proc = run_kvl("pack", str(src), str(tmp_path / "c"), check=False)
    assert proc.returncode == 1 and OTHER_REVISION in proc.stderr and "Traceback" not in proc.stderr


def rewrite_header(shard: Path, edit) -> None:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    shard.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


def test_refuses_wrong_shape_in_header(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in weight_map if n.endswith("self_attn.q_proj.weight"))

    def swap(header: dict) -> None:
        header[name]["shape"] = header[name]["shape"][::-1]

    rewrite_header(src / weight_map[name], swap)
    msg = refuse(src, tmp_path / "out", "wrong shape")
    assert name in msg


def test_refuses_missing_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n in index["weight_map"] if ".mlp.experts.3.up_proj" in n)
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    msg = refuse(src, tmp_path / "out", "missing")
    assert name in msg


def test_refuses_truncated_shard(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    shard = sorted(src.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    msg = refuse(src, tmp_path / "out", shard.name)
    assert "truncat" in msg.lower() or "short" in msg.lower() or "bytes" in msg


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["text_config"].update(q_lora_rank=64), "q_lora_rank"),
    (lambda c: c["text_config"].update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    (lambda c: c["text_config"].update(scoring_func="softmax"), "scoring_func"),
])
def test_refuses_unsupported_config(tiny_ckpt: Path, tmp_path: Path, edit, match: str) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    refuse(src, tmp_path / "out", match)


def test_refuses_unreadable_config(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    (src / "config.json").write_text("{not json")
    refuse(src, tmp_path / "out", "config.json")


def test_refuses_nonempty_foreign_destination(tiny_ckpt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "busy"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        pack_checkpoint(tiny_ckpt, dst, allow_revision=True, progress=False)
    assert (dst / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------------
# Damaged packs


def test_reader_reports_truncated_bin(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    expected = (pack / "experts.bin").stat().st_size
    with open(pack / "experts.bin", "r+b") as f:
        f.truncate(4096)
    with pytest.raises(UserError) as info:
        packfmt.verify(pack)
    assert str(info.value) == (f"experts.bin: expected {expected} bytes, found 4096 — the pack is "
                               "incomplete; rerun kvl pack")


def test_reader_reports_flipped_idx_byte_and_missing_marker(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    data = bytearray((pack / "trunk.idx").read_bytes())
    data[300] ^= 0x10
    (pack / "trunk.idx").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"trunk\.idx"):
        packfmt.verify(pack)
    with pytest.raises(UserError, match="CRC mismatch"):
        packfmt.decode_index(bytes(data), "trunk.idx")
    (pack / "PACK_COMPLETE.json").unlink()
    with pytest.raises(UserError, match="the pack is incomplete; rerun kvl pack"):
        packfmt.verify(pack)


def test_reader_reports_corrupt_data(tiny_pack: Path, tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    reader = packfmt.PackReader(pack)
    rec = reader.stores["vision"].records[2]
    with open(pack / "vision.bin", "r+b") as f:
        f.seek(rec.offset)
        byte = f.read(1)
        f.seek(rec.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    packfmt.verify(pack)  # structure is fine
    with pytest.raises(UserError, match=rec.name.replace(".", r"\.")):
        packfmt.verify(pack, check_data_crc=True)


def test_rerun_survives_torn_journal_and_lost_bin(tiny_ckpt: Path, clean_pack: dict[str, bytes],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "pack"
    proc = run_kvl("pack", "--quiet", "--allow-revision", str(tiny_ckpt), str(out), check=False,
                   env_extra={"KVL_PACK_TEST_KILL_AT": "flush:4", "KVL_PACK_FLUSH_ITEMS": "8"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with open(out / ".pack-journal" / "done.log", "ab") as f:
        f.write(b"language_model.model.layers.2.mlp.experts.5 0a1b")  # a crash mid-append
    (out / "vision.bin").unlink()  # journaled vision items must be redone, not trusted
    run_kvl("pack", "--quiet", "--allow-revision", str(tiny_ckpt), str(out))
    assert tree_bytes(out) == clean_pack
