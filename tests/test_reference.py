"""Checks of the independent reference (tests/reference) against third-party implementations.

The reference is the oracle for every runtime correctness test, so it is itself checked here:
text decoder vs transformers' DeepseekV3ForCausalLM (logits and greedy tokens), hand bicubic vs
torch, vision block-diagonal attention and merge order, tokenizer vs tiktoken, prompt assembly vs
jinja2 rendering of the checkpoint's chat_template.jinja, preprocessing against the spec's figures.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.reference.checkpoint import load_config, load_tensors, q8_roundtrip_rows
from tests.reference.preprocess import load_preprocessor_config, num_media_tokens, preprocess
from tests.reference.template import expand_media, prompt_ids, render_prompt
from tests.reference.text import TextReference
from tests.reference.tokenizer import PATTERN, ReferenceTokenizer
from tests.reference.vision import (
    VisionReference,
    bicubic_by_hand,
    bicubic_torch,
    merge_patches,
    rope_2d,
    rope_2d_angles,
)

LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """The tensors here are tiny: one thread avoids spin-wait overhead on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# text decoder vs transformers
# ---------------------------------------------------------------------------------------------
def _transformers_model(ckpt: Path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    text_config = dict(load_config(ckpt)["text_config"])
    text_config["rope_scaling"] = None  # the checkpoint states none; no YaRN
    text_config.pop("model_type", None)
    # rope_interleave=True is the official de-interleave; kv_a_layernorm keeps the 1e-6 default.
    config = DeepseekV3Config(**text_config, rope_interleave=True)
    config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    prefix = "language_model."
    state = {name[len(prefix):]: t for name, t in load_tensors(ckpt, prefix).items()}
    model.load_state_dict(state, strict=True)
    assert model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == 1e-6
    return model


@pytest.fixture(scope="module", params=["tiny_ckpt", "tiny_ckpt_grouped"])
def text_pair(request):
    ckpt = request.getfixturevalue(request.param)
    return request.param, ckpt, TextReference(ckpt), _transformers_model(ckpt)


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_text_logits_match_transformers(text_pair):
    name, ckpt, ref, model = text_pair
    vocab = ref.cfg["vocab_size"]
    ids = _prompt(vocab, 40, seed=3)
    ids = [i for i in ids if i != ref.media_token_id]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    got = ref.logits(ids)
    diff = (got - expected).abs().max().item()
    print(f"\n[{name}] text logits max |ref - transformers| = {diff:.3e} over {len(ids)} tokens "
          f"(logit scale {expected.abs().max().item():.2f})")
    assert got.shape == (len(ids), vocab)
    assert diff <= LOGIT_TOLERANCE


def test_media_rows_replace_placeholders_in_order(text_pair):
    name, ckpt, ref, model = text_pair
    media = ref.media_token_id
    ids = _prompt(ref.cfg["vocab_size"], 20, seed=4)
    ids = [i for i in ids if i != media]
    ids[3:3] = [media] * 4
    ids[15:15] = [media] * 2
    g = torch.Generator().manual_seed(5)
    media_embeds = torch.randn(6, ref.cfg["hidden_size"], generator=g)
    with torch.no_grad():
        embeds = model.model.embed_tokens(torch.tensor([ids]))
        positions = [i for i, t in enumerate(ids) if t == media]
        embeds[0, positions] = media_embeds
        expected = model(inputs_embeds=embeds).logits[0]
    diff = (ref.logits(ids, media_embeds) - expected).abs().max().item()
    print(f"\n[{name}] logits with media rows max diff = {diff:.3e}")
    assert diff <= LOGIT_TOLERANCE
    with pytest.raises(ValueError, match="media"):
        ref.logits(ids, media_embeds[:5])


def test_greedy_matches_transformers(text_pair):
    name, ckpt, ref, model = text_pair
    ids = [i for i in _prompt(ref.cfg["vocab_size"], 12, seed=6) if i != ref.media_token_id]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == 16
    assert ref.greedy(ids, 16) == expected


def test_grouped_routing_is_exercised(tiny_ckpt_grouped):
    """The grouped fixture must make group masking matter, or the comparison above proves little."""
    ref = TextReference(tiny_ckpt_grouped)
    c = ref.cfg
    assert c["n_group"] > c["topk_group"] >= 1
    layer = c.get("first_k_dense_replace", 0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, c["hidden_size"], generator=g)
    idx, weights = ref.route(layer, x)
    p = f"model.layers.{layer}.mlp.gate."
    biased = torch.sigmoid(x @ ref.w[p + "weight"].T) + ref.w[p + "e_score_correction_bias"]
    ungrouped = biased.topk(c["num_experts_per_tok"], dim=-1).indices
    changed = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(idx, ungrouped, strict=True))
    assert changed > 0
    torch.testing.assert_close(weights.sum(dim=-1), torch.full((256,), c["routed_scaling_factor"]))


