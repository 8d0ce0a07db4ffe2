"""`kvl synth`: random-weight checkpoints in the official Kimi-VL layout.

Owns: the tiny/full preset configs, the deterministic per-tensor weight generator (SynthSource, a
TensorSource that needs no files: any tensor, in any order, always gives the same bytes for the same
(seed, name)), and writing a complete checkpoint directory (config, shards + index, processor and
tokenizer assets).
Does not own: names/shapes (modelspec.py), the safetensors format (safetensors_io.py), tokenizer
assets (synth_tokenizer.py).

Weights are uniform with the std a sensible init would use: activations stay O(1) through every
layer (residual-branch outputs damped), router bias non-zero, logits spread (std ~4) so greedy
decoding is not decided by near-ties. Uniform rather than normal because it is built straight from
raw generator bits, which keeps a full-size (16.4e9 parameter) stream to minutes.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np

from kvl import synth_tokenizer
from kvl.errors import UserError
from kvl.modelspec import LM_HEAD, ROUTER_BIAS_SUFFIX, check_supported, expected_tensors, text_dims
from kvl.safetensors_io import INDEX_NAME, NUMPY_DTYPES, SafetensorsWriter, write_index

_FULL_TEXT = {
    "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "ep_size": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.446, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "aux_loss_alpha": 0.001, "seq_aux": True, "max_position_embeddings": 131072,
    "rope_theta": 800000.0, "rope_scaling": None, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
    "initializer_range": 0.02, "use_cache": True, "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
}
_FULL_VISION = {
    "model_type": "moonvit", "patch_size": 14, "init_pos_emb_height": 64,
    "init_pos_emb_width": 64, "num_attention_heads": 16, "num_hidden_layers": 27,
    "hidden_size": 1152, "intermediate_size": 4304, "merge_kernel_size": [2, 2],
    "torch_dtype": "bfloat16",
}
# Every structural feature of the real model at a few MB: dense layer 0 + 3 MoE layers, shared
# experts, the real vocabulary size (so the tokenizer ids fit), a pos-emb table small enough that
# every test image needs resampling.
_TINY_TEXT = dict(_FULL_TEXT, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  max_position_embeddings=8192)
_TINY_VISION = dict(_FULL_VISION, init_pos_emb_height=8, init_pos_emb_width=8,
                    num_attention_heads=4, num_hidden_layers=3, hidden_size=64,
                    intermediate_size=100)
PRESETS = {"tiny": (_TINY_TEXT, _TINY_VISION, 3), "full": (_FULL_TEXT, _FULL_VISION, 7)}

PREPROCESSOR_CONFIG = {
    "auto_map": {"AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor",
                 "AutoProcessor": "processing_kimi_vl.KimiVLProcessor"},
    "image_processor_type": "KimiVLImageProcessor",
    "processor_class": "KimiVLProcessor",
    "patch_size": 14,
    "in_token_limit": 4096,
    "merge_kernel_size": [2, 2],
    "num_pooled_tokens": 1024,
    "pad_input": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

RESIDUAL_DAMPING = 0.5     # branch outputs (o_proj, down_proj, wo, fc1) add O(0.5) per layer
LOGIT_STD = 5.0            # lm_head std * sqrt(hidden): greedy picks are not near-ties
ROUTER_BIAS_STD = 0.3
POS_EMB_STD = 1.0
SMALL_BIAS_STD = 0.02
NORM_HALF_WIDTH = 0.1      # norm weights uniform in 1 +- 0.1
_CHUNK = 1 << 22           # elements generated per step (bounded temporaries; fixed for determinism)
_SQRT3 = math.sqrt(3.0)


def preset_config(preset: str = "tiny", n_group: int | None = None,
                  topk_group: int | None = None) -> dict:
    """The complete config.json for a preset, with optional group-limited routing."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    text, vision, _ = PRESETS[preset]
    text = copy.deepcopy(text)
    if (n_group is None) != (topk_group is None):
        raise UserError("--n-group and --topk-group go together; pass both")
    if n_group is not None:
        text["n_group"], text["topk_group"] = int(n_group), int(topk_group)  # type: ignore[arg-type]
    config = {
        "architectures": ["KimiVLForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_vl.KimiVLConfig",
            "AutoModel": "modeling_kimi_vl.KimiVLForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_vl.KimiVLForConditionalGeneration",
        },
        "model_type": "kimi_vl",
        "media_placeholder_token_id": 163605,
        "ignore_index": -100,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.3",
        "text_config": text,
        "vision_config": copy.deepcopy(vision),
    }
    problems = check_supported(config)
    if problems:
        raise UserError("the requested synthetic config is not runnable: " + "; ".join(problems))
    return config


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> BF16 raw bits (uint16). NaN-free input assumed."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).copy()
    lsb = bits >> 16
    lsb &= 1
    bits += np.uint32(0x7FFF)
    bits += lsb
    bits >>= 16
    return bits.astype(np.uint16)


