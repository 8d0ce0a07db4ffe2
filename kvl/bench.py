"""`kvl bench MODEL`: speed of the text engine as ratios to this machine's bandwidth limits.

Owns: the measurement procedure (fresh engine per prompt length, cold prefill, greedy decode,
optional warm repeat), the byte accounting from the pack's index (what a token must move through
RAM and read from SSD), the lower bounds and the measured/bound ratios, and a portable fallback
measurement of the physical limits (DRAM read with numpy threads, O_DIRECT reads of experts.bin).
Does not own: any model math or I/O policy (native engine), planning (planner.py). The C helper
bench/membw.c is the preferred source of the limits (`--limits FILE` takes its JSON lines);
bench/run_all.sh runs both and bench/RESULTS.md shows the figures.

Byte accounting (per decoded token, context T):
  RAM  = every trunk tensor except embed_tokens (lm_head, attention, norms, dense MLP, routers,
         shared experts; stored bytes) + one embed_tokens row + num_experts_per_tok routed expert
         extents per MoE layer (data bytes, not the 4 KiB padding) + the KV history read by
         attention (n_layers x T x (kv_lora_rank + qk_rope_head_dim) x KV element bytes).
  SSD  = measured: the engine's expert_bytes_read + trunk_bytes_read deltas over the decode.
  decode bound = max(SSD/token / direct-read BW, RAM/token / DRAM BW); their sum is shown too.
First token (prefill of the prompt + picking its first output token), cold engine caches:
  SSD  = trunk tensors the plan streams (not resident after open) + distinct routed experts the
         prompt routes to x padded extent; distinct experts = the expert-cache misses of the cold
         prefill done in one chunk (the engine reads each (layer, expert) at most once per chunk).
  RAM  = every trunk tensor except embed_tokens once + distinct experts x extent data bytes +
         prompt embedding rows.
  first-token bound = SSD / direct-read BW + RAM / DRAM BW. The FLOP floor (2 x active weights x
  prompt tokens / measured FMA peak) is printed beside it: long prompts are compute-bound.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvl.errors import UserError

MIB = 1 << 20
GB = 1e9
PAGE = 4096
EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = "language_model.lm_head.weight"
KV_BYTES = {"f32": 4, "bf16": 2}


# ---- arguments ---------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="packed model directory (kvl pack / kvl prepare output)")
    parser.add_argument("--ram-mib", type=int, default=4096, help="RAM budget of the plan (4096)")
    parser.add_argument("--cache-mib", type=int, default=512, help="expert cache MiB (512)")
    parser.add_argument("--trunk-cache-mib", default="auto",
                        help="auto (what the budget leaves), 0 = stream the trunk, or MiB")
    parser.add_argument("--threads", type=int, default=0, help="engine threads (0 = every core)")
    parser.add_argument("--prompt-lens", default="16,512",
                        help="comma-separated prompt lengths in tokens (16,512)")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="greedy tokens decoded and timed after each prompt (16)")
    parser.add_argument("--warm", action="store_true",
                        help="after the cold prompt, run a warm-up prefill (fills the caches), "
                             "then time the same prompt and the decode again on warm caches")
    parser.add_argument("--warmup-tokens", type=int, default=512,
                        help="tokens of the --warm warm-up prompt (512)")
    parser.add_argument("--max-batch", type=int, default=0,
                        help="prefill chunk in tokens (0 = the longest prompt, so each prompt is "
                             "one chunk and reads each routed expert at most once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (0)")
    parser.add_argument("--act-dtype", default="f32", choices=["f32", "bf16"],
                        help="inputs of the Linear layers (kvl chat --act-dtype; f32)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="echo 3 > /proc/sys/vm/drop_caches before each engine open (root)")
    parser.add_argument("--limits", type=Path, default=None,
                        help="JSON lines from bench/membw.c (dram/ssd/fma); without it the limits "
                             "are measured here with numpy threads and O_DIRECT reads")
    parser.add_argument("--membw", type=Path, default=None,
                        help="bench/membw.c binary: re-measure DRAM and direct-read bandwidth right "
                             "before and after each decode, so its ratio uses the machine's "
                             "bandwidth of that moment (shared machines drift by 30%% and more)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


# ---- physical limits -------------------------------------------------------------------------

@dataclass
class Limits:
    dram_bytes_per_s: float        # best multi-thread streaming read
    ssd_bytes_per_s: float         # best O_DIRECT extent-sized random read (any queue depth)
    fma_flops_per_s: float | None  # best FP32 FMA peak, all threads
    source: str
    detail: list[dict] = field(default_factory=list)


def load_limits(path: Path) -> Limits:
    try:
        rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise UserError(f"--limits {path}: unreadable ({exc}); produce it with bench/run_all.sh "
                        "or drop --limits to measure here") from None
    dram = [r["best_bytes_per_s"] for r in rows if r.get("mode") == "dram"]
    ssd = [r["bytes_per_s"] for r in rows if r.get("mode") == "ssd"]
    fma = [r["flops_per_s"] for r in rows if r.get("mode") == "fma"]
    if not dram or not ssd:
        raise UserError(f"--limits {path} needs at least one dram and one ssd line (membw output)")
    return Limits(max(dram), max(ssd), max(fma) if fma else None, str(path), rows)


def _numpy_dram_read(size_bytes: int, threads: int, reps: int) -> float:
    """Best bytes/s of `threads` threads each OR-reducing its own slice (numpy drops the GIL)."""
    buf = np.empty(size_bytes // 8, dtype=np.uint64)
    buf[:] = np.arange(buf.size, dtype=np.uint64)
    slices = np.array_split(buf, threads)
    best = 0.0
    for _ in range(reps):
        barrier = threading.Barrier(threads + 1)
        workers = [threading.Thread(target=lambda s=s, b=barrier: (b.wait(), np.bitwise_or.reduce(s)))
                   for s in slices]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        best = max(best, size_bytes / (time.perf_counter() - t0))
    del buf
    return best


def direct_read_bw(path: Path, block: int, qd: int, reads: int, seed: int) -> float:
    """bytes/s of O_DIRECT reads of `block` bytes at random 4 KiB-aligned offsets, qd in flight."""
    if not hasattr(os, "O_DIRECT"):
        raise UserError("O_DIRECT is not available on this platform; pass --limits from membw")
    block = (block + PAGE - 1) // PAGE * PAGE
    size = path.stat().st_size
    slots = (size - block) // PAGE + 1
    rng = np.random.default_rng(seed)
    offsets = (rng.integers(0, slots, size=reads) * PAGE).tolist()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    done = [0] * qd

    def worker(k: int) -> None:
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
        try:
            for off in offsets[k::qd]:
                done[k] += os.preadv(fd, [buf], off)
        finally:
            buf.close()
    try:
        t0 = time.perf_counter()
        workers = [threading.Thread(target=worker, args=(k,)) for k in range(qd)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        secs = time.perf_counter() - t0
    finally:
        os.close(fd)
    return sum(done) / secs


def measure_limits(model: Path, extent: int, threads: int, drop: bool) -> Limits:
    rows: list[dict] = []
    for t in sorted({1, threads}):
        bw = _numpy_dram_read(1 << 30, t, 3)
        rows.append({"mode": "dram", "impl": "numpy", "threads": t, "best_bytes_per_s": bw})
    for qd in (1, 2):
        if drop:
            drop_page_cache()
        bw = direct_read_bw(model / "experts.bin", extent, qd, 64, seed=qd)
        rows.append({"mode": "ssd", "impl": "python", "qd": qd, "block": extent,
                     "bytes_per_s": bw})
    return Limits(max(r["best_bytes_per_s"] for r in rows if r["mode"] == "dram"),
                  max(r["bytes_per_s"] for r in rows if r["mode"] == "ssd"), None,
                  "measured by kvl bench (numpy / python O_DIRECT)", rows)


def drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise UserError(f"--drop-caches needs root on Linux ({exc}); run without it") from None


def probe_limits(membw: Path, model: Path, threads: int, seed: int) -> dict[str, float]:
    """A short DRAM read (1 GiB, best of 3) and direct-read probe (128 reads of 2 MiB, 4 in
    flight, the engine's read pattern) with the membw binary, in a child process so its buffers
    never count in this process's peak RSS."""
    def run(*argv: str) -> dict:
        proc = subprocess.run([str(membw), *argv], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise UserError(f"--membw {membw} {' '.join(argv)} failed: {proc.stderr.strip()}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    dram = run("dram", "1024", str(threads), "3", "avx2")["best_bytes_per_s"]
    experts = model / "experts.bin"
    block = min(2 << 20, max(PAGE, experts.stat().st_size // 2 // PAGE * PAGE))  # tiny packs
    ssd = run("ssd", str(experts), str(block), "4", "128", str(seed))["bytes_per_s"]
    return {"dram_bytes_per_s": float(dram), "ssd_bytes_per_s": float(ssd)}


# ---- byte accounting ------------------------------------------------------------------------

@dataclass
class PackBytes:
    trunk_used: int            # every trunk tensor except embed_tokens (stored bytes)
    lm_head: int
    embed_row: int
    extent_data: int           # one routed expert's data bytes
    extent_padded: int         # the same padded to 4 KiB (one direct read)
    n_moe_layers: int
    top_k: int
    n_layers: int
    kv_row_elems: int          # kv_lora_rank + qk_rope_head_dim
    n_extents: int
    active_weight_elems: int   # weights a token multiplies (no embed, no lm_head), for FLOPs
    hidden: int
    vocab: int

    def decode_ram(self, context: float, kv_bytes: int) -> float:
        kv = self.n_layers * context * self.kv_row_elems * kv_bytes
        return self.trunk_used + self.embed_row + self.n_moe_layers * self.top_k * self.extent_data + kv

    def prefill_ram(self, tokens: int, distinct: int, kv_bytes: int) -> float:
        kv = self.n_layers * tokens * self.kv_row_elems * kv_bytes
        return self.trunk_used + tokens * self.embed_row + distinct * self.extent_data + kv

    def prefill_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.active_weight_elems + 2.0 * self.hidden * self.vocab


def pack_bytes(model: Path) -> PackBytes:
    from kvl.packfmt import PackReader

    reader = PackReader(model)
    hp = reader.hparams
    g = lambda k: int(hp["text." + k])  # noqa: E731
    trunk = reader.stores["trunk"].records
    experts = reader.stores["experts"].records
    if not experts:
        raise UserError(f"{model}/experts.idx holds no experts; rerun kvl pack")
    by_name = {r.name: r for r in trunk}
    if EMBED not in by_name or LM_HEAD not in by_name:
        raise UserError(f"{model}/trunk.idx lacks {EMBED} or {LM_HEAD}; rerun kvl pack")
    used = sum(r.nbytes for r in trunk if r.name != EMBED)
    n_layers = g("num_hidden_layers")
    n_moe = sum(1 for layer in range(n_layers)
                if g("n_routed_experts") > 0 and layer >= g("first_k_dense_replace")
                and layer % max(g("moe_layer_freq"), 1) == 0)
    elems = lambda r: int(np.prod(r.shape))  # noqa: E731
    # weights multiplied per token: 2-D trunk matrices except embed/lm_head, routed experts
    trunk_elems = sum(elems(r) for r in trunk if len(r.shape) == 2 and r.name not in (EMBED, LM_HEAD))
    expert_elems = 3 * g("moe_intermediate_size") * g("hidden_size")
    ext = experts[0]
    return PackBytes(trunk_used=used, lm_head=by_name[LM_HEAD].nbytes,
                     embed_row=by_name[EMBED].nbytes // g("vocab_size"),
                     extent_data=ext.nbytes, extent_padded=(ext.nbytes + PAGE - 1) // PAGE * PAGE,
                     n_moe_layers=n_moe, top_k=g("num_experts_per_tok"), n_layers=n_layers,
                     kv_row_elems=g("kv_lora_rank") + g("qk_rope_head_dim"), n_extents=len(experts),
                     active_weight_elems=trunk_elems + n_moe * g("num_experts_per_tok") * expert_elems,
                     hidden=g("hidden_size"), vocab=g("vocab_size"))


# ---- measurement -----------------------------------------------------------------------------

def peak_rss_bytes() -> int:
    """Peak RSS of this process since reset_peak_rss (Linux VmHWM); ru_maxrss where there is no
    /proc (that one cannot be reset, so it includes the limit measurements)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the limit measurements' 1 GiB buffers
    do not count as the engine's peak; elsewhere the peak includes them (said in the output)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5\n")


def random_prompt(vocab: int, n: int, seed: int, avoid: set[int]) -> np.ndarray:
    """n token ids uniform over the vocabulary, without the media placeholder (it needs media)."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, vocab, size=n, dtype=np.int64)
    for bad in avoid:
        out[out == bad] = (bad + 1) % vocab
    return out.astype(np.int32)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _ssd(d: dict) -> int:
    return int(d["expert_bytes_read"] + d["trunk_bytes_read"])


def _hit_rate(d: dict) -> float | None:
    n = d["expert_hits"] + d["expert_misses"]
    return d["expert_hits"] / n if n else None


def time_prompt(engine: Any, tokens: np.ndarray, max_context: int, max_batch: int) -> tuple[Any, dict]:
    native = engine._native
    session = native.new_session(max_context=max_context, max_batch=max_batch)
    before = native.stats()
    t0 = time.perf_counter()
    logits = session.prefill(tokens, logits="last")
    t1 = time.perf_counter()
    first = int(np.argmax(logits))
    t2 = time.perf_counter()
    d = _delta(native.stats(), before)
    return session, {"tokens": int(tokens.size), "prefill_s": t1 - t0, "first_token_s": t2 - t0,
                     "prefill_tokens_per_s": tokens.size / (t1 - t0), "first_token": first,
                     "ssd_bytes": _ssd(d), "expert_misses": int(d["expert_misses"]),
                     "expert_hits": int(d["expert_hits"]),
                     "expert_stall_s": d["expert_stall_ns"] / 1e9,
                     "trunk_bytes_read": int(d["trunk_bytes_read"]),
                     "expert_bytes_read": int(d["expert_bytes_read"])}


def time_decode(engine: Any, session: Any, first: int, n: int) -> dict:
    native = engine._native
    start_pos = session.position
    before = native.stats()
    token = first
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = session.step(token)
        token = int(np.argmax(logits))
        times.append(time.perf_counter() - t0)
    d = _delta(native.stats(), before)
    return {"tokens": n, "context_start": start_pos, "s_per_token_mean": float(np.mean(times)),
            "s_per_token_median": float(np.median(times)), "s_per_token_min": float(np.min(times)),
            "ssd_bytes_per_token": _ssd(d) / n, "expert_hit_rate": _hit_rate(d),
            "expert_stall_s_per_token": d["expert_stall_ns"] / 1e9 / n,
            "trunk_stall_s_per_token": d["trunk_stall_ns"] / 1e9 / n,
            "expert_bytes_read": int(d["expert_bytes_read"]),
            "trunk_bytes_read": int(d["trunk_bytes_read"])}


def timed_decode(args: argparse.Namespace, model: Path, threads: int, engine: Any, session: Any,
                 first: int) -> dict:
    """time_decode, bracketed by bandwidth probes when --membw is given."""
    if not args.membw:
        return time_decode(engine, session, first, args.decode_tokens)
    before = probe_limits(args.membw, model, threads, seed=first)
    dec = time_decode(engine, session, first, args.decode_tokens)
    dec["probes"] = (before, probe_limits(args.membw, model, threads, seed=first + 1))
    return dec


def decode_bounds(dec: dict, pb: PackBytes, lim: Limits, kv_bytes: int) -> None:
    context = dec["context_start"] + (dec["tokens"] + 1) / 2.0
    ram = pb.decode_ram(context, kv_bytes)
    ssd_t = dec["ssd_bytes_per_token"] / lim.ssd_bytes_per_s
    ram_t = ram / lim.dram_bytes_per_s
    dec.update(ram_bytes_per_token=ram, bound_ssd_s=ssd_t, bound_ram_s=ram_t,
               bound_s=max(ssd_t, ram_t), bound_sum_s=ssd_t + ram_t,
               ratio=dec["s_per_token_mean"] / max(ssd_t, ram_t),
               ratio_to_sum=dec["s_per_token_mean"] / (ssd_t + ram_t))


def adjacent_bounds(dec: dict, before: dict[str, float], after: dict[str, float]) -> None:
    """The decode's ratio against the mean of the probes taken just before and after it."""
    dram = (before["dram_bytes_per_s"] + after["dram_bytes_per_s"]) / 2
    ssd = (before["ssd_bytes_per_s"] + after["ssd_bytes_per_s"]) / 2
    bound = max(dec["ssd_bytes_per_token"] / ssd, dec["ram_bytes_per_token"] / dram)
    dec.update(adjacent={"before": before, "after": after, "dram_bytes_per_s": dram,
                         "ssd_bytes_per_s": ssd, "bound_s": bound,
                         "ratio": dec["s_per_token_mean"] / bound,
                         "ratio_median": dec["s_per_token_median"] / bound})


def prompt_bounds(p: dict, pb: PackBytes, lim: Limits, streamed_trunk: int, distinct: int,
                  kv_bytes: int, cold: bool) -> None:
    experts_from_ssd = distinct if cold else p["expert_misses"]
    ssd = streamed_trunk + experts_from_ssd * pb.extent_padded
    ram = pb.prefill_ram(p["tokens"], distinct, kv_bytes)
    bound = ssd / lim.ssd_bytes_per_s + ram / lim.dram_bytes_per_s
    p.update(distinct_experts=distinct, bound_ssd_bytes=ssd, bound_ram_bytes=ram, bound_s=bound,
             ratio=p["first_token_s"] / bound)
    if lim.fma_flops_per_s:
        flops = pb.prefill_flops(p["tokens"])
        p.update(flops=flops, flop_floor_s=flops / lim.fma_flops_per_s,
                 ratio_to_max_bound=p["first_token_s"] / max(bound, flops / lim.fma_flops_per_s))


def run_bench(args: argparse.Namespace) -> dict:
    from kvl.engine import Engine

    model = Path(args.model)
    try:
        lens = sorted({int(x) for x in str(args.prompt_lens).split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--prompt-lens {args.prompt_lens!r}: give comma-separated integers, "
                        "e.g. 16,512") from None
    if not lens or min(lens) < 1 or args.decode_tokens < 1:
        raise UserError("--prompt-lens needs positive lengths and --decode-tokens >= 1")
    if args.trunk_cache_mib == "auto":
        trunk_mib = None
    else:
        try:
            trunk_mib = int(args.trunk_cache_mib)
        except ValueError:
            raise UserError(f"--trunk-cache-mib {args.trunk_cache_mib!r}: use auto or a MiB "
                            "number") from None
    pb = pack_bytes(model)
    threads = args.threads if args.threads > 0 else (os.cpu_count() or 1)
    limits = (load_limits(args.limits) if args.limits
              else measure_limits(model, pb.extent_data, threads, args.drop_caches))
    reset_peak_rss()
    max_batch = args.max_batch or max(lens + [args.warmup_tokens if args.warm else 0])
    max_context = max(lens) + args.decode_tokens + 8
    if args.warm:
        max_context = max(max_context, args.warmup_tokens + 8)

    result: dict[str, Any] = {
        "model": str(model), "settings": {
            "ram_mib": args.ram_mib, "cache_mib": args.cache_mib,
            "trunk_cache_mib": args.trunk_cache_mib, "threads": threads,
            "prompt_lens": lens, "decode_tokens": args.decode_tokens, "warm": args.warm,
            "max_batch": max_batch, "max_context": max_context, "seed": args.seed,
            "drop_caches": args.drop_caches, "act_dtype": args.act_dtype},
        "limits": asdict(limits), "pack_bytes": asdict(pb), "runs": []}
    for n in lens:
        if args.drop_caches:
            drop_page_cache()
        t0 = time.perf_counter()
        engine = Engine(model, ram_mib=args.ram_mib, cache_mib=args.cache_mib,
                        trunk_cache_mib=trunk_mib, threads=args.threads, max_context=max_context,
                        load_vision=False, max_batch=max_batch, act_dtype=args.act_dtype)
        open_s = time.perf_counter() - t0
        try:
            info = engine.info()
            open_stats = engine.stats()
            kv_bytes = KV_BYTES.get(str(info["kv_dtype"]), 4)
            streamed_trunk = engine.plan.trunk_cacheable - int(info["trunk_cache_bytes"])
            run: dict[str, Any] = {
                "prompt_tokens": n, "open_s": open_s, "plan_total_bytes": engine.plan.total,
                "plan": engine.plan.describe(), "open_ssd_bytes": _ssd(open_stats),
                "info": {k: info[k] for k in ("n_threads", "kernels", "kv_dtype", "act_dtype",
                                              "trunk_direct_io", "expert_direct_io", "global_bytes",
                                              "trunk_cache_bytes", "expert_cache_bytes",
                                              "engine_workspace_bytes", "expert_extent_bytes")},
                "streamed_trunk_bytes": streamed_trunk}
            avoid = {int(info["media_placeholder_token_id"])}
            tokens = random_prompt(pb.vocab, n, args.seed + n, avoid)
            session, cold = time_prompt(engine, tokens, max_context, max_batch)
            distinct = cold["expert_misses"]
            prompt_bounds(cold, pb, limits, streamed_trunk, distinct, kv_bytes, cold=True)
            run["cold_prompt"] = cold
            dec = timed_decode(args, model, threads, engine, session, cold["first_token"])
            decode_bounds(dec, pb, limits, kv_bytes)
            if "probes" in dec:
                adjacent_bounds(dec, *dec.pop("probes"))
            run["decode_after_cold"] = dec
            session.close()
            if args.warm:
                warm_tokens = random_prompt(pb.vocab, args.warmup_tokens, args.seed + 10_000, avoid)
                s2, _ = time_prompt(engine, warm_tokens, max_context, max_batch)
                s2.close()
                session, warm = time_prompt(engine, tokens, max_context, max_batch)
                prompt_bounds(warm, pb, limits, streamed_trunk, distinct, kv_bytes, cold=False)
                run["warm_prompt"] = warm
                dec = timed_decode(args, model, threads, engine, session, warm["first_token"])
                decode_bounds(dec, pb, limits, kv_bytes)
                if "probes" in dec:
                    adjacent_bounds(dec, *dec.pop("probes"))
                run["decode_warm"] = dec
                session.close()
        finally:
            engine.close()
        run["peak_rss_bytes"] = peak_rss_bytes()
        result["runs"].append(run)
        if not args.json:
            print(format_run(run), flush=True)
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


# ---- output ---------------------------------------------------------------------------------

def _hit_rate_text(decode: dict) -> str:
    rate = decode["expert_hit_rate"]
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def _g(x: float) -> str:
    return f"{x / GB:.3f} GB"


def format_run(run: dict) -> str:
    lines = [f"== prompt {run['prompt_tokens']} tokens: engine open {run['open_s']:.2f} s, "
             f"RAM plan {run['plan_total_bytes'] / MIB:,.0f} MiB, kernels {run['info']['kernels']} "
             f"(Linear inputs {run['info'].get('act_dtype', 'f32')}), "
             f"direct I/O trunk={run['info']['trunk_direct_io']} "
             f"experts={run['info']['expert_direct_io']}, streamed trunk "
             f"{_g(run['streamed_trunk_bytes'])}"]
    for key, label in (("cold_prompt", "cold"), ("warm_prompt", "warm")):
        p = run.get(key)
        if not p:
            continue
        extra = (f", FLOP floor {p['flop_floor_s']:.2f} s (ratio to max bound "
                 f"{p['ratio_to_max_bound']:.2f})") if "flop_floor_s" in p else ""
        lines.append(f"  {label} prefill: {p['prefill_tokens_per_s']:.2f} tok/s, first token "
                     f"{p['first_token_s']:.2f} s, SSD {_g(p['ssd_bytes'])}, distinct experts "
                     f"{p['distinct_experts']}, bound {p['bound_s']:.2f} s -> ratio "
                     f"{p['ratio']:.2f}{extra}")
    for key, label in (("decode_after_cold", "decode"), ("decode_warm", "warm decode")):
        d = run.get(key)
        if not d:
            continue
        hit = _hit_rate_text(d)
        lines.append(f"  {label}: {d['s_per_token_mean']:.3f} s/token (median "
                     f"{d['s_per_token_median']:.3f}), SSD {_g(d['ssd_bytes_per_token'])}/token, "
                     f"RAM {_g(d['ram_bytes_per_token'])}/token, hit rate {hit}, bound "
                     f"{d['bound_s']:.3f} s (SSD {d['bound_ssd_s']:.3f} + RAM {d['bound_ram_s']:.3f}"
                     f" = {d['bound_sum_s']:.3f}) -> ratio {d['ratio']:.2f} "
                     f"(to sum {d['ratio_to_sum']:.2f})")
        if "adjacent" in d:
            a = d["adjacent"]
            lines.append(f"    adjacent probes: DRAM {_g(a['dram_bytes_per_s'])}/s, direct read "
                         f"{_g(a['ssd_bytes_per_s'])}/s -> bound {a['bound_s']:.3f} s, ratio "
                         f"{a['ratio']:.2f} (median {a['ratio_median']:.2f})")
    lines.append(f"  peak RSS so far {run['peak_rss_bytes'] / MIB:,.0f} MiB")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvl import native

    try:
        result = run_bench(args)
    except native.KvlError as exc:
        raise UserError(str(exc)) from None
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n", "utf-8")
    if args.json:
        print(text)
    else:
        lim = result["limits"]
        print(f"limits ({lim['source']}): DRAM {_g(lim['dram_bytes_per_s'])}/s, direct read "
              f"{_g(lim['ssd_bytes_per_s'])}/s" + (f", FMA {lim['fma_flops_per_s'] / 1e9:.0f} GFLOP/s"
                                                  if lim['fma_flops_per_s'] else ""))
        print(f"peak RSS {result['peak_rss_bytes'] / MIB:,.0f} MiB")
    return 0


def _adjacent_cells(d: dict) -> str:
    a = d.get("adjacent")
    if not a:
        return "n/a | n/a | n/a"
    return (f"{a['dram_bytes_per_s'] / GB:.1f} / {a['ssd_bytes_per_s'] / GB:.2f} | {a['bound_s']:.3f} | "
            f"**{a['ratio']:.2f}** ({a['ratio_median']:.2f})")


def markdown_report(results: list[tuple[str, dict]]) -> str:
    """Markdown tables of several `kvl bench --out` results, each labelled by its setting."""
    out = ["| setting | prompt tokens | engine open s | RAM plan MiB | prefill tok/s | first token s "
           "| SSD read GB | distinct experts | first-token bound s | ratio | FLOP floor s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, res in results:
        for r in res["runs"]:
            for key, state in (("cold_prompt", "cold"), ("warm_prompt", "warm")):
                p = r.get(key)
                if not p:
                    continue
                floor = f"{p['flop_floor_s']:.2f}" if "flop_floor_s" in p else "n/a"
                out.append(f"| {label} ({state}) | {p['tokens']} | {r['open_s']:.2f} | "
                           f"{r['plan_total_bytes'] / MIB:,.0f} | {p['prefill_tokens_per_s']:.2f} | "
                           f"{p['first_token_s']:.2f} | {p['ssd_bytes'] / GB:.2f} | "
                           f"{p['distinct_experts']} | {p['bound_s']:.2f} | **{p['ratio']:.2f}** | "
                           f"{floor} |")
    out += ["", "| setting | context (tokens) | decode s/token (mean / median) | SSD GB/token "
            "| RAM GB/token | expert hit rate | SSD bound s | RAM bound s | bound = max s "
            "| ratio | ratio to SSD+RAM sum | expert stall s/token "
            "| adjacent probes DRAM / direct read GB/s | adjacent bound s | adjacent ratio (median) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, res in results:
        for r in res["runs"]:
            for key, state in (("decode_after_cold", "after cold prompt"), ("decode_warm", "warm")):
                d = r.get(key)
                if not d:
                    continue
                hit = _hit_rate_text(d)
                out.append(f"| {label} ({state}) | {d['context_start']}+{d['tokens']} | "
                           f"{d['s_per_token_mean']:.3f} / {d['s_per_token_median']:.3f} | "
                           f"{d['ssd_bytes_per_token'] / GB:.3f} | {d['ram_bytes_per_token'] / GB:.3f} | "
                           f"{hit} | {d['bound_ssd_s']:.3f} | {d['bound_ram_s']:.3f} | "
                           f"{d['bound_s']:.3f} | **{d['ratio']:.2f}** | {d['ratio_to_sum']:.2f} | "
                           f"{d['expert_stall_s_per_token']:.3f} | {_adjacent_cells(d)} |")
    out += ["", "| setting | peak RSS MiB (ru_maxrss since start / VmHWM since the engine phase) "
            "| RAM plan total MiB |", "|---|---|---|"]
    for label, res in results:
        plans = ", ".join(f"{r['plan_total_bytes'] / MIB:,.0f}" for r in res["runs"])
        out.append(f"| {label} | {res['ru_maxrss_bytes'] / MIB:,.0f} / {res['peak_rss_bytes'] / MIB:,.0f} "
                   f"| {plans} |")
    return "\n".join(out)
