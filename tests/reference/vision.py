"""Reference MoonViT vision tower + multimodal projector, FP32 throughout.

Owns: spec §5 written out directly — patch embedding as a dense map, bicubic-resampled learned
position embedding (torch F.interpolate, plus a by-hand bicubic used to cross-check it), 2D RoPE
with the column/row pair layout, pre-LN blocks with block-diagonal (per image) bidirectional
attention, final LN, 2x2 patch merge and the projector. Does not own: preprocessing (preprocess.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import load_config, load_tensors

# Not in config.json; fixed by the official modeling code (spec §2.3).
LAYER_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
BICUBIC_A = -0.75  # PyTorch's cubic convolution constant


def cubic_weight(x: float) -> float:
    """PyTorch's cubic convolution kernel with A = -0.75 (spec §5.2)."""
    a = BICUBIC_A
    x = abs(x)
    if x <= 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return 0.0


def bicubic_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] resampling matrix of one axis: align_corners=False, unclamped source
    coordinate, taps i0-1..i0+2 clamped to the border, no antialiasing."""
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    ratio = n_in / n_out
    for dst in range(n_out):
        src = (dst + 0.5) * ratio - 0.5
        i0 = math.floor(src)
        t = src - i0
        taps = (cubic_weight(1.0 + t), cubic_weight(t), cubic_weight(1.0 - t), cubic_weight(2.0 - t))
        for offset, weight in zip((-1, 0, 1, 2), taps, strict=True):
            m[dst, min(max(i0 + offset, 0), n_in - 1)] += weight
    return m


def bicubic_by_hand(table: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """table [H, W, C] -> [out_h, out_w, C], separable, weights from the spec's description."""
    rows = bicubic_matrix(table.shape[0], out_h)
    cols = bicubic_matrix(table.shape[1], out_w)
    out = torch.einsum("ri,ijc,sj->rsc", rows, table.to(torch.float64), cols)
    return out.to(torch.float32)


