"""`kvl chat`: one-shot (`kvl chat MODEL "prompt"`) and interactive (`kvl chat MODEL`) chat.

Owns: the command's options, streaming replies to stdout, the interactive loop (/reset, /stats,
/image PATH, /quit; Ctrl-C stops the current reply, Ctrl-D quits), --show-tokens diagnostics and
--json output. Generation runs in a worker thread so the main thread can take Ctrl-C at any
time, including during a long prefill.
Does not own: prompt building, prefix reuse or sampling (engine.py / generate.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import queue
import signal
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from kvl.conversation import ImageInput, Message
from kvl.errors import UserError
from kvl.generate import DEFAULT_TEMPERATURE, Done, SamplingParams, TextDelta

MIB = 1 << 20
HELP_LINE = "commands: /reset  /stats  /image PATH  /quit   (Ctrl-C stops a reply, Ctrl-D quits)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="packed model directory (from kvl pack / kvl prepare)")
    parser.add_argument("prompt", nargs="?", help="one-shot prompt ('-' reads stdin); "
                        "omit for an interactive chat")
    parser.add_argument("--ram-mib", type=int, default=4096, help="total RAM budget (default 4096)")
    parser.add_argument("--cache-mib", type=int, default=512, help="expert cache (default 512)")
    parser.add_argument("--trunk-cache-mib", type=int, default=None,
                        help="trunk cache (default: what the RAM budget leaves)")
    parser.add_argument("--max-new", type=int, default=512, help="max new tokens (default 512)")
    parser.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                        help=f"sampling temperature, 0 = greedy (default {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--system", default=None, help="system prompt (default: the template's)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="attach an image to the (first) user message (repeatable)")
    parser.add_argument("--threads", type=int, default=0, help="worker threads (0 = all cores)")
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--kernels", default="auto", choices=["auto", "scalar", "avx2", "avx512"])
    parser.add_argument("--act-dtype", default="f32", choices=["f32", "bf16"],
                        help="inputs of the Linear layers: f32 (exact, default) or bf16 (as the "
                             "checkpoint's own BF16 inference: ~2x faster prefill on CPUs with "
                             "AVX512_BF16, logits move by BF16 rounding)")
    parser.add_argument("--no-vision", action="store_true", help="do not load the vision tower")
    parser.add_argument("--show-tokens", action="store_true",
                        help="print token ids, timings, cache/I-O statistics and peak RSS")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per reply instead of streaming text")


def read_image(path: str) -> ImageInput:
    try:
        return ImageInput(Path(path).read_bytes())
    except FileNotFoundError:
        raise UserError(f"image file '{path}' not found") from None
    except OSError as exc:
        raise UserError(f"cannot read image file '{path}' ({exc.strerror})") from None


def peak_rss_bytes() -> int | None:
    """Peak resident set of this process.

    Linux: VmHWM of /proc/self/status, because getrusage's ru_maxrss survives exec and so reports
    the parent's RSS when the parent (e.g. a test runner) was larger. Elsewhere: getrusage.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def params_from(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_new_tokens=args.max_new, stop=list(args.stop))
    params.validate()
    return params


class Turn:
    """Runs one generation in a worker thread; the caller drains events and may cancel."""

    def __init__(self, chat: Any, messages: list[Message], params: SamplingParams):
        self.cancel = threading.Event()
        self.events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(chat, messages, params),
                                        name="kvl-generate", daemon=True)
        self._thread.start()

    def _run(self, chat: Any, messages: list[Message], params: SamplingParams) -> None:
        try:
            for event in chat.generate(messages, params, self.cancel):
                self.events.put(event)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.events.put(exc)
        self.events.put(None)

    def __iter__(self):
        while True:
            try:
                event = self.events.get(timeout=0.1)  # short waits let SIGINT handlers run
            except queue.Empty:
                continue
            if event is None:
                self._thread.join()
                return
            if isinstance(event, BaseException):
                self._thread.join()
                raise event
            yield event


