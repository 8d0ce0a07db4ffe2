"""Conversation: messages (text + images) → prompt tokens + the media they reference.

Owns: the Message / ImageInput types, turning messages into the HF message shape the chat
template expects, media expansion with each image's token count, and the per-position identity
keys used for prefix reuse (a media position is identified by its image's content hash and row,
so two different images with the same grid never count as a shared prefix).
Does not own: pixels (image.py), the vision forward (engine.py) or the sampling loop (generate.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvl.chat_template import ChatTemplate, expand_media
from kvl.errors import UserError
from kvl.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ImageInput:
    """An image as the encoded file bytes (JPEG/PNG/WebP/GIF)."""
    data: bytes

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class Message:
    """One turn. role: system | user | assistant | tool; parts: text strings and images in order."""
    role: str
    parts: list[str | ImageInput] = field(default_factory=list)


@dataclass
class PromptImage:
    digest: str
    image: ImageInput
    grid: tuple[int, int]
    n_tokens: int


@dataclass
class Prompt:
    """A rendered prompt: token ids (media expanded), its images in order, and position keys."""
    tokens: list[int]
    images: list[PromptImage]
    keys: list[Hashable]


def to_template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """HF-shaped message dicts: content is a string when the turn is one text part, else a list."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Message):
            raise UserError(f"message {index} is a {type(message).__name__}, expected Message")
        if message.role not in ROLES:
            raise UserError(f"message {index} has role {message.role!r}; "
                            f"use one of {', '.join(ROLES)}")
        parts = list(message.parts)
        if len(parts) == 1 and isinstance(parts[0], str):
            out.append({"role": message.role, "content": parts[0]})
            continue
        items: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, str):
                items.append({"type": "text", "text": part})
            elif isinstance(part, ImageInput):
                if message.role not in ("user", "system"):
                    raise UserError(f"message {index} ({message.role}) has an image; "
                                    "images are only accepted in user or system messages")
                items.append({"type": "image"})
            else:
                raise UserError(f"message {index} has a part of type {type(part).__name__}; "
                                "parts are text strings or ImageInput")
        out.append({"role": message.role, "content": items})
    return out


def message_images(messages: Sequence[Message]) -> list[ImageInput]:
    return [p for m in messages for p in m.parts if isinstance(p, ImageInput)]


def build_prompt(messages: Sequence[Message], template: ChatTemplate, tokenizer: Tokenizer,
                 image_grid: Callable[[ImageInput], tuple[int, int]],
                 merge: tuple[int, int], add_generation_prompt: bool = True) -> Prompt:
    """Render, tokenize and media-expand messages.

    image_grid maps an image to its patch grid (rows, cols) after official preprocessing.
    """
    if not messages:
        raise UserError("the conversation is empty; send at least one message")
    text = template.render(to_template_messages(messages), add_generation_prompt)
    images: list[PromptImage] = []
    for image in message_images(messages):
        grid = image_grid(image)
        n_tokens = (grid[0] // merge[0]) * (grid[1] // merge[1])
        images.append(PromptImage(image.digest, image, grid, n_tokens))
    tokens = expand_media(tokenizer.encode(text), [i.n_tokens for i in images],
                          tokenizer.media_pad)
    keys: list[Hashable] = []
    image_iter = iter(images)
    current: PromptImage | None = None
    row = 0
    for token in tokens:
        if token == tokenizer.media_pad:
            if current is None or row == current.n_tokens:
                current, row = next(image_iter), 0
            keys.append((current.digest, row))
            row += 1
        else:
            keys.append(token)
    return Prompt(tokens, images, keys)


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
