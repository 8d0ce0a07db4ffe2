"""`kvl chat` and the Engine / ChatSession API on the tiny pack, checked against the independent
reference (tests/reference: template, tokenizer, FP32 text decoder with Q8 experts)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from kvl.conversation import ImageInput, Message
from kvl.generate import Done, SamplingParams, TextDelta
from tests.reference.preprocess import load_preprocessor_config, num_media_tokens, preprocess_one
from tests.reference.template import prompt_ids
from tests.reference.text import TextReference
from tests.reference.tokenizer import ReferenceTokenizer

REPO = Path(__file__).resolve().parents[1]
N_NEW = 8


@pytest.fixture(scope="module")
def ref_text(tiny_ckpt: Path) -> TextReference:
    return TextReference(tiny_ckpt, q8_experts=True)


@pytest.fixture(scope="module")
def ref_tok(tiny_pack: Path) -> ReferenceTokenizer:
    return ReferenceTokenizer(tiny_pack)


@pytest.fixture(scope="module")
def engine(tiny_pack: Path):
    from kvl.engine import Engine

    eng = Engine(tiny_pack, ram_mib=1024, cache_mib=1, max_context=512, threads=2)
    yield eng
    eng.close()


def kvl_chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "kvl", "chat", *args], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def reference_reply(ref_text: TextReference, ref_tok: ReferenceTokenizer, ids: list[int],
                    produced: list[int], n_new: int) -> None:
    """produced must be the reference's greedy continuation, cut at a stop id if one came."""
    expected = ref_text.greedy(ids, n_new)
    stops = {ref_tok.special_id("<|im_end|>"), ref_tok.special_id("[EOS]")}
    for i, token in enumerate(expected):
        if token in stops:
            expected = expected[:i]
            break
    assert produced == expected


def test_one_shot_json_matches_reference(tiny_pack: Path, ref_text: TextReference,
                                         ref_tok: ReferenceTokenizer) -> None:
    result = kvl_chat(str(tiny_pack), "Reply with exactly one short word: hello", "--json",
                      "--temperature", "0", "--max-new", str(N_NEW), "--ram-mib", "1024",
                      "--threads", "2", "--max-context", "512")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    messages = [{"role": "user", "content": "Reply with exactly one short word: hello"}]
    ids = prompt_ids(ref_tok, messages, [])
    assert report["prompt_token_ids"] == ids
    reference_reply(ref_text, ref_tok, ids, report["output_token_ids"], N_NEW)
    assert report["reply"] == ref_tok.decode(report["output_token_ids"])
    assert report["usage"]["prompt_tokens"] == len(ids)
    assert report["usage"]["completion_tokens"] == len(report["output_token_ids"])
    assert report["cache"]["tokens_prefilled"] == len(ids)
    assert set(report["timings"]) >= {"prefill_s", "first_token_s", "decode_s_per_token",
                                      "vision_s"}
    assert "component" not in result.stderr  # --json prints no plan


def test_one_shot_bf16_linear_inputs_match_reference(tiny_ckpt: Path, tiny_pack: Path,
                                                     ref_tok: ReferenceTokenizer) -> None:
    result = kvl_chat(str(tiny_pack), "Reply with exactly one short word: hello",
                      "--json", "--temperature", "0", "--max-new", str(N_NEW), "--ram-mib", "1024",
                      "--threads", "2", "--max-context", "512", "--act-dtype", "bf16")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["io"]["act_dtype"] == "bf16"
    ids = prompt_ids(ref_tok, [{"role": "user", "content": "Reply with exactly one short word: hello"}], [])
    ref16 = TextReference(tiny_ckpt, q8_experts=True, linear_inputs="bf16")
    reference_reply(ref16, ref_tok, ids, report["output_token_ids"], N_NEW)


def test_one_shot_streams_text_and_show_tokens(tiny_pack: Path, ref_tok: ReferenceTokenizer,
                                               tmp_path: Path) -> None:
    image_path = tmp_path / "red.png"
    Image.new("RGB", (100, 50), (200, 20, 20)).save(image_path)
    result = kvl_chat(str(tiny_pack), "What colour?", "--image", str(image_path), "--temperature",
                      "0", "--max-new", "4", "--show-tokens", "--ram-mib", "1024",
                      "--threads", "2", "--max-context", "512")
    assert result.returncode == 0, result.stderr
    assert "component" in result.stderr and "total" in result.stderr  # the plan
    output_line = next(line for line in result.stderr.splitlines() if line.startswith("[tokens] output"))
    ids = [int(x) for x in output_line.split(":", 1)[1].split()]
    assert result.stdout == ref_tok.decode(ids) + "\n"
    # official grid for 100x50: rows 4, cols 8 -> 8 media tokens (spec §6)
    assert "[image] 1: grid 4x8 patches, 8 media tokens" in result.stderr
    for tag in ("[timing]", "[cache]", "[io]", "[memory] peak RSS"):
        assert tag in result.stderr


