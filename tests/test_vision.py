"""Native MoonViT + projector (wasm-core/src/vision.c through kvl.native) against the independent
PyTorch reference on the tiny synthesized checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kvl.image import preprocess
from kvl.native import KvlError, NativeEngine
from tests.reference.vision import VisionReference

# Relative tolerance of the spec's FP32 comparison: max|native - reference| <= TOL * max|reference|.
TOL = 1e-3


@pytest.fixture(scope="module")
def engine(tiny_pack: Path):
    eng = NativeEngine(tiny_pack, load_vision=True)
    yield eng
    close = getattr(eng, "close", None)
    if close is not None:
        close()


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path) -> VisionReference:
    return VisionReference(tiny_ckpt)


@pytest.fixture(scope="module")
def configs(tiny_ckpt: Path) -> tuple[dict, dict]:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    pre = json.loads((tiny_ckpt / "preprocessor_config.json").read_text())
    return config["vision_config"], pre


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _compare(engine, reference, pixel_values: np.ndarray, grids: np.ndarray, label: str) -> np.ndarray:
    got = engine.vision_encode(pixel_values, grids)
    want = reference.encode(torch.from_numpy(pixel_values), [tuple(g) for g in grids.tolist()]).numpy()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    print(f"vision {label}: grids {grids.tolist()} max|diff| = {diff:.3e}, max|ref| = {scale:.3e}, "
          f"relative = {diff / scale:.3e}")
    assert diff <= TOL * scale
    return got


def _grid_for(patch: int, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random normalised patches for a given grid (bypasses image resizing)."""
    rng = np.random.default_rng(seed)
    pixel_values = rng.uniform(-1.0, 1.0, (rows * cols, 3, patch, patch)).astype(np.float32)
    return pixel_values, np.asarray([[rows, cols]], dtype=np.int32)