# ---------------------------------------------------------------------------------------------
# Q8 expert round trip
# ---------------------------------------------------------------------------------------------
def test_q8_roundtrip_rule():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(16, 40, generator=g).to(torch.bfloat16).to(torch.float32)
    w[3] = 0.0
    w[5, 7] = -4.0  # row whose extreme is negative
    deq = q8_roundtrip_rows(w)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    assert torch.all(deq[3] == 0)
    assert deq[5, 7].item() == pytest.approx(-4.0, rel=1e-6)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = deq / safe
    assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127.0 + 1e-3
    assert torch.all((deq - w).abs() <= scale / 2 + 1e-7)
    # half-to-even: a value exactly halfway between two steps rounds to the even one
    row = torch.tensor([[127.0, 2.5, 3.5, -2.5]])
    assert q8_roundtrip_rows(row).tolist() == [[127.0, 2.0, 4.0, -2.0]]


def test_q8_only_touches_routed_experts(tiny_ckpt):
    plain = TextReference(tiny_ckpt)
    q8 = TextReference(tiny_ckpt, q8_experts=True)
    changed = {n for n in plain.w if not torch.equal(plain.w[n], q8.w[n])}
    assert changed and all(".mlp.experts." in n for n in changed)
    ids = [i for i in _prompt(plain.cfg["vocab_size"], 10, seed=9) if i != plain.media_token_id]
    diff = (plain.logits(ids) - q8.logits(ids)).abs().max().item()
    print(f"\nQ8-expert vs BF16-expert reference logits max diff = {diff:.3e}")
    assert 0 < diff < 1.0


# ---------------------------------------------------------------------------------------------
# vision
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_hw", [(2, 2), (4, 6), (8, 8), (12, 10), (14, 20), (3, 17)])
def test_bicubic_by_hand_equals_torch(out_hw):
    g = torch.Generator().manual_seed(10)
    table = torch.randn(8, 8, 5, generator=g) * 3
    hand = bicubic_by_hand(table, *out_hw)
    torch.testing.assert_close(hand, bicubic_torch(table, *out_hw), rtol=0, atol=1e-5)


def test_bicubic_same_size_is_identity():
    table = torch.randn(16, 16, 3)
    assert torch.equal(bicubic_torch(table, 16, 16), table)


def test_rope_2d_pair_layout():
    head_dim = 16
    angles = rope_2d_angles(3, 5, head_dim)  # [15, 8]
    n = 2 * 5 + 3  # row 2, column 3
    freq1 = 10000.0 ** (-4.0 / head_dim)
    assert angles[n, 0].item() == pytest.approx(3.0)  # pair 0: column
    assert angles[n, 1].item() == pytest.approx(2.0)  # pair 1: row
    assert angles[n, 2].item() == pytest.approx(3.0 * freq1)
    assert angles[n, 3].item() == pytest.approx(2.0 * freq1)


