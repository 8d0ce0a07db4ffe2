"""RAM planner: every resident byte of a running kvl, decided before anything is allocated.

Owns: the RamPlan (one line per resident component), the automatic trunk-cache budget (whatever
the budget leaves, capped at what the trunk can use), refusing plans over --ram-mib with what to
lower and by how much, and reconciling the plan with the figures the native engine reports after
it opened.
Does not own: allocation. The engine allocates from the budgets the plan passes it; the byte
rules mirrored here (global block, forward-order trunk prefix + streaming buffers, expert slots,
session arena) are wasm-core/src/engine.c's and model.c's, and tests/test_planner.py asserts that
the two agree exactly.

Measured constants (see the report in tests/test_planner.py's peak-RSS check):
- FIXED_OVERHEAD_BYTES: RSS of a Python 3.11 process after importing every kvl front-end module
  with numpy, Pillow, jinja2 and tiktoken (39.4 MiB measured) plus the native library and its
  thread stacks, rounded up.
- TOKENIZER_BYTES_PER_FILE_BYTE: tiktoken keeps the vocabulary twice (Python dict + Rust maps);
  a 163,584-token, 2.9 MB tiktoken.model measured 55.8 MiB resident (19.1 bytes per file byte).
- MARGIN_BYTES: allocator fragmentation, page tables, transient copies; the stated tolerance of
  peak RSS over the plan.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvl.errors import UserError

MIB = 1 << 20
PAGE = 4096
FIXED_OVERHEAD_BYTES = 48 * MIB
TOKENIZER_BYTES_PER_FILE_BYTE = 20
MARGIN_BYTES = 64 * MIB
KV_DTYPE_BYTES = {"f32": 4, "bf16": 2}
DEFAULT_MAX_BATCH = 256

# sizeof(struct kvl_session) is not visible from Python; kvl_session_bytes adds it to the arena.
# It is far below a page, so the plan reserves one page for it until the engine reports.
SESSION_STRUCT_RESERVE = PAGE
ARENA_ALIGN = 64  # wasm-core/src/model.c
_LAYER = "language_model.model.layers.{}."
# Per-layer trunk tensors in the engine's forward order (engine.c KVL_TT_*): attention, then the
# dense MLP (layer < first_k_dense_replace) or the shared experts.
_ATTENTION = ("self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
              "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def align_to(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def layer_is_moe(hp: dict[str, float], layer: int) -> bool:
    return (int(hp["text.n_routed_experts"]) > 0 and layer >= int(hp["text.first_k_dense_replace"])
            and layer % max(int(hp["text.moe_layer_freq"]), 1) == 0)


def _trunk_layout(trunk: dict, hp: dict[str, float]) -> tuple[int, list[int]]:
    """(resident global bytes, padded sizes of the cacheable trunk tensors in forward order).

    Globals as the engine lays them out in one block: lm_head (BF16, page aligned), norms
    converted to FP32 (64-byte aligned), and per MoE layer the router (BF16, page aligned) and
    its FP32 correction bias. embed_tokens is never resident (rows are read on demand).
    """
    hidden = _hparam(hp, "text.hidden_size")
    kv_lora = _hparam(hp, "text.kv_lora_rank")
    n_routed = _hparam(hp, "text.n_routed_experts")
    n_layers = _hparam(hp, "text.num_hidden_layers")
    try:
        lm_head = trunk["language_model.lm_head.weight"]
    except KeyError:
        raise UserError("trunk.idx lacks language_model.lm_head.weight; rerun kvl pack") from None
    globals_bytes = align_page(lm_head.nbytes) + align_to(hidden * 4, 64)
    order: list[int] = []
    for layer in range(n_layers):
        prefix = _LAYER.format(layer)
        globals_bytes += 2 * align_to(hidden * 4, 64) + align_to(kv_lora * 4, 64)
        moe = layer_is_moe(hp, layer)
        if moe:
            router = trunk.get(prefix + "mlp.gate.weight")
            if router is None:
                raise UserError(f"trunk.idx lacks {prefix}mlp.gate.weight; rerun kvl pack")
            globals_bytes += align_page(router.nbytes) + align_to(n_routed * 4, 64)
        mlp = "mlp.shared_experts." if moe else "mlp."
        for suffix in _ATTENTION + tuple(mlp + m for m in _MLP):
            rec = trunk.get(prefix + suffix)
            if rec is not None:
                order.append(align_page(rec.nbytes))
    return globals_bytes, order


def trunk_cache_split(order: list[int], budget: int) -> tuple[int, int]:
    """(resident bytes, streaming-buffer bytes) for a trunk budget: the engine keeps the longest
    forward-order prefix that fits and double-buffers the largest streamed tensor."""
    used = 0
    first_streamed = len(order)
    for i, size in enumerate(order):
        if used + size > budget:
            first_streamed = i
            break
        used += size
    streamed = order[first_streamed:]
    return used, (2 * max(streamed) if streamed else 0)


def session_layout_bytes(hp: dict[str, float], max_context: int, max_batch: int, kv_dtype: str,
                         n_threads: int) -> int:
    """The session arena as wasm-core/src/model.c lays it out (KV first, then prefill buffers)."""
    g = lambda key: _hparam(hp, "text." + key)  # noqa: E731
    batch = min(max_batch, max_context)
    hidden, heads, kv_lora, rope = g("hidden_size"), g("num_attention_heads"), g("kv_lora_rank"), \
        g("qk_rope_head_dim")
    nope, v_dim, n_routed, top_k = g("qk_nope_head_dim"), g("v_head_dim"), \
        g("n_routed_experts"), g("num_experts_per_tok")
    n_layers, n_group = g("num_hidden_layers"), g("n_group")
    kv_row = kv_lora + rope
    widths = [1]
    for layer in range(n_layers):
        if layer_is_moe(hp, layer):
            # shared rows + one expert's: a small chunk keeps both side by side (model.c)
            widths.append((g("n_shared_experts") + 1) * g("moe_intermediate_size"))
        else:
            widths.append(g("intermediate_size"))
    mlp_width = max(widths)
    scores = heads * max_context
    routing = 3 * n_routed + n_group + 4
    tiled = kv_lora * heads + (kv_lora * nope + 1) // 2   # attn_tiled: context block, W_uk^T
    per_thread = align_to(max(scores, routing) + 2 * kv_row + rope + tiled, 16)
    sizes = [
        n_layers * max_context * kv_row * KV_DTYPE_BYTES[kv_dtype],   # KV
        batch * hidden * 4, batch * hidden * 4,                        # x, xn
        batch * heads * (nope + rope) * 4, batch * kv_row * 4,         # q, a
        batch * heads * kv_row * 4, batch * heads * kv_lora * 4,       # q absorbed + rope, context
        batch * heads * v_dim * 4,                                     # o
        batch * mlp_width * 4, batch * mlp_width * 4,                  # gate, up
        batch * n_routed * 4, batch * top_k * 4,                       # router logits, weights
        batch * hidden * 4, batch * hidden * 4, batch * hidden * 4,    # moe out, xg, yg
        n_threads * per_thread * 4,                                    # per-thread scratch
        batch * top_k * 4, (n_routed + 1) * 4, batch * top_k * 4, n_routed * 4,  # expert lists
        hidden * 2,                                                    # one embedding row
        kv_lora * max_context * 4,                                     # latents transposed
    ]
    return sum(align_to(size or 1, ARENA_ALIGN) for size in sizes)


def align_page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def mib(n: int | float) -> str:
    return f"{n / MIB:,.1f}"


@dataclass
class RamPlan:
    """Resident bytes by component. `exact` names the components confirmed by the engine."""
    ram_bytes: int
    max_context: int
    max_batch: int
    kv_dtype: str
    fixed_overhead: int
    margin: int
    tokenizer: int
    globals: int
    trunk_cache: int
    trunk_cacheable: int
    expert_cache: int
    expert_extent: int
    kv: int
    session_arena: int
    engine_workspace: int
    vision: int
    media_cache: int
    logits: int
    trunk_auto: bool
    vision_python: int = 0  # pixels + embeddings Python holds around a vision call (in `vision`)
    exact: set[str] = field(default_factory=set)

    COMPONENTS = ("fixed_overhead", "tokenizer", "globals", "trunk_cache", "expert_cache", "kv",
                  "session_arena", "engine_workspace", "vision", "media_cache", "logits", "margin")
    LABELS = {
        "fixed_overhead": "Python + libraries (measured)",
        "tokenizer": "tokenizer vocabulary",
        "globals": "resident trunk (lm_head, norms, routers)",
        "trunk_cache": "trunk cache",
        "expert_cache": "expert cache (whole extents)",
        "kv": "KV cache",
        "session_arena": "session arena",
        "engine_workspace": "trunk streaming buffers",
        "vision": "vision working memory (largest image)",
        "media_cache": "image embeddings of the conversation",
        "logits": "logits + sampler buffers",
        "margin": "margin (fragmentation, transient copies)",
    }

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in self.COMPONENTS)

    @property
    def trunk_cache_bytes(self) -> int:
        return self.trunk_cache

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_cache

    def describe(self) -> str:
        rows = [("component", "MiB", "")]
        for c in self.COMPONENTS:
            note = ""
            if c == "kv":
                note = f"{self.max_context} tokens, {self.kv_dtype}"
            elif c == "trunk_cache":
                note = ("auto, " if self.trunk_auto else "") + \
                       f"{100 * self.trunk_cache / max(self.trunk_cacheable, 1):.0f}% of " \
                       f"{mib(self.trunk_cacheable)} MiB"
            elif c == "expert_cache" and self.expert_extent:
                note = f"{self.expert_cache // self.expert_extent} extents"
            if c in self.exact:
                note = (note + ", " if note else "") + "engine-reported"
            rows.append((self.LABELS[c], mib(getattr(self, c)), note))
        rows.append(("total", mib(self.total), f"budget {mib(self.ram_bytes)} MiB"))
        width = max(len(r[0]) for r in rows)
        lines = [f"{r[0]:<{width}}  {r[1]:>10}  {r[2]}".rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        return "\n".join(lines)

    def check_budget(self) -> None:
        over = self.total - self.ram_bytes
        if over <= 0:
            return
        hints = []
        min_expert = self.expert_extent  # never below one extent; the engine's own floor may be higher
        if self.expert_cache - min_expert >= over:
            hints.append(f"lower --cache-mib by {math.ceil(over / MIB)}")
        if not self.trunk_auto and self.trunk_cache >= over:
            hints.append(f"lower --trunk-cache-mib by {math.ceil(over / MIB)}")
        per_token = self.kv // max(self.max_context, 1)
        if per_token and self.kv >= over:
            fewer = math.ceil(over / per_token)
            if fewer < self.max_context:
                hints.append(f"lower --max-context by {fewer} (to {self.max_context - fewer})")
        if self.vision:
            hints.append("run without vision")
        hints.append(f"raise --ram-mib to {math.ceil(self.total / MIB)}")
        raise UserError(f"the RAM plan needs {mib(self.total)} MiB, {mib(over)} MiB over "
                        f"--ram-mib {mib(self.ram_bytes)}; " + " or ".join(hints)
                        + "\n" + self.describe())

    def reconcile(self, info: dict, session_bytes: int, vision_bytes: int | None) -> list[str]:
        """Adopt the engine's exact figures; return the components that differed.

        Raises UserError if the exact plan no longer fits the budget.
        """
        changed: list[str] = []

        def adopt(component: str, value: int) -> None:
            if getattr(self, component) != value:
                changed.append(f"{component}: planned {getattr(self, component)}, engine {value}")
                setattr(self, component, value)
            self.exact.add(component)

        adopt("globals", int(info["global_bytes"]))
        adopt("expert_cache", int(info["expert_cache_bytes"]))
        adopt("engine_workspace", int(info["engine_workspace_bytes"]))
        adopt("trunk_cache", int(info["trunk_cache_bytes"]))
        self.expert_extent = int(info["expert_extent_bytes"])
        self.kv_dtype = str(info.get("kv_dtype") or self.kv_dtype)
        if session_bytes < self.kv:
            changed.append(f"session: engine reports {session_bytes} bytes < KV {self.kv}")
        adopt("session_arena", max(int(session_bytes) - self.kv, 0))
        if vision_bytes is not None:
            adopt("vision", int(vision_bytes) + self.vision_python)
        self.check_budget()
        return changed


def vision_call_estimate(hp: dict[str, float], patches: int, n_threads: int) -> int:
    """Working memory of one vision call (largest weight phase + FP32 activations), the shape of
    wasm-core/src/vision.c's layout; Engine replaces it with kvl_vision_bytes once open."""
    g = lambda key: _hparam(hp, "vision." + key)  # noqa: E731
    d, inter, p = g("hidden_size"), g("intermediate_size"), g("patch_size")
    width = d * g("merge_kernel_h") * g("merge_kernel_w")
    text_hidden = _hparam(hp, "text.hidden_size")
    bf16 = lambda n: align_page(2 * n)  # noqa: E731
    embed = bf16(d * 3 * p * p) + bf16(d) + bf16(g("init_pos_emb_height") * g("init_pos_emb_width") * d)
    block = 6 * bf16(d) + bf16(3 * d * d) + bf16(3 * d) + bf16(d * d) + bf16(inter * d) \
        + bf16(inter) + bf16(d * inter)
    proj = max(4 * bf16(d) + bf16(width * width) + bf16(width), bf16(text_hidden * width))
    head_dim = d // g("num_attention_heads")
    activations = 4 * (2 * patches * d + patches * max(3 * d, inter) + patches * head_dim
                       + n_threads * patches + 9 * d + inter + width)
    return max(embed, block, proj) + activations


