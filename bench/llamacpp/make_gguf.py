#!/usr/bin/env python3
"""Write a random-weight GGUF with the exact shapes of Kimi-VL-A3B-Instruct's text decoder.

Owns: the llama.cpp baseline model files for bench/llamacpp/run.sh (arch `deepseek2`): Q8_0
throughout, or (`--expert-type q4_0`) the routed experts Q4_0 and everything else as in the Q8_0
file -- the same split as `kvl pack --expert-dtype q4 --trunk-dtype q8`.
Does not own: anything kvl loads (kvl uses its own pack format; see docs/FORMAT.md), nor any
claim about output quality -- the weights are random, only speed/memory are meaningful.

Why this exists: no real checkpoint can be downloaded here, but llama.cpp's speed and memory
behaviour depend only on tensor shapes, types and routing, so a random model of the same shapes
measures what a user picking llama.cpp would get on this machine.

Layout follows the vendored llama.cpp (llama-cpp-python 0.3.36 -> llama.cpp 0c1e57098):
  * metadata keys as written by conversion/deepseek.py DeepseekV2Model.set_gguf_parameters
    (MLA stored as MQA: head_count_kv 1, key_length 576, value_length 512, key_length_mla 192,
    value_length_mla 128; sigmoid gating; expert_weights_norm; leading_dense_block_count 1);
  * attention kv_b split into attn_k_b [n_head, kv_lora, nope] and attn_v_b [n_head, v, kv_lora]
    (numpy order; the loader's ggml order is reversed), as the converter does for MLA absorption;
  * routed experts stacked per layer in ffn_{gate,up,down}_exps; exp_probs_b is the
    e_score_correction_bias;
  * tensor types as `llama-quantize ... Q8_0` leaves them: every matrix Q8_0 (trunk included),
    norms / router (ffn_gate_inp) / exp_probs_b F32.

Q4_0 routed experts (`--expert-type q4_0`): each block of 32 weights is an fp16 scale and 16
bytes of 4-bit codes (value = (code - 8) * scale; byte j holds code j low, code j + 16 high), written
directly as uniform random codes with the scale chosen for the same standard deviation, or with
`--via-float` quantised by gguf.quants (bit-exact ggml Q4_0).

Q8_0 data: by default each block is written directly as a valid Q8_0 block (fp16 scale + 32
uniform int8 codes in [-127, 127]) with the scale chosen so the dequantised weights have standard
deviation 1/sqrt(fan_in). That is what quantising a uniform random matrix yields, and it is ~15x
faster than drawing normals and quantising them, which matters for ~16e9 weights on 2 shared
cores. `--via-float` instead draws N(0, 1/sqrt(fan_in)) floats and quantises them with
gguf.quants (bit-exact with ggml's reference Q8_0); use it for small checks.

Memory stays bounded: tensors are generated and written in row chunks of ~--chunk-mib MiB.
Deterministic: every tensor uses its own numpy Generator seeded from (--seed, tensor index).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # a clear message instead of a traceback
    sys.exit("make_gguf.py needs the `gguf` package: pip install gguf")

Q8_BLOCK = 32          # weights per Q8_0 block
Q8_BYTES = 2 + Q8_BLOCK  # fp16 scale + 32 int8 codes
UNIFORM_CODE_STD = 127 / np.sqrt(3.0)  # std of integers uniform on [-127, 127] (approximately)
Q4_BYTES = 2 + Q8_BLOCK // 2  # fp16 scale + 32 4-bit codes (Q4_0 also has 32 weights a block)
Q4_CODE_STD = np.sqrt((16**2 - 1) / 12.0)  # std of integers uniform on [-8, 7]
BLOCK_BYTES = {"q8": Q8_BYTES, "q4": Q4_BYTES}
QTYPE = {"q8": QT.Q8_0, "q4": QT.Q4_0}


@dataclass(frozen=True)
class Hparams:
    """Kimi-VL-A3B-Instruct text_config (see /work/shared/kimi-vl-spec.md section 2.2)."""
    vocab: int = 163840
    hidden: int = 2048
    layers: int = 27
    heads: int = 16
    dense_ff: int = 11264
    moe_ff: int = 1408
    experts: int = 64
    experts_used: int = 6
    shared_experts: int = 2
    first_dense: int = 1
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v_dim: int = 128
    rope_theta: float = 800000.0
    rms_eps: float = 1e-5
    routed_scale: float = 2.446
    ctx: int = 131072
    bos: int = 163584
    eos: int = 163585
    pad: int = 163839


def hparams_from_config(path: Path) -> Hparams:
    """The text decoder's dimensions from a Kimi-VL config.json (its text_config), so the GGUF
    always matches the model kvl packs from the same file."""
    import json

    tc = json.loads(path.read_text("utf-8"))["text_config"]
    return Hparams(
        vocab=tc["vocab_size"], hidden=tc["hidden_size"], layers=tc["num_hidden_layers"],
        heads=tc["num_attention_heads"], dense_ff=tc["intermediate_size"],
        moe_ff=tc["moe_intermediate_size"], experts=tc["n_routed_experts"],
        experts_used=tc["num_experts_per_tok"], shared_experts=tc["n_shared_experts"],
        first_dense=tc["first_k_dense_replace"], kv_lora=tc["kv_lora_rank"],
        nope=tc["qk_nope_head_dim"], rope=tc["qk_rope_head_dim"], v_dim=tc["v_head_dim"],
        rope_theta=tc["rope_theta"], rms_eps=tc["rms_norm_eps"],
        routed_scale=tc["routed_scaling_factor"], ctx=tc["max_position_embeddings"],
        bos=tc["bos_token_id"], eos=tc["eos_token_id"], pad=tc["pad_token_id"])


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]   # numpy order (outermost first); last axis is ggml ne[0] = fan-in
    kind: str                # "q8" / "q4" (random Q8_0 / Q4_0), "f32" (random normal), "ones" (norm weights)
    std: float


def tensor_plan(hp: Hparams, expert_kind: str = "q8") -> list[TensorSpec]:
    """Every tensor in file order, with the shapes llama.cpp's deepseek2 loader checks; the routed
    experts (ffn_*_exps) of kind expert_kind, every other matrix Q8_0."""
    T = gguf.TENSOR_NAMES
    M = gguf.MODEL_TENSOR

    def n(t: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = "weight") -> str:
        base = T[t].format(bid=bid) if bid is not None else T[t]
        return f"{base}.{suffix}"

    def mat(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, tuple(shape), "q8", 1.0 / np.sqrt(shape[-1]))

    def experts(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, tuple(shape), expert_kind, 1.0 / np.sqrt(shape[-1]))

    def norm(name: str, size: int) -> TensorSpec:
        return TensorSpec(name, (size,), "ones", 0.0)

    plan = [mat(n(M.TOKEN_EMBD), hp.vocab, hp.hidden)]
    q_dim = hp.heads * (hp.nope + hp.rope)
    shared_ff = hp.moe_ff * hp.shared_experts
    for i in range(hp.layers):
        plan += [
            norm(n(M.ATTN_NORM, i), hp.hidden),
            mat(n(M.ATTN_Q, i), q_dim, hp.hidden),
            mat(n(M.ATTN_KV_A_MQA, i), hp.kv_lora + hp.rope, hp.hidden),
            norm(n(M.ATTN_KV_A_NORM, i), hp.kv_lora),
            mat(n(M.ATTN_K_B, i), hp.heads, hp.kv_lora, hp.nope),
            mat(n(M.ATTN_V_B, i), hp.heads, hp.v_dim, hp.kv_lora),
            mat(n(M.ATTN_OUT, i), hp.hidden, hp.heads * hp.v_dim),
            norm(n(M.FFN_NORM, i), hp.hidden),
        ]
        if i < hp.first_dense:
            plan += [
                mat(n(M.FFN_GATE, i), hp.dense_ff, hp.hidden),
                mat(n(M.FFN_DOWN, i), hp.hidden, hp.dense_ff),
                mat(n(M.FFN_UP, i), hp.dense_ff, hp.hidden),
            ]
        else:
            plan += [
                # The router stays F32 like llama-quantize leaves it; a small random
                # correction bias keeps the sigmoid top-k routing data-dependent.
                TensorSpec(n(M.FFN_GATE_INP, i), (hp.experts, hp.hidden), "f32", 1.0 / np.sqrt(hp.hidden)),
                TensorSpec(n(M.FFN_EXP_PROBS_B, i, "bias"), (hp.experts,), "f32", 0.01),
                experts(n(M.FFN_GATE_EXP, i), hp.experts, hp.moe_ff, hp.hidden),
                experts(n(M.FFN_DOWN_EXP, i), hp.experts, hp.hidden, hp.moe_ff),
                experts(n(M.FFN_UP_EXP, i), hp.experts, hp.moe_ff, hp.hidden),
                mat(n(M.FFN_GATE_SHEXP, i), shared_ff, hp.hidden),
                mat(n(M.FFN_DOWN_SHEXP, i), hp.hidden, shared_ff),
                mat(n(M.FFN_UP_SHEXP, i), shared_ff, hp.hidden),
            ]
    plan += [norm(n(M.OUTPUT_NORM), hp.hidden), mat(n(M.OUTPUT), hp.vocab, hp.hidden)]
    return plan


def stored_bytes(spec: TensorSpec) -> int:
    count = int(np.prod(spec.shape))
    if spec.kind in BLOCK_BYTES:
        if spec.shape[-1] % Q8_BLOCK:
            raise ValueError(f"{spec.name}: row length {spec.shape[-1]} is not a multiple of {Q8_BLOCK}")
        return count // Q8_BLOCK * BLOCK_BYTES[spec.kind]
    return count * 4


def byte_shape(spec: TensorSpec) -> tuple[int, ...]:
    if spec.kind in BLOCK_BYTES:
        return (*spec.shape[:-1], spec.shape[-1] // Q8_BLOCK * BLOCK_BYTES[spec.kind])
    return spec.shape


def build_vocab(hp: Hparams) -> tuple[list[str], list[int]]:
    """A valid byte-level BPE vocab of hp.vocab unique tokens.

    llama-bench feeds random token ids, so only validity matters: the 256 byte tokens (GPT-2
    byte-to-unicode mapping, which llama.cpp needs e.g. for the newline token), unique filler
    tokens, and the special tokens at Kimi's ids marked CONTROL."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    byte_chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in byte_chars:
            byte_chars[b] = chr(256 + extra)
            extra += 1
    tokens = [byte_chars[b] for b in range(256)]
    types = [int(gguf.TokenType.NORMAL)] * 256
    specials = {hp.bos: "[BOS]", hp.eos: "[EOS]", hp.pad: "[PAD]"}
    for i in range(256, hp.vocab):
        if i in specials:
            tokens.append(specials[i])
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(f"<rand_{i}>")
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types


