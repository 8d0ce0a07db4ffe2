"""The native text engine (kvl_core.h engine/session API through kvl/native.py) against the
independent PyTorch reference (tests/reference), plus its invariances and error handling.

The library comes from $KVL_LIB (or the package folder / build/wasm-core), see kvl/native.py.
"""
from __future__ import annotations

import shutil
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kvl.native import (
    KVL_ERR_CANCELLED,
    KVL_ERR_CONTEXT_FULL,
    KVL_ERR_INVALID_ARG,
    KvlError,
    NativeEngine,
    Sampler,
)
from tests.reference.text import TextReference

PROMPT = [5, 17, 300, 4242, 9, 77, 1000, 163000, 12, 88, 6021, 3, 31337, 250, 7, 99, 1234]


# The engine's two activation modes (kvl_core.h KVL_ACT_*): "f32" (default) = exact Linear inputs,
# held to 1e-3 against the FP32 reference; "bf16" (opt-in) = Linear inputs rounded to BF16, run
# against the reference that rounds the same inputs.
ACTS = ["f32", "bf16"]
_refs: dict[tuple[str, str], TextReference] = {}


@pytest.fixture(scope="module")
def ref_tiny(tiny_ckpt: Path) -> TextReference:
    return TextReference(tiny_ckpt, q8_experts=True)


@pytest.fixture(scope="module")
def engine(tiny_pack: Path):
    eng = NativeEngine(tiny_pack, n_threads=2)
    assert eng.info()["act_dtype"] == "f32"  # the default
    yield eng
    eng.close()


def _cases(request: pytest.FixtureRequest, which: str, act: str) -> tuple[Path, TextReference]:
    ckpt = request.getfixturevalue("tiny_ckpt" if which == "tiny" else "tiny_ckpt_grouped")
    pack = request.getfixturevalue("tiny_pack" if which == "tiny" else "tiny_pack_grouped")
    if (which, act) not in _refs:
        _refs[(which, act)] = TextReference(ckpt, q8_experts=True, linear_inputs=act)
    return pack, _refs[(which, act)]


def _greedy(eng: NativeEngine, prompt: list[int], n: int, max_batch: int = 8) -> list[int]:
    with eng.new_session(max_context=256, max_batch=max_batch) as s:
        logits = s.prefill(prompt)
        out = []
        for _ in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            logits = s.step(tok)
        return out


# ---- agreement with the reference ------------------------------------------------------------------

def _prefill_all(pack: Path, act: str, ids: list[int], max_batch: int) -> np.ndarray:
    with NativeEngine(pack, n_threads=2, act_dtype=act) as eng, \
            eng.new_session(max_context=512, max_batch=max_batch) as s:
        assert eng.info()["act_dtype"] == act
        if len(ids) <= 130:
            return s.prefill(ids, logits="all")
        first = s.prefill(ids[:130], logits="all")  # chunks of 64, 64, 2
        return np.concatenate([first, s.prefill(ids[130:], logits="all")])  # over the cache


def _long_prompt(n: int = 300) -> list[int]:
    return [int(x) for x in np.random.default_rng(7).integers(0, 163840, n)]


@pytest.mark.parametrize("which", ["tiny", "grouped"])
def test_prefill_logits_match_reference(request: pytest.FixtureRequest, which: str) -> None:
    pack, ref = _cases(request, which, "f32")
    want = ref.logits(PROMPT).numpy()
    got = _prefill_all(pack, "f32", PROMPT, max_batch=5)  # chunks of 5: chunking is exercised
    diff = float(np.abs(got - want).max())
    print(f"[{which}] prefill logits max |native - reference| = {diff:.3e}")
    assert got.shape == want.shape
    assert diff <= 1e-3


def test_long_prompt_across_chunks_matches_reference(tiny_pack: Path, ref_tiny: TextReference) -> None:
    ids = _long_prompt()
    diff = float(np.abs(_prefill_all(tiny_pack, "f32", ids, 64) - ref_tiny.logits(ids).numpy()).max())
    print(f"300-token prompt max |native - reference| = {diff:.3e}")
    assert diff <= 1e-3


