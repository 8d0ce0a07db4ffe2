"""`kvl serve`: the Starlette app, its routes, auth, body limits, request logging and the
uvicorn runner.

Owns: routing (/healthz, /v1/models, /v1/chat/completions, /v1/messages,
/v1/messages/count_tokens), API-key checks, the request-body size limit, choosing the error
dialect per route, turning a job's events into a JSON reply or an SSE stream (with keep-alives),
noticing clients that disconnect (their job is cancelled), one log line per request, and the
command-line options.
Does not own: the JSON shapes (openai_api.py / anthropic_api.py), the engine thread (worker.py)
or generation (kvl.engine).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvl.conversation import Message
from kvl.errors import UserError
from kvl.generate import Done, TextDelta
from kvl.server import anthropic_api, openai_api
from kvl.server.errors import ApiError, anthropic_error_body, invalid, openai_error_body
from kvl.server.worker import END, Job, Worker

DEFAULT_MODEL_ID = "kimi-vl-a3b-instruct-q8"
MIB = 1 << 20
DEFAULT_MAX_BODY_MIB = 20
KEEPALIVE_S = 5.0  # a silent stream (long prefill) still shows the client it is alive
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class ServerConfig:
    model_id: str = DEFAULT_MODEL_ID
    api_key: str | None = None
    max_context: int = 4096
    max_body_bytes: int = DEFAULT_MAX_BODY_MIB * MIB
    vision: bool = True


class ClientGone(Exception):
    """The client closed the connection before its reply was ready."""


@dataclass
class RequestLog:
    method: str
    path: str
    started: float
    status: int = 0
    prompt_tokens: int | None = None
    reused: int | None = None
    images: int | None = None
    completion: int | None = None
    note: str = ""

    def record(self, done: Done) -> None:
        self.prompt_tokens = done.prompt_tokens
        self.reused = done.reused_prompt_tokens
        self.images = done.images_encoded
        self.completion = done.completion_tokens
        if done.finish_reason == "cancelled":
            self.note = "cancelled"

    def emit(self) -> None:
        def show(value: int | None) -> str:
            return "-" if value is None else str(value)

        line = (f"kvl serve: {self.method} {self.path} {self.status} "
                f"prompt={show(self.prompt_tokens)} reused={show(self.reused)} "
                f"images={show(self.images)} completion={show(self.completion)} "
                f"{time.perf_counter() - self.started:.3f}s")
        print(line + (f" ({self.note})" if self.note else ""), file=sys.stderr, flush=True)


# -- event reading --------------------------------------------------------------------------
class EventReader:
    """Reads a job's events with an optional timeout and never loses one to a timeout (a single
    pending get is kept across waits instead of being cancelled)."""

    TIMEOUT = object()

    def __init__(self, job: Job):
        self.job = job
        self._getter: asyncio.Future | None = None

    async def next(self, timeout: float | None = None) -> Any:
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.job.events.get())
        finished, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not finished:
            return self.TIMEOUT
        item, self._getter = self._getter.result(), None
        return item

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


async def watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client hangs up (the body has been read, so the next ASGI
    message can only be http.disconnect)."""
    while True:
        try:
            message = await request.receive()
        except Exception:  # noqa: BLE001 - a broken transport means the client is gone too
            job.cancel.set()
            return
        if message["type"] == "http.disconnect":
            job.cancel.set()
            return


async def collect(request: Request, job: Job, log: RequestLog,
                  shutting_down: Callable[[], bool]) -> tuple[str, Done]:
    watcher = asyncio.ensure_future(watch_disconnect(request, job))
    reader = EventReader(job)
    pieces: list[str] = []
    done: Done | None = None
    try:
        while True:
            item = await reader.next()
            if item is END:
                break
            if isinstance(item, ApiError):
                raise item
            if isinstance(item, TextDelta):
                pieces.append(item.text)
            elif isinstance(item, Done):
                done = item
                log.record(item)
    finally:
        watcher.cancel()
        reader.close()
    if done is not None and done.finish_reason == "cancelled" and shutting_down():
        raise ApiError("unavailable", "the server is shutting down; retry against a running one")
    if job.cancel.is_set() or done is None or done.finish_reason == "cancelled":
        raise ClientGone()
    return "".join(pieces), done


