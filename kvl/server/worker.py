"""The one thread that owns the Engine and its single ChatSession.

Owns: loading the engine in the background (status loading → ready | failed), the bounded job
queue (full → ApiError rate_limit), running one generation at a time on the persistent
ChatSession (so its KV carries over and the next request reuses the longest common prefix), and
delivering each job's events, errors and end marker to the asyncio queue of the request that
submitted it. A job whose client has gone (cancel set) is skipped or stopped between tokens.
Does not own: HTTP or the API dialects (app.py, openai_api.py, anthropic_api.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvl.conversation import Message
from kvl.errors import UserError
from kvl.generate import Done, SamplingParams
from kvl.server.errors import ApiError

END = None  # the last item of every job's event queue
RETRY_AFTER_S = 2


@dataclass
class Job:
    messages: list[Message]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: Any) -> None:
        """Hand an event to the request's event loop (safe from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()


class Worker:
    def __init__(self, open_engine: Callable[[], Any], max_queue: int,
                 on_failed: Callable[[str], None] | None = None,
                 log: Callable[[str], None] | None = None):
        if max_queue < 1:
            raise UserError(f"--max-queue must be at least 1 (got {max_queue})")
        self._open_engine = open_engine
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_failed = on_failed
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.status = "loading"
        self.error: str | None = None
        self.engine: Any = None
        self.session: Any = None
        self._current: Job | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvl-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from request handlers ----------------------------------------------------------
    def require_ready(self) -> None:
        if self.status == "loading":
            raise ApiError("unavailable", "the model is still loading; retry when GET /healthz "
                           "says ready", retry_after=RETRY_AFTER_S)
        if self.status != "ready":
            raise ApiError("unavailable", f"the model could not be loaded: {self.error}")

    def submit(self, messages: list[Message], params: SamplingParams,
               loop: asyncio.AbstractEventLoop) -> Job:
        self.require_ready()
        if self.stopping:
            raise ApiError("unavailable", "the server is shutting down")
        job = Job(messages, params, loop)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise ApiError("rate_limit", f"the server is busy: {self._jobs.maxsize} request(s) "
                           "are already waiting; retry shortly (see Retry-After)",
                           retry_after=RETRY_AFTER_S) from None
        return job

    def count_tokens(self, messages: list[Message]) -> int:
        """Exact prompt tokens (images included). Runs on the caller's thread: it renders,
        tokenizes and decodes images to size them, but never touches the KV or native engine."""
        self.require_ready()
        try:
            return int(self.session.count_tokens(messages))
        except UserError as exc:
            raise ApiError("invalid_request", str(exc)) from None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def begin_shutdown(self) -> None:
        """Stop the running generation and refuse new and waiting requests, so open streams end
        promptly (with an error event) instead of holding the server's shutdown."""
        self._stopping.set()
        current = self._current
        if current is not None:
            current.cancel.set()
        self._refuse_waiting()

    def _refuse_waiting(self) -> None:
        """Answer every queued request with 'shutting down' (a None entry only wakes the thread)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit(ApiError("unavailable", "the server is shutting down"))
                job.emit(END)

    def stop(self, timeout: float = 10.0) -> None:
        self.begin_shutdown()
        self._refuse_waiting()  # what arrived since, then wake the thread
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._open_engine()
            self.session = self.engine.new_chat()
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            self.error = str(exc) if isinstance(exc, UserError) else \
                f"{type(exc).__name__}: {exc}"
            self.status = "failed"
            if not isinstance(exc, UserError):
                traceback.print_exc()
            if self._on_failed is not None:
                self._on_failed(self.error)
            return
        self.status = "ready"
        try:
            while not self._stopping.is_set():
                job = self._jobs.get()
                if job is None:
                    break
                if self.stopping:  # taken off the queue just as shutdown began
                    job.emit(ApiError("unavailable", "the server is shutting down"))
                    job.emit(END)
                    continue
                if job.cancel.is_set():  # its client left while it waited
                    self._log("kvl serve: skipped a queued request whose client disconnected")
                    job.emit(END)
                    continue
                self._current = job
                if self.stopping:  # shutdown began between the check above and now
                    job.cancel.set()
                try:
                    self._generate(job)
                finally:
                    self._current = None
        finally:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - closing at exit; nothing left to save
                traceback.print_exc()

    def _generate(self, job: Job) -> None:
        try:
            for event in self.session.generate(job.messages, job.params, job.cancel):
                job.emit(event)
                if isinstance(event, Done) and event.finish_reason == "cancelled":
                    why = "the server is stopping" if self.stopping else \
                        "the client disconnected"
                    self._log(f"kvl serve: generation cancelled after {event.completion_tokens} "
                              f"token(s): {why}")
        except UserError as exc:
            job.emit(ApiError("invalid_request", str(exc)))
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
            traceback.print_exc()
            job.emit(ApiError("server", f"generation failed: {type(exc).__name__}: {exc}"))
        finally:
            job.emit(END)