@pytest.mark.parametrize("ids", [PROMPT, _long_prompt()], ids=["17 tokens", "300 tokens"])
@pytest.mark.parametrize("which", ["tiny", "grouped"])
def test_bf16_linear_inputs_against_reference(request: pytest.FixtureRequest, which: str,
                                              ids: list[int]) -> None:
    """Opt-in BF16 mode. Its kernels equal their references within FP32 summation bounds
    (test_kernels.c); end to end, an activation lying within FP32 noise of a BF16 rounding
    midpoint can round the other way than in the reference, a 1-ulp BF16 change that the 64-wide
    toy model turns into ~0.1 on a logit. So the bound here is the size of BF16 rounding itself:
    the engine must be no farther from the BF16 reference than that reference is from FP32."""
    pack, ref16 = _cases(request, which, "bf16")
    _, ref32 = _cases(request, which, "f32")
    want16, want32 = ref16.logits(ids).numpy(), ref32.logits(ids).numpy()
    got = _prefill_all(pack, "bf16", ids, 64)
    diff = float(np.abs(got - want16).max())
    rounding = float(np.abs(want16 - want32).max())
    print(f"[{which}, {len(ids)} tokens] bf16 mode: max |native - bf16 reference| = {diff:.3e}; "
          f"BF16 rounding moves the reference by {rounding:.3e}")
    assert rounding > 0 and diff <= rounding


@pytest.mark.parametrize("act", ACTS)  # in both modes, against the matching reference
@pytest.mark.parametrize("which", ["tiny", "grouped"])
def test_greedy_32_tokens_match_reference(request: pytest.FixtureRequest, which: str, act: str) -> None:
    pack, ref = _cases(request, which, act)
    want = ref.greedy(PROMPT[:6], 32)
    with NativeEngine(pack, n_threads=2, act_dtype=act) as eng:
        got = _greedy(eng, PROMPT[:6], 32)
    assert got == want


def test_media_rows_replace_placeholder_embeddings(engine: NativeEngine, ref_tiny: TextReference) -> None:
    media_id = engine.info()["media_placeholder_token_id"]
    ids = [5, 6, media_id, media_id, 7, media_id, 8]
    rows = np.random.default_rng(3).normal(size=(3, engine.hidden_size)).astype(np.float32)
    want = ref_tiny.logits(ids, torch.from_numpy(rows)).numpy()
    with engine.new_session(max_context=32, max_batch=4) as s:
        got = s.prefill(ids, media_embeds=rows, logits="all")
    assert float(np.abs(got - want).max()) <= 1e-3
    with engine.new_session(max_context=32) as s:
        with pytest.raises(KvlError) as exc:
            s.prefill(ids, media_embeds=rows[:2])
        assert exc.value.status == KVL_ERR_INVALID_ARG and "media" in str(exc.value)
        assert s.position == 0


# ---- session semantics ---------------------------------------------------------------------------------

def test_incremental_decode_equals_full_prefill(engine: NativeEngine) -> None:
    with engine.new_session(max_context=64) as s:
        full = s.prefill(PROMPT, logits="all")
    with engine.new_session(max_context=64) as s:
        rows = [s.prefill(PROMPT[:1])]
        rows += [s.step(t) for t in PROMPT[1:]]
        assert s.position == len(PROMPT)
    diff = float(np.abs(np.stack(rows) - full).max())
    print(f"incremental vs full prefill max diff = {diff:.3e}")
    assert diff <= 1e-4


def test_truncate_then_prefill_equals_fresh(engine: NativeEngine) -> None:
    a, b, c = PROMPT[:7], PROMPT[7:12], [11, 22, 33, 44]
    with engine.new_session(max_context=64, max_batch=4) as s:
        s.prefill(a + b, logits="none")
        s.truncate(len(a))
        assert s.position == len(a)
        got = s.prefill(c, logits="all")
    with engine.new_session(max_context=64, max_batch=4) as s:
        fresh = s.prefill(a + c, logits="all")[len(a):]
    assert float(np.abs(got - fresh).max()) <= 1e-4


def test_multi_turn_equals_fresh_prefill(engine: NativeEngine) -> None:
    a, b = PROMPT[:9], [400, 401, 402, 403, 404]
    with engine.new_session(max_context=64, max_batch=4) as s:
        logits = s.prefill(a)
        generated = []
        for _ in range(5):
            tok = int(np.argmax(logits))
            generated.append(tok)
            logits = s.step(tok)
        got = s.prefill(b, logits="all")
    with engine.new_session(max_context=64, max_batch=16) as s:
        fresh = s.prefill(a + generated + b, logits="all")[-len(b):]
    assert float(np.abs(got - fresh).max()) <= 1e-4


