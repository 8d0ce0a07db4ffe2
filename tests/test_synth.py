"""kvl synth, kvl/modelspec.py and the synthetic tokenizer assets.

Expected values come from the model description (real dims, counts, special ids, prompt strings)
written here as literals, never from the code under test."""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from pathlib import Path

import jinja2
import numpy as np
import pytest
import tiktoken
import torch
from safetensors import safe_open

from kvl import modelspec
from kvl.cli import main as kvl_main
from kvl.errors import UserError
from kvl.safetensors_io import SafetensorsCheckpoint
from kvl.synth import SynthSource, preset_config, shard_plan, synthesize
from kvl.synth_tokenizer import PAT_STR

REPO = Path(__file__).resolve().parents[1]

# The real Kimi-VL-A3B-Instruct dims (model description §2), independent of kvl/synth.py.
REAL_TEXT = dict(
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
    n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    ep_size=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.446,
    n_group=1, topk_group=1, norm_topk_prob=True, aux_loss_alpha=0.001, seq_aux=True,
    max_position_embeddings=131072, rope_theta=800000.0, rope_scaling=None, rms_norm_eps=1e-5,
    hidden_act="silu", attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
    bos_token_id=163584, eos_token_id=163585, pad_token_id=163839, model_type="deepseek_v3",
)
REAL_VISION = dict(
    model_type="moonvit", patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64,
    num_attention_heads=16, num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
    merge_kernel_size=[2, 2],
)
REAL_CONFIG = {"model_type": "kimi_vl", "media_placeholder_token_id": 163605,
               "architectures": ["KimiVLForConditionalGeneration"],
               "text_config": REAL_TEXT, "vision_config": REAL_VISION}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- modelspec, full dims

def test_full_inventory_counts_and_params() -> None:
    inv = modelspec.expected_tensors(REAL_CONFIG)
    assert len(inv) == 5652
    params = sum(int(np.prod(shape)) for _, shape in inv.values())
    assert params == 16_407_656_048
    assert sum(int(np.prod(s)) * 2 for _, s in inv.values()) == 32_815_312_096
    inv32 = modelspec.expected_tensors(REAL_CONFIG, bias_dtype="f32")
    nbytes = sum(int(np.prod(s)) * (4 if d == "F32" else 2) for d, s in inv32.values())
    assert nbytes == 32_815_312_096 + 3_328
    # Spot checks against the published shapes.
    L = "language_model.model.layers."
    assert inv[L + "0.mlp.gate_proj.weight"] == ("BF16", (11264, 2048))
    assert inv[L + "1.self_attn.q_proj.weight"] == ("BF16", (3072, 2048))
    assert inv[L + "1.self_attn.kv_a_proj_with_mqa.weight"] == ("BF16", (576, 2048))
    assert inv[L + "1.self_attn.kv_b_proj.weight"] == ("BF16", (4096, 512))
    assert inv[L + "26.mlp.experts.63.down_proj.weight"] == ("BF16", (2048, 1408))
    assert inv[L + "26.mlp.shared_experts.up_proj.weight"] == ("BF16", (2816, 2048))
    assert inv[L + "5.mlp.gate.e_score_correction_bias"] == ("BF16", (64,))
    assert L + "0.mlp.gate.weight" not in inv and L + "27.input_layernorm.weight" not in inv
    assert inv["vision_tower.patch_embed.pos_emb.weight"] == ("BF16", (64, 64, 1152))
    assert inv["vision_tower.encoder.blocks.26.wqkv.weight"] == ("BF16", (3456, 1152))
    assert inv["multi_modal_projector.linear_1.weight"] == ("BF16", (4608, 4608))
    assert inv["multi_modal_projector.linear_2.weight"] == ("BF16", (2048, 4608))
    assert sum(1 for n in inv if n.startswith("vision_tower.")) == 329
    assert sum(1 for n in inv if n.startswith("multi_modal_projector.")) == 6


def test_full_preset_is_the_real_config() -> None:
    cfg = preset_config("full")
    for key, value in REAL_TEXT.items():
        assert cfg["text_config"][key] == value, key
    for key, value in REAL_VISION.items():
        assert cfg["vision_config"][key] == value, key
    assert cfg["media_placeholder_token_id"] == 163605
    assert cfg["model_type"] == "kimi_vl"
    assert modelspec.check_supported(cfg) == []