async def event_stream(job: Job, log: RequestLog, head: bytes,
                       on_delta: Callable[[str], bytes], on_done: Callable[[Done], bytes],
                       on_error: Callable[[ApiError], bytes], keepalive: bytes,
                       shutting_down: Callable[[], bool]) -> AsyncIterator[bytes]:
    """SSE bytes of one job. When the client disconnects, Starlette cancels this generator
    (or a write fails); either way `finally` cancels the job so the worker moves on."""
    reader = EventReader(job)
    finished = False
    log.status = 200
    try:
        yield head
        while True:
            item = await reader.next(KEEPALIVE_S)
            if item is EventReader.TIMEOUT:
                yield keepalive
                continue
            if item is END:
                finished = True
                break
            if isinstance(item, ApiError):
                log.note = f"error: {item.message}"
                finished = True  # clients may hang up as soon as they read the last event
                yield on_error(item)
                break
            if isinstance(item, TextDelta):
                chunk = on_delta(item.text)
                if chunk:
                    yield chunk
            elif isinstance(item, Done):
                log.record(item)
                finished = True
                if item.finish_reason == "cancelled" and shutting_down():
                    yield on_error(ApiError("unavailable", "the server is shutting down"))
                else:
                    yield on_done(item)
                break  # Done is the job's last event; END only follows it
    finally:
        reader.close()
        if not finished:
            job.cancel.set()
            log.status = 499
            log.note = "client disconnected"
        log.emit()


# -- the app ----------------------------------------------------------------------------------
Handler = Callable[[Request, RequestLog], Awaitable[Response]]


