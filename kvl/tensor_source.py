"""Where the packer gets checkpoint tensors from.

Owns: the TensorSource protocol. Implementations: a safetensors checkpoint directory
(kvl/safetensors_io.py) and the synthesizer itself (kvl/synth.py), so a full-size pack can be
produced without first writing 33 GB of BF16 shards.

Arrays are numpy: BF16 tensors come back as uint16 arrays holding the raw BF16 bits (numpy has no
bfloat16), F32 tensors as float32. Shapes are the checkpoint's own.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class TensorSource(Protocol):
    def config(self) -> dict:
        """The parsed config.json."""

    def asset_files(self) -> dict[str, bytes]:
        """Non-tensor files to copy into the pack, by file name: config.json,
        generation_config.json, tokenizer_config.json, tiktoken.model, chat_template.jinja,
        preprocessor_config.json (whichever exist)."""

    def revision(self) -> str | None:
        """Recorded source revision (40 hex chars) or None when unknown."""

    def tensor_names(self) -> list[str]:
        """Every tensor name, in the checkpoint's index order."""

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) with dtype 'BF16' or 'F32' (or another safetensors dtype string)."""

    def read(self, name: str) -> np.ndarray:
        """The tensor's data: uint16 raw bits for BF16, float32 for F32."""

    def shard_of(self, name: str) -> str | None:
        """Shard file name holding the tensor, or None for sources without shards."""
