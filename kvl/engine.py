"""Engine / ChatSession: the Python API over the native engine.

Owns: opening a pack with a RAM plan (plan first, then the native engine with exactly the
planned cache budgets, then reconciling the plan with the engine's reported bytes), one lock so
sessions of an engine never run concurrently, and ChatSession: prompt building, prefix reuse
against the tokens already in the session's KV, image embeddings cached per conversation by
content hash (rounded to BF16, the official boundary), prefill, cancellation, and the decode loop.
Does not own: the sampling loop details (generate.py), templates (chat_template.py), pixels
(image.py) or any model math (native).
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

import numpy as np

from kvl.chat_template import ChatTemplate
from kvl.conversation import ImageInput, Message, Prompt, build_prompt, common_prefix
from kvl.errors import UserError
from kvl.generate import Cancelled, Done, SamplingParams, TextDelta, decode_loop, seed_or_random
from kvl.planner import DEFAULT_MAX_BATCH, RamPlan, largest_image_grid, plan
from kvl.tokenizer import Tokenizer

KVL_ERR_CANCELLED = 7  # kvl_core.h kvl_status


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """FP32 → nearest-even BF16 → FP32 (what the official model feeds the text decoder)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def _is_cancelled(exc: BaseException) -> bool:
    return getattr(exc, "status", None) == KVL_ERR_CANCELLED