def run_turn(chat: Any, messages: list[Message], params: SamplingParams, stream: TextIO | None,
             interactive: bool) -> tuple[str, Done]:
    """Generate one reply; Ctrl-C cancels it (interactive) instead of ending the program."""
    turn = Turn(chat, messages, params)
    previous = None
    if interactive and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: turn.cancel.set())
    pieces: list[str] = []
    done: Done | None = None
    try:
        for event in turn:
            if isinstance(event, TextDelta):
                pieces.append(event.text)
                if stream is not None and event.text:
                    stream.write(event.text)
                    stream.flush()
            elif isinstance(event, Done):
                done = event
    except KeyboardInterrupt:
        turn.cancel.set()
        for event in turn:  # let the worker wind down cleanly
            if isinstance(event, Done):
                done = event
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    assert done is not None
    return "".join(pieces), done


def turn_report(engine: Any, chat: Any, reply: str, done: Done,
                before: dict[str, int] | None = None) -> dict[str, Any]:
    """Everything about one reply; cache/I-O counters are this turn's (stats minus `before`)."""
    stats = engine.stats()
    if before is not None:
        stats = {k: v - before.get(k, 0) for k, v in stats.items()}
    info = engine.info()
    return {
        "reply": reply,
        "finish_reason": done.finish_reason,
        "stop_sequence": done.stop_sequence,
        "prompt_token_ids": chat.last_prompt_tokens,
        "output_token_ids": chat.last_output_tokens,
        "usage": {"prompt_tokens": done.prompt_tokens,
                  "completion_tokens": done.completion_tokens,
                  "reused_prompt_tokens": done.reused_prompt_tokens,
                  "images_encoded": done.images_encoded},
        "timings": done.timings,
        "cache": {k: stats.get(k) for k in (
            "trunk_hits", "trunk_misses", "trunk_bytes_read", "trunk_stall_ns",
            "expert_hits", "expert_misses", "expert_bytes_read", "expert_stall_ns",
            "vision_bytes_read", "tokens_prefilled", "tokens_decoded")},
        "io": {"trunk_direct_io": bool(info.get("trunk_direct_io")),
               "expert_direct_io": bool(info.get("expert_direct_io")),
               "vision_direct_io": bool(info.get("vision_direct_io")),
               "kernels": info.get("kernels"), "act_dtype": info.get("act_dtype"),
               "threads": info.get("n_threads")},
        "images": chat.last_images,
        "peak_rss_bytes": peak_rss_bytes(),
        "plan_bytes": engine.plan.total,
    }


def print_show_tokens(report: dict[str, Any], out: TextIO) -> None:
    t = report["timings"]
    c = report["cache"]
    io = report["io"]
    u = report["usage"]
    yes = {True: "direct", False: "buffered"}
    out.write(f"[tokens] prompt {u['prompt_tokens']} (reused {u['reused_prompt_tokens']}): "
              f"{' '.join(map(str, report['prompt_token_ids']))}\n")
    out.write(f"[tokens] output {u['completion_tokens']} ({report['finish_reason']}): "
              f"{' '.join(map(str, report['output_token_ids']))}\n")
    out.write(f"[timing] vision {t['vision_s']:.3f} s, prefill {t['prefill_s']:.3f} s, "
              f"first token {t['first_token_s']:.3f} s, next token "
              f"{1000 * t['decode_s_per_token']:.1f} ms avg\n")
    out.write(f"[cache] trunk {c['trunk_hits']} hits / {c['trunk_misses']} misses / "
              f"{(c['trunk_bytes_read'] or 0) / MIB:.1f} MiB read; experts {c['expert_hits']} hits"
              f" / {c['expert_misses']} misses / {(c['expert_bytes_read'] or 0) / MIB:.1f} MiB read"
              "\n")
    out.write(f"[io] trunk {yes[io['trunk_direct_io']]}, experts {yes[io['expert_direct_io']]}, "
              f"vision {yes[io['vision_direct_io']]}; kernels {io['kernels']}, Linear inputs "
              f"{io['act_dtype']}, {io['threads']} threads\n")
    peak = report["peak_rss_bytes"]
    out.write(f"[memory] peak RSS {'n/a' if peak is None else f'{peak / MIB:.1f} MiB'} "
              f"(plan {report['plan_bytes'] / MIB:.1f} MiB)\n")
    for n, image in enumerate(report["images"], 1):
        out.write(f"[image] {n}: grid {image['grid'][0]}x{image['grid'][1]} patches, "
                  f"{image['media_tokens']} media tokens\n")
    out.flush()


