"""Reference image preprocessing (spec §6), written directly against Pillow.

Owns: the official processor's pixel pipeline — optional BICUBIC downscale past in_token_limit,
right/bottom padding in the image's own mode, convert("RGB"), normalisation, patchify — and the
media-token count. Does not own: decoding files or EXIF handling (the official code applies none).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

# The position-embedding RoPE table of the official encoder has 512 x 512 entries.
MAX_GRID_SIDE = 512


def load_preprocessor_config(ckpt_dir: str | Path) -> dict:
    return json.loads((Path(ckpt_dir) / "preprocessor_config.json").read_text(encoding="utf-8"))


def _pad_right_bottom(image: Image.Image, width: int, height: int) -> Image.Image:
    """Pad with value 0 in the image's own mode (palette index 0 for "P", like torchvision)."""
    if image.size == (width, height):
        return image
    padded = Image.new(image.mode, (width, height), 0)
    if image.mode == "P":
        palette = image.getpalette()
        if palette is not None:
            padded.putpalette(palette)
    padded.paste(image, (0, 0))
    return padded


def preprocess_one(image: Image.Image, config: dict) -> tuple[np.ndarray, tuple[int, int]]:
    patch = int(config["patch_size"])
    limit = int(config["in_token_limit"])
    merge_h, merge_w = (int(k) for k in config.get("merge_kernel_size", (2, 2)))
    width, height = image.size
    patches = (width // patch) * (height // patch)
    if patches > limit:
        scale = math.sqrt(limit / patches)
        image = image.resize((int(width * scale), int(height * scale)), Image.BICUBIC)
        width, height = image.size
    if not config.get("pad_input", False):
        # The spec only pins down the padding path (the real preprocessor_config.json has
        # pad_input true); guessing the other path would make this oracle untrustworthy.
        raise ValueError("reference preprocessing models pad_input=true only")
    step_w, step_h = merge_w * patch, merge_h * patch
    width += (step_w - width % step_w) % step_w
    height += (step_h - height % step_h) % step_h
    image = _pad_right_bottom(image, width, height)
    if width // patch >= MAX_GRID_SIDE or height // patch >= MAX_GRID_SIDE:
        raise ValueError("Exceed pos emb")
    rgb = np.asarray(image.convert("RGB"), dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    mean = np.asarray(config["image_mean"], dtype=np.float32)
    std = np.asarray(config["image_std"], dtype=np.float32)
    chw = ((rgb - mean) / std).transpose(2, 0, 1)  # [3, H, W]
    gh, gw = height // patch, width // patch
    tiles = chw.reshape(3, gh, patch, gw, patch).transpose(1, 3, 0, 2, 4).reshape(gh * gw, 3, patch, patch)
    return np.ascontiguousarray(tiles, dtype=np.float32), (gh, gw)


def preprocess(images: list[Image.Image], config: dict) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """All images' patches concatenated [sum gh*gw, 3, p, p] float32 and the grids (rows, cols)."""
    pixel_values, grids = [], []
    for image in images:
        tiles, grid = preprocess_one(image, config)
        pixel_values.append(tiles)
        grids.append(grid)
    return np.concatenate(pixel_values, axis=0), grids


def num_media_tokens(grid: tuple[int, int], merge: tuple[int, int] | list[int]) -> int:
    return (grid[0] // merge[0]) * (grid[1] // merge[1])