def test_cancel_rolls_back_or_completes(engine: NativeEngine) -> None:
    # The race is inherent (the tiny model is fast); whichever way it ends, the session must be
    # consistent: cancelled -> position unchanged and reusable; finished -> fully advanced.
    long_prompt = [int(x) for x in np.random.default_rng(1).integers(0, 1000, 1500)]
    with engine.new_session(max_context=2048, max_batch=1) as s:
        s.prefill(PROMPT[:3], logits="none")
        timer = threading.Timer(0.01, s.cancel)
        timer.start()
        try:
            s.prefill(long_prompt, logits="none")
            assert s.position == 3 + len(long_prompt)
        except KvlError as exc:
            assert exc.status == KVL_ERR_CANCELLED
            assert s.position == 3
        finally:
            timer.join()
        s.truncate(3)
        got = s.prefill(PROMPT[3:], logits="last")
    with engine.new_session(max_context=64) as s:
        want = s.prefill(PROMPT, logits="last")
    assert float(np.abs(got - want).max()) <= 1e-4


# ---- invariances of configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
def test_greedy_invariant_under_engine_options(tiny_pack: Path, act: str) -> None:
    prompt, n = PROMPT[:5], 12
    with NativeEngine(tiny_pack, n_threads=2, act_dtype=act) as eng:
        base = _greedy(eng, prompt, n)
        info = eng.info()
    extent, topk = info["expert_extent_bytes"], info["num_experts_per_tok"]
    variants = {
        "1 thread": dict(n_threads=1),
        "min expert cache": dict(n_threads=2, expert_cache_bytes=topk * extent),
        "stream all trunk": dict(n_threads=2, trunk_cache_bytes=-1),
        "partial trunk cache": dict(n_threads=2, trunk_cache_bytes=3 * 4096),
        "scalar kernels": dict(n_threads=2, kernels="scalar"),
        "buffered io": dict(n_threads=2, io_mode="buffered"),
    }
    for label, opts in variants.items():
        with NativeEngine(tiny_pack, act_dtype=act, **opts) as eng:
            got = _greedy(eng, prompt, n)
            stats, vinfo = eng.stats(), eng.info()
        assert got == base, label
        if label == "min expert cache":
            assert vinfo["expert_cache_bytes"] == topk * extent
            assert stats["expert_misses"] > info["n_routed_experts"]  # extents were re-read
        if label == "stream all trunk":
            assert vinfo["trunk_cache_bytes"] == 0 and stats["trunk_hits"] == 0
            assert stats["trunk_misses"] > 0 and stats["trunk_bytes_read"] > 0
        if label == "scalar kernels":
            assert vinfo["kernels"] == "scalar" and vinfo["act_dtype"] == act


def test_bf16_linear_inputs_incremental_equals_full(tiny_pack: Path) -> None:
    """Decode (n = 1 kernels) and prefill (tiled kernels) round the same activations the same
    way, so stepping equals prefilling up to FP32 summation order and rounding flips."""
    with NativeEngine(tiny_pack, n_threads=2, act_dtype="bf16") as eng:
        with eng.new_session(max_context=64, max_batch=len(PROMPT)) as s:
            full = s.prefill(PROMPT, logits="all")
        with eng.new_session(max_context=64) as s:
            rows = np.stack([s.prefill(PROMPT[:1])] + [s.step(t) for t in PROMPT[1:]])
    with NativeEngine(tiny_pack, n_threads=2, act_dtype="f32") as eng, \
            eng.new_session(max_context=64, max_batch=len(PROMPT)) as s:
        exact = s.prefill(PROMPT, logits="all")
    diff, rounding = float(np.abs(rows - full).max()), float(np.abs(full - exact).max())
    print(f"bf16 mode: incremental vs full prefill {diff:.3e}; bf16 vs f32 mode {rounding:.3e}")
    assert np.argmax(rows, axis=1).tolist() == np.argmax(full, axis=1).tolist()
    assert diff <= rounding


def test_kv_bf16_close_to_f32(tiny_pack: Path) -> None:
    with NativeEngine(tiny_pack, n_threads=2, kv_dtype="f32") as e32, \
            e32.new_session(max_context=64) as s:
        a = s.prefill(PROMPT, logits="all")
        assert e32.info()["kv_dtype"] == "f32"
    with NativeEngine(tiny_pack, n_threads=2, kv_dtype="bf16") as e16, \
            e16.new_session(max_context=64) as s:
        b = s.prefill(PROMPT, logits="all")
        assert e16.info()["kv_dtype"] == "bf16"
    diff = float(np.abs(a - b).max())
    print(f"bf16 vs f32 KV cache: max logit difference = {diff:.3e}")
    assert 0 < diff < 0.5  # bf16 does round the cache, but the model stays close


