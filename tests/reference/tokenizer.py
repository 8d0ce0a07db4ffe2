"""Reference tokenizer: pure-Python byte-pair encoding of tiktoken.model (spec §8).

Owns: reading tiktoken.model and tokenizer_config.json by hand, the pre-tokenizer pattern (run
through `regex` in V1 mode so `&&` class intersection works), splitting at special-token literals,
and lowest-rank-leftmost byte-pair merging. Deliberately does not use tiktoken: it is the
independent check of the runtime tokenizer, which does.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import regex

# Alternation order matters (spec §8); V1 mode makes `&&` an intersection instead of literal '&'.
PATTERN_PARTS = (
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
PATTERN = "|".join(PATTERN_PARTS)
NUM_RESERVED_SPECIAL = 256
# Python-side chunking of the official tokenizer; only matters for very long inputs.
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def read_ranks(path: str | Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_text(encoding="ascii").splitlines():
        if not line.strip():
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _runs(text: str):
    """Split into pieces of at most MAX_RUN_CHARS consecutive space / non-space characters."""
    start, length, spacy = 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if spacy is None or is_space != spacy:
            spacy, length = is_space, 1
        else:
            length += 1
            if length > MAX_RUN_CHARS:
                yield text[start:i]
                start, length = i, 1
    if start < len(text):
        yield text[start:]


class ReferenceTokenizer:
    def __init__(self, tokenizer_dir: str | Path) -> None:
        tokenizer_dir = Path(tokenizer_dir)
        self.ranks = read_ranks(tokenizer_dir / "tiktoken.model")
        self.decoder = {rank: token for token, rank in self.ranks.items()}
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        names = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        n_base = len(self.ranks)
        self.special_to_id: dict[str, int] = {}
        for i in range(n_base, n_base + NUM_RESERVED_SPECIAL + 2):
            self.special_to_id[names.get(i, f"<|reserved_token_{i}|>")] = i
        self.id_to_special = {i: s for s, i in self.special_to_id.items()}
        self.config = config
        self._splitter = regex.compile("(?V1)" + PATTERN)
        ordered = sorted(self.special_to_id, key=len, reverse=True)
        self._special_splitter = regex.compile("(" + "|".join(regex.escape(s) for s in ordered) + ")")

    def special_id(self, name: str) -> int:
        if name not in self.special_to_id:
            raise KeyError(f"special token {name!r} not in tokenizer_config.json's special range")
        return self.special_to_id[name]

    def _bpe(self, piece: bytes) -> list[int]:
        rank = self.ranks.get(piece)
        if rank is not None:
            return [rank]
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best_rank, best_at = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best_rank is None or r < best_rank):  # strict <: leftmost wins ties
                    best_rank, best_at = r, i
            if best_rank is None:
                break
            parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
        return [self.ranks[p] for p in parts]

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._splitter.findall(text):
            ids.extend(self._bpe(piece.encode("utf-8")))
        return ids

    def encode(self, text: str) -> list[int]:
        """Every special-token literal in the text becomes its id (all specials allowed)."""
        ids: list[int] = []
        for segment in self._special_splitter.split(text):
            if not segment:
                continue
            if segment in self.special_to_id:
                ids.append(self.special_to_id[segment])
                continue
            for chunk_at in range(0, len(segment), MAX_CHUNK_CHARS):
                for run in _runs(segment[chunk_at:chunk_at + MAX_CHUNK_CHARS]):
                    ids.extend(self._encode_ordinary(run))
        return ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if i in self.id_to_special:
                out += self.id_to_special[i].encode("utf-8")
            else:
                out += self.decoder[i]
        return out.decode("utf-8", errors="replace")
