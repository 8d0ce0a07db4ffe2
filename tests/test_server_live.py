"""kvl serve end to end: the real server (a subprocess on 127.0.0.1) over the real Engine on the
tiny pack, driven by the official openai and anthropic SDKs and raw httpx.

One server per module (started with --api-key, --max-queue 1 so a queue-full 429 is easy to
provoke); every test leaves it serving, and several check it still does.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
MODEL = "kimi-vl-a3b-instruct-q8"
KEY = "live-test-key"
CTX = 8192
SLOW = 8000  # max_tokens of requests meant to still be running when we disconnect


class Server:
    def __init__(self, url: str, process: subprocess.Popen, log_path: Path):
        self.url = url
        self.process = process
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text("utf-8", errors="replace")

    def openai(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def anthropic(self, key: str = KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"x-api-key": key} if key else {})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    return out


@pytest.fixture(scope="module")
def server(tiny_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log_file = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvl", "serve", str(tiny_pack), "--host", "127.0.0.1",
         "--port", str(port), "--api-key", KEY, "--max-queue", "1", "--max-context", str(CTX),
         "--threads", "1"],
        cwd=REPO, env=env(), stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    handle = Server(url, process, log_path)
    status = None
    try:
        for _ in range(600):  # up to 60 s for startup and engine load
            if process.poll() is not None:
                pytest.fail(f"kvl serve exited with {process.returncode}:\n{handle.log()}")
            try:
                status = httpx.get(f"{url}/healthz", timeout=2).json()["status"]
            except httpx.TransportError:
                status = None
            if status == "ready":
                break
            time.sleep(0.1)
        assert status == "ready", handle.log()
        yield handle
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log_file.close()


def png(size: tuple[int, int] = (56, 56), seed: int = 0) -> bytes:
    image = Image.new("RGB", size)
    image.putdata([((x * 7 + seed) % 256, (y * 5) % 256, (x * y + seed) % 256)
                   for y in range(size[1]) for x in range(size[0])])
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- basics ---------------------------------------------------------------------------------
def test_health_and_models(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ready"}
    models = server.openai().models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = server.http().get("/v1/models").json()
    assert raw["data"][0]["capabilities"]["vision"] is True


def test_wrong_key_is_401(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.openai("not-the-key").chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        server.anthropic("not-the-key").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with server.http(None) as client:
        missing = client.post("/v1/messages/count_tokens", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        bearer = client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert bearer.status_code == 200
        assert client.get("/healthz").status_code == 200


# -- OpenAI ---------------------------------------------------------------------------------
def test_openai_nonstream_and_stream_agree(server: Server) -> None:
    api = server.openai()
    messages = [{"role": "user", "content": "Name three colours."}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                        temperature=0)
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    pieces: list[str] = []
    reasons: list[str | None] = []
    usage = None
    for chunk in api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert "".join(pieces) == choice.message.content
    assert reasons[-1] == choice.finish_reason and all(r is None for r in reasons[:-1])
    assert usage is not None
    assert usage.completion_tokens == reply.usage.completion_tokens
    assert usage.prompt_tokens == reply.usage.prompt_tokens
    # the same conversation again: all but the last prompt token come from the KV
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def last_chat_line(server: Server) -> str:
    """The server's log line of the latest successful chat completion (logged before the reply
    is sent, so it is there once the SDK call returns)."""
    return [line for line in server.log().splitlines()
            if "POST /v1/chat/completions 200" in line][-1]


def test_openai_image_data_url(server: Server) -> None:
    api = server.openai()
    image = png(seed=3)
    text_only = [{"role": "user", "content": "Describe the picture."}]
    with_image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(image)}"}},
        {"type": "text", "text": "Describe the picture."}]}]
    plain = api.chat.completions.create(model=MODEL, messages=text_only, max_tokens=3,
                                        temperature=0)
    pictured = api.chat.completions.create(model=MODEL, messages=with_image, max_tokens=3,
                                           temperature=0)
    assert pictured.usage.prompt_tokens > plain.usage.prompt_tokens
    assert isinstance(pictured.choices[0].message.content, str)
    assert "images=1" in last_chat_line(server)  # the image was encoded once ...
    again = api.chat.completions.create(model=MODEL, messages=with_image, max_tokens=3,
                                        temperature=0)
    assert again.choices[0].message.content == pictured.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert "images=0" in last_chat_line(server)  # ... and not re-encoded on reuse


def test_openai_multi_turn_reuses_prefix(server: Server) -> None:
    api = server.openai()
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of a made-up country?"}]
    first = api.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                        temperature=0.7, seed=11)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And its largest river?"}]
    second = api.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                         temperature=0.7, seed=11)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the whole first prompt came from the KV
    assert cached < second.usage.prompt_tokens


# -- Anthropic ------------------------------------------------------------------------------
def test_anthropic_nonstream_and_stream(server: Server) -> None:
    api = server.anthropic()
    # this anthropic SDK has no temperature argument; the API field travels in extra_body
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=7, extra_body={"temperature": 0},
                                  system=[{"type": "text", "text": "Be terse."}],
                                  messages=[{"role": "user", "content": "Count to five."}])
    reply = api.messages.create(**kwargs)
    assert reply.role == "assistant" and reply.content[0].type == "text"
    assert reply.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert 1 <= reply.usage.output_tokens <= 7
    with api.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text
    assert final.stop_reason == reply.stop_reason
    assert final.usage.output_tokens == reply.usage.output_tokens
    total = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    counted = api.messages.count_tokens(model=MODEL, system=kwargs["system"],
                                        messages=kwargs["messages"]).input_tokens
    assert counted == total
    # message_delta's cumulative usage gives the final split; the repeat reused the prompt
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted
    assert final.usage.cache_read_input_tokens == counted - 1


def test_anthropic_raw_event_sequence(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Say something."}]}
    names: list[str] = []
    datas: list[dict[str, Any]] = []
    with server.http() as client, client.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        current = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                current = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == current
                names.append(current)
                datas.append(data)
    sequence = " ".join(names)
    assert re.fullmatch(r"message_start content_block_start( ping| content_block_delta)* "
                        r"content_block_stop message_delta message_stop", sequence), sequence
    assert "ping" in names
    delta = datas[names.index("message_delta")]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence")
    outputs = sum(1 for n in names if n == "content_block_delta")
    assert 1 <= delta["usage"]["output_tokens"] <= 5 and outputs <= delta["usage"]["output_tokens"]


def test_anthropic_image_and_multi_turn(server: Server) -> None:
    api = server.anthropic()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(png((84, 56), seed=9))}}
    turn = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    first = api.messages.create(model=MODEL, max_tokens=5, messages=turn,
                                 extra_body={"temperature": 0})
    first_prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    counted = api.messages.count_tokens(model=MODEL, messages=turn).input_tokens
    without = api.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]).input_tokens
    assert counted == first_prompt and counted > without
    turn += [{"role": "assistant", "content": first.content[0].text},
             {"role": "user", "content": "Are you sure?"}]
    second = api.messages.create(model=MODEL, max_tokens=5, messages=turn,
                                 extra_body={"temperature": 0})
    assert second.usage.cache_read_input_tokens >= first_prompt
    assert second.usage.input_tokens > 0


def test_count_tokens_equals_chat_prompt_tokens(server: Server) -> None:
    image = png((70, 42), seed=5)
    counted = server.anthropic().messages.count_tokens(
        model=MODEL, system="Look carefully.",
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "First:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(image)}},
            {"type": "text", "text": "what colour dominates?"}]}]).input_tokens
    reply = server.openai().chat.completions.create(
        model=MODEL, max_tokens=2, messages=[
            {"role": "system", "content": "Look carefully."},
            {"role": "user", "content": [
                {"type": "text", "text": "First:"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(image)}"}},
                {"type": "text", "text": "what colour dominates?"}]}])
    assert reply.usage.prompt_tokens == counted


# -- against kvl chat ------------------------------------------------------------------------
def test_greedy_output_matches_kvl_chat(server: Server, tiny_pack: Path) -> None:
    prompt = "Tell me about the sea, briefly."
    # the TypeScript kvl chat (dist/, built by scripts/test before pytest) on the same native core
    chat = subprocess.run(
        ["node", str(REPO / "dist" / "cli" / "kvl.js"), "chat", str(tiny_pack), prompt, "--json",
         "--backend", "native", "--temperature", "0", "--max-new", "12", "--max-context", str(CTX),
         "--threads", "1"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr
    expected = json.loads(chat.stdout.strip().splitlines()[-1])
    messages = [{"role": "user", "content": prompt}]
    via_openai = server.openai().chat.completions.create(model=MODEL, messages=messages,
                                                         max_tokens=12, temperature=0)
    assert via_openai.choices[0].message.content == expected["reply"]
    assert via_openai.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert via_openai.usage.completion_tokens == expected["usage"]["completion_tokens"]
    via_anthropic = server.anthropic().messages.create(model=MODEL, messages=messages,
                                                       max_tokens=12,
                                                       extra_body={"temperature": 0})
    assert via_anthropic.content[0].text == expected["reply"]


# -- queueing and disconnects ------------------------------------------------------------------
def test_queue_full_429_and_disconnects(server: Server) -> None:
    start = len(server.log())
    slow = {"model": MODEL, "max_tokens": SLOW, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    with (server.http() as running_client, server.http() as waiting_client,
          running_client.stream("POST", "/v1/chat/completions", json=slow) as running):
        assert running.status_code == 200
        lines = running.iter_lines()
        for line in lines:  # until a generated token arrives: the worker is busy with it
            if line.startswith("data: ") and '"content": "' in line and \
                    '"role"' not in line:
                break
        with waiting_client.stream("POST", "/v1/messages", json=slow) as waiting:
            assert waiting.status_code == 200
            waiting_lines = waiting.iter_lines()  # kept referenced: dropping it closes
            assert next(waiting_lines) == "event: message_start"  # queued, still connected
            with pytest.raises(openai.RateLimitError):
                server.openai().chat.completions.create(
                    model=MODEL, max_tokens=2,
                    messages=[{"role": "user", "content": "hi"}])
            with server.http() as client:
                busy = client.post("/v1/messages", json={
                    "model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]})
            assert busy.status_code == 429
            assert busy.json()["error"]["type"] == "rate_limit_error"
            assert int(busy.headers["retry-after"]) > 0
        # leaving the blocks closes both connections mid-stream
    after = server.openai().chat.completions.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Still there?"}])
    assert after.choices[0].finish_reason in ("stop", "length")
    assert 1 <= after.usage.completion_tokens <= 3
    log = server.log()[start:]
    cancelled = [int(n) for n in re.findall(r"generation cancelled after (\d+) token", log)]
    assert cancelled and min(cancelled) < SLOW
    # The queued request's client left too. Both connections close at once, so the worker either
    # skipped it while it waited or, when the disconnect reached it just after the running one
    # ended, started it and cancelled it at once: never a whole reply to nobody.
    skipped = "skipped a queued request whose client disconnected" in log
    assert skipped or len(cancelled) >= 2, log


def test_disconnect_nonstreaming_then_normal(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": SLOW, "temperature": 0,
            "messages": [{"role": "user", "content": "Another long story, please."}]}
    before = server.log().count("generation cancelled after")
    done = threading.Event()

    def give_up() -> None:
        try:
            with server.http() as client:
                client.post("/v1/chat/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            pass
        done.set()

    thread = threading.Thread(target=give_up)
    thread.start()
    thread.join(30)
    assert done.is_set()
    reply = server.anthropic().messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "ok?"}])
    assert 1 <= reply.usage.output_tokens <= 2
    assert server.log().count("generation cancelled after") == before + 1


# -- bad input ---------------------------------------------------------------------------------
def _oai(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def _ant(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}],
            **extra}


def _oai_image(url: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}


def _ant_image(data: str, media_type: str = "image/png") -> dict[str, Any]:
    return _ant([{"type": "image", "source": {"type": "base64", "media_type": media_type,
                                              "data": data}}])


BAD: list[tuple[str, Any, int, str]] = [
    ("/v1/chat/completions", b"{not json", 400, "invalid_request_error"),
    ("/v1/messages", b"[1, 2]", 400, "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai(messages="hi"), 400, "invalid_request_error"),
    ("/v1/chat/completions", _oai(max_tokens=0), 400, "invalid_request_error"),
    ("/v1/chat/completions", _oai(max_tokens=-5), 400, "invalid_request_error"),
    ("/v1/chat/completions", _oai(max_tokens=CTX * 10), 400, "invalid_request_error"),
    ("/v1/messages", _ant(max_tokens=10 ** 9), 400, "invalid_request_error"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai(temperature="warm"), 400, "invalid_request_error"),
    ("/v1/chat/completions", _oai(messages=[{"role": "narrator", "content": "x"}]), 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]), 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai(messages=[{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "f"}}]}]), 400, "invalid_request_error"),
    ("/v1/messages", _ant([{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]), 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai_image("https://example.com/cat.png"), 400,
     "invalid_request_error"),
    ("/v1/chat/completions", _oai_image("data:image/png;base64,%%%notbase64"), 400,
     "invalid_request_error"),
    ("/v1/messages", _ant_image(b64(b"just some text, not an image")), 400,
     "invalid_request_error"),
    ("/v1/messages", _ant_image(b64(png()[:60])), 400, "invalid_request_error"),  # truncated
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": b64(b"\x89PNG\r\n\x1a\nxx")}}]}]},
     400, "invalid_request_error"),
    ("/v1/chat/completions", _oai(model="gpt-4o"), 404, "invalid_request_error"),
    ("/v1/messages", _ant(model="claude-3-5-sonnet-latest"), 404, "not_found_error"),
    ("/v1/messages", _ant("x" * (CTX * 8)), 400, "invalid_request_error"),  # over the context
]


def test_bad_input_is_4xx_and_server_keeps_serving(server: Server) -> None:
    with server.http() as client:
        for path, body, status, kind in BAD:
            if isinstance(body, bytes):
                response = client.post(path, content=body,
                                       headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            payload = response.json()
            if path.startswith("/v1/messages"):
                assert payload["type"] == "error" and payload["error"]["type"] == kind
            else:
                assert payload["error"]["type"] == kind and payload["error"]["message"]
        huge = client.post("/v1/messages", content=b"{" + b" " * (21 << 20) + b"}",
                           headers={"content-type": "application/json"})
        assert huge.status_code == 413
        assert huge.json()["error"]["type"] == "request_too_large"
        assert client.get("/healthz").json() == {"status": "ready"}
    reply = server.openai().chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hello again"}])
    assert 1 <= reply.usage.completion_tokens <= 2
    assert server.process.poll() is None
