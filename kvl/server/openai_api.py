"""OpenAI Chat Completions dialect: request JSON → Message/SamplingParams, events → JSON/SSE.

Owns: validating a /v1/chat/completions body, the chat.completion and chat.completion.chunk
shapes (including the usage-only final chunk of stream_options.include_usage) and the model list.
Does not own: HTTP, auth, queueing (app.py / worker.py) or generation (kvl.engine).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvl.conversation import ImageInput, Message
from kvl.generate import Done, SamplingParams
from kvl.server.errors import (
    IMAGE_MEDIA_TYPES,
    ApiError,
    decode_image_base64,
    get_bool,
    get_int,
    get_number,
    get_str,
    invalid,
    json_type,
    max_tokens_value,
    require_object,
    stop_list,
)

# "developer" is the newer OpenAI name for the system role.
ROLE_MAP = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
            "tool": "tool"}
UNSUPPORTED_PARTS = {"input_audio": "audio input", "file": "file input",
                     "refusal": "refusal parts"}


@dataclass
class ChatRequest:
    model: str
    messages: list[Message]
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_image_url(part: dict[str, Any], where: str) -> ImageInput:
    spec = part.get("image_url")
    url = spec if isinstance(spec, str) else (spec.get("url") if isinstance(spec, dict) else None)
    if not isinstance(url, str):
        raise invalid(f"{where}.image_url must be an object with a string 'url'", where)
    if url.startswith(("http://", "https://")):
        raise invalid(f"{where}: this server never fetches URLs; send the image inline as a "
                      "data URL (data:image/png;base64,...)", where)
    if not url.startswith("data:"):
        raise invalid(f"{where}: image_url.url must be a data URL "
                      "(data:image/jpeg|png|webp;base64,...)", where)
    header, sep, payload = url[5:].partition(",")
    media_type, *options = header.split(";")
    if not sep or "base64" not in options:
        raise invalid(f"{where}: the data URL must be base64-encoded "
                      "(data:<media type>;base64,<data>)", where)
    if media_type.lower() not in IMAGE_MEDIA_TYPES:
        raise invalid(f"{where}: unsupported media type {media_type!r}; send one of "
                      f"{', '.join(IMAGE_MEDIA_TYPES)}", where)
    return ImageInput(decode_image_base64(payload, where))


def parse_content(content: Any, role: str, where: str) -> list[str | ImageInput]:
    if isinstance(content, str):
        return [content]
    if content is None:
        raise invalid(f"{where}.content is required (tool calls are not supported by this "
                      "server)", f"{where}.content")
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or an array of content parts, "
                      f"got {json_type(content)}", f"{where}.content")
    parts: list[str | ImageInput] = []
    for n, raw in enumerate(content):
        part_where = f"{where}.content[{n}]"
        part = require_object(raw, part_where)
        kind = part.get("type")
        if kind == "text":
            parts.append(get_str(part, "text", f"{part_where}.text", required=True) or "")
        elif kind == "image_url":
            if role not in ("user", "system"):
                raise invalid(f"{part_where}: images are only accepted in user messages",
                              part_where)
            parts.append(parse_image_url(part, part_where))
        elif kind in UNSUPPORTED_PARTS:
            raise invalid(f"{part_where}: {UNSUPPORTED_PARTS[kind]} is not supported; this "
                          "model reads text and images", part_where)
        else:
            raise invalid(f"{part_where}: unsupported content part type {kind!r}; use 'text' or "
                          "'image_url'", part_where)
    return parts


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list):
        raise invalid(f"'messages' must be an array, got {json_type(raw)}", "messages")
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages")
    messages: list[Message] = []
    for n, item in enumerate(raw):
        where = f"messages[{n}]"
        message = require_object(item, where)
        role = message.get("role")
        if role not in ROLE_MAP:
            raise invalid(f"{where}.role is {role!r}; use one of {', '.join(ROLE_MAP)}",
                          f"{where}.role")
        if message.get("tool_calls"):
            raise invalid(f"{where}: tool calls are not supported by this server",
                          f"{where}.tool_calls")
        messages.append(Message(ROLE_MAP[role], parse_content(message.get("content"), role,
                                                              where)))
    return messages


def parse_chat_request(body: Any, *, max_context: int) -> ChatRequest:
    body = require_object(body, "request body")
    model = get_str(body, "model", "model", required=True, allow_empty=False)
    messages = parse_messages(body.get("messages"))
    if get_int(body, "n", "n", 1, 1 << 30) not in (None, 1):
        raise invalid("'n' must be 1: this server generates one choice per request", "n")
    for key in ("tools", "functions"):
        if body.get(key):
            raise invalid(f"'{key}' is not supported: this server has no tool calling", key)
    if body.get("logprobs"):
        raise invalid("'logprobs' is not supported by this server", "logprobs")
    max_tokens = max_tokens_value(body, "max_completion_tokens", max_context)
    if max_tokens is None:
        max_tokens = max_tokens_value(body, "max_tokens", max_context)
    params = SamplingParams()
    temperature = get_number(body, "temperature", "temperature", 0.0, 2.0)
    if temperature is not None:
        params.temperature = temperature
    top_p = get_number(body, "top_p", "top_p", 0.0, 1.0, low_inclusive=False)
    if top_p is not None:
        params.top_p = top_p
    top_k = get_int(body, "top_k", "top_k", 0, 1 << 30)  # extension (as vLLM / llama.cpp)
    if top_k is not None:
        params.top_k = top_k
    params.seed = get_int(body, "seed", "seed", -(1 << 63), (1 << 64) - 1)
    # Without a limit the reply may fill the context; the engine caps it at what is left.
    params.max_new_tokens = max_tokens if max_tokens is not None else max_context
    params.stop = stop_list(body.get("stop"), "stop")
    stream = get_bool(body, "stream", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        include_usage = get_bool(require_object(options, "stream_options"), "include_usage",
                                 "stream_options.include_usage")
    return ChatRequest(model or "", messages, params, stream, include_usage)


# -- responses --------------------------------------------------------------------------------
def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def usage_body(done: Done) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.reused_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_body(completion_id: str, created: int, model: str, text: str,
                    done: Done) -> dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                 "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason(done)}],
            "usage": usage_body(done)}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


DONE_MARKER = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, a dead socket fails it


class ChunkStream:
    """The chat.completion.chunk sequence of one streamed completion."""

    def __init__(self, model: str, include_usage: bool, completion_id: str | None = None,
                 created: int | None = None):
        self.id = completion_id or new_completion_id()
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.include_usage = include_usage

    def _chunk(self, delta: dict[str, Any], reason: str | None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta(self, text: str) -> bytes:
        return self._chunk({"content": text}, None) if text else b""

    def finish(self, done: Done) -> bytes:
        out = self._chunk({}, finish_reason(done))
        if self.include_usage:
            out += sse({"id": self.id, "object": "chat.completion.chunk",
                        "created": self.created, "model": self.model,
                        "system_fingerprint": None, "choices": [], "usage": usage_body(done)})
        return out + DONE_MARKER

    @staticmethod
    def error(error: ApiError) -> bytes:
        from kvl.server.errors import openai_error_body

        return sse(openai_error_body(error)) + DONE_MARKER


def model_card(model_id: str, created: int, max_context: int, vision: bool) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "kvl",
            "context_length": max_context,
            "capabilities": {"vision": vision, "chat_completions": True, "messages": True,
                             "streaming": True, "tools": False}}


def models_body(model_id: str, created: int, max_context: int, vision: bool) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created, max_context, vision)]}
