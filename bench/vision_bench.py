"""Vision timing: native MoonViT + projector (kvl_vision_encode) against the PyTorch reference.

Owns: timing only (asserts nothing). For each image size: a random RGB image of that size,
official preprocessing (kvl.image.preprocess), then
  native    kvl.native.NativeEngine(pack, load_vision=True).vision_encode, timed per call
            (weights are streamed from vision.bin on every call; the bytes read are reported);
  reference tests/reference/vision.py VisionReference math with the pack's BF16 vision tensors
            widened to FP32 (the reference's own loader would load the whole 33 GB checkpoint in
            FP32, and the synthesized full-size model exists only as a pack), torch threads = --threads.
Peak RSS per phase: Linux VmHWM after resetting it (echo 5 > /proc/self/clear_refs) at the start
of the phase, plus the phase's baseline RSS, so the native and reference phases do not mask
each other. Also prints max|native - reference| relative to max|reference| as a sanity check.

Usage: PYTHONPATH=. python bench/vision_bench.py PACK [--sizes 448,1024] [--threads 2]
       [--reps 2] [--which native,reference] [--json OUT]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvl.image import preprocess  # noqa: E402
from kvl.packfmt import PackReader  # noqa: E402

MIB = 1 << 20


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0) and return the current RSS."""
    with contextlib.suppress(OSError):  # older kernels: the phase peak then includes earlier ones
        Path("/proc/self/clear_refs").write_text("5\n")
    return _status_kib("VmRSS")


def peak() -> int:
    return _status_kib("VmHWM")


def random_image(side: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def native_phase(pack: Path, inputs: dict, threads: int, reps: int) -> tuple[dict, dict]:
    from kvl.native import NativeEngine

    reader = PackReader(pack)
    extent = (reader.stores["experts"].records[0].nbytes + 4095) // 4096 * 4096
    top_k = int(reader.hparams["text.num_experts_per_tok"])
    base = reset_peak()
    t0 = time.perf_counter()
    # Smallest text caches the engine accepts (streamed trunk, one layer's top-k experts):
    # this phase is about vision.
    engine = NativeEngine(pack, n_threads=threads, load_vision=True, trunk_cache_bytes=-1,
                          expert_cache_bytes=top_k * extent)
    open_s = time.perf_counter() - t0
    info = engine.info()
    out: dict = {"open_s": open_s, "rss_after_open": _status_kib("VmRSS"),
                 "vision_direct_io": info["vision_direct_io"], "kernels": info["kernels"],
                 "n_threads": info["n_threads"], "sizes": {}}
    outputs = {}
    for side, (px, grids) in inputs.items():
        times, reads = [], []
        before_rss = reset_peak()
        for _ in range(reps):
            s0 = engine.stats()["vision_bytes_read"]
            t = time.perf_counter()
            rows = engine.vision_encode(px, grids)
            times.append(time.perf_counter() - t)
            reads.append(engine.stats()["vision_bytes_read"] - s0)
        outputs[side] = rows
        out["sizes"][side] = {"grid": grids.tolist()[0], "tokens": int(rows.shape[0]),
                              "seconds": times, "vision_bytes_read": reads,
                              "working_memory_planned": engine.vision_bytes(grids),
                              "rss_before": before_rss, "peak_rss": peak()}
        print(f"native {side}x{side}: grid {grids.tolist()[0]}, {rows.shape[0]} tokens, "
              f"{', '.join(f'{x:.2f}' for x in times)} s, read {reads[-1] / MIB:,.0f} MiB, "
              f"peak RSS {peak() / MIB:,.0f} MiB (phase start {before_rss / MIB:,.0f} MiB)",
              flush=True)
    engine.close()
    out["process_base_rss"] = base
    return out, outputs


def reference_phase(pack: Path, inputs: dict, threads: int, reps: int) -> tuple[dict, dict]:
    import torch

    from tests.reference.vision import VisionReference

    torch.set_num_threads(threads)
    base = reset_peak()
    t0 = time.perf_counter()
    reader = PackReader(pack)
    config = reader.config
    ref = VisionReference.__new__(VisionReference)  # the reference's math, our weight source
    ref.cfg = config["vision_config"]
    ref.kernel = tuple(ref.cfg.get("merge_kernel_size", (2, 2)))
    ref.w = {rec.name: torch.from_numpy(reader.tensor_f32(rec.name))
             for rec in reader.stores["vision"].records}
    load_s = time.perf_counter() - t0
    out: dict = {"load_s": load_s, "rss_after_load": _status_kib("VmRSS"),
                 "torch_threads": torch.get_num_threads(), "sizes": {}}
    outputs = {}
    for side, (px, grids) in inputs.items():
        before_rss = reset_peak()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            rows = ref.encode(torch.from_numpy(px), [tuple(g) for g in grids.tolist()]).numpy()
            times.append(time.perf_counter() - t)
        outputs[side] = rows
        out["sizes"][side] = {"grid": grids.tolist()[0], "seconds": times,
                              "rss_before": before_rss, "peak_rss": peak()}
        print(f"reference {side}x{side}: grid {grids.tolist()[0]}, "
              f"{', '.join(f'{x:.2f}' for x in times)} s, peak RSS {peak() / MIB:,.0f} MiB "
              f"(phase start {before_rss / MIB:,.0f} MiB)", flush=True)
    out["process_base_rss"] = base
    return out, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--sizes", default="448,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--which", default="native,reference")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    which = {w.strip() for w in args.which.split(",")}
    pre = json.loads((args.pack / "preprocessor_config.json").read_text("utf-8"))
    merge = tuple(PackReader(args.pack).config["vision_config"].get("merge_kernel_size", (2, 2)))
    inputs = {}
    for side in (int(s) for s in args.sizes.split(",")):
        px, grids = preprocess([random_image(side, side)], pre, merge)
        inputs[side] = (px, grids)
    result: dict = {"pack": str(args.pack), "threads": args.threads, "reps": args.reps}
    native_out = ref_out = None
    if "native" in which:
        try:
            result["native"], native_out = native_phase(args.pack, inputs, args.threads, args.reps)
        except Exception as exc:  # noqa: BLE001 - report and still time the reference
            result["native_error"] = f"{type(exc).__name__}: {exc}"
            print(f"native vision failed: {result['native_error']}", flush=True)
    if "reference" in which:
        result["reference"], ref_out = reference_phase(args.pack, inputs, args.threads, args.reps)
    if native_out and ref_out:
        result["agreement"] = {}
        for side in inputs:
            want, got = ref_out[side], native_out[side]
            rel = float(np.abs(got - want).max() / np.abs(want).max())
            result["agreement"][side] = rel
            print(f"{side}x{side}: max|native - reference| / max|reference| = {rel:.2e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
