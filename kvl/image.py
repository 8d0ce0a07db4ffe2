"""Official Kimi-VL image preprocessing (Pillow + numpy) and image loading with clear errors.

Owns: decoding user images safely (load_image), the official resize / pad / normalise /
patchify pipeline (preprocess, spec section 6), and media-token arithmetic (num_media_tokens,
grid_for_size). Does not own: the vision forward (wasm-core/src/vision.c) or prompt expansion
(kvl/chat_template.py).

Every number comes from preprocessor_config.json (patch_size, in_token_limit, pad_input,
image_mean, image_std, merge_kernel_size) or the caller's merge kernel from config.json's
vision_config. The one model constant that is in neither file is the 512 x 512 2D-RoPE table of
MoonViT, which bounds the patch grid (the official processor's "Exceed pos emb" check).
"""
from __future__ import annotations

import functools
import io
import math
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from kvl.errors import UserError

# The official processor rejects grids with >= 512 patches per side: MoonViT's 2D-RoPE table is
# built for 512 x 512 positions in the modeling code (not serialised in config.json).
ROPE_GRID_LIMIT = 512

# Formats a user may send. Pillow can decode more, but every extra decoder is extra attack
# surface for input that arrives over the network.
SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF")

# Default decode guard: 64 megapixels (~256 MB as RGBA) is far beyond what the model can use
# (images above in_token_limit patches are downscaled anyway) yet admits large photos.
DEFAULT_MAX_PIXELS = 64_000_000
# Files larger than this are refused before decoding (compressed data, so generous).
DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024

ImageSource = bytes | bytearray | memoryview | str | Path


def _describe(source: ImageSource) -> str:
    if isinstance(source, (str, Path)):
        return f"image file '{source}'"
    return f"image data ({len(source)} bytes)"


