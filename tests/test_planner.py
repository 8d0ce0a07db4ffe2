"""kvl.planner: arithmetic on the full-size model (numbers worked out by hand from the spec's
dimensions), refusal over budget, equality with the bytes the native engine reports on the tiny
pack, and peak RSS of a real `kvl chat` run against the plan."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvl.errors import UserError
from kvl.planner import (
    MIB,
    SESSION_STRUCT_RESERVE,
    _trunk_layout,
    plan,
    session_layout_bytes,
    trunk_cache_split,
)

REPO = Path(__file__).resolve().parents[1]

# Kimi-VL-A3B-Instruct text hparams as the pack stores them (spec §2.2), written out literally.
FULL_HP = {
    "text.vocab_size": 163840, "text.hidden_size": 2048, "text.intermediate_size": 11264,
    "text.moe_intermediate_size": 1408, "text.num_hidden_layers": 27,
    "text.num_attention_heads": 16, "text.n_routed_experts": 64, "text.n_shared_experts": 2,
    "text.num_experts_per_tok": 6, "text.first_k_dense_replace": 1, "text.moe_layer_freq": 1,
    "text.kv_lora_rank": 512, "text.q_lora_rank": 0, "text.qk_nope_head_dim": 128,
    "text.qk_rope_head_dim": 64, "text.v_head_dim": 128, "text.n_group": 1, "text.topk_group": 1,
    "text.max_position_embeddings": 131072,
}


def _full_trunk() -> dict:
    """Trunk records of the full model: name -> record with nbytes (BF16 = 2 bytes)."""
    rec = lambda *shape: SimpleNamespace(nbytes=2 * _prod(shape))  # noqa: E731
    trunk = {"language_model.lm_head.weight": rec(163840, 2048),
             "language_model.model.embed_tokens.weight": rec(163840, 2048),
             "language_model.model.norm.weight": rec(2048)}
    for layer in range(27):
        p = f"language_model.model.layers.{layer}."
        trunk[p + "input_layernorm.weight"] = rec(2048)
        trunk[p + "post_attention_layernorm.weight"] = rec(2048)
        trunk[p + "self_attn.kv_a_layernorm.weight"] = rec(512)
        trunk[p + "self_attn.q_proj.weight"] = rec(16 * 192, 2048)
        trunk[p + "self_attn.kv_a_proj_with_mqa.weight"] = rec(576, 2048)
        trunk[p + "self_attn.kv_b_proj.weight"] = rec(16 * 256, 512)
        trunk[p + "self_attn.o_proj.weight"] = rec(2048, 16 * 128)
        if layer == 0:
            for name, shape in (("gate_proj", (11264, 2048)), ("up_proj", (11264, 2048)),
                                ("down_proj", (2048, 11264))):
                trunk[p + f"mlp.{name}.weight"] = rec(*shape)
        else:
            trunk[p + "mlp.gate.weight"] = rec(64, 2048)
            trunk[p + "mlp.gate.e_score_correction_bias"] = SimpleNamespace(nbytes=64 * 4)
            for name, shape in (("gate_proj", (2816, 2048)), ("up_proj", (2816, 2048)),
                                ("down_proj", (2048, 2816))):
                trunk[p + f"mlp.shared_experts.{name}.weight"] = rec(*shape)
    return trunk


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_full_size_globals_and_trunk() -> None:
    globals_bytes, order = _trunk_layout(_full_trunk(), FULL_HP)
    # lm_head 163840*2048*2 = 671,088,640 (page multiple); final norm as FP32 8,192;
    # per layer two 2048-float norms + a 512-float norm = 18,432 (x27 = 497,664);
    # per MoE layer router 64*2048*2 = 262,144 + FP32 bias 256 (x26 = 6,822,400).
    assert globals_bytes == 671_088_640 + 8_192 + 497_664 + 6_822_400
    # attention per layer: q 3072*2048*2 = 12,582,912, kv_a 576*2048*2 = 2,359,296,
    # kv_b 4096*512*2 = 4,194,304, o 2048*2048*2 = 8,388,608; dense MLP 3 x 11264*2048*2 =
    # 3 x 46,137,344; shared experts 3 x 2816*2048*2 = 3 x 11,534,336 (all page multiples)
    attention = 12_582_912 + 2_359_296 + 4_194_304 + 8_388_608
    assert len(order) == 27 * 7
    assert sum(order) == 27 * attention + 3 * 46_137_344 + 26 * 3 * 11_534_336
    # a budget that holds exactly layer 0's attention keeps that prefix and streams the rest,
    # double-buffering the largest streamed tensor (a dense MLP matrix)
    resident, workspace = trunk_cache_split(order, attention + 4095)
    assert resident == attention
    assert workspace == 2 * 46_137_344
    assert trunk_cache_split(order, sum(order)) == (sum(order), 0)


def test_full_size_kv_and_session() -> None:
    one = session_layout_bytes(FULL_HP, 2048, 256, "f32", 1)
    two = session_layout_bytes(FULL_HP, 4096, 256, "f32", 1)
    # KV grows 27 layers x (512 + 64) x 4 bytes = 62,208 bytes per token (f32), the
    # per-thread attention scores 16 heads x 4 bytes = 64 bytes per token, and the transposed
    # latents of prefill attention 512 x 4 bytes = 2,048 bytes per token
    assert two - one == 2048 * (62_208 + 64 + 2_048)
    bf16 = session_layout_bytes(FULL_HP, 4096, 256, "bf16", 1)
    assert two - bf16 == 4096 * 31_104
    # at 4096 tokens the f32 KV alone is 254,803,968 bytes; the arena adds prefill buffers
    assert two > 254_803_968
    threads = session_layout_bytes(FULL_HP, 4096, 256, "f32", 3) - two
    # per-thread scratch: align16(16*4096 + 2*576 + 64 + 512*16 + 512*128/2) = 107,712 floats
    assert threads == 2 * 107_712 * 4


def test_plan_refuses_over_budget(tiny_pack: Path) -> None:
    loose = plan(tiny_pack, ram_mib=100_000, cache_mib=1, trunk_cache_mib=0, max_context=512,
                 check=False)
    budget_mib = loose.total // MIB - 10
    with pytest.raises(UserError) as info:
        plan(tiny_pack, ram_mib=budget_mib, cache_mib=1, trunk_cache_mib=0, max_context=512)
    message = str(info.value)
    over = (loose.total - budget_mib * MIB) / MIB
    assert f"{over:,.1f} MiB over --ram-mib {budget_mib:,.1f}" in message
    assert f"raise --ram-mib to {-(-loose.total // MIB)}" in message
    assert "KV cache" in message  # the table says where the bytes go


def test_plan_refuses_expert_cache_below_one_layer(tiny_pack: Path) -> None:
    with pytest.raises(UserError, match="raise --cache-mib"):
        plan(tiny_pack, ram_mib=4096, cache_mib=0)


def test_plan_rejects_context_beyond_model(tiny_pack: Path) -> None:
    limit = json.loads((tiny_pack / "config.json").read_text())["text_config"][
        "max_position_embeddings"]
    with pytest.raises(UserError, match="max-context"):
        plan(tiny_pack, max_context=limit + 1)


def _hparams_and_order(pack: Path) -> tuple[dict, list[int]]:
    from kvl.packfmt import PackReader

    reader = PackReader(pack)
    return reader.hparams, _trunk_layout(reader.stores["trunk"].by_name, reader.hparams)[1]


@pytest.mark.parametrize("trunk", ["auto", "stream", "part"])
def test_plan_equals_engine_bytes(tiny_pack: Path, trunk: str) -> None:
    from kvl.native import NativeEngine

    hp, order = _hparams_and_order(tiny_pack)
    ram_plan = plan(tiny_pack, ram_mib=4096, cache_mib=1,
                    trunk_cache_mib=0 if trunk == "stream" else None, max_context=256, threads=2)
    if trunk == "part":
        # a byte budget between tensor boundaries: the engine keeps the forward-order prefix
        budget = sum(order[:len(order) // 2]) + 4095
        resident, workspace = trunk_cache_split(order, budget)
        assert 0 < resident < sum(order) and workspace > 0
    else:
        budget = ram_plan.trunk_cache if ram_plan.trunk_cache > 0 else -1
        resident, workspace = ram_plan.trunk_cache, ram_plan.engine_workspace
    if trunk == "auto":
        assert resident == sum(order) and workspace == 0  # the tiny trunk fits entirely
    if trunk == "stream":
        assert resident == 0 and workspace == 2 * max(order)
    engine = NativeEngine(tiny_pack, n_threads=2, expert_cache_bytes=ram_plan.expert_cache,
                          trunk_cache_bytes=budget, kv_dtype="f32", load_vision=False)
    try:
        info = engine.info()
        assert info["global_bytes"] == ram_plan.globals
        assert info["expert_cache_bytes"] == ram_plan.expert_cache
        assert info["expert_extent_bytes"] == ram_plan.expert_extent
        assert info["trunk_cache_bytes"] == resident
        assert info["engine_workspace_bytes"] == workspace
        # session bytes = the arena layout exactly + the session struct (less than a page)
        for ctx, batch in ((256, 256), (100, 32), (64, 8), (16, 64)):
            extra = engine.session_bytes(ctx, batch) - session_layout_bytes(hp, ctx, batch,
                                                                            "f32", 2)
            assert 0 < extra <= SESSION_STRUCT_RESERVE
        assert engine.session_bytes(256, 256) - engine.session_bytes(128, 256) == \
            session_layout_bytes(hp, 256, 256, "f32", 2) - session_layout_bytes(hp, 128, 256,
                                                                                "f32", 2)
    finally:
        engine.close()


def test_engine_reconciles_plan(tiny_pack: Path) -> None:
    from kvl.engine import Engine

    with Engine(tiny_pack, ram_mib=1024, cache_mib=1, max_context=256, threads=2) as engine:
        differing = {d.split(":")[0] for d in engine.plan_differences}
        # only the session struct size and the vision estimate are not known before opening
        assert differing <= {"session_arena", "vision"}
        assert {"globals", "expert_cache", "trunk_cache", "engine_workspace",
                "session_arena", "vision"} <= engine.plan.exact
        assert engine.plan.total <= 1024 * MIB
        assert "engine-reported" in engine.plan.describe()

