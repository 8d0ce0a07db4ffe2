"""Anthropic Messages dialect: request JSON → Message/SamplingParams, events → JSON/SSE.

Owns: validating /v1/messages and /v1/messages/count_tokens bodies, the message object, the
named-event stream (message_start, content_block_start, ping, content_block_delta,
content_block_stop, message_delta, message_stop) and usage in Anthropic's split: input_tokens are
the prompt tokens computed now, cache_read_input_tokens those reused from the KV of earlier turns.
Does not own: HTTP, auth, queueing (app.py / worker.py) or generation (kvl.engine).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvl.conversation import ImageInput, Message
from kvl.generate import Done, SamplingParams
from kvl.server.errors import (
    IMAGE_MEDIA_TYPES,
    ApiError,
    anthropic_error_body,
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

ROLES = ("user", "assistant")
UNSUPPORTED_BLOCKS = {
    "tool_use": "tool use", "tool_result": "tool results", "server_tool_use": "tool use",
    "document": "documents", "search_result": "search results", "thinking": "thinking blocks",
    "redacted_thinking": "thinking blocks", "audio": "audio", "file": "files",
}


@dataclass
class MessagesRequest:
    model: str
    messages: list[Message]
    params: SamplingParams
    stream: bool


def parse_image_block(block: dict[str, Any], where: str) -> ImageInput:
    source = require_object(block.get("source"), f"{where}.source")
    kind = source.get("type")
    if kind == "url":
        raise invalid(f"{where}: this server never fetches URLs; send the image as a base64 "
                      "source ({\"type\": \"base64\", \"media_type\": ..., \"data\": ...})", where)
    if kind != "base64":
        raise invalid(f"{where}.source.type must be 'base64', got {kind!r}", f"{where}.source")
    media_type = get_str(source, "media_type", f"{where}.source.media_type", required=True)
    if (media_type or "").lower() not in IMAGE_MEDIA_TYPES:
        raise invalid(f"{where}.source.media_type {media_type!r} is not supported; use one of "
                      f"{', '.join(IMAGE_MEDIA_TYPES)}", f"{where}.source.media_type")
    data = get_str(source, "data", f"{where}.source.data", required=True) or ""
    return ImageInput(decode_image_base64(data, f"{where}.source.data"))


def parse_blocks(content: Any, role: str, where: str) -> list[str | ImageInput]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or an array of content blocks, got "
                      f"{json_type(content)}", where)
    parts: list[str | ImageInput] = []
    for n, raw in enumerate(content):
        block_where = f"{where}[{n}]"
        block = require_object(raw, block_where)
        kind = block.get("type")
        if kind == "text":
            parts.append(get_str(block, "text", f"{block_where}.text", required=True) or "")
        elif kind == "image":
            if role != "user":
                raise invalid(f"{block_where}: images are only accepted in user messages",
                              block_where)
            parts.append(parse_image_block(block, block_where))
        elif kind in UNSUPPORTED_BLOCKS:
            raise invalid(f"{block_where}: {UNSUPPORTED_BLOCKS[kind]} ({kind!r} blocks) are not "
                          "supported by this server; it reads text and images", block_where)
        else:
            raise invalid(f"{block_where}: unsupported content block type {kind!r}; use 'text' "
                          "or 'image'", block_where)
    return parts


def parse_conversation(body: dict[str, Any]) -> list[Message]:
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        parts = parse_blocks(system, "system", "system")
        if any(isinstance(p, ImageInput) for p in parts):
            raise invalid("system accepts text blocks only", "system")
        messages.append(Message("system", parts))
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise invalid(f"'messages' is required and must be an array, got {json_type(raw)}",
                      "messages")
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages")
    for n, item in enumerate(raw):
        where = f"messages[{n}]"
        message = require_object(item, where)
        role = message.get("role")
        if role not in ROLES:
            hint = " (put system text in the top-level 'system' field)" if role == "system" else ""
            raise invalid(f"{where}.role is {role!r}; use 'user' or 'assistant'{hint}",
                          f"{where}.role")
        if "content" not in message:
            raise invalid(f"{where}.content is required", f"{where}.content")
        messages.append(Message(role, parse_blocks(message["content"], role, f"{where}.content")))
    return messages


def parse_model(body: dict[str, Any]) -> str:
    return get_str(body, "model", "model", required=True, allow_empty=False) or ""


def parse_messages_request(body: Any, *, max_context: int) -> MessagesRequest:
    body = require_object(body, "request body")
    model = parse_model(body)
    messages = parse_conversation(body)
    if body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required", "max_tokens")
    max_tokens = max_tokens_value(body, "max_tokens", max_context)
    params = SamplingParams(max_new_tokens=int(max_tokens or 1))
    temperature = get_number(body, "temperature", "temperature", 0.0, 1.0)
    if temperature is not None:
        params.temperature = temperature
    top_p = get_number(body, "top_p", "top_p", 0.0, 1.0, low_inclusive=False)
    if top_p is not None:
        params.top_p = top_p
    top_k = get_int(body, "top_k", "top_k", 0, 1 << 30)
    if top_k is not None:
        params.top_k = top_k
    if body.get("stop_sequences") is not None and not isinstance(body["stop_sequences"], list):
        raise invalid("'stop_sequences' must be an array of strings", "stop_sequences")
    params.stop = stop_list(body.get("stop_sequences"), "stop_sequences")
    # `tools` / `tool_choice` are accepted and ignored so agents that always send them (Claude
    # Code) still get plain-text answers; tool_use blocks in the conversation are refused above.
    stream = get_bool(body, "stream", "stream")
    return MessagesRequest(model, messages, params, stream)


def parse_count_tokens_request(body: Any) -> tuple[str, list[Message]]:
    body = require_object(body, "request body")
    return parse_model(body), parse_conversation(body)


# -- responses --------------------------------------------------------------------------------
def stop_reason(done: Done) -> str:
    if done.finish_reason == "length":
        return "max_tokens"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_body(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens - done.reused_prompt_tokens,
            "output_tokens": done.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": done.reused_prompt_tokens}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message_body(message_id: str, model: str, text: str, done: Done) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason(done),
            "stop_sequence": done.stop_sequence, "usage": usage_body(done)}


def event(name: str, obj: dict[str, Any]) -> bytes:
    return (f"event: {name}\ndata: ".encode("ascii")
            + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n")


PING = event("ping", {"type": "ping"})


class MessageStream:
    """The named-event sequence of one streamed message (a single text content block)."""

    def __init__(self, model: str, message_id: str | None = None):
        self.id = message_id or new_message_id()
        self.model = model

    def start(self, prompt_tokens: int) -> bytes:
        # Reuse is known only after prefill; message_delta carries the final split.
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return (event("message_start", {"type": "message_start", "message": message})
                + event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
                + PING)

    @staticmethod
    def delta(text: str) -> bytes:
        if not text:
            return b""
        return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": text}})

    @staticmethod
    def finish(done: Done) -> bytes:
        return (event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason(done),
                                                    "stop_sequence": done.stop_sequence},
                                          "usage": usage_body(done)})
                + event("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error(error: ApiError) -> bytes:
        return event("error", anthropic_error_body(error))