def test_full_shard_plan_like_the_real_checkpoint() -> None:
    inv = modelspec.expected_tensors(REAL_CONFIG)
    plan = shard_plan(inv, 7)
    assert len(plan) == 7 and all(plan)
    assert sum(len(p) for p in plan) == 5652
    sizes = [sum(int(np.prod(inv[n][1])) * 2 for n in p) for p in plan]
    assert all(3.5e9 < s < 5.5e9 for s in sizes[:-1]), sizes
    assert all(n in plan[0] for n in inv if n.startswith(VISION_PREFIXES))


def test_full_source_reads_one_tensor_lazily() -> None:
    src = SynthSource(preset_config("full"), seed=0)
    name = "language_model.model.layers.26.mlp.experts.63.down_proj.weight"
    assert len(src.tensor_names()) == 5652
    assert src.tensor_info(name) == ("BF16", (2048, 1408))
    data = src.read(name)
    assert data.shape == (2048, 1408) and data.dtype == np.uint16
    values = bf16_to_f32(data)
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 1e-3
    assert 0.1 / np.sqrt(1408) < values.std() < 2.0 / np.sqrt(1408)


def test_hparams_keys_match_format_doc() -> None:
    text = (REPO / "docs" / "FORMAT.md").read_text()
    section = text.split("## hparam keys", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`((?:text|vision)\.[a-z_]+|media_placeholder_token_id)`", section))
    hp = modelspec.hparams(REAL_CONFIG)
    assert set(hp) == documented
    assert hp["text.q_lora_rank"] == 0.0
    assert hp["text.kv_a_layernorm_eps"] == 1e-6
    assert hp["text.norm_topk_prob"] == 1.0
    assert hp["text.routed_scaling_factor"] == 2.446
    assert hp["vision.merge_kernel_h"] == 2.0 and hp["vision.merge_kernel_w"] == 2.0
    assert hp["vision.rope_theta"] == 10000.0 and hp["vision.layer_norm_eps"] == 1e-5
    assert hp["media_placeholder_token_id"] == 163605.0


@pytest.mark.parametrize("path,value,expect", [
    (("text_config", "q_lora_rank"), 1536, "q_lora_rank"),
    (("text_config", "rope_scaling"), {"type": "yarn", "factor": 4.0}, "rope_scaling"),
    (("text_config", "scoring_func"), "softmax", "scoring_func"),
    (("text_config", "topk_method"), "greedy", "topk_method"),
    (("text_config", "qk_rope_head_dim"), 63, "odd"),
    (("text_config", "n_group"), 5, "not divisible by n_group"),
    (("text_config", "topk_group"), 2, "exceeds n_group"),
    (("vision_config", "num_attention_heads"), 64, "not divisible by 4"),
])
def test_check_supported_flags(path: tuple[str, str], value: object, expect: str) -> None:
    cfg = copy.deepcopy(REAL_CONFIG)
    cfg[path[0]][path[1]] = value
    problems = modelspec.check_supported(cfg)
    assert any(expect in p for p in problems), problems


def test_config_errors_are_user_errors() -> None:
    cfg = copy.deepcopy(REAL_CONFIG)
    del cfg["text_config"]["kv_lora_rank"]
    with pytest.raises(UserError, match="text_config.kv_lora_rank is missing"):
        modelspec.expected_tensors(cfg)
    cfg = copy.deepcopy(REAL_CONFIG)
    cfg["vision_config"]["hidden_size"] = "big"
    with pytest.raises(UserError, match="vision_config.hidden_size"):
        modelspec.expected_tensors(cfg)
    with pytest.raises(UserError, match="no 'text_config'"):
        modelspec.expected_tensors({"vision_config": {}})


class _DictSource:
    def __init__(self, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]):
        self._config, self._tensors = config, tensors

    def config(self) -> dict:
        return self._config

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self._tensors[name]


