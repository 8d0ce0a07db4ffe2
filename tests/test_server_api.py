"""kvl serve without a model: request JSON → Message/SamplingParams, events → the exact OpenAI
and Anthropic JSON/SSE shapes, validation, auth, limits and queueing.

A fake backend (FakeEngine / FakeChat below, allowed only in this file) stands in for the Engine
behind the real Worker and the real Starlette app; the official openai / anthropic SDKs talk to
the app in-process through Starlette's TestClient.
"""
from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image
from starlette.testclient import TestClient

from kvl.conversation import ImageInput, Message
from kvl.errors import UserError
from kvl.generate import Done, SamplingParams, TextDelta
from kvl.server import anthropic_api, openai_api
from kvl.server.app import ServerConfig, create_app
from kvl.server.errors import ApiError, anthropic_error_body, openai_error_body
from kvl.server.worker import Worker

MODEL = "kimi-vl-a3b-instruct-q8"
CTX = 256


def png_bytes(size: tuple[int, int] = (8, 6), color: str = "red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


# -- OpenAI request translation ---------------------------------------------------------------
def test_openai_text_and_image_parts_become_messages() -> None:
    image = png_bytes()
    req = openai_api.parse_chat_request({
        "model": MODEL,
        "messages": [{"role": "developer", "content": "be brief"},
                     user([{"type": "text", "text": "what is"},
                           {"type": "image_url", "image_url": {"url": data_url(image)}},
                           {"type": "text", "text": "this?"}]),
                     {"role": "assistant", "content": "a square"},
                     user("sure?")]}, max_context=CTX)
    assert req.model == MODEL
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user"]
    assert req.messages[0].parts == ["be brief"]
    parts = req.messages[1].parts
    assert parts[0] == "what is" and parts[2] == "this?"
    assert isinstance(parts[1], ImageInput) and parts[1].data == image
    assert req.messages[3].parts == ["sure?"]
    assert not req.stream and not req.include_usage


def test_openai_sampling_fields() -> None:
    req = openai_api.parse_chat_request({
        "model": MODEL, "messages": [user("hi")], "temperature": 0, "top_p": 0.5, "seed": 7,
        "max_tokens": 9, "max_completion_tokens": 5, "stop": "END", "stream": True,
        "stream_options": {"include_usage": True}}, max_context=CTX)
    p = req.params
    assert (p.temperature, p.top_p, p.seed, p.stop) == (0.0, 0.5, 7, ["END"])
    assert p.max_new_tokens == 5  # max_completion_tokens wins over the legacy max_tokens
    assert req.stream and req.include_usage
    listed = openai_api.parse_chat_request({"model": MODEL, "messages": [user("hi")],
                                            "stop": ["a", "b"], "max_tokens": 3},
                                           max_context=CTX)
    assert listed.params.stop == ["a", "b"] and listed.params.max_new_tokens == 3
    default = openai_api.parse_chat_request({"model": MODEL, "messages": [user("hi")]},
                                            max_context=CTX)
    assert default.params.max_new_tokens == CTX
    assert default.params.temperature == SamplingParams().temperature


OPENAI_BAD = [
    ({"messages": [user("hi")]}, "model"),
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": 5, "messages": [user("hi")]}, "model"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "content"),
    ({"model": MODEL, "messages": [user(42)]}, "content"),
    ({"model": MODEL, "messages": [user([{"type": "input_audio", "input_audio": {}}])]}, "audio"),
    ({"model": MODEL, "messages": [user([{"type": "file", "file": {}}])]}, "file"),
    ({"model": MODEL, "messages": [user([{"type": "video"}])]}, "video"),
    ({"model": MODEL, "messages": [user([{"type": "text"}])]}, "text"),
    ({"model": MODEL, "messages": [user([{"type": "image_url",
                                          "image_url": {"url": "https://e.com/a.png"}}])]},
     "never fetches"),
    ({"model": MODEL, "messages": [user([{"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,!!!"}}])]},
     "base64"),
    ({"model": MODEL, "messages": [user([{"type": "image_url", "image_url": {
        "url": data_url(b"hello, not an image")}}])]}, "not a JPEG"),
    ({"model": MODEL, "messages": [user([{"type": "image_url", "image_url": {
        "url": "data:audio/wav;base64,AAAA"}}])]}, "media type"),
    ({"model": MODEL, "messages": [user("hi")], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": [user("hi")], "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "messages": [user("hi")], "max_tokens": CTX + 1}, "max_tokens"),
    ({"model": MODEL, "messages": [user("hi")], "max_tokens": "10"}, "max_tokens"),
    ({"model": MODEL, "messages": [user("hi")], "max_completion_tokens": 2.5},
     "max_completion_tokens"),
    ({"model": MODEL, "messages": [user("hi")], "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": [user("hi")], "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": [user("hi")], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [user("hi")], "stop": [""]}, "stop"),
    ({"model": MODEL, "messages": [user("hi")], "stop": 3}, "stop"),
    ({"model": MODEL, "messages": [user("hi")], "stream": "yes"}, "stream"),
    ({"model": MODEL, "messages": [user("hi")], "seed": True}, "seed"),
    ({"model": MODEL, "messages": [user("hi")], "n": 2}, "'n'"),
    ({"model": MODEL, "messages": [user("hi")], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": None,
                                    "tool_calls": [{"id": "x"}]}]}, "tool"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]}]}, "user messages"),
    ([1, 2], "JSON object"),
]


