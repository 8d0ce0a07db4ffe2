"""kvl/prepare.py against a local hub stand-in: download + pack end to end, resume, offline."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvl
from kvl import packfmt, prepare
from kvl.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_standin import HubStandin  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub writes a partial file in 10 MB chunks; shrink them so a cut-off after a few
    KB of a tiny shard leaves a partial file to resume from."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_prepare_end_to_end_with_resumed_transfer(tiny_ckpt: Path, tiny_pack: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  small_chunks: None) -> None:
    weight_map = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    biggest = max(shards, key=lambda s: (tiny_ckpt / s).stat().st_size)
    cut_at = (tiny_ckpt / biggest).stat().st_size // 2
    present_at_acquire: list[list[str]] = []
    original_acquire = prepare._ShardDownloads.acquire

    def spying_acquire(self, shard: str) -> None:
        original_acquire(self, shard)
        present_at_acquire.append(sorted(p.name for p in self.scratch.glob("*.safetensors")))

    monkeypatch.setattr(prepare._ShardDownloads, "acquire", spying_acquire)
    with HubStandin(tiny_ckpt, kvl.PINNED_REPO, kvl.PINNED_REVISION, cut_once={biggest: cut_at}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        dst = prepare.prepare(tmp_path / "pack", progress=False)
        requests = list(hub.requests)
        gets = hub.gets_of(biggest)

    reader = packfmt.verify(dst, check_data_crc=True)
    assert reader.revision == kvl.PINNED_REVISION
    assert (dst / "SOURCE_REVISION.txt").read_text() == kvl.PINNED_REVISION + "\n"
    for store in ("trunk", "experts", "vision"):  # same tensors as packing the directory directly
        assert (dst / f"{store}.bin").read_bytes() == (tiny_pack / f"{store}.bin").read_bytes()
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (dst / name).read_bytes() == (tiny_ckpt / name).read_bytes()
    assert not (dst / ".download").exists() and not (dst / ".pack-journal").exists()
    # The cut-off transfer was resumed from the partial file, not restarted.
    resumed = [g for g in gets if g.range and not g.range.startswith("bytes=0-")]
    assert resumed, [g.range for g in gets]
    assert int(resumed[0].range.split("=")[1].split("-")[0]) > 0
    # Only the needed files were fetched, each shard's data once (plus header range reads).
    fetched = {r.path.rsplit("/", 1)[-1] for r in requests if r.method == "GET"}
    assert fetched <= set(shards) | set(packfmt.ASSET_FILES) | {"model.safetensors.index.json"}
    for shard in shards:
        full = [g for g in hub.gets_of(shard) if g.range is None]
        assert len(full) == 1, shard
    # Bounded scratch: when a shard arrives, at most one earlier shard is still on disk.
    assert present_at_acquire and all(len(p) <= 2 for p in present_at_acquire), present_at_acquire
    assert [p for p in present_at_acquire if len(p) == 1], present_at_acquire


def test_prepare_is_idempotent_and_keeps_download_on_request(tiny_ckpt: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with HubStandin(tiny_ckpt, kvl.PINNED_REPO, kvl.PINNED_REVISION) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        dst = prepare.prepare(tmp_path / "pack", keep_download=True, progress=False)
        assert sorted(p.name for p in (dst / ".download").glob("*.safetensors")) == \
            sorted(p.name for p in tiny_ckpt.glob("*.safetensors"))
        before = {p.name: p.read_bytes() for p in dst.glob("*.bin")}
        n_requests = len(hub.requests)
        prepare.prepare(dst, progress=False)  # complete pack: checked, nothing downloaded
        assert len(hub.requests) == n_requests
        assert {p.name: p.read_bytes() for p in dst.glob("*.bin")} == before


def test_prepare_fails_fast_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(UserError) as info:
        prepare.prepare(tmp_path / "pack", progress=False)
    message = str(info.value)
    assert message.startswith(f"cannot reach {endpoint} (HF_ENDPOINT): ")
    assert "check your connection or set HF_ENDPOINT" in message
    assert not (tmp_path / "pack" / "PACK_COMPLETE.json").exists()


def test_prepare_cli_offline_message(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_ENDPOINT=endpoint)
    proc = subprocess.run([sys.executable, "-m", "kvl", "prepare", str(tmp_path / "pack")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"kvl prepare: error: cannot reach {endpoint} (HF_ENDPOINT)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prepare_unknown_revision(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with HubStandin(tiny_ckpt, kvl.PINNED_REPO, kvl.PINNED_REVISION) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UserError, match="revision deadbeef.*does not exist"):
            prepare.prepare(tmp_path / "pack", revision="deadbeef", progress=False)


def test_prepare_resumes_after_interrupted_pack(tiny_ckpt: Path, tiny_pack: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepare that dies mid-way (here: the hub vanishes after the first shard) resumes on rerun
    without re-downloading shards that are already packed."""
    weight_map = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    original_acquire = prepare._ShardDownloads.acquire
    calls: list[str] = []

    def failing_acquire(self, shard: str) -> None:
        if shard == shards[1]:
            raise UserError("simulated outage")
        calls.append(shard)
        original_acquire(self, shard)

    with HubStandin(tiny_ckpt, kvl.PINNED_REPO, kvl.PINNED_REVISION) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setattr(prepare._ShardDownloads, "acquire", failing_acquire)
        with pytest.raises(UserError, match="simulated outage"):
            prepare.prepare(tmp_path / "pack", progress=False)
        assert not (tmp_path / "pack" / "PACK_COMPLETE.json").exists()
        assert not (tmp_path / "pack" / ".download" / shards[0]).exists()  # packed, so deleted
        monkeypatch.setattr(prepare._ShardDownloads, "acquire", original_acquire)
        dst = prepare.prepare(tmp_path / "pack", progress=False)
        full_gets = {s: len([g for g in hub.gets_of(s) if g.range is None]) for s in shards}
    assert full_gets[shards[0]] == 1, full_gets
    for store in ("trunk", "experts", "vision"):
        assert (dst / f"{store}.bin").read_bytes() == (tiny_pack / f"{store}.bin").read_bytes()
