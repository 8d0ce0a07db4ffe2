"""kvl.image: official preprocessing against the independent reference, token counts from the
spec's examples, and clear errors for bad images."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kvl.errors import UserError
from kvl.image import grid_for_size, largest_grid, load_image, num_media_tokens, preprocess
from tests.reference import preprocess as ref

# Values of the real preprocessor_config.json (spec section 6).
OFFICIAL = {"patch_size": 14, "in_token_limit": 4096, "merge_kernel_size": [2, 2],
            "pad_input": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Different numbers everywhere, so a hard-coded constant in kvl.image would show: CLIP
# statistics and a token limit small enough that modest images must be downscaled.
SMALL_LIMIT = {"patch_size": 14, "in_token_limit": 40, "merge_kernel_size": [2, 2],
               "pad_input": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
               "image_std": [0.26862954, 0.26130258, 0.27577711]}

SIZES = [(1, 1), (13, 29), (28, 28), (100, 50), (641, 479), (1000, 1000), (3000, 40)]


def _noise(size: tuple[int, int], mode: str, seed: int) -> Image.Image:
    """Random-content image in `mode` (a palette image gets a palette whose index 0 is not black)."""
    rng = np.random.default_rng(seed)
    width, height = size
    if mode == "P":
        image = Image.frombytes("P", size, rng.integers(0, 256, (height, width), np.uint8).tobytes())
        image.putpalette(rng.integers(1, 256, 768, np.uint8).tobytes())
        return image
    rgba = Image.frombytes("RGBA", size, rng.integers(0, 256, (height, width, 4), np.uint8).tobytes())
    if mode == "1":
        return rgba.convert("L").convert("1")
    return rgba.convert(mode)


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _assert_same_as_reference(image: Image.Image, config: dict) -> tuple[int, int]:
    pixel_values, grids = preprocess([image], config)
    expected_pixels, expected_grids = ref.preprocess([image], config)
    assert pixel_values.dtype == np.float32 and grids.dtype == np.int32
    assert [tuple(g) for g in grids.tolist()] == [tuple(g) for g in expected_grids]
    assert np.array_equal(pixel_values, expected_pixels)
    return int(grids[0][0]), int(grids[0][1])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "LA", "P", "1", "CMYK"])
def test_preprocess_matches_reference_for_sizes_and_modes(size: tuple[int, int], mode: str) -> None:
    image = _noise(size, mode, seed=size[0] * 7 + size[1])
    for config in (OFFICIAL, SMALL_LIMIT):
        grid = _assert_same_as_reference(image, config)
        assert grid == grid_for_size(size[0], size[1], config)


def test_resize_and_padding_paths_are_all_exercised() -> None:
    """The size list covers: neither, padding only, resizing only-with-padding, and both."""
    patch = OFFICIAL["patch_size"]
    resized = [s for s in SIZES if (s[0] // patch) * (s[1] // patch) > OFFICIAL["in_token_limit"]]
    padded = [s for s in SIZES if s[0] % 28 or s[1] % 28]
    untouched = [s for s in SIZES if s not in resized and s not in padded]
    assert resized and padded and untouched
    assert any((w // patch) * (h // patch) > SMALL_LIMIT["in_token_limit"] for w, h in SIZES)


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "LA"), ("PNG", "P"),
                                      ("PNG", "1"), ("PNG", "L"), ("JPEG", "RGB"), ("JPEG", "L"),
                                      ("JPEG", "CMYK"), ("WEBP", "RGB"), ("WEBP", "RGBA"),
                                      ("GIF", "P")])
def test_saved_files_decode_and_match_reference(fmt: str, mode: str, tmp_path) -> None:
    data = _encode(_noise((641, 479), mode, seed=5), fmt)
    decoded = load_image(data)
    with Image.open(io.BytesIO(data)) as plain:   # independent decode of the same bytes
        plain.load()
        assert decoded.mode == plain.mode and decoded.size == plain.size
        assert np.array_equal(np.asarray(decoded.convert("RGB")), np.asarray(plain.convert("RGB")))
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(data)
    assert np.array_equal(np.asarray(load_image(path).convert("RGB")),
                          np.asarray(decoded.convert("RGB")))
    assert np.array_equal(np.asarray(load_image(str(path)).convert("RGB")),
                          np.asarray(decoded.convert("RGB")))
    for config in (OFFICIAL, SMALL_LIMIT):
        _assert_same_as_reference(decoded, config)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animation_uses_first_frame(fmt: str) -> None:
    first = Image.new("RGB", (64, 48), (250, 10, 10))
    second = Image.new("RGB", (64, 48), (10, 10, 250))
    buffer = io.BytesIO()
    first.save(buffer, format=fmt, save_all=True, append_images=[second], duration=100, loop=0)
    decoded = load_image(buffer.getvalue()).convert("RGB")
    pixel = decoded.getpixel((5, 5))
    assert pixel[0] > 200 and pixel[2] < 60, pixel
    pixel_values, _ = preprocess([buffer.getvalue()], OFFICIAL)
    expected, _ = ref.preprocess([load_image(buffer.getvalue())], OFFICIAL)
    assert np.array_equal(pixel_values, expected)
    # the red frame, not the blue one, reaches the model (top-left patch is all image content)
    assert (pixel_values[0, 0] - pixel_values[0, 2]).min() > 1.0


def test_exif_orientation_is_not_applied() -> None:
    image = _noise((40, 20), "RGB", seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif.tobytes())
    decoded = load_image(buffer.getvalue())
    assert decoded.size == (40, 20)
    _, grids = preprocess([decoded], OFFICIAL)
    assert grids.tolist() == [[2, 4]]


# Token counts stated in the spec (section 6), width x height -> tokens.
SPEC_TOKENS = [((196, 196), 49), ((224, 224), 64), ((28, 28), 1), ((10, 10), 1), ((100, 50), 8),
               ((640, 480), 414), ((1024, 1024), 1089), ((1920, 1080), 1032)]


@pytest.mark.parametrize("size,tokens", SPEC_TOKENS)
def test_media_token_counts_match_spec(size: tuple[int, int], tokens: int) -> None:
    merge = OFFICIAL["merge_kernel_size"]
    _, grids = preprocess([Image.new("RGB", size, (30, 60, 90))], OFFICIAL)
    assert num_media_tokens(grids[0], merge) == tokens
    assert num_media_tokens(grid_for_size(size[0], size[1], OFFICIAL), merge) == tokens
    assert ref.num_media_tokens(tuple(grids[0]), merge) == tokens


def test_several_images_concatenate_in_order() -> None:
    images = [_noise((100, 50), "RGB", 1), _noise((28, 56), "L", 2), _noise((13, 29), "RGBA", 3)]
    pixel_values, grids = preprocess(images, OFFICIAL)
    expected_pixels, expected_grids = ref.preprocess(images, OFFICIAL)
    assert grids.tolist() == [list(g) for g in expected_grids]
    assert np.array_equal(pixel_values, expected_pixels)


def test_merge_kernel_argument_overrides_config() -> None:
    _, grids = preprocess([Image.new("RGB", (100, 50))], OFFICIAL, merge_kernel_size=[3, 3])
    assert grids.tolist() == [[6, 9]]   # 50 -> 84 px (multiple of 42), 100 -> 126 px


# ------------------------------------------------------------------------------ bad input ---

def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return (struct.pack(">I", len(payload)) + kind + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring width x height (8-bit RGB) with a tiny compressed body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def _expect_user_error(source, *words: str) -> str:
    with pytest.raises(UserError) as info:
        load_image(source)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_empty_bytes() -> None:
    _expect_user_error(b"", "empty")


def test_random_bytes() -> None:
    _expect_user_error(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes(),
                       "not a supported image")


def test_text_file(tmp_path) -> None:
    path = tmp_path / "notes.png"
    path.write_text("this is not an image\n" * 20)
    message = _expect_user_error(path, "not a supported image")
    assert "notes.png" in message


def test_missing_file(tmp_path) -> None:
    _expect_user_error(tmp_path / "nope.jpg", "cannot read", "nope.jpg")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files(fmt: str) -> None:
    data = _encode(_noise((300, 200), "RGB", seed=9), fmt)
    _expect_user_error(data[: len(data) // 2], "corrupt or truncated")


def test_zero_size_image() -> None:
    _expect_user_error(_png_header_only(0, 10), "PNG", "zero/invalid dimensions")


def test_decompression_bomb_header() -> None:
    _expect_user_error(_png_header_only(100_000, 100_000), "decompression bomb")


def test_pixel_guard_is_a_parameter() -> None:
    data = _encode(_noise((300, 200), "RGB", seed=1), "PNG")
    assert load_image(data, max_pixels=60_000).size == (300, 200)
    _expect_user_error_kw = pytest.raises(UserError, match="pixel limit")
    with _expect_user_error_kw:
        load_image(data, max_pixels=59_999)


def test_unsupported_format_is_refused() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="BMP")
    _expect_user_error(buffer.getvalue(), "not a supported image", "JPEG")


def test_grid_over_position_bound() -> None:
    image = Image.new("RGB", (8000, 60))   # 572 x 6 patches after padding, no resize
    for call in (lambda: preprocess([image], OFFICIAL), lambda: grid_for_size(8000, 60, OFFICIAL)):
        with pytest.raises(UserError, match="too elongated.*fewer than 512 patches"):
            call()
    with pytest.raises(ValueError, match="Exceed pos emb"):
        ref.preprocess([image], OFFICIAL)


def test_damaged_config_is_reported() -> None:
    with pytest.raises(UserError, match="patch_size"):
        preprocess([Image.new("RGB", (28, 28))], dict(OFFICIAL, patch_size=0))
    with pytest.raises(UserError, match="image_std"):
        preprocess([Image.new("RGB", (28, 28))], dict(OFFICIAL, image_std=[0.5, 0.5]))


def test_pixel_limit_between_own_guard_and_pillow_limit() -> None:
    # 80 Mpx: above kvl's default 64 Mpx guard, below the point where Pillow itself refuses
    _expect_user_error(_png_header_only(10_000, 8_000), "pixel limit", "decompression bomb")


def test_extreme_aspect_ratio_fails_before_padding() -> None:
    # padding this to 28 rows first would build an 84-megapixel image; the check comes first
    image = Image.new("L", (3_000_000, 1))
    with pytest.raises(UserError, match="too elongated"):
        preprocess([image], OFFICIAL)


def test_palette_padding_uses_index_zero() -> None:
    """Spec section 6 (c): padding a P image uses palette index 0, whatever colour it is."""
    image = Image.new("P", (20, 20), 1)
    image.putpalette([255, 0, 0] + [0, 0, 255] * 255)   # index 0 red, index 1 blue
    pixel_values, grids = preprocess([image], OFFICIAL)
    assert grids.tolist() == [[2, 2]]
    last = pixel_values[-1]              # bottom-right patch: rows/cols 14..27, image ends at 20
    assert np.allclose(last[:, -1, -1], [1.0, -1.0, -1.0])   # padding: red
    assert np.allclose(last[:, 0, 0], [-1.0, -1.0, 1.0])     # image: blue


def test_rgba_resize_is_premultiplied() -> None:
    """Spec section 6 (a): a resized RGBA image loses the colour of transparent pixels."""
    image = Image.new("RGBA", (100, 100), (255, 0, 0, 0))
    kept, _ = preprocess([image], OFFICIAL)        # 49 patches: no resize, colour survives
    resized, _ = preprocess([image], SMALL_LIMIT)  # 49 > 40: resized in RGBA mode
    mean = np.asarray(SMALL_LIMIT["image_mean"], np.float32)
    std = np.asarray(SMALL_LIMIT["image_std"], np.float32)
    assert np.allclose(kept[0, :, 0, 0], [1.0, -1.0, -1.0])
    assert np.allclose(resized[0, :, 0, 0], (0.0 - mean) / std)


def test_largest_grid_bounds_every_image() -> None:
    rows, cols = largest_grid(OFFICIAL)
    assert rows % 2 == 0 and cols % 2 == 0 and rows < 512 and cols < 512
    # more than the square sqrt(in_token_limit) guess, and more than the spec's 1024x1024 case
    assert rows * cols > 66 * 66
    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(1, 12_000, (3000, 2))]
    sizes += [(w, h) for w in range(6600, 6800, 7) for h in range(120, 200, 3)]   # thin images
    for width, height in sizes:
        try:
            gh, gw = grid_for_size(width, height, OFFICIAL)
        except UserError:
            continue
        assert gh * gw <= rows * cols, (width, height)