def _stream_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"kvl-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:16], "little")


def _uniform_fill(out: np.ndarray, seed: int, name: str, center: float, std: float) -> None:
    """Fills a flat float32 or uint16 (BF16 bits) array with uniform values of the given mean/std,
    generated chunk by chunk from the (seed, name) stream."""
    rng = np.random.Generator(np.random.PCG64(_stream_seed(seed, name)))
    half = np.float32(std * _SQRT3)
    n = out.size
    for start in range(0, n, _CHUNK):
        count = min(_CHUNK, n - start)
        bits = rng.bit_generator.random_raw((count + 1) // 2).view(np.uint32)[:count]
        # 23 random mantissa bits under exponent 0 -> a float in [1, 2), then affine to [-h, h).
        bits >>= 9
        bits |= np.uint32(0x3F800000)
        vals = bits.view(np.float32)
        vals -= np.float32(1.5)
        vals *= 2 * half
        if center:
            vals += np.float32(center)
        if out.dtype == np.uint16:
            # In-place round-to-nearest-even to BF16 on the same buffer.
            lsb = bits >> 16
            lsb &= 1
            bits += np.uint32(0x7FFF)
            bits += lsb
            bits >>= 16
            out[start:start + count] = bits
        else:
            out[start:start + count] = vals


class SynthSource:
    """TensorSource over generated weights: nothing is stored, each read regenerates the tensor."""

    def __init__(self, config: dict, seed: int = 0, bias_dtype: str = "bf16"):
        self._config = config
        self.seed = int(seed)
        self.bias_dtype = bias_dtype.upper()
        self._inventory = expected_tensors(config, self.bias_dtype)
        dims = text_dims(config)
        self._hidden = dims.hidden_size

    def config(self) -> dict:
        return self._config

    def asset_files(self) -> dict[str, bytes]:
        assets = {"config.json": _json_bytes(self._config),
                  "preprocessor_config.json": _json_bytes(PREPROCESSOR_CONFIG)}
        assets.update(synth_tokenizer.tokenizer_assets())
        return assets

    def revision(self) -> str | None:
        return None

    def tensor_names(self) -> list[str]:
        return list(self._inventory)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        try:
            return self._inventory[name]
        except KeyError:
            raise UserError(f"tensor {name} is not part of this synthetic model") from None

    def shard_of(self, name: str) -> str | None:
        return None

    def init_stats(self, name: str) -> tuple[float, float]:
        """(mean, std) the generator uses for a tensor."""
        _, shape = self.tensor_info(name)
        if name == LM_HEAD:
            return 0.0, LOGIT_STD / math.sqrt(self._hidden)
        if name.endswith("embed_tokens.weight"):
            return 0.0, 1.0
        if name.endswith(ROUTER_BIAS_SUFFIX):
            return 0.0, ROUTER_BIAS_STD
        if name.endswith("pos_emb.weight"):
            return 0.0, POS_EMB_STD
        if len(shape) == 1:
            if "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                return 1.0, NORM_HALF_WIDTH / _SQRT3
            return 0.0, SMALL_BIAS_STD
        fan_in = math.prod(shape[1:])
        std = 1.0 / math.sqrt(fan_in)
        if name.endswith(("o_proj.weight", "down_proj.weight", ".wo.weight", "fc1.weight")):
            std *= RESIDUAL_DAMPING
        return 0.0, std

    def read(self, name: str) -> np.ndarray:
        dtype, shape = self.tensor_info(name)
        mean, std = self.init_stats(name)
        out = np.empty(math.prod(shape), dtype=NUMPY_DTYPES[dtype])
        _uniform_fill(out, self.seed, name, mean, std)
        return out.reshape(shape)


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def shard_plan(inventory: dict[str, tuple[str, tuple[int, ...]]], n_shards: int
               ) -> list[list[str]]:
    """Splits the inventory (in order) into n_shards contiguous, non-empty, roughly equal-byte
    groups; vision tower and projector always land in the first shard, like the real checkpoint."""
    names = list(inventory)
    if len(names) < n_shards:
        raise ValueError("fewer tensors than shards")
    sizes = [math.prod(s) * NUMPY_DTYPES[d].itemsize for d, s in inventory.values()]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    total = sum(sizes)
    n_vision = sum(1 for n in names if n.startswith(("vision_tower.", "multi_modal_projector.")))
    bounds = [0]
    for k in range(1, n_shards):
        target = total * k / n_shards
        i = next((j for j, s in enumerate(starts) if s >= target), len(names))
        lo = max(bounds[-1] + 1, n_vision if k == 1 else 0)
        i = min(max(i, lo), len(names) - (n_shards - k))
        bounds.append(i)
    bounds.append(len(names))
    return [names[bounds[k]:bounds[k + 1]] for k in range(n_shards)]


def synthesize(out_dir: Path, preset: str = "tiny", seed: int = 0, bias_dtype: str = "bf16",
               n_group: int | None = None, topk_group: int | None = None,
               progress: bool = False) -> Path:
    """Writes a complete random checkpoint directory and returns its path."""
    if bias_dtype.lower() not in ("bf16", "f32"):
        raise UserError(f"--bias-dtype {bias_dtype!r}: choose bf16 or f32")
    config = preset_config(preset, n_group, topk_group)
    source = SynthSource(config, seed, bias_dtype)
    inventory = {n: source.tensor_info(n) for n in source.tensor_names()}
    n_shards = PRESETS[preset][2]
    plan = shard_plan(inventory, n_shards)
    total = sum(math.prod(s) * NUMPY_DTYPES[d].itemsize for d, s in inventory.values())

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A stale index would make a half-rewritten directory look complete.
    (out_dir / INDEX_NAME).unlink(missing_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < total + (64 << 20):
        raise UserError(f"{out_dir} has {free / 2**30:.1f} GiB free but the {preset} checkpoint "
                        f"needs {total / 2**30:.1f} GiB; choose another folder")
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"kvl synth {preset}")
    weight_map: dict[str, str] = {}
    for k, names in enumerate(plan):
        file = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        entries = [(n, *inventory[n]) for n in names]
        with SafetensorsWriter(out_dir / file, entries) as writer:
            for name in names:
                data = source.read(name)
                writer.write(name, data)
                if bar is not None:
                    bar.update(data.nbytes)
                del data
        weight_map.update((n, file) for n in names)
    if bar is not None:
        bar.close()
    # Index last: a directory with an index has all its shards.
    ordered = {n: weight_map[n] for n in inventory}
    for file, data in source.asset_files().items():
        (out_dir / file).write_bytes(data)
    write_index(out_dir, ordered, total)
    return out_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output checkpoint directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny (a few MB, every structural feature) or full (real dims, ~33 GB)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a function of seed and name")
    parser.add_argument("--bias-dtype", choices=("bf16", "f32"), default="bf16",
                        help="on-disk dtype of the router correction bias")
    parser.add_argument("--n-group", type=int, default=None,
                        help="expert groups for group-limited routing (with --topk-group)")
    parser.add_argument("--topk-group", type=int, default=None,
                        help="groups kept per token (with --n-group)")


def run(args: argparse.Namespace) -> int:
    out = synthesize(args.out, preset=args.preset, seed=args.seed, bias_dtype=args.bias_dtype,
                     n_group=args.n_group, topk_group=args.topk_group,
                     progress=args.preset == "full")
    total = json.loads((out / INDEX_NAME).read_text())["metadata"]["total_size"]
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, {total / 2**20:.1f} MiB of tensors) "
          f"to {out}; it has no source revision, so pack it with --allow-revision")
    return 0
