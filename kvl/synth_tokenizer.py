"""Tokenizer assets for synthesized checkpoints (the real vocabulary cannot be downloaded here).

Owns: a deterministic stand-in `tiktoken.model` with exactly as many base ranks as the real one,
`tokenizer_config.json` with the official special-token ids, our own `chat_template.jinja` that
renders the official prompt strings, and `generation_config.json`.
Does not own: tokenizing at run time (kvl/tokenizer.py) or rendering (kvl/chat_template.py).

The vocabulary: ranks 0..255 are the single bytes in GPT-2 byte order (rank 0 = b"!"), then merges
learned by a small byte-pair training run on an embedded multilingual sample (so real English,
Vietnamese, Chinese and code become multi-byte tokens), then deterministic filler tokens (pairs of
existing tokens) up to the full rank count. Token ids therefore differ from the real model's; only
the special ids and the structure match.
"""
from __future__ import annotations

import base64
import collections
import functools
import json

import regex

from kvl.tokenizer import PATTERN

N_BASE_TOKENS = 163_584
N_SPECIAL_SLOTS = 256  # ids N_BASE_TOKENS .. N_BASE_TOKENS+255 (= model vocab 163840 - 1)

# The pre-tokenizer of the official tokenizer (spec §8): one definition, kvl.tokenizer's.
PAT_STR = PATTERN

NAMED_SPECIALS: dict[int, str] = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
    163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
    163593: "[EOT]", 163594: "<|im_system|>", 163601: "<|im_middle|>",
    163602: "<|media_start|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163838: "[UNK]", 163839: "[PAD]",
}
BOS_ID, EOS_ID, IM_END_ID, PAD_ID = 163584, 163585, 163586, 163839

_SAMPLE = """\
The quick brown fox jumps over the lazy dog. Hello! How can I assist you today? Please describe
the image in one short sentence. What is the capital of France? The capital of France is Paris.
Reply with exactly one short word: hello. There are three cats on the table and a red ball.
I think that this is a good idea, but we should check the results before we continue.
You are a helpful assistant. The user asked a question about the weather and the answer was sunny.
In the picture, a man is riding a bicycle down a street next to tall buildings and green trees.
Xin chào! Tôi là một trợ lý hữu ích. Hôm nay trời đẹp quá. Viết đúng một từ: chào.
Việt Nam là một quốc gia ở Đông Nam Á. Thủ đô của Việt Nam là Hà Nội. Cảm ơn bạn rất nhiều.
Bức ảnh này cho thấy một con mèo đang ngủ trên ghế. Chúng tôi muốn biết thêm về người dùng.
你好！我是一个有用的助手。今天天气很好。请用一句话描述这张图片。中国的首都是北京。
这张图片显示了一只猫在椅子上睡觉。我们想了解更多关于用户的信息。谢谢你的帮助。
def main(argv: list[str]) -> int:
    for index, value in enumerate(argv):
        if value == "--help":
            print("usage: main [options]")
            return 0
    return 1

import numpy as np
x = np.zeros((3, 4), dtype=np.float32)
result = {"name": "kvl", "version": 1, "items": [1, 2, 3]}
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
"""


