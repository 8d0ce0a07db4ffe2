"""config.json -> typed model dimensions, the expected tensor inventory, validation messages.

Owns: reading the Kimi-VL config (text_config = DeepSeek-V3 decoder, vision_config = MoonViT),
deriving every tensor name/dtype/shape of the official checkpoint layout from those dims, checking a
TensorSource against that inventory, listing config features the runtime cannot run exactly, and
the pack's hparam table (docs/FORMAT.md "hparam keys").
Does not own: reading files or packing (the TypeScript packer, packer/; its host/model-spec.ts is
the same table, and this module goes with the Python doctor that still uses it), the math (wasm-core/).

Nothing here is model-size specific: every dimension comes from the config dict. The only fixed
facts are the ones the official code hard-codes rather than stores in config.json.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvl.errors import UserError

# Fixed by the official modelling code, not present in config.json.
KV_A_LAYERNORM_EPS = 1e-6  # DeepseekV3RMSNorm constructed without rms_norm_eps -> class default
VISION_ROPE_THETA = 10000.0
VISION_LAYER_NORM_EPS = 1e-5

DTYPE = "BF16"
ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
ROUTER_BIAS_DTYPES = ("BF16", "F32")

TEXT_PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
VISION_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "multi_modal_projector."


@dataclass(frozen=True)
class TextDims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    kv_a_layernorm_eps: float = KV_A_LAYERNORM_EPS

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        # Same rule as the official DeepseekV3DecoderLayer.
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


@dataclass(frozen=True)
class VisionDims:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    init_pos_emb_height: int
    init_pos_emb_width: int
    merge_kernel_h: int
    merge_kernel_w: int
    rope_theta: float = VISION_ROPE_THETA
    layer_norm_eps: float = VISION_LAYER_NORM_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def projector_width(self) -> int:
        return self.hidden_size * self.merge_kernel_h * self.merge_kernel_w


@dataclass(frozen=True)
class ModelDims:
    text: TextDims
    vision: VisionDims
    media_placeholder_token_id: int


def _section(config: dict, key: str) -> dict:
    if not isinstance(config, dict):
        raise UserError("config.json is not a JSON object; re-download config.json")
    section = config.get(key)
    if not isinstance(section, dict):
        raise UserError(f"config.json has no '{key}' object; this is not a Kimi-VL config "
                        "(re-download config.json from the model repository)")
    return section


def _get(section: dict, where: str, key: str, kind: type) -> Any:
    if key not in section:
        raise UserError(f"config.json: {where}.{key} is missing; re-download config.json")
    value = section[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise UserError(f"config.json: {where}.{key} = {value!r} is not a {kind.__name__}; "
                        "fix or re-download config.json")
    return value


def _positive(where: str, key: str, value: int) -> int:
    if value <= 0:
        raise UserError(f"config.json: {where}.{key} = {value} must be positive")
    return value


def text_dims(config: dict) -> TextDims:
    t = _section(config, "text_config")
    w = "text_config"

    def pos(key: str) -> int:
        return _positive(w, key, _get(t, w, key, int))

    q_lora = t.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool)):
        raise UserError(f"config.json: text_config.q_lora_rank = {q_lora!r} must be null or an integer")
    n_routed = _get(t, w, "n_routed_experts", int)
    if n_routed < 0:
        raise UserError(f"config.json: text_config.n_routed_experts = {n_routed} must not be negative")
    return TextDims(
        vocab_size=pos("vocab_size"),
        hidden_size=pos("hidden_size"),
        intermediate_size=pos("intermediate_size"),
        moe_intermediate_size=pos("moe_intermediate_size"),
        num_hidden_layers=pos("num_hidden_layers"),
        num_attention_heads=pos("num_attention_heads"),
        n_routed_experts=n_routed,
        n_shared_experts=_get(t, w, "n_shared_experts", int) if t.get("n_shared_experts") is not None else 0,
        num_experts_per_tok=pos("num_experts_per_tok"),
        first_k_dense_replace=_get(t, w, "first_k_dense_replace", int),
        moe_layer_freq=pos("moe_layer_freq"),
        kv_lora_rank=pos("kv_lora_rank"),
        q_lora_rank=q_lora,
        qk_nope_head_dim=pos("qk_nope_head_dim"),
        qk_rope_head_dim=pos("qk_rope_head_dim"),
        v_head_dim=pos("v_head_dim"),
        routed_scaling_factor=_get(t, w, "routed_scaling_factor", float),
        n_group=pos("n_group"),
        topk_group=pos("topk_group"),
        norm_topk_prob=_get(t, w, "norm_topk_prob", bool),
        rope_theta=_get(t, w, "rope_theta", float),
        rms_norm_eps=_get(t, w, "rms_norm_eps", float),
        max_position_embeddings=pos("max_position_embeddings"),
    )


def vision_dims(config: dict) -> VisionDims:
    v = _section(config, "vision_config")
    w = "vision_config"

    def pos(key: str) -> int:
        return _positive(w, key, _get(v, w, key, int))

    merge = _get(v, w, "merge_kernel_size", list)
    if (len(merge) != 2 or not all(isinstance(m, int) and not isinstance(m, bool) and m > 0
                                   for m in merge)):
        raise UserError(f"config.json: vision_config.merge_kernel_size = {merge!r} must be two "
                        "positive integers")
    return VisionDims(
        hidden_size=pos("hidden_size"),
        num_hidden_layers=pos("num_hidden_layers"),
        num_attention_heads=pos("num_attention_heads"),
        intermediate_size=pos("intermediate_size"),
        patch_size=pos("patch_size"),
        init_pos_emb_height=pos("init_pos_emb_height"),
        init_pos_emb_width=pos("init_pos_emb_width"),
        merge_kernel_h=merge[0],
        merge_kernel_w=merge[1],
    )


def model_dims(config: dict) -> ModelDims:
    return ModelDims(
        text=text_dims(config),
        vision=vision_dims(config),
        media_placeholder_token_id=_get(config, "top level", "media_placeholder_token_id", int),
    )


def expected_tensors(config: dict, bias_dtype: str | None = None
                     ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The official checkpoint inventory: name -> (dtype, shape), in shard order (vision and
    projector first, then the text decoder). bias_dtype ('BF16'/'F32', case-insensitive) fixes the
    router-bias dtype; None reports BF16 (check_source accepts either)."""
    t = text_dims(config)
    v = vision_dims(config)
    bias_dt = (bias_dtype or "BF16").upper()
    if bias_dt not in ROUTER_BIAS_DTYPES:
        raise UserError(f"router bias dtype {bias_dtype!r} must be bf16 or f32")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def add(name: str, *shape: int, dtype: str = DTYPE) -> None:
        out[name] = (dtype, tuple(shape))

    # Vision tower (MoonViT).
    vh, vi = v.hidden_size, v.intermediate_size
    add("vision_tower.patch_embed.proj.weight", vh, 3, v.patch_size, v.patch_size)
    add("vision_tower.patch_embed.proj.bias", vh)
    add("vision_tower.patch_embed.pos_emb.weight", v.init_pos_emb_height, v.init_pos_emb_width, vh)
    for b in range(v.num_hidden_layers):
        p = f"vision_tower.encoder.blocks.{b}."
        add(p + "norm0.weight", vh)
        add(p + "norm0.bias", vh)
        add(p + "wqkv.weight", 3 * vh, vh)
        add(p + "wqkv.bias", 3 * vh)
        add(p + "wo.weight", vh, vh)
        add(p + "wo.bias", vh)
        add(p + "norm1.weight", vh)
        add(p + "norm1.bias", vh)
        add(p + "mlp.fc0.weight", vi, vh)
        add(p + "mlp.fc0.bias", vi)
        add(p + "mlp.fc1.weight", vh, vi)
        add(p + "mlp.fc1.bias", vh)
    add("vision_tower.encoder.final_layernorm.weight", vh)
    add("vision_tower.encoder.final_layernorm.bias", vh)

    # Projector: per-patch LN, then the merged (kh*kw patches) vector through two linears.
    pw = v.projector_width
    add("multi_modal_projector.pre_norm.weight", vh)
    add("multi_modal_projector.pre_norm.bias", vh)
    add("multi_modal_projector.linear_1.weight", pw, pw)
    add("multi_modal_projector.linear_1.bias", pw)
    add("multi_modal_projector.linear_2.weight", t.hidden_size, pw)
    add("multi_modal_projector.linear_2.bias", t.hidden_size)

    # Text decoder.
    h = t.hidden_size
    add(TEXT_PREFIX + "embed_tokens.weight", t.vocab_size, h)
    for layer in range(t.num_hidden_layers):
        p = f"{TEXT_PREFIX}layers.{layer}."
        add(p + "input_layernorm.weight", h)
        add(p + "self_attn.q_proj.weight", t.num_attention_heads * t.q_head_dim, h)
        add(p + "self_attn.kv_a_proj_with_mqa.weight", t.kv_lora_rank + t.qk_rope_head_dim, h)
        add(p + "self_attn.kv_a_layernorm.weight", t.kv_lora_rank)
        add(p + "self_attn.kv_b_proj.weight",
            t.num_attention_heads * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank)
        add(p + "self_attn.o_proj.weight", h, t.num_attention_heads * t.v_head_dim)
        add(p + "post_attention_layernorm.weight", h)
        if t.is_moe_layer(layer):
            mi = t.moe_intermediate_size
            add(p + "mlp.gate.weight", t.n_routed_experts, h)
            add(p + ROUTER_BIAS_SUFFIX, t.n_routed_experts, dtype=bias_dt)
            for e in range(t.n_routed_experts):
                q = f"{p}mlp.experts.{e}."
                add(q + "gate_proj.weight", mi, h)
                add(q + "up_proj.weight", mi, h)
                add(q + "down_proj.weight", h, mi)
            if t.n_shared_experts > 0:
                si = t.n_shared_experts * mi
                add(p + "mlp.shared_experts.gate_proj.weight", si, h)
                add(p + "mlp.shared_experts.up_proj.weight", si, h)
                add(p + "mlp.shared_experts.down_proj.weight", h, si)
        else:
            add(p + "mlp.gate_proj.weight", t.intermediate_size, h)
            add(p + "mlp.up_proj.weight", t.intermediate_size, h)
            add(p + "mlp.down_proj.weight", h, t.intermediate_size)
    add(TEXT_PREFIX + "norm.weight", h)
    add(LM_HEAD, t.vocab_size, h)
    return out


