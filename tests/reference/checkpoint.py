"""Checkpoint loading for the reference: config.json + (sharded) safetensors -> FP32 tensors.

Owns: reading a checkpoint directory into a name -> FP32 torch.Tensor dict, and the independent
row-wise Q8 round trip of routed expert weights (docs/FORMAT.md rule) used to compare against a
runtime that stores experts as Q8. Does not own: any model math.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

# Routed expert matrices only; shared experts and the router stay unquantized in the runtime.
ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def load_config(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point the reference at a checkpoint directory")
    return json.loads(path.read_text(encoding="utf-8"))


def shard_files(ckpt_dir: str | Path) -> list[Path]:
    """Shards named by model.safetensors.index.json, or the single model.safetensors."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [ckpt_dir / name for name in sorted(set(weight_map.values()))]
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{ckpt_dir} has neither model.safetensors.index.json nor model.safetensors")


def q8_roundtrip_rows(weight: torch.Tensor) -> torch.Tensor:
    """Row-wise symmetric Q8 quantize + dequantize, all in FP32.

    scale[r] = max|W[r]|/127 (0 for an all-zero row); q = clip(round_half_even(W/scale), -127, 127).
    torch.round rounds half to even, which is the rule the runtime's packer must follow too.
    """
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / safe), -127.0, 127.0)
    q = torch.where(scale > 0, q, torch.zeros_like(q))
    return q * scale


def load_tensors(ckpt_dir: str | Path, prefix: str = "", q8_experts: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, converted to FP32."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in shard_files(ckpt_dir):
        for name, value in load_file(str(shard)).items():
            if not name.startswith(prefix):
                continue
            value = value.to(torch.float32)
            if q8_experts and ROUTED_EXPERT_WEIGHT.search(name):
                value = q8_roundtrip_rows(value)
            tensors[name] = value
    if not tensors:
        raise ValueError(f"no tensors with prefix {prefix!r} in {ckpt_dir}")
    return tensors