def test_missing_image_is_a_clear_error(tiny_pack: Path) -> None:
    result = kvl_chat(str(tiny_pack), "hi", "--image", "/nonexistent/cat.png")
    assert result.returncode == 1
    assert "image file '/nonexistent/cat.png' not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_interactive_session(tiny_pack: Path, ref_text: TextReference,
                             ref_tok: ReferenceTokenizer) -> None:
    script = "Hello there\n/stats\nTell me more\n/reset\nHello there\n/quit\n"
    result = kvl_chat(str(tiny_pack), "--json", "--temperature", "0", "--max-new", str(N_NEW),
                      "--ram-mib", "1024", "--threads", "2", "--max-context", "512", stdin=script)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [e["event"] for e in events] == ["reply", "stats", "reply", "reset", "reply"]
    first, stats, second, _, third = events
    assert stats["stats"]["session_tokens"] > 0
    assert stats["stats"]["tokens_prefilled"] == first["usage"]["prompt_tokens"]
    # per-turn counters: turn 2 prefilled only the part of its prompt that was not reused
    assert second["cache"]["tokens_prefilled"] == (second["usage"]["prompt_tokens"]
                                                   - second["usage"]["reused_prompt_tokens"])
    # turn 2 reuses turn 1's prompt from the KV and equals a fresh run of the whole conversation
    assert second["usage"]["reused_prompt_tokens"] >= first["usage"]["prompt_tokens"]
    conversation = [{"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": first["reply"]},
                    {"role": "user", "content": "Tell me more"}]
    ids = prompt_ids(ref_tok, conversation, [])
    assert second["prompt_token_ids"] == ids
    reference_reply(ref_text, ref_tok, ids, second["output_token_ids"], N_NEW)
    # after /reset nothing is reused and the first turn repeats exactly
    assert third["usage"]["reused_prompt_tokens"] == 0
    assert third["output_token_ids"] == first["output_token_ids"]


def _collect(stream) -> tuple[str, list[int], Done]:
    text, ids, done = [], [], None
    for event in stream:
        if isinstance(event, TextDelta):
            text.append(event.text)
            ids.append(event.token_id)
        else:
            done = event
    assert isinstance(done, Done)
    return "".join(text), ids, done


def test_session_prefix_reuse_equals_fresh(engine) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    chat = engine.new_chat()
    first = [Message("user", ["Hello"])]
    text1, _, done1 = _collect(chat.generate(first, greedy))
    convo = first + [Message("assistant", [text1]), Message("user", ["And then?"])]
    _, _, done2 = _collect(chat.generate(convo, greedy))
    reused_ids = chat.last_output_tokens
    assert done2.reused_prompt_tokens >= done1.prompt_tokens
    fresh = engine.new_chat()
    _, _, done3 = _collect(fresh.generate(convo, greedy))
    assert done3.reused_prompt_tokens == 0
    assert fresh.last_output_tokens == reused_ids
    # regenerating the same conversation reuses everything but the last prompt token
    _, _, done4 = _collect(fresh.generate(convo, greedy))
    assert done4.reused_prompt_tokens == done4.prompt_tokens - 1
    assert fresh.last_output_tokens == reused_ids


def test_images_encoded_once_per_conversation(engine, tiny_pack: Path,
                                              ref_tok: ReferenceTokenizer) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (60, 90), (10, 200, 30)).save(buffer, "PNG")
    image = ImageInput(buffer.getvalue())
    chat = engine.new_chat()
    greedy = SamplingParams(temperature=0, max_new_tokens=3)
    turn1 = [Message("user", [image, "What is it?"])]
    # independent token count: reference preprocessing grid, reference template + tokenizer
    _, grid = preprocess_one(Image.open(io.BytesIO(image.data)), load_preprocessor_config(tiny_pack))
    n_media = num_media_tokens(grid, (2, 2))
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert chat.count_tokens(turn1) == len(prompt_ids(ref_tok, hf, [n_media]))
    text, _, done1 = _collect(chat.generate(turn1, greedy))
    assert done1.images_encoded == 1 and done1.timings["vision_s"] > 0
    turn2 = turn1 + [Message("assistant", [text]), Message("user", ["Sure?"])]
    _, _, done2 = _collect(chat.generate(turn2, greedy))
    assert done2.images_encoded == 0
    assert done2.reused_prompt_tokens >= done1.prompt_tokens
    # a different image with the same size must not be taken for the cached one
    other = io.BytesIO()
    Image.new("RGB", (60, 90), (250, 250, 0)).save(other, "PNG")
    turn3 = [Message("user", [ImageInput(other.getvalue()), "What is it?"])]
    _, _, done3 = _collect(chat.generate(turn3, greedy))
    assert done3.images_encoded == 1
    media_start = ref_tok.special_id("<|media_pad|>")
    first_media = prompt_ids(ref_tok, hf, [n_media]).index(media_start)
    assert done3.reused_prompt_tokens == first_media