class Engine:
    """A packed model opened for chat. Not thread-safe beyond the internal lock: every session
    call takes the engine lock, so concurrent generations are serialised."""

    def __init__(self, model_dir: str | Path, *, ram_mib: int = 4096, cache_mib: int = 512,
                 trunk_cache_mib: int | None = None, threads: int = 0, max_context: int = 4096,
                 load_vision: bool = True, kernels: str = "auto",
                 max_batch: int = DEFAULT_MAX_BATCH, act_dtype: str = "f32"):
        from kvl import native

        self.model_dir = Path(model_dir)
        self.plan: RamPlan = plan(self.model_dir, ram_mib, cache_mib, trunk_cache_mib,
                                  max_context, load_vision, max_batch=max_batch, threads=threads)
        self.tokenizer = Tokenizer(self.model_dir)
        self.template = ChatTemplate(self.model_dir)
        self.load_vision = load_vision
        self.max_context = max_context
        self.max_batch = max_batch
        self.preprocessor_config: dict = {}
        if load_vision:
            self.preprocessor_config = json.loads(
                (self.model_dir / "preprocessor_config.json").read_text("utf-8"))
        self._native_mod = native
        self._native = native.NativeEngine(
            str(self.model_dir), n_threads=threads, expert_cache_bytes=self.plan.expert_cache,
            trunk_cache_bytes=self.plan.trunk_cache if self.plan.trunk_cache > 0 else -1,
            kernels=kernels, kv_dtype=self.plan.kv_dtype, load_vision=load_vision,
            act_dtype=act_dtype)
        try:
            info = self._native.info()
            self.merge = (int(info["vision_merge_h"]), int(info["vision_merge_w"]))
            session_bytes = int(self._native.session_bytes(max_context, max_batch))
            vision_bytes = None
            if load_vision:
                grid = largest_image_grid(self.preprocessor_config, self.merge)
                vision_bytes = int(self._native.vision_bytes(np.asarray([grid], dtype=np.int32)))
            self.plan_differences = self.plan.reconcile(info, session_bytes, vision_bytes)
        except BaseException:
            self._native.close()
            raise
        self.lock = threading.Lock()
        self._sessions: list[ChatSession] = []

    def info(self) -> dict:
        return dict(self._native.info())

    def stats(self) -> dict:
        return dict(self._native.stats())

    def reset_stats(self) -> None:
        self._native.reset_stats()

    def new_chat(self) -> ChatSession:
        session = ChatSession(self)
        self._sessions.append(session)
        return session

    def close(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions.clear()
        if self._native is not None:
            self._native.close()
            self._native = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- images -----------------------------------------------------------------------------
    def image_grid(self, image: ImageInput) -> tuple[int, int]:
        from kvl import image as image_mod

        if not self.load_vision:
            raise UserError("this model was opened without vision; images are not accepted")
        picture = image_mod.load_image(image.data)
        width, height = picture.size
        return tuple(image_mod.grid_for_size(width, height, self.preprocessor_config,
                                             self.merge))  # type: ignore[return-value]

    def encode_image(self, image: ImageInput) -> tuple[np.ndarray, tuple[int, int]]:
        """Text-space embeddings of one image (rows x hidden, BF16-rounded FP32) and its grid."""
        from kvl import image as image_mod

        pixel_values, grids = image_mod.preprocess([image.data], self.preprocessor_config,
                                                   self.merge)
        rows = self._native.vision_encode(pixel_values, grids)
        return round_to_bf16(rows), (int(grids[0][0]), int(grids[0][1]))


class ChatSession:
    """One conversation with its own KV timeline on the engine."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._session = engine._native.new_session(max_context=engine.max_context,
                                                   max_batch=engine.max_batch)
        self._keys: list[Hashable] = []          # identity of each position held in the KV
        self._grids: dict[str, tuple[int, int]] = {}
        self._embeds: dict[str, np.ndarray] = {}
        self.last_prompt_tokens: list[int] = []
        self.last_output_tokens: list[int] = []
        self.last_images: list[dict] = []

    @property
    def position(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._session = None

    def reset(self) -> None:
        with self.engine.lock:
            if self._session is not None:
                self._session.truncate(0)
            self._keys = []
            self._embeds.clear()

    def _grid(self, image: ImageInput) -> tuple[int, int]:
        digest = image.digest
        if digest not in self._grids:
            self._grids[digest] = self.engine.image_grid(image)
        return self._grids[digest]

    def _prompt(self, messages: Sequence[Message]) -> Prompt:
        return build_prompt(messages, self.engine.template, self.engine.tokenizer, self._grid,
                            self.engine.merge)

    def count_tokens(self, messages: list[Message]) -> int:
        """Exact prompt tokens, media tokens and the generation prompt included."""
        return len(self._prompt(messages).tokens)

    def _media_rows(self, keys: Sequence[Hashable]) -> np.ndarray | None:
        rows = [self._embeds[k[0]][k[1]] for k in keys if isinstance(k, tuple)]
        return np.ascontiguousarray(np.stack(rows)) if rows else None

    def generate(self, messages: list[Message], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[TextDelta | Done]:
        """Stream the assistant reply to messages: TextDelta per token, then one Done."""
        params.validate()
        if self._session is None:
            raise UserError("this chat session is closed")
        started = time.perf_counter()
        prompt = self._prompt(messages)
        if len(prompt.tokens) >= self.engine.max_context:
            raise UserError(f"the conversation is {len(prompt.tokens)} tokens, the context holds "
                            f"{self.engine.max_context}; shorten it or raise --max-context")
        with self.engine.lock:
            yield from self._generate_locked(prompt, params, cancel, started)

    def _generate_locked(self, prompt: Prompt, params: SamplingParams,
                         cancel: threading.Event | None, started: float
                         ) -> Iterator[TextDelta | Done]:
        native = self.engine._native_mod
        session = self._session
        timings = {"prefill_s": 0.0, "first_token_s": 0.0, "decode_s_per_token": 0.0,
                   "vision_s": 0.0}
        self.last_prompt_tokens = list(prompt.tokens)
        self.last_output_tokens = []
        self.last_images = [{"sha256": i.digest, "grid": list(i.grid), "media_tokens": i.n_tokens}
                            for i in prompt.images]

        def done(reason: str, completion: int, reused: int, encoded: int,
                 stop: str | None = None) -> Done:
            return Done(reason, len(prompt.tokens), completion, reused, encoded, timings, stop)

        # Images: encode only those not already embedded in this conversation, one at a time so
        # vision working memory stays at the planned single-image peak.
        in_prompt = {i.digest for i in prompt.images}
        for digest in list(self._embeds):
            if digest not in in_prompt:
                del self._embeds[digest]
        encoded = 0
        vision_start = time.perf_counter()
        for image in prompt.images:
            if cancel is not None and cancel.is_set():
                yield done("cancelled", 0, 0, encoded)
                return
            if image.digest not in self._embeds:
                rows, grid = self.engine.encode_image(image.image)
                if rows.shape[0] != image.n_tokens:
                    raise UserError(f"image {image.digest[:12]}: vision produced {rows.shape[0]} "
                                    f"rows for {image.n_tokens} media tokens (grid {grid})")
                self._embeds[image.digest] = rows
                encoded += 1
        timings["vision_s"] = time.perf_counter() - vision_start

        # Prefix reuse: keep the longest common prefix; always prefill at least the last token
        # so its logits exist.
        reused = min(common_prefix(self._keys, prompt.keys), len(prompt.keys) - 1)
        watcher = _CancelWatcher(cancel, session)
        try:
            if session.position != reused:
                session.truncate(reused)
            self._keys = self._keys[:reused]
            suffix = prompt.tokens[reused:]
            media = self._media_rows(prompt.keys[reused:])
            prefill_start = time.perf_counter()
            try:
                logits = session.prefill(np.asarray(suffix, dtype=np.int32), media_embeds=media,
                                         logits="last")
            except native.KvlError as exc:
                if _is_cancelled(exc):
                    timings["prefill_s"] = time.perf_counter() - prefill_start
                    yield done("cancelled", 0, reused, encoded)
                    return
                raise
            timings["prefill_s"] = time.perf_counter() - prefill_start
            self._keys = list(prompt.keys)

            budget = min(params.max_new_tokens, self.engine.max_context - len(prompt.tokens))
            run_params = SamplingParams(params.temperature, params.top_p, params.top_k,
                                        params.seed, max(budget, 1), list(params.stop))
            sampler = native.Sampler(temperature=float(params.temperature),
                                     top_k=int(params.top_k), top_p=float(params.top_p),
                                     seed=seed_or_random(params.seed))

            def step(token: int) -> np.ndarray:
                try:
                    return session.step(int(token))
                except native.KvlError as exc:
                    if _is_cancelled(exc):
                        raise Cancelled() from exc
                    raise

            result: dict = {}
            for delta in decode_loop(logits, step, sampler.sample, self.engine.tokenizer,
                                     run_params, cancel, self._keys.append, result):
                if not timings["first_token_s"] and "first_token_at" in result:
                    timings["first_token_s"] = result["first_token_at"] - started
                yield delta
            timings["decode_s_per_token"] = result["decode_s_per_token"]
            self.last_output_tokens = list(result["generated"])
            yield done(result["finish_reason"], result["completion_tokens"], reused, encoded,
                       result["stop_sequence"])
        except GeneratorExit:
            raise  # the consumer stopped reading at a yield: the KV and keys are consistent
        except BaseException:
            # Unknown KV state after an error: start the next turn from scratch.
            self._keys = []
            with contextlib.suppress(Exception):  # the original error matters more
                session.truncate(0)
            raise
        finally:
            watcher.stop()
            if session.position != len(self._keys):
                # e.g. the consumer closed the generator mid-step; drop what we cannot vouch for
                self._keys = []
                session.truncate(0)


class _CancelWatcher:
    """Forwards a threading.Event to the native session's cancel (interrupts a long prefill)."""

    def __init__(self, cancel: threading.Event | None, session: object):
        self._cancel = cancel
        self._session = session
        self._finished = threading.Event()
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        if cancel is not None:
            self._thread = threading.Thread(target=self._run, name="kvl-cancel", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._cancel is not None
        while not self._finished.is_set():
            if self._cancel.wait(0.05):
                with self._guard:
                    if not self._finished.is_set():
                        self._session.cancel()  # type: ignore[attr-defined]
                return

    def stop(self) -> None:
        with self._guard:
            self._finished.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["Engine", "ChatSession", "round_to_bf16"]