def test_check_source_reports_every_problem() -> None:
    inv = dict(modelspec.expected_tensors(REAL_CONFIG))
    L = "language_model.model.layers."
    assert modelspec.check_source(_DictSource(REAL_CONFIG, inv)) == []
    inv[L + "3.mlp.gate.e_score_correction_bias"] = ("F32", (64,))  # allowed either way
    assert modelspec.check_source(_DictSource(REAL_CONFIG, inv)) == []
    del inv[L + "7.mlp.experts.12.up_proj.weight"]
    inv[L + "2.self_attn.o_proj.weight"] = ("BF16", (2048, 1024))
    inv[L + "4.mlp.gate.weight"] = ("F16", (64, 2048))
    inv[L + "4.self_attn.rotary_emb.inv_freq"] = ("F32", (32,))
    problems = modelspec.check_source(_DictSource(REAL_CONFIG, inv))
    text = "\n".join(problems)
    assert L + "7.mlp.experts.12.up_proj.weight" in text and "missing" in text
    assert "expected [2048, 2048] found [2048, 1024]" in text
    assert L + "4.mlp.gate.weight: wrong dtype: expected BF16 found F16" in text
    assert "unexpected tensor " + L + "4.self_attn.rotary_emb.inv_freq" in text


# ---------------------------------------------------------------- tiny checkpoint on disk

def test_tiny_layout(tiny_ckpt: Path) -> None:
    files = {p.name for p in tiny_ckpt.iterdir()}
    shards = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    for name in shards + ["model.safetensors.index.json", "config.json", "generation_config.json",
                          "preprocessor_config.json", "tokenizer_config.json", "tiktoken.model",
                          "chat_template.jinja"]:
        assert name in files, name
    assert not any(f.endswith(".partial") for f in files)
    assert not {"SOURCE_REVISION.txt", ".kvl_revision"} & files  # synthetic: no revision
    total_mb = sum(p.stat().st_size for p in tiny_ckpt.iterdir()) / 2**20
    assert total_mb < 60

    config = json.loads((tiny_ckpt / "config.json").read_text())
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    expected = modelspec.expected_tensors(config)
    assert set(index["weight_map"]) == set(expected)
    assert set(index["weight_map"].values()) == set(shards)
    for name, shard in index["weight_map"].items():
        if name.startswith(VISION_PREFIXES):
            assert shard == shards[0], name

    # Independent reader: the reference safetensors package.
    data_bytes = 0
    seen = {}
    for shard in shards:
        with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                t = f.get_slice(key)
                seen[key] = (t.get_dtype(), tuple(t.get_shape()))
                data_bytes += int(np.prod(t.get_shape())) * (4 if t.get_dtype() == "F32" else 2)
                assert index["weight_map"][key] == shard
    assert seen == {n: (d, s) for n, (d, s) in expected.items()}
    assert index["metadata"]["total_size"] == data_bytes

    with SafetensorsCheckpoint(tiny_ckpt) as ckpt:
        assert modelspec.check_source(ckpt) == []
        assert ckpt.revision() is None