@pytest.mark.parametrize("body,mention", OPENAI_BAD)
def test_openai_rejects_bad_requests(body: Any, mention: str) -> None:
    with pytest.raises(ApiError) as caught:
        openai_api.parse_chat_request(body, max_context=CTX)
    assert caught.value.status == 400
    assert mention.lower() in caught.value.message.lower()


# -- Anthropic request translation -------------------------------------------------------------
def test_anthropic_system_blocks_images_and_params() -> None:
    image = png_bytes((5, 9))
    req = anthropic_api.parse_messages_request({
        "model": MODEL, "max_tokens": 12, "temperature": 0.3, "top_p": 0.9, "top_k": 4,
        "stop_sequences": ["\n\nHuman:"], "stream": True,
        "system": [{"type": "text", "text": "rule one", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "rule two"}],
        "tools": [{"name": "ignored", "input_schema": {"type": "object"}}],
        "messages": [
            user([{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": base64.b64encode(image).decode()}},
                  {"type": "text", "text": "describe"}]),
            {"role": "assistant", "content": [{"type": "text", "text": "a bar"}]},
            user("and?")]}, max_context=CTX)
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user"]
    assert req.messages[0].parts == ["rule one", "rule two"]
    assert isinstance(req.messages[1].parts[0], ImageInput)
    assert req.messages[1].parts[0].data == image and req.messages[1].parts[1] == "describe"
    assert req.messages[2].parts == ["a bar"]
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.stop) == \
        (12, 0.3, 0.9, 4, ["\n\nHuman:"])
    assert req.stream
    plain = anthropic_api.parse_messages_request(
        {"model": MODEL, "max_tokens": 1, "system": "be kind", "messages": [user("x")]},
        max_context=CTX)
    assert plain.messages[0] == Message("system", ["be kind"])


def _image_block(source: dict[str, Any]) -> dict[str, Any]:
    return {"type": "image", "source": source}


ANTHROPIC_BAD = [
    ({"model": MODEL, "messages": [user("hi")]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": [user("hi")]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": CTX + 1, "messages": [user("hi")]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": [user("hi")]}, "model"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     "system"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user"}]}, "content"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([{"type": "tool_use", "id": "t",
                                                           "name": "f", "input": {}}])]},
     "tool"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([{"type": "document"}])]},
     "document"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([{"type": "audio"}])]}, "audio"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([_image_block(
        {"type": "url", "url": "https://e.com/x.png"})])]}, "never fetches"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([_image_block(
        {"type": "base64", "media_type": "image/png", "data": "***"})])]}, "base64"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([_image_block(
        {"type": "base64", "media_type": "image/png",
         "data": base64.b64encode(b"plain text").decode()})])]}, "not a JPEG"),
    ({"model": MODEL, "max_tokens": 5, "messages": [user([_image_block(
        {"type": "base64", "media_type": "application/pdf", "data": "AAAA"})])]}, "media_type"),
    ({"model": MODEL, "max_tokens": 5, "temperature": 1.5, "messages": [user("hi")]},
     "temperature"),
    ({"model": MODEL, "max_tokens": 5, "stop_sequences": "x", "messages": [user("hi")]},
     "stop_sequences"),
    ({"model": MODEL, "max_tokens": 5, "top_k": -1, "messages": [user("hi")]}, "top_k"),
    ({"model": MODEL, "max_tokens": 5, "system": 7, "messages": [user("hi")]}, "system"),
]