def _resident_figures(pack: Path) -> tuple[int, int]:
    """(global, all-resident trunk cache) bytes from the pack index by the documented rule
    (engine.c): lm_head and routers as stored, page aligned; norm vectors widened to f32 and the
    f32 router bias, 64-byte aligned; every other trunk tensor except embed_tokens, page aligned,
    goes to the trunk cache."""
    from kvl.packfmt import PackReader

    def a4k(n: int) -> int:
        return (n + 4095) // 4096 * 4096

    def a64(n: int) -> int:
        return (n + 63) // 64 * 64

    glob = trunk = 0
    for rec in PackReader(pack).stores["trunk"].records:
        if rec.name in ("language_model.lm_head.weight",) or rec.name.endswith("mlp.gate.weight"):
            glob += a4k(rec.nbytes)
        elif rec.name.endswith(("norm.weight", "layernorm.weight")):
            glob += a64(rec.nbytes * 2)   # BF16 -> f32
        elif rec.name.endswith("e_score_correction_bias"):
            glob += a64(rec.nbytes)       # stored f32
        elif rec.name != "language_model.model.embed_tokens.weight":
            trunk += a4k(rec.nbytes)
    return glob, trunk


def test_info_and_session_bytes(engine: NativeEngine, tiny_pack: Path) -> None:
    info = engine.info()
    want_global, want_trunk = _resident_figures(tiny_pack)
    assert info["global_bytes"] == want_global
    assert info["trunk_cache_bytes"] == want_trunk  # default (0) = every trunk tensor resident
    assert info["n_threads"] == 2 and info["hidden_size"] > 0 and info["vocab_size"] > 0
    lm_head_bytes = info["vocab_size"] * info["hidden_size"] * 2
    assert info["global_bytes"] >= lm_head_bytes
    assert info["expert_cache_bytes"] % info["expert_extent_bytes"] == 0
    assert info["expert_extent_bytes"] % 4096 == 0
    small, large = engine.session_bytes(128, 16), engine.session_bytes(256, 16)
    # the KV part grows linearly with max_context: at least layers x (latent + rope) x 4 bytes/token
    per_token = info["n_layers"] * (info["kv_lora_rank"] + info["qk_rope_head_dim"]) * 4
    assert large - small >= 128 * per_token
    with NativeEngine(tiny_pack, n_threads=1, trunk_cache_bytes=-1) as eng:
        i2 = eng.info()
        assert i2["trunk_cache_bytes"] == 0 and i2["engine_workspace_bytes"] > 0


# ---- errors ---------------------------------------------------------------------------------------------

def test_context_overflow_and_bad_tokens(engine: NativeEngine) -> None:
    vocab = engine.vocab_size
    with engine.new_session(max_context=8, max_batch=4) as s:
        with pytest.raises(KvlError) as exc:
            s.prefill(list(range(1, 10)))
        assert exc.value.status == KVL_ERR_CONTEXT_FULL and "max_context" in str(exc.value)
        assert s.position == 0
        s.prefill(list(range(1, 9)), logits="none")
        with pytest.raises(KvlError) as exc:
            s.step(5)
        assert exc.value.status == KVL_ERR_CONTEXT_FULL
        assert s.position == 8
        s.truncate(2)
        for bad in (vocab, vocab + 10, -1):
            with pytest.raises(KvlError) as exc:
                s.prefill([1, bad])
            assert exc.value.status == KVL_ERR_INVALID_ARG and str(bad) in str(exc.value)
            with pytest.raises(KvlError) as exc:
                s.step(bad)
            assert exc.value.status == KVL_ERR_INVALID_ARG
        assert s.position == 2
        with pytest.raises(KvlError):
            s.truncate(3)


