"""Tokenizer: tiktoken over the pack's `tiktoken.model`, special tokens from tokenizer_config.json.

Owns: loading the vocabulary, encode (special-token strings allowed, as the official tokenizer
does), decode (special ids become their literal text), a streaming decoder that never emits half
of a multi-byte UTF-8 character, and lookups of the ids the runtime needs (end of turn, media).
Does not own: the chat template (chat_template.py) or media expansion.
Model facts (pattern, reserved-token rule, pre-split limits) follow the spec §8.
"""
from __future__ import annotations

import base64
import codecs
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken

from kvl.errors import UserError

# The official pre-tokenizer pattern (spec §8). tiktoken's regex engine supports the `&&` class
# intersection; Python's `regex` in V0 mode would not, which is why we never use it here.
PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# The official tokenizer reserves this many special ids after the base vocabulary (+2).
NUM_RESERVED_SPECIAL = 256
# Official pre-split limits: tiktoken's matcher degrades on very long inputs and runs.
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def read_tiktoken_model(path: Path) -> dict[bytes, int]:
    """Parse `base64(token) rank` lines; a clear error for a missing or malformed file."""
    if not path.is_file():
        raise UserError(f"{path} is missing; the model directory needs the tokenizer file "
                        "tiktoken.model (rerun kvl pack)")
    ranks: dict[bytes, int] = {}
    with path.open("rb") as handle:
        for line_no, line in enumerate(handle, 1):
            line = line.strip()
            if not line:
                continue
            try:
                token_b64, rank = line.split()
                ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
            except ValueError as exc:
                raise UserError(f"{path}:{line_no} is not 'base64 rank' ({exc}); "
                                "the tokenizer file is corrupt, rerun kvl pack") from exc
    if not ranks:
        raise UserError(f"{path} is empty; rerun kvl pack")
    return ranks


def _split_runs(text: str) -> Iterator[str]:
    """Cut text into pieces with no run of > MAX_RUN_CHARS space or non-space characters.

    Mirrors the official tokenizer so huge inputs tokenize identically.
    """
    for start in range(0, len(text), MAX_CHUNK_CHARS):
        chunk = text[start:start + MAX_CHUNK_CHARS]
        piece_start = 0
        run_len = 0
        run_is_space = chunk[0].isspace() if chunk else False
        for i, ch in enumerate(chunk):
            is_space = ch.isspace()
            if is_space != run_is_space:
                run_is_space = is_space
                run_len = 1
            else:
                run_len += 1
                if run_len > MAX_RUN_CHARS:
                    yield chunk[piece_start:i]
                    piece_start = i
                    run_len = 1
        yield chunk[piece_start:]


class Tokenizer:
    """The model's tokenizer, built from a pack (or checkpoint) directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        ranks = read_tiktoken_model(model_dir / "tiktoken.model")
        config_path = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise UserError(f"{config_path} is missing; rerun kvl pack") from exc
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
            raise UserError(f"{config_path} is not valid JSON ({exc}); rerun kvl pack") from exc
        decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
        if not isinstance(decoder, dict):
            raise UserError(f"{config_path} has no added_tokens_decoder object, so the special "
                            "token ids are unknown; rerun kvl pack")
        named: dict[int, str] = {}
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not isinstance(content, str) or not key.isdigit():
                raise UserError(f"{config_path}: bad added_tokens_decoder entry {key!r}; rerun kvl pack")
            named[int(key)] = content
        self.num_base_tokens = len(ranks)
        specials: dict[str, int] = {}
        first = self.num_base_tokens
        for token_id in range(first, first + NUM_RESERVED_SPECIAL + 2):
            specials[named.get(token_id, f"<|reserved_token_{token_id}|>")] = token_id
        self.special_tokens = specials
        self.special_ids = {i: s for s, i in specials.items()}
        self._encoding = tiktoken.Encoding(name=f"kvl:{model_dir.name}", pat_str=PATTERN,
                                           mergeable_ranks=ranks, special_tokens=specials)
        self._config = config
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in longest_first) + ")")
        self.im_end = self.id_of("<|im_end|>")
        self.eos = self._config_token_id("eos_token", "[EOS]")
        self.media_pad = self.id_of("<|media_pad|>")
        self.media_start = self.id_of("<|media_start|>")
        self.media_end = self.id_of("<|media_end|>")

    def _config_token_id(self, key: str, fallback: str) -> int:
        value = self._config.get(key, fallback)
        if isinstance(value, dict):  # HF AddedToken serialisation
            value = value.get("content", fallback)
        return self.id_of(str(value))

    def id_of(self, special: str) -> int:
        """Id of a special token by name; clear error when the tokenizer lacks it."""
        try:
            return self.special_tokens[special]
        except KeyError:
            raise UserError(f"tokenizer_config.json has no special token {special!r}; "
                            "the model directory is not a Kimi-VL pack") from None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn (spec §9)."""
        return frozenset({self.im_end, self.eos})

    @property
    def n_vocab(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of text; literal special-token strings become their special ids.

        Special strings are split off first, then long plain segments are pre-split (spec §8
        order), so huge inputs tokenize exactly as the official tokenizer does.
        """
        if len(text) <= MAX_RUN_CHARS:
            return self._encoding.encode(text, allowed_special="all")
        ids: list[int] = []
        for segment in self._special_re.split(text):
            if not segment:
                continue
            special = self.special_tokens.get(segment)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(self.encode_ordinary(segment))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of text with special-token strings treated as plain text."""
        ids: list[int] = []
        for piece in _split_runs(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        special = self.special_ids.get(token_id)
        if special is not None:
            return special.encode("utf-8")
        try:
            return self._encoding.decode_single_token_bytes(token_id)
        except KeyError:
            raise UserError(f"token id {token_id} is not in the vocabulary") from None

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(i) for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; special ids as their literal names, invalid UTF-8 replaced."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns ids into text incrementally; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is still held (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
