"""Errors of the HTTP API and their two wire shapes (OpenAI and Anthropic).

Owns: ApiError (an HTTP status plus a neutral error kind) and rendering it as each API's JSON
error body, so a handler raises one exception and the route decides the dialect.
Does not own: request parsing (openai_api.py / anthropic_api.py) or routing (app.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# neutral kind -> (HTTP status, OpenAI error type, Anthropic error type)
KINDS: dict[str, tuple[int, str, str]] = {
    "invalid_request": (400, "invalid_request_error", "invalid_request_error"),
    "authentication": (401, "authentication_error", "authentication_error"),
    "not_found": (404, "invalid_request_error", "not_found_error"),
    "model_not_found": (404, "invalid_request_error", "not_found_error"),
    "method_not_allowed": (405, "invalid_request_error", "invalid_request_error"),
    "too_large": (413, "invalid_request_error", "request_too_large"),
    "rate_limit": (429, "rate_limit_error", "rate_limit_error"),
    "server": (500, "server_error", "api_error"),
    "unavailable": (503, "server_error", "overloaded_error"),
}

# OpenAI puts a machine-readable code next to the type for some errors.
OPENAI_CODES = {
    "model_not_found": "model_not_found",
    "too_large": "request_too_large",
    "rate_limit": "rate_limit_exceeded",
    "authentication": "invalid_api_key",
    "not_found": "not_found",
}


@dataclass(eq=False)  # exceptions compare and hash by identity
class ApiError(Exception):
    """An error answered to the client; `kind` is a key of KINDS."""
    kind: str
    message: str
    param: str | None = None
    retry_after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown ApiError kind {self.kind!r}")
        super().__init__(self.message)

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after)} if self.retry_after is not None else {}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request", message, param)


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": KINDS[error.kind][1],
                      "param": error.param, "code": OPENAI_CODES.get(error.kind)}}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": KINDS[error.kind][2], "message": error.message}}


# -- typed field checks shared by both API translators ---------------------------------------
# Python's bool is an int subclass; a JSON `true` must never pass as a number.
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and value not in (float("inf"), float("-inf")))


def require_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON object, got {json_type(value)}", where)
    return value


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def get_str(obj: dict[str, Any], key: str, where: str, *, required: bool = False,
            allow_empty: bool = True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise invalid(f"'{where}' is required", where)
        return None
    if not isinstance(value, str):
        raise invalid(f"'{where}' must be a string, got {json_type(value)}", where)
    if not allow_empty and not value:
        raise invalid(f"'{where}' must not be empty", where)
    return value


def get_bool(obj: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{where}' must be true or false, got {json_type(value)}", where)
    return value


def get_number(obj: dict[str, Any], key: str, where: str, low: float, high: float,
               *, low_inclusive: bool = True) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise invalid(f"'{where}' must be a number, got {json_type(value)}", where)
    too_low = value < low if low_inclusive else value <= low
    if too_low or value > high:
        bracket = "[" if low_inclusive else "("
        raise invalid(f"'{where}' must be in {bracket}{low:g}, {high:g}], got {value}", where)
    return float(value)


def get_int(obj: dict[str, Any], key: str, where: str, low: int, high: int,
            hint: str = "") -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(f"'{where}' must be an integer, got {json_type(value)}", where)
    if not low <= value <= high:
        raise invalid(f"'{where}' must be between {low} and {high}, got {value}{hint}", where)
    return value


def max_tokens_value(obj: dict[str, Any], key: str, max_context: int) -> int | None:
    return get_int(obj, key, key, 1, max_context,
                   hint=f" (the server's context is {max_context} tokens; "
                        "start it with a larger --max-context for longer replies)")


def stop_list(value: Any, where: str) -> list[str]:
    """A stop string or a list of them (OpenAI allows both)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(f"'{where}' must be a string or an array of strings, "
                      f"got {json_type(value)}", where)
    for n, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise invalid(f"'{where}[{n}]' must be a non-empty string", where)
    return list(items)


# -- images -----------------------------------------------------------------------------------
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif")


def sniff_image(data: bytes) -> str | None:
    """The media type the bytes' magic number says, or None when it is no supported image."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


def decode_image_base64(text: str, where: str) -> bytes:
    import base64
    import binascii

    compact = "".join(text.split())  # some clients wrap base64 at 76 columns
    if not compact:
        raise invalid(f"{where}: the image data is empty", where)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: the image data is not valid base64", where) from None
    if sniff_image(data) is None:
        raise invalid(f"{where}: the decoded data is not a JPEG, PNG, WebP or GIF image", where)
    return data