def test_stop_string_is_not_emitted(engine) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    messages = [Message("user", ["Write something."])]
    full, _, _ = _collect(engine.new_chat().generate(messages, greedy))
    clean = full.replace("\ufffd", "")
    assert len(clean) >= 4, "the tiny model produced too little text for this test"
    stop = clean[len(clean) // 2:len(clean) // 2 + 2]
    cut = full.index(stop)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop=[stop])
    text, _, done = _collect(engine.new_chat().generate(messages, params))
    assert done.finish_reason == "stop" and done.stop_sequence == stop
    assert text == full[:cut]


def test_streamed_text_equals_decoded_ids(engine) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, seed=7, max_new_tokens=10)
    chat = engine.new_chat()
    text, ids, done = _collect(chat.generate([Message("user", ["Tell a story"])], params))
    assert ids == chat.last_output_tokens
    assert text == engine.tokenizer.decode(ids)
    assert done.finish_reason in ("length", "stop")
    # same seed, same tokens; the engine is deterministic
    again = engine.new_chat()
    _collect(again.generate([Message("user", ["Tell a story"])], params))
    assert again.last_output_tokens == ids


def test_cancellation(engine) -> None:
    greedy = SamplingParams(temperature=0, max_new_tokens=20)
    messages = [Message("user", ["Count to ten."])]
    chat = engine.new_chat()
    cancel = threading.Event()
    produced = 0
    done = None
    for event in chat.generate(messages, greedy, cancel):
        if isinstance(event, TextDelta):
            produced += 1
            if produced == 2:
                cancel.set()
        else:
            done = event
    assert done is not None and done.finish_reason == "cancelled"
    assert done.completion_tokens == 2
    # cancelled before starting: nothing generated
    cancel_now = threading.Event()
    cancel_now.set()
    _, ids, early = _collect(chat.generate(messages, greedy, cancel_now))
    assert early.finish_reason == "cancelled" and ids == []
    # the session stays usable and consistent: same output as a fresh session
    _, _, after = _collect(chat.generate(messages, SamplingParams(temperature=0, max_new_tokens=5)))
    assert after.finish_reason in ("length", "stop")
    fresh = engine.new_chat()
    _collect(fresh.generate(messages, SamplingParams(temperature=0, max_new_tokens=5)))
    assert chat.last_output_tokens == fresh.last_output_tokens


def test_context_overflow_is_a_user_error(engine) -> None:
    from kvl.errors import UserError

    chat = engine.new_chat()
    with pytest.raises(UserError, match="max-context"):
        list(chat.generate([Message("user", ["word " * 2000])], SamplingParams()))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery to a child is POSIX-only")
def test_ctrl_c_stops_the_reply_not_the_chat(tiny_pack: Path) -> None:
    import select
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(REPO))
    limit = json.loads((tiny_pack / "config.json").read_text())["text_config"][
        "max_position_embeddings"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvl", "chat", str(tiny_pack), "--temperature", "0", "--max-new",
         str(limit), "--max-context", str(limit), "--ram-mib", "2048", "--threads", "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(b"Count forever\n")
        proc.stdin.flush()
        streamed = b""
        deadline = time.monotonic() + 120
        while len(streamed) < 8 and time.monotonic() < deadline:  # the reply is streaming
            ready, _, _ = select.select([proc.stdout], [], [], 1)
            if ready:
                streamed += os.read(proc.stdout.fileno(), 256)
        assert len(streamed) >= 8, "no streamed reply"
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"/stats\n/quit\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        out = streamed + proc.stdout.read()
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert b"[stopped]" in out
    assert "session_tokens=" in err  # /stats ran after the interrupted reply
    assert "interrupted" not in err