@pytest.mark.parametrize("body,mention", ANTHROPIC_BAD)
def test_anthropic_rejects_bad_requests(body: Any, mention: str) -> None:
    with pytest.raises(ApiError) as caught:
        anthropic_api.parse_messages_request(body, max_context=CTX)
    assert caught.value.status == 400
    assert mention.lower() in caught.value.message.lower()


# -- response shapes ------------------------------------------------------------------------
def done(reason: str = "stop", prompt: int = 30, completion: int = 4, reused: int = 11,
         stop: str | None = None) -> Done:
    return Done(reason, prompt, completion, reused, 1, {}, stop)


def parse_openai_sse(raw: bytes) -> list[Any]:
    """data: lines → JSON objects, with the literal [DONE] kept as a string."""
    assert raw.endswith(b"\n\n")
    out: list[Any] = []
    for record in raw.decode().split("\n\n")[:-1]:
        assert record.startswith("data: "), record
        payload = record[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def parse_anthropic_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for record in raw.decode().split("\n\n")[:-1]:
        event_line, data_line = record.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        out.append((event_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out


def test_openai_completion_body_shape() -> None:
    body = openai_api.completion_body("chatcmpl-1", 100, MODEL, "hello", done("length"))
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
                             "prompt_tokens_details": {"cached_tokens": 11},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    assert openai_api.finish_reason(done("stop", stop="X")) == "stop"


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_chunk_stream_shape(include_usage: bool) -> None:
    stream = openai_api.ChunkStream(MODEL, include_usage, "chatcmpl-9", 5)
    raw = stream.start() + stream.delta("he") + stream.delta("") + stream.delta("llo") \
        + stream.finish(done("stop"))
    items = parse_openai_sse(raw)
    assert items[-1] == "[DONE]"
    chunks = items[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-9"
               and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[1:3]]
    assert texts == ["he", "llo"]  # the empty delta produced no chunk
    final = chunks[3]["choices"][0]
    assert final["delta"] == {} and final["finish_reason"] == "stop"
    if include_usage:
        assert len(chunks) == 5
        assert all(c["usage"] is None for c in chunks[:4])
        assert chunks[4]["choices"] == []
        assert chunks[4]["usage"]["prompt_tokens_details"]["cached_tokens"] == 11
    else:
        assert len(chunks) == 4 and all("usage" not in c for c in chunks)


def test_anthropic_message_body_and_stop_reasons() -> None:
    body = anthropic_api.message_body("msg_1", MODEL, "hi", done("stop", stop="###"))
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "hi"}]
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "###"
    assert body["usage"] == {"input_tokens": 19, "output_tokens": 4,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 11}
    assert anthropic_api.stop_reason(done("stop")) == "end_turn"
    assert anthropic_api.stop_reason(done("length")) == "max_tokens"


def test_anthropic_event_sequence() -> None:
    stream = anthropic_api.MessageStream(MODEL, "msg_7")
    raw = stream.start(30) + stream.delta("a") + stream.delta("") + anthropic_api.PING \
        + stream.delta("b") + stream.finish(done("length", completion=2))
    events = parse_anthropic_sse(raw)
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta",
                     "ping", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"] == "msg_7" and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 30
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert [d["delta"] for n, d in events if n == "content_block_delta"] == \
        [{"type": "text_delta", "text": "a"}, {"type": "text_delta", "text": "b"}]
    delta = events[7][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == 30


def test_error_bodies() -> None:
    error = ApiError("model_not_found", "no such model", "model")
    assert error.status == 404
    assert openai_error_body(error) == {"error": {"message": "no such model",
                                                  "type": "invalid_request_error",
                                                  "param": "model", "code": "model_not_found"}}
    assert anthropic_error_body(error) == {"type": "error", "error": {
        "type": "not_found_error", "message": "no such model"}}
    busy = ApiError("rate_limit", "busy", retry_after=3)
    assert busy.status == 429 and busy.headers() == {"retry-after": "3"}
    assert anthropic_error_body(ApiError("too_large", "big"))["error"]["type"] == \
        "request_too_large"


# -- the app over a fake backend ----------------------------------------------------------
class FakeChat:
    """Stands in for ChatSession: counts one token per character, replies with fixed words."""

    WORDS = ["alpha ", "beta ", "gamma ", "delta"]

    def __init__(self, gate: threading.Event | None):
        self.calls: list[tuple[list[Message], SamplingParams]] = []
        self.gate = gate
        self.previous = 0

    def count_tokens(self, messages: list[Message]) -> int:
        total = 0
        for m in messages:
            for p in m.parts:
                if isinstance(p, ImageInput):
                    if not p.data.startswith(b"\x89PNG"):
                        raise UserError("the image is not a PNG")
                    total += 4
                else:
                    total += len(p)
        return total + 2

    def generate(self, messages: list[Message], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[TextDelta | Done]:
        self.calls.append((messages, params))
        prompt = self.count_tokens(messages)
        reused, self.previous = min(self.previous, prompt - 1), prompt
        emitted = 0
        for n, word in enumerate(self.WORDS[:params.max_new_tokens]):
            if self.gate is not None:
                self.gate.wait(10)
            if cancel is not None and cancel.is_set():
                yield Done("cancelled", prompt, emitted, reused, 0, {})
                return
            emitted += 1
            yield TextDelta(word, n)
        reason = "length" if params.max_new_tokens < len(self.WORDS) else "stop"
        yield Done(reason, prompt, emitted, reused, 0, {})


class FakeEngine:
    def __init__(self, gate: threading.Event | None = None):
        self.chat = FakeChat(gate)
        self.closed = False

    def new_chat(self) -> FakeChat:
        return self.chat

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def served() -> Iterator[tuple[TestClient, FakeEngine, Worker]]:
    engine = FakeEngine()
    worker = Worker(lambda: engine, max_queue=2)
    worker.start()
    for _ in range(200):
        if worker.status == "ready":
            break
        threading.Event().wait(0.01)
    app = create_app(worker, ServerConfig(model_id=MODEL, api_key="sekret", max_context=CTX,
                                          max_body_bytes=64 * 1024))
    with TestClient(app) as client:
        yield client, engine, worker
    worker.stop()
    assert engine.closed


def sdk_openai(client: TestClient, key: str = "sekret") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client,
                         max_retries=0)


def sdk_anthropic(client: TestClient, key: str = "sekret") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key=key, http_client=client,
                               max_retries=0)


def test_app_openai_sdk_roundtrip(served: tuple[TestClient, FakeEngine, Worker]) -> None:
    client, engine, _ = served
    api = sdk_openai(client)
    assert [m.id for m in api.models.list().data] == [MODEL]
    reply = api.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, seed=1, stop=["zz"],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]}])
    assert reply.choices[0].message.content == "alpha beta gamma "
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == 4 + 4 + 2 and reply.usage.completion_tokens == 3
    messages, params = engine.chat.calls[-1]
    assert isinstance(messages[0].parts[1], ImageInput)
    assert (params.max_new_tokens, params.temperature, params.seed, params.stop) == \
        (3, 0.0, 1, ["zz"])
    pieces, usage, reasons = [], None, []
    for chunk in api.chat.completions.create(model=MODEL, messages=[user("look")], stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert "".join(pieces) == "".join(FakeChat.WORDS) and reasons[-1] == "stop"
    assert usage is not None and usage.prompt_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == 5  # the fake reuses the previous prompt


def test_app_anthropic_sdk_roundtrip(served: tuple[TestClient, FakeEngine, Worker]) -> None:
    client, engine, _ = served
    api = sdk_anthropic(client)
    reply = api.messages.create(model=MODEL, max_tokens=2, system="sys",
                                messages=[user("hello")])
    assert reply.content[0].text == "alpha beta " and reply.stop_reason == "max_tokens"
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == 3 + 5 + 2
    with api.messages.stream(model=MODEL, max_tokens=10, messages=[user("hello")]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(FakeChat.WORDS) and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4
    counted = api.messages.count_tokens(model=MODEL, messages=[user("hello")])
    assert counted.input_tokens == 5 + 2


def test_app_auth_limits_and_errors(served: tuple[TestClient, FakeEngine, Worker]) -> None:
    client, _, _ = served
    assert client.get("/healthz").json() == {"status": "ready"}  # no key needed
    with pytest.raises(openai.AuthenticationError):
        sdk_openai(client, "wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError):
        sdk_anthropic(client, "wrong").messages.create(model=MODEL, max_tokens=1,
                                                       messages=[user("x")])
    assert client.get("/v1/models").status_code == 401  # no key at all
    assert client.get("/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200
    key = {"x-api-key": "sekret"}
    big = client.post("/v1/messages", headers=key, content=b"{" + b" " * 70000 + b"}")
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    bad = client.post("/v1/chat/completions", headers=key, content=b"{nope")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unknown = client.post("/v1/messages", headers=key,
                          json={"model": "claude-x", "max_tokens": 1, "messages": [user("x")]})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        sdk_openai(client).chat.completions.create(model="gpt-x", messages=[user("x")])
    # a content error found while counting (the fake's stand-in for an undecodable image)
    gif = base64.b64encode(b"GIF89a" + b"\0" * 20).decode()
    decoded = client.post("/v1/messages", headers=key, json={
        "model": MODEL, "max_tokens": 1,
        "messages": [user([{"type": "image", "source": {"type": "base64",
                                                         "media_type": "image/gif",
                                                         "data": gif}}])]})
    assert decoded.status_code == 400 and "PNG" in decoded.json()["error"]["message"]
    too_long = client.post("/v1/chat/completions", headers=key, json={
        "model": MODEL, "messages": [user("x" * CTX)]})
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
    route = client.get("/v1/nowhere", headers=key)
    assert route.status_code == 404 and "error" in route.json()
    # still serving
    ok = client.post("/v1/chat/completions", headers=key,
                     json={"model": MODEL, "messages": [user("x")], "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "alpha "


def test_worker_queue_full_and_loading() -> None:
    import asyncio

    gate = threading.Event()
    engine = FakeEngine(gate)
    worker = Worker(lambda: engine, max_queue=1)
    with pytest.raises(ApiError) as loading:
        worker.submit([Message("user", ["x"])], SamplingParams(), asyncio.new_event_loop())
    assert loading.value.kind == "unavailable" and "loading" in loading.value.message
    worker.start()
    for _ in range(200):
        if worker.status == "ready":
            break
        threading.Event().wait(0.01)
    loop = asyncio.new_event_loop()
    try:
        first = worker.submit([Message("user", ["a"])], SamplingParams(max_new_tokens=2), loop)
        for _ in range(500):  # until the worker has taken the first job off the queue
            if engine.chat.calls:
                break
            threading.Event().wait(0.01)
        worker.submit([Message("user", ["b"])], SamplingParams(max_new_tokens=2), loop)
        with pytest.raises(ApiError) as full:
            worker.submit([Message("user", ["c"])], SamplingParams(), loop)
        assert full.value.status == 429 and full.value.headers()["retry-after"]
        first.cancel.set()
    finally:
        gate.set()
        worker.stop()
        loop.close()
    assert len(engine.chat.calls) <= 2


def test_app_reports_loading_then_ready() -> None:
    release = threading.Event()
    engine = FakeEngine()

    def slow_open() -> FakeEngine:
        release.wait(10)
        return engine

    worker = Worker(slow_open, max_queue=2)
    worker.start()
    app = create_app(worker, ServerConfig(model_id=MODEL, max_context=CTX))
    try:
        with TestClient(app) as client:
            assert client.get("/healthz").json() == {"status": "loading"}
            early = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                      "messages": [user("x")]})
            assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
            assert early.headers["retry-after"]
            release.set()
            for _ in range(500):
                if client.get("/healthz").json()["status"] == "ready":
                    break
                threading.Event().wait(0.01)
            assert client.get("/healthz").json() == {"status": "ready"}
            late = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1,
                                                     "messages": [user("x")]})
            assert late.status_code == 200 and late.json()["content"][0]["text"] == "alpha "
    finally:
        release.set()
        worker.stop()


def test_app_reports_failed_load() -> None:
    def broken() -> FakeEngine:
        raise UserError("PACK_COMPLETE.json is missing")

    failures: list[str] = []
    worker = Worker(broken, max_queue=1, on_failed=failures.append)
    worker.start()
    for _ in range(500):
        if worker.status != "loading":
            break
        threading.Event().wait(0.01)
    app = create_app(worker, ServerConfig(model_id=MODEL, max_context=CTX))
    with TestClient(app) as client:
        health = client.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "PACK_COMPLETE" in health.json()["error"]
        chat = client.post("/v1/chat/completions", json={"model": MODEL,
                                                         "messages": [user("x")]})
        assert chat.status_code == 503 and "PACK_COMPLETE" in chat.json()["error"]["message"]
    assert failures and "PACK_COMPLETE" in failures[0]
    worker.stop()
