"""Generation: sampling parameters, streamed events, and the token loop after prefill.

Owns: SamplingParams / TextDelta / Done, stop ids and stop strings (a stop string is never
emitted: text that could be the start of one is held back until it cannot), UTF-8-safe streaming
text, max_new_tokens, cancellation between tokens, and decode timings.
Does not own: prompt building and prefix reuse (engine.py / conversation.py) or the sampler math
(native kvl_sample).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvl.errors import UserError
from kvl.tokenizer import Tokenizer

DEFAULT_TEMPERATURE = 0.2  # the model card's recommendation for Instruct


@dataclass
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 <= self.top_p <= 1:
            raise UserError(f"top_p must be in [0, 1] (0 or 1 = off) (got {self.top_p})")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError("stop strings must be non-empty strings")


@dataclass
class TextDelta:
    """One generated token and the text it completes (may be "" while a UTF-8 character or a
    possible stop string is incomplete)."""
    text: str
    token_id: int


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    reused_prompt_tokens: int
    images_encoded: int
    timings: dict  # prefill_s, first_token_s, decode_s_per_token, vision_s
    stop_sequence: str | None = None


class Cancelled(Exception):
    """Raised by a step/prefill callable when the native call was interrupted by cancel."""


class StopMatcher:
    """Finds stop strings in streamed text; releases only text that cannot start one."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string if one completed)."""
        self._held += text
        if not self._stops:
            out, self._held = self._held, ""
            return out, None
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._held.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            out = self._held[:first[0]]
            self._held = ""
            return out, first[1]
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._held)), keep, -1):
                if self._held.endswith(stop[:k]):
                    keep = k
                    break
        out = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return out, None

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


def seed_or_random(seed: int | None) -> int:
    if seed is None:
        return int.from_bytes(np.random.default_rng().bytes(8), "little")
    return int(seed) & 0xFFFF_FFFF_FFFF_FFFF


def decode_loop(first_logits: np.ndarray, step: Callable[[int], np.ndarray],
                sample: Callable[[np.ndarray], int], tokenizer: Tokenizer,
                params: SamplingParams, cancel: threading.Event | None,
                on_stepped: Callable[[int], None], result: dict) -> Iterator[TextDelta]:
    """Sample tokens until a stop id, stop string, max_new_tokens or cancel.

    `step(token)` appends the token to the KV and returns the next logits; the last sampled
    token (and a stop id) is not stepped, so the KV ends at the last token whose successor was
    needed. `on_stepped(token)` records each stepped token. Fills result with finish_reason,
    stop_sequence, completion_tokens, generated ids and decode timings.
    """
    stop_ids = tokenizer.stop_ids
    decoder = tokenizer.stream_decoder()
    matcher = StopMatcher(params.stop)
    generated: list[int] = []
    step_times: list[float] = []
    logits = first_logits
    result.update(finish_reason="length", stop_sequence=None, generated=generated)
    while True:
        if cancel is not None and cancel.is_set():
            result["finish_reason"] = "cancelled"
            break
        token = int(sample(logits))
        if token in stop_ids:
            result["finish_reason"] = "stop"
            break
        generated.append(token)
        if "first_token_at" not in result:
            result["first_token_at"] = time.perf_counter()
        text, stop = matcher.push(decoder.push(token))
        if stop is not None:
            if text:
                yield TextDelta(text, token)
            result["finish_reason"] = "stop"
            result["stop_sequence"] = stop
            break
        if len(generated) >= params.max_new_tokens:
            text += matcher.push(decoder.flush())[0] + matcher.flush()
            yield TextDelta(text, token)
            break
        yield TextDelta(text, token)
        if cancel is not None and cancel.is_set():
            result["finish_reason"] = "cancelled"
            break
        started = time.perf_counter()
        try:
            logits = step(token)
        except Cancelled:
            result["finish_reason"] = "cancelled"
            break
        step_times.append(time.perf_counter() - started)
        on_stepped(token)
    if result["finish_reason"] != "length" and result["stop_sequence"] is None:
        tail = matcher.push(decoder.flush())[0] + matcher.flush()
        if tail and generated:
            yield TextDelta(tail, generated[-1])
    result["completion_tokens"] = len(generated)
    result["decode_s_per_token"] = (sum(step_times) / len(step_times)) if step_times else 0.0
