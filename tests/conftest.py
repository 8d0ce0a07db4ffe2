"""Shared fixtures: one tiny synthesized checkpoint and its pack per test session.

The checkpoints and packs are made by the TypeScript `kvl synth` / `kvl pack` (dist/cli/kvl.js,
built by `npm ci` / `npx tsc`): the Python synthesizer and packer are gone. Everything is written
under pytest's session temp dir; nothing touches the repository.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KVL_JS = REPO / "dist" / "cli" / "kvl.js"


def kvl_ts(*args: str) -> None:
    """Runs the TypeScript `kvl` command; fails the fixture with its output when it fails."""
    if not KVL_JS.is_file():
        pytest.fail(f"{KVL_JS} is missing: build the TypeScript front end first (npx tsc -p .)")
    result = subprocess.run(["node", str(KVL_JS), *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.fail(f"kvl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint in the official layout (seed 0)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    kvl_ts("synth", str(out), "--preset", "tiny", "--seed", "0")
    return out


@pytest.fixture(scope="session")
def tiny_ckpt_grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with group-limited routing (n_group > topk_group) and an F32 router bias."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny_grouped"
    kvl_ts("synth", str(out), "--preset", "tiny", "--seed", "1", "--bias-dtype", "f32",
           "--n-group", "4", "--topk-group", "2")
    return out


@pytest.fixture(scope="session")
def tiny_pack(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_ckpt packed into a kvl runtime directory."""
    out = tmp_path_factory.mktemp("pack") / "tiny"
    kvl_ts("pack", str(tiny_ckpt), str(out), "--allow-revision")
    return out


@pytest.fixture(scope="session")
def tiny_pack_grouped(tiny_ckpt_grouped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pack") / "tiny_grouped"
    kvl_ts("pack", str(tiny_ckpt_grouped), str(out), "--allow-revision")
    return out