def write_metadata(w: gguf.GGUFWriter, hp: Hparams, expert_kind: str) -> None:
    w.add_name("kimi-vl-a3b-text-random")
    w.add_description("Random weights with Kimi-VL-A3B-Instruct text decoder shapes (kvl bench)")
    # the type most of the bytes have (llama.cpp only prints it)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0 if expert_kind == "q4" else gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(hp.layers)
    w.add_context_length(hp.ctx)
    w.add_embedding_length(hp.hidden)
    w.add_feed_forward_length(hp.dense_ff)
    w.add_head_count(hp.heads)
    w.add_head_count_kv(1)  # MLA is stored as MQA over the compressed latent
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_expert_count(hp.experts)
    w.add_expert_used_count(hp.experts_used)
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(hp.first_dense)
    w.add_vocab_size(hp.vocab)
    w.add_kv_lora_rank(hp.kv_lora)
    w.add_key_length(hp.kv_lora + hp.rope)
    w.add_value_length(hp.kv_lora)
    w.add_key_length_mla(hp.nope + hp.rope)
    w.add_value_length_mla(hp.v_dim)
    w.add_expert_feed_forward_length(hp.moe_ff)
    w.add_expert_shared_count(hp.shared_experts)
    w.add_expert_weights_scale(hp.routed_scale)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(hp.rope)
    tokens, types = build_vocab(hp)
    w.add_tokenizer_model("gpt2")
    # "kimi-k2" is the pre-tokenizer llama.cpp uses for Kimi's tiktoken vocab; with it the
    # loader does not require BPE merges, which a random vocab has no meaningful use for.
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(hp.bos)
    w.add_eos_token_id(hp.eos)
    w.add_pad_token_id(hp.pad)
    w.add_add_bos_token(False)


