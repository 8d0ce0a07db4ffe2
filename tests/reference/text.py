"""Reference text decoder (DeepSeek-V3 style, naive MLA), FP32 throughout.

With linear_inputs="bf16" the input of every Linear layer (q_proj, kv_a_proj_with_mqa, o_proj,
the MLPs and experts, lm_head; not the router, which the official code runs in FP32, and not
kv_b_proj, which the runtime applies to the FP32 latent in its absorbed form) is rounded to BF16
first: the checkpoint's own BF16 inputs, with FP32 products, as the runtime's --act-dtype bf16.

Owns: the decoder forward written directly from the model spec §4 (embeddings with media rows,
RMSNorm, MLA with q_lora_rank null, interleaved-layout RoPE, dense SwiGLU, sigmoid/noaux_tc MoE
with group-limited routing, shared experts, final norm, lm_head) and a greedy loop that recomputes
the whole prefix each step. Does not own: caching, quantisation (see checkpoint.q8_roundtrip_rows)
or anything used by the runtime.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import load_config, load_tensors

TEXT_PREFIX = "language_model."
# The official module builds kv_a_layernorm without passing rms_norm_eps: class default 1e-6 (spec §4.2).
KV_A_LAYERNORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           cast: Callable[[torch.Tensor], torch.Tensor] = _identity) -> torch.Tensor:
    h = F.silu(F.linear(cast(x), gate)) * F.linear(cast(x), up)
    return F.linear(cast(h), down)


def rope_official_layout(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Spec §4.5: de-interleave the rope vector, then rotate-half with cat(angles, angles).

    x: [..., n, d] with positions [n]. inv_freq and angles are FP32 like the official code, because
    computing them in double drifts measurably at long context.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [n, d/2]
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)
    r = x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)  # [x0,x2,...,x1,x3,...]
    rotated = torch.cat((-r[..., d // 2:], r[..., : d // 2]), dim=-1)
    return r * cos + rotated * sin


class TextReference:
    """FP32 reference of the text decoder. `q8_experts` swaps routed experts for their Q8 round trip."""

    def __init__(self, ckpt_dir: str | Path, q8_experts: bool = False,
                 linear_inputs: str = "f32") -> None:
        if linear_inputs not in ("f32", "bf16"):
            raise ValueError(f"linear_inputs {linear_inputs!r} must be f32 or bf16")
        self.cast = round_bf16 if linear_inputs == "bf16" else _identity
        config = load_config(ckpt_dir)
        self.media_token_id: int | None = config.get("media_placeholder_token_id")
        self.cfg = config.get("text_config", config)
        if self.cfg.get("q_lora_rank") is not None:
            raise ValueError("reference supports q_lora_rank = null only (plain q_proj), as in Kimi-VL")
        if self.cfg.get("rope_scaling") is not None:
            raise ValueError("reference supports rope_scaling = null only, as in Kimi-VL")
        raw = load_tensors(ckpt_dir, TEXT_PREFIX, q8_experts=q8_experts)
        self.w = {name[len(TEXT_PREFIX):]: t for name, t in raw.items()}

    # -- blocks ---------------------------------------------------------------------------------
    def _attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        p = f"model.layers.{layer}.self_attn."
        n_heads = c["num_attention_heads"]
        nope, rope, v_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        latent = c["kv_lora_rank"]
        n = x.shape[0]
        positions = torch.arange(n)

        q = F.linear(self.cast(x), self.w[p + "q_proj.weight"]).view(n, n_heads, nope + rope).transpose(0, 1)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        a = F.linear(self.cast(x), self.w[p + "kv_a_proj_with_mqa.weight"])
        c_kv = rms_norm(a[:, :latent], self.w[p + "kv_a_layernorm.weight"], KV_A_LAYERNORM_EPS)
        k_rope = a[:, latent:]
        kv = F.linear(c_kv, self.w[p + "kv_b_proj.weight"]).view(n, n_heads, nope + v_dim).transpose(0, 1)
        k_nope, v = kv[..., :nope], kv[..., nope:]

        q_rope = rope_official_layout(q_rope, positions, c["rope_theta"])
        k_rope = rope_official_layout(k_rope, positions, c["rope_theta"])  # one vector shared by all heads

        query = torch.cat((q_nope, q_rope), dim=-1)
        key = torch.cat((k_nope, k_rope.unsqueeze(0).expand(n_heads, n, rope)), dim=-1)
        scores = (query @ key.transpose(-1, -2)) * (1.0 / math.sqrt(nope + rope))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.to(torch.float32), dim=-1)
        out = (probs @ v).transpose(0, 1).reshape(n, n_heads * v_dim)
        return F.linear(self.cast(out), self.w[p + "o_proj.weight"])

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Spec §4.8 for every row of x: (expert indices [n, k], weights [n, k])."""
        c = self.cfg
        p = f"model.layers.{layer}.mlp.gate."
        n_experts, k = c["n_routed_experts"], c["num_experts_per_tok"]
        n_group, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
        scores = torch.sigmoid(F.linear(x, self.w[p + "weight"]))
        biased = scores + self.w[p + "e_score_correction_bias"]
        per_group = biased.view(-1, n_group, n_experts // n_group)
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
        kept_groups = group_score.topk(topk_group, dim=-1).indices
        group_keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept_groups, True)
        expert_keep = group_keep.unsqueeze(-1).expand_as(per_group).reshape(-1, n_experts)
        # Official MoEGate / transformers set masked experts to 0.0 (not -inf): a masked expert can
        # still win against negative biased scores, and the reference must reproduce that.
        masked = biased.masked_fill(~expert_keep, 0.0)
        idx = masked.topk(k, dim=-1).indices
        weights = scores.gather(1, idx)
        # The official gate normalizes only when top_k > 1 as well (transformers ignores top_k here).
        if c.get("norm_topk_prob", False) and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * c["routed_scaling_factor"]

    def _moe(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        idx, weights = self.route(layer, x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slots = (idx == e).nonzero(as_tuple=True)
            q = f"{p}experts.{e}."
            y = swiglu(x[rows], self.w[q + "gate_proj.weight"], self.w[q + "up_proj.weight"],
                       self.w[q + "down_proj.weight"], self.cast)
            out[rows] += y * weights[rows, slots].unsqueeze(-1)  # rows are distinct within one expert
        s = p + "shared_experts."
        return out + swiglu(x, self.w[s + "gate_proj.weight"], self.w[s + "up_proj.weight"],
                            self.w[s + "down_proj.weight"], self.cast)

    def _ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer < self.cfg.get("first_k_dense_replace", 0):
            p = f"model.layers.{layer}.mlp."
            return swiglu(x, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"],
                          self.w[p + "down_proj.weight"], self.cast)
        return self._moe(layer, x)

    # -- public API -----------------------------------------------------------------------------
    def embed(self, input_ids: list[int], media_embeds: torch.Tensor | None = None) -> torch.Tensor:
        ids = torch.tensor(list(input_ids), dtype=torch.long)
        x = self.w["model.embed_tokens.weight"][ids].clone()
        media_rows = (ids == self.media_token_id).nonzero().flatten() if self.media_token_id is not None \
            else torch.empty(0, dtype=torch.long)
        n_media = 0 if media_embeds is None else media_embeds.shape[0]
        if n_media != media_rows.numel():
            raise ValueError(f"{media_rows.numel()} media placeholder tokens but {n_media} "
                             "media embedding rows")
        if n_media:
            x[media_rows] = media_embeds.to(torch.float32)
        return x

    @torch.no_grad()
    def hidden_states(self, input_ids: list[int], media_embeds: torch.Tensor | None = None) -> torch.Tensor:
        eps = self.cfg["rms_norm_eps"]
        x = self.embed(input_ids, media_embeds)
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            x = x + self._attention(layer, rms_norm(x, self.w[p + "input_layernorm.weight"], eps))
            x = x + self._ffn(layer, rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps))
        return rms_norm(x, self.w["model.norm.weight"], eps)

    @torch.no_grad()
    def logits(self, input_ids: list[int], media_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 logits [n, vocab] for every position."""
        return F.linear(self.cast(self.hidden_states(input_ids, media_embeds)), self.w["lm_head.weight"])

    @torch.no_grad()
    def greedy(self, input_ids: list[int], n_new: int, media_embeds: torch.Tensor | None = None) -> list[int]:
        """n_new argmax tokens (no stop ids); the whole prefix is recomputed each step."""
        ids = list(input_ids)
        new: list[int] = []
        for _ in range(n_new):
            last = self.hidden_states(ids, media_embeds)[-1]
            token = int(F.linear(self.cast(last), self.w["lm_head.weight"]).argmax())
            ids.append(token)
            new.append(token)
        return new
