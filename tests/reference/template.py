"""Reference prompt assembly (spec §7.1) and media expansion (§7.2), written by hand.

Owns: turning chat messages into the prompt string without rendering chat_template.jinja (the
runtime renders the template; this is the independent check), expanding each image's single
<|media_pad|> to its token count, and producing input ids with the reference tokenizer.
"""
from __future__ import annotations

from .tokenizer import ReferenceTokenizer

DEFAULT_SYSTEM = "You are a helpful assistant"
ROLE_MARKERS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
MEDIA_PAD = "<|media_pad|>"
IMAGE_BLOCK = "<|media_start|>image<|media_content|>" + MEDIA_PAD + "<|media_end|>"


def _is_image_item(item: dict) -> bool:
    return item.get("type") == "image" or "image" in item or "image_url" in item


def render_content(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    # Items that are neither images nor carry text contribute nothing (jinja renders undefined as "").
    return "".join(IMAGE_BLOCK if _is_image_item(item) else str(item.get("text", "")) for item in content)


def render_prompt(messages: list[dict], add_generation_prompt: bool = False) -> str:
    parts: list[str] = []
    if messages and messages[0]["role"] != "system":
        parts.append("<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>")
    for message in messages:
        role = message["role"]
        # Roles without a marker (e.g. "tool") render as the bare role name.
        parts.append(ROLE_MARKERS.get(role, "") + role + "<|im_middle|>"
                     + render_content(message["content"]) + "<|im_end|>")
    if add_generation_prompt:
        parts.append("<|im_assistant|>assistant<|im_middle|>")
    return "".join(parts)


def expand_media(prompt: str, tokens_per_image: list[int]) -> str:
    """Replace the i-th <|media_pad|> by tokens_per_image[i] copies of it."""
    pieces = prompt.split(MEDIA_PAD)
    if len(pieces) - 1 != len(tokens_per_image):
        raise ValueError(f"prompt has {len(pieces) - 1} images but {len(tokens_per_image)} "
                         "token counts given")
    out = [pieces[0]]
    for count, rest in zip(tokens_per_image, pieces[1:], strict=True):
        out.append(MEDIA_PAD * count + rest)
    return "".join(out)


def prompt_ids(tokenizer: ReferenceTokenizer, messages: list[dict], tokens_per_image: list[int],
               add_generation_prompt: bool = True) -> list[int]:
    return tokenizer.encode(expand_media(render_prompt(messages, add_generation_prompt), tokens_per_image))
