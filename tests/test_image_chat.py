"""Image chat end to end: `kvl chat --image` and a multi-turn ChatSession with images, against the
independent reference pipeline (reference preprocessing → reference MoonViT + projector → BF16
media boundary → reference template/tokenizer → reference FP32 decoder with Q8 experts)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kvl.conversation import ImageInput, Message
from kvl.generate import Done, SamplingParams, TextDelta
from tests.reference.preprocess import load_preprocessor_config, num_media_tokens, preprocess_one
from tests.reference.template import prompt_ids
from tests.reference.text import TextReference
from tests.reference.tokenizer import ReferenceTokenizer
from tests.reference.vision import VisionReference

REPO = Path(__file__).resolve().parents[1]
N_NEW = 10


def noise_image(width: int, height: int, seed: int, fmt: str) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    # 100x50 → grid 4x8 and 60x90 → grid 8x6: both force the 8x8 tiny position table to be resampled.
    folder = tmp_path_factory.mktemp("images")
    paths = [folder / "wide.png", folder / "tall.jpg"]
    paths[0].write_bytes(noise_image(100, 50, 1, "PNG"))
    paths[1].write_bytes(noise_image(60, 90, 2, "JPEG"))
    return paths


class ReferencePipeline:
    def __init__(self, ckpt: Path, pack: Path) -> None:
        self.text = TextReference(ckpt, q8_experts=True)
        self.vision = VisionReference(ckpt)
        self.tok = ReferenceTokenizer(pack)
        self.pre = load_preprocessor_config(ckpt)
        self.merge = json.loads((ckpt / "config.json").read_text())["vision_config"]["merge_kernel_size"]
        self.stops = {self.tok.special_id("<|im_end|>"), self.tok.special_id("[EOS]")}

    def media(self, paths: list[Path]) -> tuple[torch.Tensor, list[int]]:
        rows, counts = [], []
        for path in paths:
            with Image.open(path) as img:
                pixels, grid = preprocess_one(img, self.pre)
            # One image per encode call, as the official eager attention requires (spec §5.4).
            rows.append(self.vision.encode(torch.from_numpy(pixels), [grid]))
            counts.append(num_media_tokens(grid, self.merge))
        # The official model hands media embeddings to the decoder in BF16.
        return torch.cat(rows).to(torch.bfloat16).to(torch.float32), counts

    def reply(self, messages: list[dict], paths: list[Path]) -> tuple[list[int], list[int]]:
        media, counts = self.media(paths)
        ids = prompt_ids(self.tok, messages, counts)
        out = self.text.greedy(ids, N_NEW, media if paths else None)
        for i, token in enumerate(out):
            if token in self.stops:
                return ids, out[:i]
        return ids, out


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path, tiny_pack: Path) -> ReferencePipeline:
    return ReferencePipeline(tiny_ckpt, tiny_pack)


def test_chat_with_two_images_matches_reference(tiny_pack: Path, images: list[Path],
                                                reference: ReferencePipeline) -> None:
    prompt = "What differs between these two pictures?"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "kvl", "chat", str(tiny_pack), prompt, "--image", str(images[0]),
         "--image", str(images[1]), "--json", "--temperature", "0", "--max-new", str(N_NEW),
         "--ram-mib", "1024", "--max-context", "512"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                              {"type": "text", "text": prompt}]}]
    ids, expected = reference.reply(messages, images)
    assert report["prompt_token_ids"] == ids
    assert expected, "the reference stopped at once: the comparison would be empty"
    assert report["output_token_ids"] == expected
    assert [img["media_tokens"] for img in report["images"]] == [8, 12]


def test_image_in_a_later_turn_matches_reference(tiny_pack: Path, images: list[Path],
                                                 reference: ReferencePipeline) -> None:
    from kvl.engine import Engine

    engine = Engine(tiny_pack, ram_mib=1024, cache_mib=1, max_context=512)
    try:
        chat = engine.new_chat()
        greedy = SamplingParams(temperature=0.0, max_new_tokens=N_NEW)
        first = [Message("user", [ImageInput(images[0].read_bytes()), "Describe it."])]
        events = list(chat.generate(first, greedy))
        answer = "".join(e.text for e in events if isinstance(e, TextDelta))
        second = first + [Message("assistant", [answer]),
                          Message("user", [ImageInput(images[1].read_bytes()), "And this one?"])]
        events = list(chat.generate(second, greedy))
    finally:
        engine.close()
    done = events[-1]
    assert isinstance(done, Done)
    assert done.images_encoded == 1  # the first image was not encoded again
    assert done.reused_prompt_tokens > 0
    produced = [e.token_id for e in events if isinstance(e, TextDelta)]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    _, expected = reference.reply(messages, images)
    assert expected, "the reference stopped at once: the comparison would be empty"
    assert produced == expected