def test_preprocessed_images_match_reference(engine, reference, configs) -> None:
    vision, pre = configs
    images = [_image(100, 50, 1), _image(200, 131, 2)]
    pixel_values, grids = preprocess(images, pre, vision["merge_kernel_size"])
    got = _compare(engine, reference, pixel_values, grids, "two images")
    merge_h, merge_w = vision["merge_kernel_size"]
    assert got.shape[0] == sum((gh // merge_h) * (gw // merge_w) for gh, gw in grids.tolist())


def test_position_table_identity_and_resampled(engine, reference, configs) -> None:
    vision, pre = configs
    patch = vision["patch_size"]
    table_h, table_w = vision["init_pos_emb_height"], vision["init_pos_emb_width"]
    merge_h, merge_w = vision["merge_kernel_size"]
    same = (table_h, table_w)                           # bicubic at equal size: the identity
    shrink = (max(merge_h, table_h // 2 // merge_h * merge_h), table_w + 2 * merge_w)
    tall = (table_h + 4 * merge_h, merge_w)             # upsampling rows, downsampling columns
    assert shrink != same and tall != same
    for seed, (rows, cols) in enumerate((same, shrink, tall)):
        pixel_values, grids = _grid_for(patch, rows, cols, seed)
        _compare(engine, reference, pixel_values, grids, f"{rows}x{cols}")


def test_image_rows_do_not_depend_on_batch_neighbours(engine, configs) -> None:
    vision, _ = configs
    patch = vision["patch_size"]
    merge_h, merge_w = vision["merge_kernel_size"]
    a_pixels, a_grid = _grid_for(patch, 2 * merge_h, 3 * merge_w, seed=10)
    b_pixels, b_grid = _grid_for(patch, 2 * merge_h, 2 * merge_w, seed=11)
    a_tokens = 2 * 3
    alone = engine.vision_encode(a_pixels, a_grid)
    after_b = engine.vision_encode(np.concatenate([b_pixels, a_pixels]),
                                   np.concatenate([b_grid, a_grid]))
    before_b = engine.vision_encode(np.concatenate([a_pixels, b_pixels]),
                                    np.concatenate([a_grid, b_grid]))
    assert alone.shape[0] == a_tokens
    assert np.array_equal(alone, after_b[-a_tokens:])
    assert np.array_equal(alone, before_b[:a_tokens])
    # and the neighbour really is a different image (the check above is not vacuous)
    assert not np.allclose(after_b[:-a_tokens][:1], alone[:1])


@pytest.mark.parametrize("grid", [(3, 4), (4, 3), (2, 0), (512, 2), (2, 512)])
def test_bad_grids_are_refused(engine, configs, grid: tuple[int, int]) -> None:
    vision, _ = configs
    patch = vision["patch_size"]
    rows, cols = grid
    pixel_values = np.zeros((rows * cols, 3, patch, patch), dtype=np.float32)
    with pytest.raises(KvlError) as info:
        engine.vision_encode(pixel_values, np.asarray([grid], dtype=np.int32))
    message = str(info.value)
    assert "grid" in message, message


def test_engine_without_vision_refuses(tiny_pack: Path, configs) -> None:
    vision, _ = configs
    pixel_values, grids = _grid_for(vision["patch_size"], 2, 2, seed=3)
    eng = NativeEngine(tiny_pack, load_vision=False)
    try:
        with pytest.raises(KvlError, match="load_vision"):
            eng.vision_encode(pixel_values, grids)
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()


def test_weights_are_streamed_once_per_call(engine, reference, configs) -> None:
    """Every vision/projector tensor is read from the store exactly once per encode call."""
    vision, _ = configs
    checkpoint_bytes = sum(t.numel() * 2 for t in reference.w.values())   # BF16 in the checkpoint
    pixel_values, grids = _grid_for(vision["patch_size"], 4, 4, seed=4)
    before = engine.stats()["vision_bytes_read"]
    engine.vision_encode(pixel_values, grids)
    assert engine.stats()["vision_bytes_read"] - before == checkpoint_bytes


def test_working_memory_figure(engine, configs) -> None:
    vision, _ = configs
    merge_h, merge_w = vision["merge_kernel_size"]
    small = engine.vision_bytes([[merge_h, merge_w]])
    large = engine.vision_bytes([[8 * merge_h, 8 * merge_w]])
    pair = engine.vision_bytes([[merge_h, merge_w], [8 * merge_h, 8 * merge_w]])
    assert 0 < small < large <= pair
    assert engine.vision_bytes(np.zeros((0, 2), dtype=np.int32)) == 0
    with pytest.raises(KvlError, match="grid"):
        engine.vision_bytes([[merge_h + 1, merge_w]])


def test_pack_missing_a_vision_tensor_is_refused(tiny_pack: Path, configs, tmp_path: Path) -> None:
    """A vision index that lacks a tensor gives a KvlError naming it (at open or at encode)."""
    import zlib

    from kvl import packfmt

    broken = tmp_path / "broken_pack"
    broken.mkdir()
    for item in tiny_pack.iterdir():
        if item.name not in ("vision.idx", "PACK_COMPLETE.json"):
            (broken / item.name).symlink_to(item)
    data = (tiny_pack / "vision.idx").read_bytes()
    index = packfmt.decode_index(data, "vision.idx")
    victim = "multi_modal_projector.linear_2.bias"
    records = [packfmt.TensorRecord(r.name.replace("linear_2.bias", "linear_2.bixs"), r.dtype,
                                    r.shape, r.offset, r.nbytes, r.crc32)
               if r.name == victim else r for r in index.records]
    assert records != index.records
    new_idx = packfmt.encode_index(index.kind, index.bin_size, index.hparams, records,
                                   index.config_text, index.revision)
    (broken / "vision.idx").write_bytes(new_idx)
    complete = json.loads((tiny_pack / "PACK_COMPLETE.json").read_text())
    complete["files"]["vision.idx"] = {"size": len(new_idx), "crc32": zlib.crc32(new_idx) & 0xFFFFFFFF}
    (broken / "PACK_COMPLETE.json").write_text(json.dumps(complete))

    vision, _ = configs
    pixel_values, grids = _grid_for(vision["patch_size"], 2, 2, seed=5)
    with pytest.raises(KvlError, match="linear_2.bias") as info:
        eng = NativeEngine(broken, load_vision=True)
        try:
            eng.vision_encode(pixel_values, grids)
        finally:
            eng.close()
    print(f"broken pack: {info.value}")
