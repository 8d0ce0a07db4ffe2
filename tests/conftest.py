"""Shared fixtures: one tiny synthesized checkpoint and its pack per test session.

Everything is written under pytest's session temp dir; nothing touches the repository.
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint in the official layout (seed 0)."""
    from kvl.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with group-limited routing (n_group > topk_group) and an F32 router bias."""
    from kvl.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("ckpt") / "tiny_grouped", preset="tiny", seed=1,
                      bias_dtype="f32", n_group=4, topk_group=2)


@pytest.fixture(scope="session")
def tiny_pack(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_ckpt packed into a kvl runtime directory."""
    from kvl.pack import pack_checkpoint

    return pack_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("pack") / "tiny", allow_revision=True)


@pytest.fixture(scope="session")
def tiny_pack_grouped(tiny_ckpt_grouped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvl.pack import pack_checkpoint

    return pack_checkpoint(tiny_ckpt_grouped, tmp_path_factory.mktemp("pack") / "tiny_grouped",
                           allow_revision=True)