# Divisors among the hparams: zero would mean a corrupt pack, not an empty model.
_POSITIVE = {"vision.num_attention_heads", "vision.patch_size", "vision.merge_kernel_h",
             "vision.merge_kernel_w", "text.num_attention_heads"}


def _hparam(hp: dict[str, float], key: str) -> int:
    """An integer hparam, in the range the native engine accepts (a whole number in 0..2^24)."""
    try:
        value = hp[key]
    except KeyError:
        raise UserError(f"the pack's hparams lack {key!r}; repack with this kvl version") from None
    low = 1 if key in _POSITIVE else 0
    if not (low <= value <= 1 << 24) or value != int(value):
        raise UserError(f"the pack's hparam {key!r} = {value!r} is out of range; the pack is "
                        "corrupt: rerun kvl pack")
    return int(value)


def largest_image_grid(preprocessor_config: dict, merge: tuple[int, int]) -> tuple[int, int]:
    """The patch grid with the most patches preprocessing lets through: vision working memory grows
    with the patch count, so the plan reserves it for this grid (not the square one: thin images
    gain the most padding after the downscale)."""
    from kvl.image import largest_grid

    return largest_grid(preprocessor_config, merge)


def plan(pack_dir: str | Path, ram_mib: int = 4096, cache_mib: int = 512,
         trunk_cache_mib: int | None = None, max_context: int = 4096, load_vision: bool = True,
         *, max_batch: int = DEFAULT_MAX_BATCH, kv_dtype: str = "f32", threads: int = 0,
         check: bool = True) -> RamPlan:
    """Plan a run of the pack. Refuses (UserError) a plan over ram_mib when check is set."""
    import json

    from kvl.packfmt import PackReader

    pack_dir = Path(pack_dir)
    reader = PackReader(pack_dir)
    hp = reader.hparams
    if kv_dtype not in KV_DTYPE_BYTES:
        raise UserError(f"kv dtype {kv_dtype!r} unknown; use one of {', '.join(KV_DTYPE_BYTES)}")
    n_layers = _hparam(hp, "text.num_hidden_layers")
    hidden = _hparam(hp, "text.hidden_size")
    vocab = _hparam(hp, "text.vocab_size")
    kv_width = _hparam(hp, "text.kv_lora_rank") + _hparam(hp, "text.qk_rope_head_dim")
    top_k = _hparam(hp, "text.num_experts_per_tok")
    max_positions = _hparam(hp, "text.max_position_embeddings")
    if not 1 <= max_context <= max_positions:
        raise UserError(f"--max-context {max_context} is outside 1..{max_positions} "
                        "(the model's max_position_embeddings)")
    if ram_mib <= 0 or cache_mib < 0 or (trunk_cache_mib is not None and trunk_cache_mib < 0):
        raise UserError("--ram-mib must be positive and cache sizes non-negative")

    trunk = reader.stores["trunk"].by_name
    globals_bytes, trunk_order = _trunk_layout(trunk, hp)
    cacheable = sum(trunk_order)
    expert_records = reader.stores["experts"].records
    if not expert_records:
        raise UserError(f"{pack_dir}/experts.idx holds no experts; rerun kvl pack")
    extent = align_page(expert_records[0].nbytes)
    # Never more slots than there are extents: the whole expert store then stays resident.
    expert_cache = min((cache_mib * MIB) // extent, len(expert_records)) * extent
    if expert_cache < top_k * extent:
        need = math.ceil(top_k * extent / MIB)
        raise UserError(f"--cache-mib {cache_mib} holds {expert_cache // extent} expert extents; "
                        f"one layer needs {top_k} ({need} MiB): raise --cache-mib to at least {need}")

    kv = n_layers * kv_width * max_context * KV_DTYPE_BYTES[kv_dtype]
    n_threads = threads if threads > 0 else (os.cpu_count() or 1)
    arena = session_layout_bytes(hp, max_context, max_batch, kv_dtype, n_threads) - kv \
        + SESSION_STRUCT_RESERVE

    vision = 0
    vision_python = 0
    if load_vision:
        try:
            pre = json.loads((pack_dir / "preprocessor_config.json").read_text("utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"{pack_dir}/preprocessor_config.json unreadable ({exc}); "
                            "rerun kvl pack") from exc
        merge = (_hparam(hp, "vision.merge_kernel_h"), _hparam(hp, "vision.merge_kernel_w"))
        grid = largest_image_grid(pre, merge)
        patches = grid[0] * grid[1]
        patch = _hparam(hp, "vision.patch_size")
        # pixels + one image's embeddings held by Python around the native call
        vision_python = 4 * (patches * 3 * patch * patch + (patches // (merge[0] * merge[1])) * hidden)
        native_estimate = vision_call_estimate(hp, patches, n_threads)
        vision = native_estimate + vision_python
    media_cache = 4 * max_context * hidden if load_vision else 0
    logits = 3 * 4 * vocab
    tokenizer = TOKENIZER_BYTES_PER_FILE_BYTE * (pack_dir / "tiktoken.model").stat().st_size

    result = RamPlan(ram_bytes=ram_mib * MIB, max_context=max_context, max_batch=max_batch,
                     kv_dtype=kv_dtype, fixed_overhead=FIXED_OVERHEAD_BYTES, margin=MARGIN_BYTES,
                     tokenizer=tokenizer, globals=globals_bytes, trunk_cache=0,
                     trunk_cacheable=cacheable, expert_cache=expert_cache, expert_extent=extent,
                     kv=kv, session_arena=arena, engine_workspace=0, vision=vision,
                     media_cache=media_cache, logits=logits, trunk_auto=trunk_cache_mib is None,
                     vision_python=vision_python)
    if trunk_cache_mib is None:
        # Largest forward-order prefix whose bytes plus the streaming buffers (needed as soon as
        # one tensor is streamed) fit in what the budget leaves.
        left = max(result.ram_bytes - result.total, 0)
        budget = left
        while True:
            resident, workspace = trunk_cache_split(trunk_order, budget)
            if resident + workspace <= left or resident == 0:
                break
            budget = resident - 1
    else:
        resident, workspace = trunk_cache_split(trunk_order, trunk_cache_mib * MIB)
    result.trunk_cache, result.engine_workspace = resident, workspace
    if check:
        result.check_budget()
    return result