def test_tiny_config_has_every_structural_feature(tiny_ckpt: Path, tiny_ckpt_grouped: Path) -> None:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    for key in ("architectures", "auto_map", "model_type", "media_placeholder_token_id",
                "ignore_index", "pad_token_id", "torch_dtype", "transformers_version"):
        assert key in config, key
    for key in REAL_TEXT:
        assert key in config["text_config"], key
    for key in REAL_VISION:
        assert key in config["vision_config"], key
    t, v = config["text_config"], config["vision_config"]
    assert t["vocab_size"] == 163840
    assert t["first_k_dense_replace"] == 1 and t["num_hidden_layers"] >= 3
    assert t["n_shared_experts"] >= 1 and t["num_experts_per_tok"] >= 2
    assert t["n_routed_experts"] > t["num_experts_per_tok"]
    assert t["q_lora_rank"] is None and t["rope_scaling"] is None
    assert v["init_pos_emb_height"] < 64 and v["hidden_size"] % v["num_attention_heads"] == 0
    assert (v["hidden_size"] // v["num_attention_heads"]) % 4 == 0
    assert modelspec.check_supported(config) == []
    grouped = json.loads((tiny_ckpt_grouped / "config.json").read_text())["text_config"]
    assert (grouped["n_group"], grouped["topk_group"]) == (4, 2)
    with SafetensorsCheckpoint(tiny_ckpt_grouped) as ckpt:
        bias = [n for n in ckpt.tensor_names() if n.endswith("e_score_correction_bias")]
        assert bias and all(ckpt.tensor_info(n)[0] == "F32" for n in bias)
        assert modelspec.check_source(ckpt) == []


def test_tiny_weight_statistics(tiny_ckpt: Path) -> None:
    with SafetensorsCheckpoint(tiny_ckpt) as ckpt:
        L = "language_model.model.layers."
        bias = bf16_to_f32(ckpt.read(L + "1.mlp.gate.e_score_correction_bias"))
        assert np.count_nonzero(bias) == bias.size
        assert 0.1 < bias.std() < 0.6  # ~N(0, 0.3)-like spread, non-zero
        norm = bf16_to_f32(ckpt.read(L + "2.input_layernorm.weight"))
        assert norm.min() > 0.85 and norm.max() < 1.15 and norm.std() > 0.01
        for name in ckpt.tensor_names():
            assert np.isfinite(bf16_to_f32(ckpt.read(name)) if ckpt.tensor_info(name)[0] == "BF16"
                               else ckpt.read(name)).all(), name


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_deterministic_and_seed_dependent(tiny_ckpt: Path, tmp_path: Path) -> None:
    again = synthesize(tmp_path / "again", preset="tiny", seed=0)
    assert _digest(again) == _digest(tiny_ckpt)
    other = synthesize(tmp_path / "other", preset="tiny", seed=7)
    a, b = _digest(tiny_ckpt), _digest(other)
    assert a["config.json"] == b["config.json"]
    assert all(a[f] != b[f] for f in a if f.endswith(".safetensors"))


def test_source_read_equals_shards_in_any_order(tiny_ckpt: Path) -> None:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    with SafetensorsCheckpoint(tiny_ckpt) as ckpt:
        names = ckpt.tensor_names()
        src = SynthSource(config, seed=0, bias_dtype="bf16")
        assert src.tensor_names() == names
        for name in reversed(names):  # reverse of the writing order
            assert np.array_equal(src.read(name), ckpt.read(name)), name
        assert src.shard_of(names[0]) is None and src.revision() is None
    # An independent reader agrees on one BF16 tensor.
    name = "language_model.model.layers.1.mlp.experts.5.gate_proj.weight"
    shard = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
        ref = f.get_tensor(name).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(SynthSource(config, seed=0).read(name), ref)


def test_source_assets_match_written_files(tiny_ckpt: Path) -> None:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    assets = SynthSource(config, 0).asset_files()
    assert set(assets) == {"config.json", "generation_config.json", "tokenizer_config.json",
                           "tiktoken.model", "chat_template.jinja", "preprocessor_config.json"}
    for name, data in assets.items():
        assert (tiny_ckpt / name).read_bytes() == data, name


def test_preprocessor_and_generation_config(tiny_ckpt: Path) -> None:
    pre = json.loads((tiny_ckpt / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 14 and pre["in_token_limit"] == 4096
    assert pre["merge_kernel_size"] == [2, 2] and pre["pad_input"] is True
    assert pre["image_mean"] == [0.5] * 3 and pre["image_std"] == [0.5] * 3
    assert pre["image_processor_type"] == "KimiVLImageProcessor"
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["temperature"] == 0.2 and gen["do_sample"] is True
    assert gen["bos_token_id"] == 163584 and gen["pad_token_id"] == 163839
    assert 163586 in gen["eos_token_id"] and 163585 in gen["eos_token_id"]


def test_cli_synth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert kvl_main(["synth", str(out), "--preset", "tiny", "--seed", "3", "--bias-dtype", "f32",
                     "--n-group", "2", "--topk-group", "1"]) == 0
    assert "--allow-revision" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    assert (cfg["n_group"], cfg["topk_group"]) == (2, 1)
    assert kvl_main(["synth", str(tmp_path / "bad"), "--n-group", "3", "--topk-group", "1"]) == 1
    err = capsys.readouterr().err
    assert "not divisible by n_group = 3" in err
    assert not (tmp_path / "bad" / "model.safetensors.index.json").exists()


# ---------------------------------------------------------------- tokenizer assets

def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split(b" ")
        raw = base64.b64decode(token)
        assert raw not in ranks, f"duplicate token bytes {raw!r}"
        ranks[raw] = int(rank)
    return ranks


def _encoding(directory: Path) -> tiktoken.Encoding:
    ranks = _load_ranks(directory / "tiktoken.model")
    tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    return tiktoken.Encoding("kvl-synth", pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)


def test_tiktoken_model_structure(tiny_ckpt: Path) -> None:
    ranks = _load_ranks(tiny_ckpt / "tiktoken.model")
    assert len(ranks) == 163_584
    assert sorted(ranks.values()) == list(range(163_584))
    by_rank = {r: t for t, r in ranks.items()}
    assert by_rank[0] == b"!" and by_rank[93] == b"~"  # GPT-2 byte order
    assert {by_rank[r] for r in range(256)} == {bytes([b]) for b in range(256)}
    assert by_rank[188] == b"\x00"  # first non-printable byte follows the 188 printable ones


def test_tokenizer_roundtrip_and_specials(tiny_ckpt: Path) -> None:
    enc = _encoding(tiny_ckpt)
    for text in ["Xin chào! Hôm nay trời đẹp quá, Việt Nam.", "你好！今天天气很好。中国的首都是北京。",
                 "The quick brown fox jumps over the lazy dog.", "def main(x):\n    return x + 1\n",
                 "emoji 🙂 and tabs\t\tand  spaces"]:
        ids = enc.encode(text)
        assert enc.decode(ids) == text
        assert max(ids) < 163_584
        if text.isascii() or "chào" in text or "你好" in text:
            assert len(ids) < len(text.encode("utf-8")) * 0.6, text  # real multi-byte merges
    assert enc.encode("<|im_end|>", allowed_special="all") == [163586]
    assert enc.encode("<|media_pad|>", allowed_special="all") == [163605]


def test_tokenizer_config_specials(tiny_ckpt: Path) -> None:
    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    dec = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    assert sorted(dec) == list(range(163584, 163840))
    expected = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
                163588: "<|im_assistant|>", 163590: "<|start_header_id|>",
                163591: "<|end_header_id|>", 163593: "[EOT]", 163594: "<|im_system|>",
                163601: "<|im_middle|>", 163602: "<|media_start|>", 163603: "<|media_content|>",
                163604: "<|media_end|>", 163605: "<|media_pad|>", 163838: "[UNK]", 163839: "[PAD]"}
    for token_id, name in expected.items():
        assert dec[token_id] == name
    assert dec[163589] == "<|reserved_token_163589|>"
    assert len(set(dec.values())) == 256
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == \
        ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert cfg["tokenizer_class"] == "TikTokenTokenizer" and cfg["model_max_length"] > 0


def _render(directory: Path, messages: list[dict], add_generation_prompt: bool) -> str:
    template = (directory / "chat_template.jinja").read_text()
    return jinja2.Environment().from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def test_chat_template_renders_official_strings(tiny_ckpt: Path) -> None:
    sys_default = "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    got = _render(tiny_ckpt, [{"role": "user", "content": "Hi there"}], True)
    assert got == (sys_default + "<|im_user|>user<|im_middle|>Hi there<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                         {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A cat."},
            {"role": "tool", "content": "42"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image", "image": "b.png"}]}]
    got = _render(tiny_ckpt, msgs, False)
    media = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"
    assert got == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                   "<|im_user|>user<|im_middle|>" + media + "What is this?<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>A cat.<|im_end|>"
                   "tool<|im_middle|>42<|im_end|>"
                   "<|im_user|>user<|im_middle|>" + media + "and" + media + "<|im_end|>")
    assert "\n" not in got


def test_bf16_rounding_matches_torch() -> None:
    from kvl.synth import f32_to_bf16_bits
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 100,
                             np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, 65504.0, 1e-40],
                                      dtype=np.float32)])
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(f32_to_bf16_bits(values), ref)