def q8_direct_chunk(rng: np.random.Generator, n_blocks: int, scale_bytes: np.ndarray) -> np.ndarray:
    buf = np.frombuffer(bytearray(rng.bytes(n_blocks * Q8_BYTES)), dtype=np.int8)
    # ggml's Q8_0 never emits -128 (its quantiser clamps to +-127); keep the codes in range.
    np.maximum(buf, -127, out=buf)
    blocks = buf.view(np.uint8).reshape(n_blocks, Q8_BYTES)
    blocks[:, :2] = scale_bytes
    return blocks


def q4_direct_chunk(rng: np.random.Generator, n_blocks: int, scale_bytes: np.ndarray) -> np.ndarray:
    # every byte value is two valid codes in [0, 15]
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * Q4_BYTES)), dtype=np.uint8).reshape(n_blocks, Q4_BYTES)
    blocks[:, :2] = scale_bytes
    return blocks


def float_chunk(rng: np.random.Generator, rows: int, row_len: int, std: float, kind: str) -> np.ndarray:
    x = rng.standard_normal((rows, row_len), dtype=np.float32)
    x *= np.float32(std)
    return gguf.quants.quantize(x, QTYPE[kind])


def write_tensor(fout, spec: TensorSpec, seed: int, index: int, via_float: bool, chunk_bytes: int) -> None:
    rng = np.random.default_rng([seed, index])
    if spec.kind == "ones":
        np.ones(spec.shape, dtype=np.float32).tofile(fout)
        return
    if spec.kind == "f32":
        (rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(spec.std)).tofile(fout)
        return
    row_len = spec.shape[-1]
    rows = int(np.prod(spec.shape[:-1]))
    row_bytes = row_len // Q8_BLOCK * BLOCK_BYTES[spec.kind]
    rows_per_chunk = max(1, chunk_bytes // row_bytes)
    code_std = Q4_CODE_STD if spec.kind == "q4" else UNIFORM_CODE_STD
    scale = np.array([spec.std / code_std], dtype=np.float16).view(np.uint8)
    direct = q4_direct_chunk if spec.kind == "q4" else q8_direct_chunk
    for start in range(0, rows, rows_per_chunk):
        r = min(rows_per_chunk, rows - start)
        if via_float:
            data = float_chunk(rng, r, row_len, spec.std, spec.kind)
        else:
            data = direct(rng, r * row_len // Q8_BLOCK, scale)
        data.tofile(fout)


def pad_to(fout, alignment: int) -> None:
    pos = fout.tell()
    pad = (-pos) % alignment
    if pad:
        fout.write(b"\x00" * pad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: /tmp/kvl-llamacpp/kimi-vl-text-q8_0.gguf, or "
                         "kimi-vl-text-q4_0-experts.gguf with --expert-type q4_0")
    ap.add_argument("--expert-type", choices=["q8_0", "q4_0"], default="q8_0",
                    help="the routed experts' type (everything else is Q8_0)")
    ap.add_argument("--config", type=Path, default=None,
                    help="take the dimensions from this config.json (e.g. the full pack's); "
                         "default: the Hparams defaults (Kimi-VL-A3B-Instruct's text_config)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=None,
                    help="override layer count (small smoke tests only; the benchmark uses 27)")
    ap.add_argument("--via-float", action="store_true",
                    help="draw normal floats and quantise with gguf.quants (slow, ~15x)")
    ap.add_argument("--chunk-mib", type=int, default=64, help="generation chunk size (bounds RAM)")
    ap.add_argument("--min-free-gib", type=float, default=25.0,
                    help="refuse to start if the output filesystem has less free space than this")
    args = ap.parse_args()
    expert_kind = "q4" if args.expert_type == "q4_0" else "q8"
    if args.out is None:
        name = "kimi-vl-text-q4_0-experts.gguf" if expert_kind == "q4" else "kimi-vl-text-q8_0.gguf"
        args.out = Path("/tmp/kvl-llamacpp") / name

    hp = hparams_from_config(args.config) if args.config else Hparams()
    if args.layers is not None:
        hp = dataclasses.replace(hp, layers=args.layers)
    if hp.layers <= hp.first_dense:
        sys.exit(f"--layers must be > {hp.first_dense} (layer 0 is dense, the rest are MoE)")
    plan = tensor_plan(hp, expert_kind)
    total = sum(stored_bytes(s) for s in plan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    free = os.statvfs(args.out.parent)
    free_gib = free.f_bavail * free.f_frsize / 2**30
    print(f"{len(plan)} tensors, {total / 2**30:.2f} GiB of tensor data; "
          f"{free_gib:.1f} GiB free at {args.out.parent}")
    if free_gib < args.min_free_gib and args.layers is None:
        sys.exit(f"only {free_gib:.1f} GiB free (< {args.min_free_gib}); free space or pass --min-free-gib")

    tmp_path = args.out.with_suffix(args.out.suffix + ".partial")
    w = gguf.GGUFWriter(tmp_path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2], use_temp_file=False)
    write_metadata(w, hp, expert_kind)
    for s in plan:
        quantised = s.kind in QTYPE
        w.add_tensor_info(s.name, byte_shape(s),
                          np.dtype(np.uint8) if quantised else np.dtype(np.float32),
                          stored_bytes(s), raw_dtype=QTYPE[s.kind] if quantised else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Tensor data is streamed here instead of via GGUFWriter.write_tensor_data, which needs each
    # tensor whole in RAM (token_embd alone would be 1.3 GB as float32). Layout is the same:
    # data section and every tensor start at a multiple of the file's alignment.
    fout = w.fout[0]
    align = w.data_alignment
    chunk_bytes = args.chunk_mib * 2**20
    t0 = time.time()
    done = 0
    pad_to(fout, align)
    for idx, s in enumerate(plan):
        start = fout.tell()
        write_tensor(fout, s, args.seed, idx, args.via_float, chunk_bytes)
        written = fout.tell() - start
        if written != stored_bytes(s):
            sys.exit(f"internal error: {s.name} wrote {written} bytes, expected {stored_bytes(s)}")
        pad_to(fout, align)
        done += written
        if s.name.endswith("ffn_up_exps.weight") or idx == len(plan) - 1:
            rate = done / max(time.time() - t0, 1e-6) / 2**20
            print(f"  {s.name}: {done / 2**30:.2f}/{total / 2**30:.2f} GiB, {rate:.0f} MiB/s", flush=True)
    w.close()
    tmp_path.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB = {args.out.stat().st_size} bytes) "
          f"in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
