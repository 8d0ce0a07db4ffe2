"""Chat template: renders the pack's chat_template.jinja and expands media placeholders.

Owns: the jinja2 environment (sandboxed, with the Hugging Face `apply_chat_template` conventions:
trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`, special-token variables),
rendering messages in the HF shape (content as a string or a list of {"type": "text", "text"} /
{"type": "image"} items), and the media expansion of spec §7.2 on token ids.
Does not own: tokenization (tokenizer.py) or image preprocessing (image.py).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvl.errors import UserError


def _raise_exception(message: str) -> None:
    raise UserError(f"chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _special_token_vars(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as plain strings, as HF passes them to templates."""
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                "mask_token"):
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


class ChatTemplate:
    """The model's chat template, loaded from a pack (or checkpoint) directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "chat_template.jinja"
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise UserError(f"{path} is missing; rerun kvl pack") from exc
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise UserError(f"{path} is not a valid jinja template ({exc})") from exc
        try:
            tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text("utf-8"))
        except (OSError, ValueError, RecursionError):
            tokenizer_config = {}
        if not isinstance(tokenizer_config, dict):
            tokenizer_config = {}
        self._special_vars = _special_token_vars(tokenizer_config)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of messages (HF message dicts)."""
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special_vars)
        except jinja2.TemplateError as exc:
            raise UserError(f"the chat template failed on these messages ({exc})") from exc


def expand_media(ids: Sequence[int], media_counts: Sequence[int], media_pad: int) -> list[int]:
    """Replace the i-th media placeholder id by media_counts[i] copies of it (spec §7.2).

    The number of placeholders must equal the number of images: a mismatch means the text itself
    contained the placeholder string, which would shift every image.
    """
    found = sum(1 for i in ids if i == media_pad)
    if found != len(media_counts):
        raise UserError(f"the prompt holds {found} image placeholders but {len(media_counts)} "
                        "images were given; remove the literal '<|media_pad|>' text from messages")
    out: list[int] = []
    image = 0
    for token in ids:
        if token == media_pad:
            out.extend([media_pad] * media_counts[image])
            image += 1
        else:
            out.append(token)
    return out