def bicubic_torch(table: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """table [H, W, C] -> [out_h, out_w, C] with F.interpolate (what the official code calls)."""
    image = table.permute(2, 0, 1).unsqueeze(0)
    out = F.interpolate(image, size=(out_h, out_w), mode="bicubic", align_corners=False)
    return out[0].permute(1, 2, 0)


def rope_2d_angles(grid_h: int, grid_w: int, head_dim: int) -> torch.Tensor:
    """[gh*gw, head_dim/2] angles: pair 2i turns by column*freq_i, pair 2i+1 by row*freq_i,
    freq_i = theta^(-4i/head_dim) (spec §5.3; the code, not the docstring, is authoritative)."""
    exponents = torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim
    freqs = 1.0 / (ROPE_THETA ** exponents)
    flat = torch.arange(grid_h * grid_w, dtype=torch.float32)
    col = flat % grid_w
    row = torch.div(flat, grid_w, rounding_mode="floor")
    by_col = col[:, None] * freqs[None, :]
    by_row = row[:, None] * freqs[None, :]
    return torch.stack((by_col, by_row), dim=-1).flatten(1)


def rope_2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [heads, n, head_dim] with pairs (2p, 2p+1) as (real, imag); angles [n, head_dim/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def merge_patches(tokens: torch.Tensor, grid: tuple[int, int], kernel: tuple[int, int]) -> torch.Tensor:
    """[gh*gw, D] -> [(gh/kh)*(gw/kw), kh*kw, D]: merged tokens row-major, members row-major
    inside each kernel window (spec §5.6)."""
    gh, gw = grid
    kh, kw = kernel
    d = tokens.shape[-1]
    x = tokens.view(gh // kh, kh, gw // kw, kw, d).permute(0, 2, 1, 3, 4)
    return x.reshape((gh // kh) * (gw // kw), kh * kw, d)


class VisionReference:
    def __init__(self, ckpt_dir: str | Path) -> None:
        config = load_config(ckpt_dir)
        self.cfg = config["vision_config"]
        self.kernel = tuple(self.cfg.get("merge_kernel_size", (2, 2)))
        self.w = load_tensors(ckpt_dir, "vision_tower.")
        self.w.update(load_tensors(ckpt_dir, "multi_modal_projector."))

    def _layer_norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[prefix + ".weight"], self.w[prefix + ".bias"],
                            LAYER_NORM_EPS)

    def _attention(self, block: str, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        n_heads = self.cfg["num_attention_heads"]
        n, d = x.shape
        head_dim = d // n_heads
        qkv = F.linear(x, self.w[block + "wqkv.weight"], self.w[block + "wqkv.bias"])
        q, k, v = qkv.view(n, 3, n_heads, head_dim).permute(1, 2, 0, 3)  # each [heads, n, head_dim]
        out = torch.empty(n_heads, n, head_dim)
        start = 0
        # Attention never crosses images: each image is its own bidirectional sequence.
        for gh, gw in grids:
            end = start + gh * gw
            angles = rope_2d_angles(gh, gw, head_dim)
            qi = rope_2d(q[:, start:end], angles)
            ki = rope_2d(k[:, start:end], angles)
            probs = torch.softmax((qi @ ki.transpose(-1, -2)) / math.sqrt(head_dim), dim=-1)
            out[:, start:end] = probs @ v[:, start:end]
            start = end
        out = out.transpose(0, 1).reshape(n, d)
        return F.linear(out, self.w[block + "wo.weight"], self.w[block + "wo.bias"])

    def patch_embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The 14x14 stride-14 conv as one dense map of each (channel, ky, kx)-ordered patch."""
        proj = self.w["vision_tower.patch_embed.proj.weight"]
        return F.linear(pixel_values.to(torch.float32).flatten(1), proj.flatten(1),
                        self.w["vision_tower.patch_embed.proj.bias"])

    def tower(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Final-LN patch features [sum gh*gw, D] before merging."""
        pos_table = self.w["vision_tower.patch_embed.pos_emb.weight"]
        x = self.patch_embed(pixel_values)
        pos = [bicubic_torch(pos_table, gh, gw).reshape(gh * gw, -1) for gh, gw in grids]
        x = x + torch.cat(pos, dim=0)
        for b in range(self.cfg["num_hidden_layers"]):
            block = f"vision_tower.encoder.blocks.{b}."
            x = x + self._attention(block, self._layer_norm(x, block + "norm0"), grids)
            h = F.linear(self._layer_norm(x, block + "norm1"), self.w[block + "mlp.fc0.weight"],
                         self.w[block + "mlp.fc0.bias"])
            x = x + F.linear(F.gelu(h, approximate="tanh"), self.w[block + "mlp.fc1.weight"],
                             self.w[block + "mlp.fc1.bias"])
        return self._layer_norm(x, "vision_tower.encoder.final_layernorm")

    def project(self, merged: torch.Tensor) -> torch.Tensor:
        """[m, members, D] -> [m, text_hidden]: LN per member, concat, linear, erf GELU, linear."""
        u = self._layer_norm(merged, "multi_modal_projector.pre_norm").flatten(1)
        h = F.gelu(F.linear(u, self.w["multi_modal_projector.linear_1.weight"],
                            self.w["multi_modal_projector.linear_1.bias"]))
        return F.linear(h, self.w["multi_modal_projector.linear_2.weight"],
                        self.w["multi_modal_projector.linear_2.bias"])

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """pixel_values [N, 3, p, p] (all images' patches, in order) -> [tokens, text_hidden]."""
        grids = [(int(gh), int(gw)) for gh, gw in grids]
        expected = sum(gh * gw for gh, gw in grids)
        if pixel_values.shape[0] != expected:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but the grids need "
                             f"{expected}")
        for gh, gw in grids:
            if gh % self.kernel[0] or gw % self.kernel[1]:
                raise ValueError(f"grid {gh}x{gw} is not a multiple of the merge kernel {self.kernel}")
        features = self.tower(pixel_values, grids)
        out, start = [], 0
        for gh, gw in grids:
            out.append(self.project(merge_patches(features[start:start + gh * gw], (gh, gw), self.kernel)))
            start += gh * gw
        return torch.cat(out, dim=0)