def test_merge_order_on_constructed_input():
    gh, gw = 4, 6
    tokens = torch.tensor([[r, c] for r in range(gh) for c in range(gw)], dtype=torch.float32)
    merged = merge_patches(tokens, (gh, gw), (2, 2))
    expected = [[[2 * R, 2 * C], [2 * R, 2 * C + 1], [2 * R + 1, 2 * C], [2 * R + 1, 2 * C + 1]]
                for R in range(gh // 2) for C in range(gw // 2)]
    assert merged.tolist() == expected


def test_rope_2d_equals_complex_rotation():
    g = torch.Generator().manual_seed(16)
    x = torch.randn(3, 12, 16, generator=g)
    angles = rope_2d_angles(3, 4, 16)
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
                                  * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    torch.testing.assert_close(rope_2d(x, angles), expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def vision_ref(tiny_ckpt):
    return VisionReference(tiny_ckpt)


def _patches(grid: tuple[int, int], patch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(grid[0] * grid[1], 3, patch, patch, generator=g) * 2 - 1


def test_vision_attention_is_per_image(tiny_ckpt, vision_ref):
    patch = vision_ref.cfg["patch_size"]
    grid_a, grid_b = (4, 6), (2, 4)
    a, b = _patches(grid_a, patch, 11), _patches(grid_b, patch, 12)
    alone_a = vision_ref.encode(a, [grid_a])
    alone_b = vision_ref.encode(b, [grid_b])
    both = vision_ref.encode(torch.cat([a, b]), [grid_a, grid_b])
    n_a = num_media_tokens(grid_a, vision_ref.kernel)
    assert both.shape == (n_a + num_media_tokens(grid_b, vision_ref.kernel),
                          load_config(tiny_ckpt)["text_config"]["hidden_size"])
    torch.testing.assert_close(both[:n_a], alone_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(both[n_a:], alone_b, rtol=0, atol=1e-5)
    # the check is only meaningful if the second image could have influenced the first
    assert not torch.allclose(alone_a[: alone_b.shape[0]], alone_b, atol=1e-3)


def test_patch_embed_equals_conv_on_preprocessed_image(tiny_ckpt, vision_ref):
    """Dense map of (c, ky, kx) patches == stride-p conv over the image the patches came from."""
    config = load_preprocessor_config(tiny_ckpt)
    p = config["patch_size"]
    rng = np.random.default_rng(17)
    image_array = rng.integers(0, 256, size=(50, 70, 3), dtype=np.uint8)
    pixels, grids = preprocess([Image.fromarray(image_array)], config)
    gh, gw = grids[0]
    patches = torch.from_numpy(pixels)
    image = patches.view(gh, gw, 3, p, p).permute(2, 0, 3, 1, 4).reshape(1, 3, gh * p, gw * p)
    conv = torch.nn.functional.conv2d(image, vision_ref.w["vision_tower.patch_embed.proj.weight"],
                                      vision_ref.w["vision_tower.patch_embed.proj.bias"], stride=p)
    expected = conv[0].flatten(1).T  # row-major over the patch grid
    torch.testing.assert_close(vision_ref.patch_embed(patches), expected, rtol=0, atol=1e-5)


def test_vision_uses_positions(vision_ref):
    """Shuffling patches must change more than the order of outputs (pos-emb and 2D RoPE act)."""
    patch = vision_ref.cfg["patch_size"]
    grid = (2, 2)
    x = _patches(grid, patch, 13)
    one = vision_ref.encode(x, [grid])
    swapped = vision_ref.encode(x[[1, 0, 2, 3]], [grid])
    assert not torch.allclose(one, swapped, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# preprocessing (figures from the spec's worked examples)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,grid,tokens", [
    ((196, 196), (14, 14), 49), ((224, 224), (16, 16), 64), ((28, 28), (2, 2), 1), ((10, 10), (2, 2), 1),
    ((100, 50), (4, 8), 8), ((640, 480), (36, 46), 414), ((1024, 1024), (66, 66), 1089),
    ((1920, 1080), (48, 86), 1032),
])
def test_preprocess_grid_and_token_counts(tiny_ckpt, size, grid, tokens):
    config = load_preprocessor_config(tiny_ckpt)
    pixels, grids = preprocess([Image.new("RGB", size, (200, 30, 90))], config)
    assert grids == [grid]
    assert pixels.shape == (grid[0] * grid[1], 3, config["patch_size"], config["patch_size"])
    assert pixels.dtype == np.float32
    assert num_media_tokens(grids[0], config["merge_kernel_size"]) == tokens


def test_preprocess_pixels_padding_and_patch_order(tiny_ckpt):
    config = load_preprocessor_config(tiny_ckpt)
    p = config["patch_size"]
    rng = np.random.default_rng(14)
    arr = rng.integers(0, 256, size=(30, 45, 3), dtype=np.uint8)  # h=30, w=45 -> padded 56 x 56
    pixels, grids = preprocess([Image.fromarray(arr)], config)
    gh, gw = grids[0]
    assert (gh, gw) == (4, 4)
    mean, std = np.float32(config["image_mean"]), np.float32(config["image_std"])
    padded = np.zeros((gh * p, gw * p, 3), dtype=np.uint8)
    padded[:30, :45] = arr
    norm = (padded.astype(np.float32) / 255 - mean) / std
    for r in range(gh):
        for c in range(gw):
            tile = norm[r * p:(r + 1) * p, c * p:(c + 1) * p].transpose(2, 0, 1)
            np.testing.assert_allclose(pixels[r * gw + c], tile, rtol=0, atol=1e-6)


def test_preprocess_palette_pads_with_index_zero(tiny_ckpt):
    config = load_preprocessor_config(tiny_ckpt)
    image = Image.new("P", (20, 20), 1)
    palette = [0] * 768
    palette[0:3] = [255, 0, 0]  # index 0 is red, so palette padding is not black
    palette[3:6] = [0, 0, 255]
    image.putpalette(palette)
    pixels, grids = preprocess([image], config)
    assert grids == [(2, 2)]
    mean, std = config["image_mean"], config["image_std"]
    red = [(1.0 - mean[0]) / std[0], (0.0 - mean[1]) / std[1], (0.0 - mean[2]) / std[2]]
    np.testing.assert_allclose(pixels[3, :, -1, -1], red, atol=1e-6)  # bottom-right = padding
    blue = [(0.0 - mean[0]) / std[0], (0.0 - mean[1]) / std[1], (1.0 - mean[2]) / std[2]]
    np.testing.assert_allclose(pixels[0, :, 0, 0], blue, atol=1e-6)


def test_preprocess_rejects_too_large(tiny_ckpt):
    config = dict(load_preprocessor_config(tiny_ckpt), in_token_limit=10**9)
    with pytest.raises(ValueError, match="Exceed pos emb"):
        preprocess([Image.new("RGB", (14 * 520, 28))], config)


def test_image_to_logits_pipeline(tiny_ckpt, vision_ref):
    """Preprocess -> vision -> text end to end: token count and media rows line up."""
    config = load_preprocessor_config(tiny_ckpt)
    rng = np.random.default_rng(15)
    image = Image.fromarray(rng.integers(0, 256, size=(40, 60, 3), dtype=np.uint8))
    pixels, grids = preprocess([image], config)
    embeds = vision_ref.encode(torch.from_numpy(pixels), grids)
    n = num_media_tokens(grids[0], config["merge_kernel_size"])
    assert embeds.shape[0] == n
    tok = ReferenceTokenizer(tiny_ckpt)
    content = [{"type": "image"}, {"type": "text", "text": "Hi"}]
    ids = prompt_ids(tok, [{"role": "user", "content": content}], [n])
    text = TextReference(tiny_ckpt)
    assert ids.count(text.media_token_id) == n
    logits = text.logits(ids, embeds)
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# tokenizer and template
# ---------------------------------------------------------------------------------------------
CORPUS = [
    "Hello! How can I assist you today?",
    "Reply with exactly one short word: hello",
    "Xin chào Việt Nam. Viết đúng một từ: chào",
    "你好，世界！我是一个有用的助手。今天天气很好。",
    "日本語のテキスト、カタカナ：コーヒー。々〻は漢字扱い",
    "Привет, мир! Ελληνικά γράμματα. العربية שלום हिन्दी 한국어",
    "don't I'LL we've THEY'RE it's You'D",
    "numbers 1234567 3.14159 -42 1,000,000 ١٢٣",
    "  leading and trailing spaces   \n\n\tTabs\r\nCRLF\n   \n",
    "def f(x):\n    return x ** 2  # comment\n\n\nprint(f(3))",
    "emoji 😀👍🏽 and symbols ©®™ ∑∫√ and a combining é (e\u0301)",
    "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "text<|media_start|>image<|media_content|><|media_pad|><|media_pad|><|media_end|>more[EOS][BOS]",
    "ALLCAPS MixedCase camelCaseWord snake_case_word kebab-case-word",
    "a" * 300 + " " + "ab" * 100,
    ("it'ſ THAT'S x'K ß'S İstanbul'da ǅemal ﬁne a\x1c\x1db a\u00a0 b "
     "l1\u2028l2 p\u0085q a\u3000b \ufeffbom Ⅻ ①②"),
    "",
]


@pytest.fixture(scope="module")
def tokenizers(tiny_ckpt):
    import tiktoken

    ref = ReferenceTokenizer(tiny_ckpt)
    config = json.loads((tiny_ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    specials = {entry["content"]: int(i) for i, entry in config["added_tokens_decoder"].items()}
    oracle = tiktoken.Encoding(name="kimi-check", pat_str=PATTERN, mergeable_ranks=ref.ranks,
                               special_tokens=specials)
    return ref, oracle, specials


@pytest.mark.parametrize("text", CORPUS)
def test_tokenizer_matches_tiktoken(tokenizers, text):
    ref, oracle, _ = tokenizers
    expected = oracle.encode(text, allowed_special="all")
    assert ref.encode(text) == expected
    assert ref.decode(expected) == text


def test_tokenizer_special_ids_from_config(tokenizers):
    ref, _, specials = tokenizers
    for name in ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                 "<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"):
        assert ref.special_id(name) == specials[name]


CONVERSATIONS = [
    ([{"role": "user", "content": "Reply with exactly one short word: hello"}], True),
    ([{"role": "user", "content": "Reply with exactly one short word: hello"}], False),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                   {"type": "text", "text": "Describe the image."}]}], True),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Xin chào"}], True),
    ([{"role": "user", "content": "What is the weather?"},
      {"role": "assistant", "content": "Let me check."},
      {"role": "tool", "content": "{\"sunny\": true}"},
      {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                   {"type": "image_url", "image_url": {"url": "a.png"}},
                                   {"type": "text", "text": " and "}, {"type": "image"}]}], True),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
      {"role": "assistant", "content": "A"}], False),
]