def create_app(worker: Worker, config: ServerConfig) -> Starlette:
    created = int(time.time())

    def shutting_down() -> bool:
        return worker.stopping

    expected_key = config.api_key.encode("utf-8") if config.api_key else None

    def error_response(dialect: str, error: ApiError) -> JSONResponse:
        body = anthropic_error_body(error) if dialect == "anthropic" else openai_error_body(error)
        return JSONResponse(body, status_code=error.status, headers=error.headers())

    def check_auth(request: Request) -> None:
        if expected_key is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
        if given is None:
            raise ApiError("authentication", "missing API key: send it as 'x-api-key: KEY' or "
                           "'Authorization: Bearer KEY'")
        if not hmac.compare_digest(given.encode("utf-8"), expected_key):
            raise ApiError("authentication", "invalid API key")

    def check_model(model: str) -> None:
        if model != config.model_id:
            raise ApiError("model_not_found", f"model {model!r} does not exist; this server "
                           f"serves {config.model_id!r}", "model")

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ApiError("too_large", f"the request body is {int(declared)} bytes, over the "
                           f"{config.max_body_bytes}-byte limit; send smaller images")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise ApiError("too_large", f"the request body is over the "
                               f"{config.max_body_bytes}-byte limit; send smaller images")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise invalid("the request body is empty; send a JSON object")
        try:
            return json.loads(raw)
        except UnicodeDecodeError:
            raise invalid("the request body is not UTF-8 JSON") from None
        except json.JSONDecodeError as exc:
            raise invalid(f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                          f"column {exc.colno})") from None

    async def prompt_size(messages: list[Message]) -> int:
        tokens = await run_in_threadpool(worker.count_tokens, messages)
        if tokens >= config.max_context:
            raise invalid(f"the conversation is {tokens} tokens but the context holds "
                          f"{config.max_context}; shorten it or restart the server with a larger "
                          "--max-context", "messages")
        return tokens

    def validate_params(params: Any) -> None:
        try:
            params.validate()
        except UserError as exc:
            raise invalid(str(exc)) from None

    def endpoint(dialect: str, handler: Handler, auth: bool = True
                 ) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            log = RequestLog(request.method, request.url.path, time.perf_counter())
            try:
                if auth:
                    check_auth(request)
                response = await handler(request, log)
            except ApiError as exc:
                response = error_response(dialect, exc)
                log.note = exc.message
            except ClientGone:
                response = Response(status_code=499)
                log.note = "client disconnected"
            except Exception as exc:  # noqa: BLE001 - answer 500, keep serving
                traceback.print_exc()
                response = error_response(dialect, ApiError(
                    "server", f"internal error: {type(exc).__name__}: {exc}"))
            if isinstance(response, StreamingResponse):
                return response  # the stream logs when it ends
            log.status = response.status_code
            if request.url.path != "/healthz":
                log.emit()
            return response
        return wrapped

    async def healthz(request: Request, log: RequestLog) -> Response:
        body: dict[str, Any] = {"status": worker.status}
        if worker.error:
            body["error"] = worker.error
        return JSONResponse(body, status_code=503 if worker.status == "failed" else 200)

    async def list_models(request: Request, log: RequestLog) -> Response:
        return JSONResponse(openai_api.models_body(config.model_id, created, config.max_context,
                                                   config.vision))

    async def get_model(request: Request, log: RequestLog) -> Response:
        check_model(request.path_params["model_id"])
        return JSONResponse(openai_api.model_card(config.model_id, created, config.max_context,
                                                  config.vision))

    async def chat_completions(request: Request, log: RequestLog) -> Response:
        req = openai_api.parse_chat_request(await read_json(request),
                                            max_context=config.max_context)
        check_model(req.model)
        validate_params(req.params)
        await prompt_size(req.messages)
        job = worker.submit(req.messages, req.params, asyncio.get_running_loop())
        if req.stream:
            chunks = openai_api.ChunkStream(config.model_id, req.include_usage)
            return StreamingResponse(
                event_stream(job, log, chunks.start(), chunks.delta, chunks.finish,
                             chunks.error, openai_api.KEEPALIVE, shutting_down),
                media_type="text/event-stream", headers=SSE_HEADERS)
        text, done = await collect(request, job, log, shutting_down)
        return JSONResponse(openai_api.completion_body(
            openai_api.new_completion_id(), int(time.time()), config.model_id, text, done))

    async def messages(request: Request, log: RequestLog) -> Response:
        req = anthropic_api.parse_messages_request(await read_json(request),
                                                   max_context=config.max_context)
        check_model(req.model)
        validate_params(req.params)
        prompt_tokens = await prompt_size(req.messages)
        job = worker.submit(req.messages, req.params, asyncio.get_running_loop())
        if req.stream:
            stream = anthropic_api.MessageStream(config.model_id)
            return StreamingResponse(
                event_stream(job, log, stream.start(prompt_tokens), stream.delta, stream.finish,
                             stream.error, anthropic_api.PING, shutting_down),
                media_type="text/event-stream", headers=SSE_HEADERS)
        text, done = await collect(request, job, log, shutting_down)
        return JSONResponse(anthropic_api.message_body(anthropic_api.new_message_id(),
                                                       config.model_id, text, done))

    async def count_tokens(request: Request, log: RequestLog) -> Response:
        model, conversation = anthropic_api.parse_count_tokens_request(await read_json(request))
        check_model(model)
        tokens = await run_in_threadpool(worker.count_tokens, conversation)
        log.prompt_tokens = tokens
        return JSONResponse({"input_tokens": tokens})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        dialect = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return error_response(dialect, ApiError(kind, message))

    routes = [
        Route("/healthz", endpoint("openai", healthz, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint("openai", list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint("openai", get_model), methods=["GET"]),
        Route("/v1/chat/completions", endpoint("openai", chat_completions), methods=["POST"]),
        Route("/v1/messages", endpoint("anthropic", messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint("anthropic", count_tokens),
              methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


# -- command line -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="packed model directory (from kvl pack / kvl prepare)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("KVL_API_KEY") or None,
                        help="require this key (x-api-key or Authorization: Bearer) on every "
                             "endpoint except /healthz (default: $KVL_API_KEY, which keeps the "
                             "key out of the process list)")
    parser.add_argument("--model-id", default=DEFAULT_MODEL_ID,
                        help=f"the model id clients must send (default {DEFAULT_MODEL_ID})")
    parser.add_argument("--ram-mib", type=int, default=4096, help="total RAM budget (default 4096)")
    parser.add_argument("--cache-mib", type=int, default=512, help="expert cache (default 512)")
    parser.add_argument("--trunk-cache-mib", type=int, default=None,
                        help="trunk cache (default: what the RAM budget leaves)")
    parser.add_argument("--max-queue", type=int, default=8,
                        help="requests that may wait while one generates; more get HTTP 429 "
                             "(default 8)")
    parser.add_argument("--max-context", type=int, default=4096,
                        help="context length in tokens (default 4096)")
    parser.add_argument("--threads", type=int, default=0, help="worker threads (0 = all cores)")
    parser.add_argument("--max-body-mib", type=int, default=DEFAULT_MAX_BODY_MIB,
                        help=f"largest accepted request body (default {DEFAULT_MAX_BODY_MIB})")
    parser.add_argument("--kernels", default="auto", choices=["auto", "scalar", "avx2", "avx512"])
    parser.add_argument("--act-dtype", default="f32", choices=["f32", "bf16"],
                        help="inputs of the Linear layers: f32 (exact, default) or bf16 (as the "
                             "checkpoint's own BF16 inference: ~2x faster prefill on CPUs with "
                             "AVX512_BF16, logits move by BF16 rounding)")
    parser.add_argument("--no-vision", action="store_true", help="do not load the vision tower")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise UserError(f"model directory '{model_dir}' not found; pack one with `kvl pack` or "
                        "`kvl prepare`")
    for name, value, low in (("--port", args.port, 0), ("--max-queue", args.max_queue, 1),
                             ("--max-context", args.max_context, 2),
                             ("--max-body-mib", args.max_body_mib, 1)):
        if value < low or (name == "--port" and value > 65535):
            raise UserError(f"{name} {value} is out of range")
    if args.api_key is not None and not args.api_key:
        raise UserError("--api-key must not be empty")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"kvl serve: warning: listening on {args.host} without --api-key; anyone who can "
              "reach this port can use the model", file=sys.stderr)

    def open_engine() -> Any:
        from kvl.engine import Engine

        engine = Engine(model_dir, ram_mib=args.ram_mib, cache_mib=args.cache_mib,
                        trunk_cache_mib=args.trunk_cache_mib, threads=args.threads,
                        max_context=args.max_context, load_vision=not args.no_vision,
                        kernels=args.kernels, act_dtype=args.act_dtype)
        print(engine.plan.describe(), file=sys.stderr, flush=True)
        print(f"kvl serve: model ready as {args.model_id!r}", file=sys.stderr, flush=True)
        return engine

    config = ServerConfig(model_id=args.model_id, api_key=args.api_key,
                          max_context=args.max_context, max_body_bytes=args.max_body_mib * MIB,
                          vision=not args.no_vision)
    server: uvicorn.Server | None = None

    def on_failed(message: str) -> None:
        print(f"kvl serve: error: cannot load the model: {message}", file=sys.stderr, flush=True)
        if server is not None:
            server.should_exit = True

    worker = Worker(open_engine, args.max_queue, on_failed=on_failed)
    app = create_app(worker, config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            worker.begin_shutdown()  # end open streams now rather than after a grace timeout
            super().handle_exit(sig, frame)

    # Bind before loading the model so a busy port fails in a second, not after the load.
    listener = bind(args.host, args.port)
    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5))
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"kvl serve: loading {model_dir}; listening on http://{shown}:{port} "
          "(GET /healthz says when the model is ready)", file=sys.stderr, flush=True)
    worker.start()
    try:
        server.run(sockets=[listener])
    finally:
        worker.stop()
        listener.close()
    return 1 if worker.status == "failed" or not server.started else 0


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"cannot resolve --host {host!r} ({exc.strerror})") from None
    listener = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":  # on Windows SO_REUSEADDR would let two servers share the port
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); is another server "
                        "using the port? choose another with --port") from None
    return listener