@pytest.mark.parametrize("opts, needle", [
    (dict(n_threads=-1), "n_threads"),
    (dict(trunk_cache_bytes=-7), "trunk_cache_bytes"),
    (dict(expert_cache_bytes=4096), "expert_cache_bytes"),
    (dict(kernels="sse9"), "kernels"),
    (dict(act_dtype="fp8"), "act_dtype"),
])
def test_invalid_options(tiny_pack: Path, opts: dict, needle: str) -> None:
    with pytest.raises(KvlError) as exc:
        NativeEngine(tiny_pack, **opts)
    assert needle in str(exc.value)


def test_expert_budget_one_below_topk_is_refused(tiny_pack: Path, engine: NativeEngine) -> None:
    info = engine.info()
    budget = info["num_experts_per_tok"] * info["expert_extent_bytes"] - 1
    with pytest.raises(KvlError) as exc:
        NativeEngine(tiny_pack, expert_cache_bytes=budget)
    assert "expert_cache_bytes" in str(exc.value)


def _copy_pack(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_experts_bin(tiny_pack: Path, tmp_path: Path) -> None:
    pack = _copy_pack(tiny_pack, tmp_path / "p")
    path = pack / "experts.bin"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(KvlError) as exc:
        NativeEngine(pack)
    assert "experts" in str(exc.value)


def test_flipped_byte_in_trunk_idx(tiny_pack: Path, tmp_path: Path) -> None:
    pack = _copy_pack(tiny_pack, tmp_path / "p")
    path = pack / "trunk.idx"
    data = bytearray(path.read_bytes())
    data[200] ^= 0x40  # inside the hparam table
    path.write_bytes(bytes(data))
    with pytest.raises(KvlError) as exc:
        NativeEngine(pack)
    assert "trunk.idx" in str(exc.value)


def test_missing_pack_complete(tiny_pack: Path, tmp_path: Path) -> None:
    pack = _copy_pack(tiny_pack, tmp_path / "p")
    (pack / "PACK_COMPLETE.json").unlink()
    with pytest.raises(KvlError) as exc:
        NativeEngine(pack)
    assert "PACK_COMPLETE.json" in str(exc.value) and "incomplete" in str(exc.value)


def _set_hparam(idx_path: Path, key: str, value: float) -> None:
    """Rewrite one hparam of an index (docs/FORMAT.md) and fix its CRC, as a buggy packer would."""
    data = bytearray(idx_path.read_bytes())
    n_hparams = struct.unpack_from("<I", data, 24)[0]
    for i in range(n_hparams):
        off = 128 + 64 * i
        if data[off:off + 56].rstrip(b"\0").decode() == key:
            struct.pack_into("<d", data, off + 56, value)
            break
    else:
        raise AssertionError(f"{key} not in {idx_path}")
    struct.pack_into("<I", data, 36, 0)
    struct.pack_into("<I", data, 36, zlib.crc32(bytes(data)) & 0xFFFFFFFF)
    idx_path.write_bytes(bytes(data))


def test_hparam_disagreeing_with_tensor_shape(tiny_pack: Path, tmp_path: Path) -> None:
    pack = _copy_pack(tiny_pack, tmp_path / "p")
    for store in ("trunk", "experts", "vision"):
        if (pack / f"{store}.idx").exists():
            _set_hparam(pack / f"{store}.idx", "text.intermediate_size", 96.0)
    with pytest.raises(KvlError) as exc:
        NativeEngine(pack)
    msg = str(exc.value)
    assert "trunk.idx" in msg and "mlp.gate_proj.weight" in msg and "96" in msg


def test_stores_disagreeing(tiny_pack: Path, tmp_path: Path) -> None:
    pack = _copy_pack(tiny_pack, tmp_path / "p")
    _set_hparam(pack / "experts.idx", "text.num_experts_per_tok", 3.0)
    with pytest.raises(KvlError) as exc:
        NativeEngine(pack)
    assert "experts.idx" in str(exc.value)


# ---- sampler binding ------------------------------------------------------------------------------------

def test_sampler_binding(engine: NativeEngine) -> None:
    with engine.new_session(max_context=32) as s:
        logits = s.prefill(PROMPT[:4])
    assert Sampler(0.0).sample(logits) == int(np.argmax(logits))
    assert Sampler(0.7, top_k=1, seed=3).sample(logits) == int(np.argmax(logits))
    a = [Sampler(1.0, top_k=40, top_p=0.9, seed=11).sample(logits) for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same first draw
    top40 = set(np.argsort(-logits)[:40].tolist())
    sampler = Sampler(1.0, top_k=40, seed=5)
    assert all(sampler.sample(logits) in top40 for _ in range(50))