@pytest.mark.parametrize("messages,add_generation_prompt", CONVERSATIONS)
def test_template_matches_jinja(tiny_ckpt, messages, add_generation_prompt):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # transformers' apply_chat_template settings
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string((tiny_ckpt / "chat_template.jinja").read_text(encoding="utf-8"))
    expected = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    assert render_prompt(messages, add_generation_prompt) == expected


def test_media_expansion_and_prompt_ids(tokenizers):
    ref, oracle, specials = tokenizers
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "A"},
                                             {"type": "image"}]}]
    prompt = render_prompt(messages, add_generation_prompt=True)
    expanded = expand_media(prompt, [3, 5])
    ids = prompt_ids(ref, messages, [3, 5])
    assert ids == oracle.encode(expanded, allowed_special="all")
    pad, start, content, end = (specials[n] for n in ("<|media_pad|>", "<|media_start|>",
                                                       "<|media_content|>", "<|media_end|>"))
    word = oracle.encode("image")
    first = ids.index(start) + 1
    assert ids[first:first + len(word)] == word
    first += len(word)
    assert ids[first] == content and ids[first + 1:first + 4] == [pad] * 3 and ids[first + 4] == end
    assert ids.count(pad) == 8
    with pytest.raises(ValueError):
        expand_media(prompt, [3])