def _sniff_format(data: bytes) -> str | None:
    """Name of the supported format whose signature the data starts with, if any."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def load_image(source: ImageSource, *, max_pixels: int = DEFAULT_MAX_PIXELS,
               max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Image.Image:
    """Decode an image fully (first frame of animations) or raise UserError saying why not.

    EXIF orientation is deliberately not applied: the official processor does not apply it,
    and the model must see the same pixels.
    """
    what = _describe(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if size > max_file_bytes:
                raise UserError(f"{what} is {size} bytes, over the {max_file_bytes}-byte limit "
                                "for images; downscale or recompress it")
            data = path.read_bytes()
        except UserError:
            raise
        except OSError as exc:
            raise UserError(f"cannot read {what}: {exc.strerror or exc}; check the path") from exc
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > max_file_bytes:
            raise UserError(f"{what} is over the {max_file_bytes}-byte limit for images; "
                            "downscale or recompress it")
    else:
        raise UserError(f"an image must be given as bytes or a file path, not "
                        f"{type(source).__name__}")
    if not data:
        raise UserError(f"{what} is empty; send a JPEG, PNG, WebP or GIF image")

    supported = ", ".join(SUPPORTED_FORMATS)
    # No change to Pillow's global MAX_IMAGE_PIXELS or the warning filters (both process-wide,
    # and the server decodes on several threads): Pillow still refuses beyond twice its own
    # limit at open, and the explicit max_pixels check below is the per-call guard.
    try:
        image = Image.open(io.BytesIO(data), formats=list(SUPPORTED_FORMATS))
    except UnidentifiedImageError as exc:
        claimed = _sniff_format(data)
        if claimed:
            raise UserError(f"{what} starts like a {claimed} file but its header is invalid "
                            "(corrupt, truncated, or zero/invalid dimensions); re-export "
                            "the image") from exc
        raise UserError(f"{what} is not a supported image (expected one of {supported}); "
                        "check that the file is really an image") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UserError(f"{what} declares enormous dimensions (possible decompression "
                        "bomb); refusing to decode it") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise UserError(f"{what} is corrupt or truncated and cannot be decoded ({exc}); "
                        "re-export the image") from exc

    width, height = image.size
    if width <= 0 or height <= 0:
        raise UserError(f"{what} has zero size ({width}x{height}); send a non-empty image")
    if width * height > max_pixels:
        raise UserError(f"{what} is {width}x{height} = {width * height} pixels, over the "
                        f"{max_pixels}-pixel limit (possible decompression bomb); "
                        "downscale it first")
    try:
        # A freshly opened animation sits on its first frame, which is what the model sees;
        # n_frames is not consulted because counting frames decodes the whole file.
        image.load()        # force a full decode now so corrupt data fails here, not later
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UserError(f"{what} declares enormous dimensions (possible decompression "
                        "bomb); refusing to decode it") from exc
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise UserError(f"{what} is corrupt or truncated and cannot be decoded ({exc}); "
                        "re-export the image") from exc
    return image


def _config_int(config: dict, key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"preprocessor_config.json: '{key}' must be a positive integer, got "
                        f"{value!r}; the pack's preprocessor_config.json looks damaged")
    return value


def _config_triple(config: dict, key: str) -> np.ndarray:
    value = config.get(key)
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        raise UserError(f"preprocessor_config.json: '{key}' must be a list of 3 numbers, got "
                        f"{value!r}")
    return np.asarray(value, dtype=np.float32)


def _merge_kernel(config: dict, merge_kernel_size: Sequence[int] | None) -> tuple[int, int]:
    merge = merge_kernel_size if merge_kernel_size is not None else config.get("merge_kernel_size")
    if isinstance(merge, np.ndarray):
        merge = merge.tolist()
    if (not isinstance(merge, (list, tuple)) or len(merge) != 2
            or not all(isinstance(m, numbers.Integral) and not isinstance(m, bool) and m > 0
                       for m in merge)):
        raise UserError(f"merge_kernel_size must be two positive integers, got {merge!r}")
    return int(merge[0]), int(merge[1])


def _resized_size(width: int, height: int, patch: int, token_limit: int) -> tuple[int, int]:
    """Official downscale rule: only when the patch count exceeds in_token_limit; int truncation."""
    patches = (width // patch) * (height // patch)
    if patches <= token_limit:
        return width, height
    scale = math.sqrt(token_limit / patches)
    return int(width * scale), int(height * scale)


def _padded(dim: int, unit: int) -> int:
    return dim + (unit - dim % unit) % unit


def grid_for_size(width: int, height: int, preprocessor_config: dict,
                  merge_kernel_size: Sequence[int] | None = None) -> tuple[int, int]:
    """Patch grid (rows, cols) that preprocess() produces for an image of this size."""
    patch = _config_int(preprocessor_config, "patch_size")
    limit = _config_int(preprocessor_config, "in_token_limit")
    merge_h, merge_w = _merge_kernel(preprocessor_config, merge_kernel_size)
    if width <= 0 or height <= 0:
        raise UserError(f"an image of {width}x{height} pixels has no content")
    new_w, new_h = _resized_size(width, height, patch, limit)
    if new_w <= 0 or new_h <= 0:
        raise UserError(f"an image of {width}x{height} pixels has too extreme an aspect ratio: "
                        "downscaling it to the token limit leaves no pixels; crop it first")
    if preprocessor_config.get("pad_input", False):
        new_w, new_h = _padded(new_w, patch * merge_w), _padded(new_h, patch * merge_h)
    else:
        new_w, new_h = new_w - new_w % patch, new_h - new_h % patch
    grid_h, grid_w = new_h // patch, new_w // patch
    if grid_h >= ROPE_GRID_LIMIT or grid_w >= ROPE_GRID_LIMIT:
        raise UserError(_elongated_message(f"an image of {width}x{height} pixels", new_w, new_h,
                                           patch))
    if grid_h == 0 or grid_w == 0 or grid_h % merge_h or grid_w % merge_w:
        raise UserError(f"an image of {width}x{height} pixels gives a {grid_h}x{grid_w} patch "
                        f"grid, not a positive multiple of the {merge_h}x{merge_w} merge kernel "
                        "(pad_input is off in preprocessor_config.json); resize it to a "
                        f"multiple of {patch * merge_w}x{patch * merge_h} pixels")
    return grid_h, grid_w


@functools.lru_cache(maxsize=8)
def _largest_grid(patch: int, limit: int, pad_input: bool, merge_h: int,
                  merge_w: int) -> tuple[int, int]:
    unit_w, unit_h = patch * merge_w, patch * merge_h
    # Sizes past ~ROPE_GRID_LIMIT * patch * 1.25 per side either exceed the RoPE bound or are
    # downscaled to the same shapes that smaller sizes reach (resizing keeps the aspect ratio),
    # so this range contains the worst case.
    top = ROPE_GRID_LIMIT * patch * 5 // 4
    widths = np.arange(1, top + 1, dtype=np.int64)
    best, best_grid = 0, (merge_h, merge_w)
    for height in range(1, top + 1):
        patches = (widths // patch) * (height // patch)
        shrink = patches > limit
        scale = np.sqrt(limit / np.maximum(patches, 1))
        new_w = np.where(shrink, (widths * scale).astype(np.int64), widths)
        new_h = np.where(shrink, (height * scale).astype(np.int64), height)
        if pad_input:
            grid_w = -(-new_w // unit_w) * merge_w
            grid_h = -(-new_h // unit_h) * merge_h
        else:
            grid_w = new_w // patch // merge_w * merge_w
            grid_h = new_h // patch // merge_h * merge_h
        valid = (grid_w < ROPE_GRID_LIMIT) & (grid_h < ROPE_GRID_LIMIT) & (new_w > 0) & (new_h > 0)
        cells = np.where(valid, grid_w * grid_h, 0)
        i = int(cells.argmax())
        if int(cells[i]) > best:
            best, best_grid = int(cells[i]), (int(grid_h[i]), int(grid_w[i]))
    return best_grid


def largest_grid(preprocessor_config: dict,
                 merge_kernel_size: Sequence[int] | None = None) -> tuple[int, int]:
    """The patch grid (rows, cols) with the most patches that preprocess() can produce for one
    image, found by exhaustive search (~1 s once per config; cached). It is not the square
    sqrt(in_token_limit) grid: padding after the downscale adds most on thin images (for the
    official config 12 x 446 = 5352 patches, versus 66 x 66 = 4356 for 1024 x 1024).
    For RAM planning: kvl_vision_bytes grows with the patch count."""
    patch = _config_int(preprocessor_config, "patch_size")
    limit = _config_int(preprocessor_config, "in_token_limit")
    merge_h, merge_w = _merge_kernel(preprocessor_config, merge_kernel_size)
    return _largest_grid(patch, limit, bool(preprocessor_config.get("pad_input", False)),
                         merge_h, merge_w)


def _elongated_message(what: str, width: int, height: int, patch: int) -> str:
    return (f"{what} is too elongated: after scaling to the token limit it is {width}x{height} "
            f"pixels = {height // patch}x{width // patch} patches, and the vision model supports "
            f"fewer than {ROPE_GRID_LIMIT} patches per side (official 'Exceed pos emb'); crop it "
            "to a less extreme aspect ratio")


def num_media_tokens(grid: Sequence[int], merge: Sequence[int]) -> int:
    """Media tokens of one image: one per merge_h x merge_w block of patches."""
    grid_h, grid_w = int(grid[0]), int(grid[1])
    return (grid_h // int(merge[0])) * (grid_w // int(merge[1]))


def _pad_right_bottom(image: Image.Image, pad_w: int, pad_h: int) -> Image.Image:
    """Black padding in the image's own mode, as torchvision's TF.pad(img, (0, 0, pw, ph)) does
    (fill 0 in every band; a palette image gets index 0, whatever colour that is)."""
    bands = len(image.getbands())
    fill: int | tuple[int, ...] = 0 if bands == 1 else (0,) * bands
    if image.mode == "P":
        palette = image.getpalette()
        out = ImageOps.expand(image, border=(0, 0, pad_w, pad_h), fill=fill)
        if palette is not None:
            out.putpalette(palette)
        return out
    return ImageOps.expand(image, border=(0, 0, pad_w, pad_h), fill=fill)


def _center_crop(image: Image.Image, crop_w: int, crop_h: int) -> Image.Image:
    """torchvision center_crop for a crop no larger than the image (round-half-even offsets)."""
    width, height = image.size
    top = int(round((height - crop_h) / 2.0))
    left = int(round((width - crop_w) / 2.0))
    return image.crop((left, top, left + crop_w, top + crop_h))


def _prepare_one(image: Image.Image, patch: int, limit: int, pad_input: bool,
                 merge_h: int, merge_w: int, config: dict, index: int) -> Image.Image:
    width, height = image.size
    # Validate the final size first, so an absurd aspect ratio fails before a huge pad is built
    # (the official processor checks after padding; the outcome is the same).
    try:
        grid_for_size(width, height, config, (merge_h, merge_w))
    except UserError as exc:
        raise UserError(f"image {index}: {exc}") from None
    new_w, new_h = _resized_size(width, height, patch, limit)
    if (new_w, new_h) != (width, height):
        # Resize in the image's own mode, like the official processor: RGBA/LA go through
        # Pillow's premultiplied path, P and 1 are resized with NEAREST by Pillow itself.
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    if pad_input:
        pad_w = (patch * merge_w - new_w % (patch * merge_w)) % (patch * merge_w)
        pad_h = (patch * merge_h - new_h % (patch * merge_h)) % (patch * merge_h)
        image = _pad_right_bottom(image, pad_w, pad_h)
    else:
        # pad_input false (not the shipped config): the official processor centre-crops to whole
        # patches instead; the spec does not pin this path down, so it is best effort.
        image = _center_crop(image, new_w - new_w % patch, new_h - new_h % patch)
    return image


def preprocess(images: Sequence[Image.Image | ImageSource], preprocessor_config: dict,
               merge_kernel_size: Sequence[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Official preprocessing of several images.

    Returns pixel_values float32 [sum(gh*gw), 3, p, p] (per image: patches row-major over the
    grid, each channel-major) and grids int32 [n_images, 2] as (rows, cols).
    merge_kernel_size defaults to the one in preprocessor_config.json; pass config.json's
    vision_config merge_kernel_size to use the model's.
    """
    patch = _config_int(preprocessor_config, "patch_size")
    limit = _config_int(preprocessor_config, "in_token_limit")
    mean = _config_triple(preprocessor_config, "image_mean")
    std = _config_triple(preprocessor_config, "image_std")
    if np.any(std == 0):
        raise UserError("preprocessor_config.json: image_std contains a zero")
    pad_input = bool(preprocessor_config.get("pad_input", False))
    merge_h, merge_w = _merge_kernel(preprocessor_config, merge_kernel_size)

    patches: list[np.ndarray] = []
    grids: list[tuple[int, int]] = []
    for index, item in enumerate(images):
        image = item if isinstance(item, Image.Image) else load_image(item)
        image = _prepare_one(image, patch, limit, pad_input, merge_h, merge_w,
                             preprocessor_config, index)
        rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
        # Same float32 operations as torchvision ToTensor + Normalize: x/255, then (x-m)/s.
        values = (rgb.astype(np.float32) / np.float32(255.0) - mean) / std
        height, width = values.shape[:2]
        grid_h, grid_w = height // patch, width // patch
        blocks = values.reshape(grid_h, patch, grid_w, patch, 3).transpose(0, 2, 4, 1, 3)
        patches.append(blocks.reshape(grid_h * grid_w, 3, patch, patch))
        grids.append((grid_h, grid_w))
    if not patches:
        return (np.zeros((0, 3, patch, patch), dtype=np.float32), np.zeros((0, 2), dtype=np.int32))
    pixel_values = np.ascontiguousarray(np.concatenate(patches, axis=0), dtype=np.float32)
    return pixel_values, np.asarray(grids, dtype=np.int32)