def open_engine(args: argparse.Namespace) -> Any:
    from kvl.engine import Engine

    return Engine(args.model, ram_mib=args.ram_mib, cache_mib=args.cache_mib,
                  trunk_cache_mib=args.trunk_cache_mib, threads=args.threads,
                  max_context=args.max_context, load_vision=not args.no_vision,
                  kernels=args.kernels, act_dtype=args.act_dtype)


def run(args: argparse.Namespace) -> int:
    params = params_from(args)
    images = [read_image(p) for p in args.image]
    if images and args.no_vision:
        raise UserError("--image needs the vision tower; drop --no-vision")
    engine = open_engine(args)
    try:
        if not args.json:
            print(engine.plan.describe(), file=sys.stderr)
        if args.prompt is not None:
            return one_shot(engine, args, params, images)
        return interactive(engine, args, params, images)
    finally:
        engine.close()


def system_messages(args: argparse.Namespace) -> list[Message]:
    return [Message("system", [args.system])] if args.system is not None else []


def one_shot(engine: Any, args: argparse.Namespace, params: SamplingParams,
             images: list[ImageInput]) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = system_messages(args) + [Message("user", [*images, prompt])]
    chat = engine.new_chat()
    before = engine.stats()
    reply, done = run_turn(chat, messages, params, None if args.json else sys.stdout,
                           interactive=False)
    report = turn_report(engine, chat, reply, done, before)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.show_tokens:
            print_show_tokens(report, sys.stderr)
    return 0


def interactive(engine: Any, args: argparse.Namespace, params: SamplingParams,
                images: list[ImageInput]) -> int:
    with contextlib.suppress(ImportError):  # Windows without pyreadline
        import readline  # noqa: F401 - line editing and history for input()
    chat = engine.new_chat()
    history: list[Message] = system_messages(args)
    pending = list(images)
    tty = sys.stdin.isatty()
    if not args.json:
        print(HELP_LINE, file=sys.stderr)
    while True:
        try:
            line = input("> " if tty else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print("\n(use /quit or Ctrl-D to leave)", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command in ("/quit", "/exit"):
                break
            if command == "/reset":
                chat.reset()
                history = system_messages(args)
                pending = []
                emit(args, {"event": "reset"}, "(conversation cleared)")
            elif command == "/stats":
                stats = engine.stats()
                stats["session_tokens"] = chat.position
                stats["peak_rss_bytes"] = peak_rss_bytes()
                emit(args, {"event": "stats", "stats": stats},
                     "  ".join(f"{k}={v}" for k, v in stats.items()))
            elif command == "/image":
                if not rest.strip():
                    print("usage: /image PATH", file=sys.stderr)
                    continue
                try:
                    pending.append(read_image(rest.strip()))
                except UserError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    continue
                emit(args, {"event": "image", "pending_images": len(pending)},
                     f"(image attached to your next message; {len(pending)} pending)")
            else:
                print(f"unknown command {command}; {HELP_LINE}", file=sys.stderr)
            continue
        message = Message("user", [*pending, line])
        before = engine.stats()
        try:
            reply, done = run_turn(chat, history + [message], params,
                                   None if args.json else sys.stdout, interactive=True)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        pending = []
        history += [message, Message("assistant", [reply])]
        report = turn_report(engine, chat, reply, done, before)
        if args.json:
            print(json.dumps({"event": "reply", **report}, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n" if done.finish_reason != "cancelled" else " [stopped]\n")
            sys.stdout.flush()
            if args.show_tokens:
                print_show_tokens(report, sys.stderr)
    return 0


def emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(obj, ensure_ascii=False), flush=True)
    else:
        print(text, file=sys.stderr)