def gpt2_byte_order() -> list[int]:
    """Bytes in GPT-2 order: printable '!'..'~', '¡'..'¬', '®'..'ÿ', then the rest ascending."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    seen = set(printable)
    return printable + [b for b in range(256) if b not in seen]


def _train_merges(text: str, max_merges: int) -> list[bytes]:
    """Plain byte-pair training: repeatedly merge the most frequent adjacent pair (ties broken by
    the pair's bytes, so the result is deterministic) until every pre-token is one token. Pairs
    seen once are merged too: the sample is small, and whole sample words as tokens make real
    text compress like a real vocabulary does."""
    pattern = regex.compile("(?V1)" + PAT_STR)
    words = collections.Counter(m.encode("utf-8") for m in pattern.findall(text))
    seqs = [([bytes([b]) for b in w], c) for w, c in words.items()]
    merged: list[bytes] = []
    for _ in range(max_merges):
        pairs: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        for seq, count in seqs:
            for a, b in zip(seq, seq[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best, _freq = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        token = best[0] + best[1]
        merged.append(token)
        for seq, _count in seqs:
            i = 0
            while i < len(seq) - 1:
                if seq[i] == best[0] and seq[i + 1] == best[1]:
                    seq[i:i + 2] = [token]
                i += 1
    return merged


@functools.lru_cache(maxsize=1)
def mergeable_ranks() -> dict[bytes, int]:
    """token bytes -> rank, exactly N_BASE_TOKENS entries, no duplicate byte strings."""
    tokens: list[bytes] = [bytes([b]) for b in gpt2_byte_order()]
    seen = set(tokens)
    for token in _train_merges(_SAMPLE, 4000):
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    # Filler: concatenations of two existing tokens, swept so that both parts have low rank
    # (every filler token is reachable by merging lower-ranked tokens).
    base = list(tokens)
    s = 0
    while len(tokens) < N_BASE_TOKENS:
        for t in range(s + 1):
            for a, b in ((s, t), (t, s)) if t != s else ((s, s),):
                token = base[a] + base[b] if a < len(base) and b < len(base) else None
                if token is not None and token not in seen:
                    seen.add(token)
                    tokens.append(token)
                    if len(tokens) == N_BASE_TOKENS:
                        break
            if len(tokens) == N_BASE_TOKENS:
                break
        s += 1
    return {tok: rank for rank, tok in enumerate(tokens)}


def special_tokens() -> dict[str, int]:
    return {special_name(i): i for i in range(N_BASE_TOKENS, N_BASE_TOKENS + N_SPECIAL_SLOTS)}


def special_name(token_id: int) -> str:
    return NAMED_SPECIALS.get(token_id, f"<|reserved_token_{token_id}|>")


@functools.lru_cache(maxsize=1)
def tiktoken_model_bytes() -> bytes:
    lines = [base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in
             mergeable_ranks().items()]
    return b"\n".join(lines) + b"\n"


def tokenizer_config() -> dict:
    decoder = {
        str(i): {"content": special_name(i), "lstrip": False, "normalized": False,
                 "rstrip": False, "single_word": False, "special": True}
        for i in range(N_BASE_TOKENS, N_BASE_TOKENS + N_SPECIAL_SLOTS)
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [NAMED_SPECIALS[i] for i in
                                      (163586, 163587, 163588, 163594, 163601, 163602, 163603,
                                       163604, 163605)],
        "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }


# Our own template text; renders exactly the official prompt strings (spec §7.1).
CHAT_TEMPLATE = """\
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role = message['role'] -%}
{%- if role == 'system' -%}<|im_system|>
{%- elif role == 'user' -%}<|im_user|>
{%- elif role == 'assistant' -%}<|im_assistant|>
{%- endif -%}
{{- role -}}<|im_middle|>
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
<|media_start|>image<|media_content|><|media_pad|><|media_end|>
{%- elif 'text' in part -%}
{{- part['text'] -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


def generation_config() -> dict:
    return {
        "bos_token_id": BOS_ID,
        "do_sample": True,
        "eos_token_id": [IM_END_ID, EOS_ID],
        "pad_token_id": PAD_ID,
        "temperature": 0.2,
        "transformers_version": "4.50.3",
    }


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_assets() -> dict[str, bytes]:
    """File name -> contents for tiktoken.model, tokenizer_config.json, chat_template.jinja,
    generation_config.json."""
    return {
        "tiktoken.model": tiktoken_model_bytes(),
        "tokenizer_config.json": _json_bytes(tokenizer_config()),
        "chat_template.jinja": CHAT_TEMPLATE.encode("utf-8"),
        "generation_config.json": _json_bytes(generation_config()),
    }