def count_params(inventory: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in inventory.values())


def _fmt_shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_supported(config: dict) -> list[str]:
    """Config features the runtime cannot run exactly, one message each (empty = supported)."""
    problems: list[str] = []
    try:
        t = text_dims(config)
        v = vision_dims(config)
    except UserError as exc:
        return [str(exc)]
    tc = config["text_config"]
    vc = config["vision_config"]
    if t.q_lora_rank is not None:
        problems.append(f"text_config.q_lora_rank = {t.q_lora_rank}: low-rank query projection is "
                        "not supported (Kimi-VL uses null)")
    if tc.get("rope_scaling") is not None:
        problems.append(f"text_config.rope_scaling = {tc.get('rope_scaling')!r}: RoPE scaling "
                        "(YaRN etc.) is not supported (Kimi-VL uses null)")
    if tc.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"text_config.scoring_func = {tc.get('scoring_func')!r}: only 'sigmoid' "
                        "router scoring is supported")
    if tc.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"text_config.topk_method = {tc.get('topk_method')!r}: only 'noaux_tc' "
                        "expert selection is supported")
    if tc.get("hidden_act", "silu") != "silu":
        problems.append(f"text_config.hidden_act = {tc.get('hidden_act')!r}: only 'silu' is supported")
    if tc.get("attention_bias", False):
        problems.append("text_config.attention_bias = true: attention biases are not supported")
    if tc.get("tie_word_embeddings", False) or config.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings = true: a tied lm_head is not supported "
                        "(Kimi-VL has a separate lm_head)")
    if t.qk_rope_head_dim % 2:
        problems.append(f"text_config.qk_rope_head_dim = {t.qk_rope_head_dim} is odd; RoPE needs "
                        "an even dimension")
    if t.n_routed_experts == 0:
        problems.append("text_config.n_routed_experts = 0: a model without routed experts is not "
                        "supported")
    else:
        if t.n_routed_experts % t.n_group:
            problems.append(f"text_config.n_routed_experts = {t.n_routed_experts} is not divisible "
                            f"by n_group = {t.n_group}")
        if t.topk_group > t.n_group:
            problems.append(f"text_config.topk_group = {t.topk_group} exceeds n_group = {t.n_group}")
        if t.num_experts_per_tok > t.n_routed_experts:
            problems.append(f"text_config.num_experts_per_tok = {t.num_experts_per_tok} exceeds "
                            f"n_routed_experts = {t.n_routed_experts}")
        elif t.n_routed_experts % t.n_group == 0 and t.topk_group <= t.n_group:
            per_group = t.n_routed_experts // t.n_group
            if t.num_experts_per_tok > t.topk_group * per_group:
                problems.append(f"text_config.num_experts_per_tok = {t.num_experts_per_tok} exceeds "
                                f"the {t.topk_group * per_group} experts of the selected groups "
                                f"(topk_group {t.topk_group} x {per_group} experts per group)")
            if t.n_group > 1 and per_group < 2:
                problems.append(f"text_config.n_group = {t.n_group} leaves fewer than 2 experts per "
                                "group; group scores (sum of the top 2) are undefined")
    if t.first_k_dense_replace < 0 or t.first_k_dense_replace > t.num_hidden_layers:
        problems.append(f"text_config.first_k_dense_replace = {t.first_k_dense_replace} is outside "
                        f"0..{t.num_hidden_layers}")
    if v.hidden_size % v.num_attention_heads:
        problems.append(f"vision_config.hidden_size = {v.hidden_size} is not divisible by "
                        f"num_attention_heads = {v.num_attention_heads}")
    elif v.head_dim % 4:
        problems.append(f"vision head_dim = {v.head_dim} is not divisible by 4 (2D RoPE splits it "
                        "into x/y pairs)")
    if (v.merge_kernel_h, v.merge_kernel_w) != (2, 2):
        problems.append(f"vision_config.merge_kernel_size = [{v.merge_kernel_h}, {v.merge_kernel_w}]:"
                        " only [2, 2] patch merging is supported")
    media = config.get("media_placeholder_token_id")
    if not isinstance(media, int) or not 0 <= media < t.vocab_size:
        problems.append(f"media_placeholder_token_id = {media!r} is not a token id below "
                        f"vocab_size {t.vocab_size}")
    if vc.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh",):
        problems.append(f"vision_config.hidden_act = {vc.get('hidden_act')!r}: only the GELU-tanh "
                        "vision MLP is supported")
    return problems


HPARAM_TEXT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "kv_lora_rank",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor",
    "n_group", "topk_group", "norm_topk_prob", "rope_theta", "rms_norm_eps",
    "kv_a_layernorm_eps", "max_position_embeddings",
)
HPARAM_VISION_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
    "init_pos_emb_height", "init_pos_emb_width", "merge_kernel_h", "merge_kernel_w",
    "rope_theta", "layer_norm_eps",
)


def hparams(config: dict) -> dict[str, float]:
    """The pack's hparam table (docs/FORMAT.md): text.*, vision.*, media_placeholder_token_id."""
    dims = model_dims(config)
    out: dict[str, float] = {}
    for key in HPARAM_TEXT_KEYS:
        value = getattr(dims.text, key)
        out["text." + key] = 0.0 if value is None else float(value)
    for key in HPARAM_VISION_KEYS:
        out["vision." + key] = float(getattr(dims.vision, key))
    out["media_placeholder_token_id"] = float(dims.media_placeholder_token_id)
    return out
