"""kvl.tokenizer and kvl.chat_template against the hand-written oracles in tests/reference
(reference tokenizer: regex V1 + plain BPE; reference template: string assembly, no jinja)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvl.chat_template import ChatTemplate, expand_media
from kvl.conversation import ImageInput, Message, build_prompt, to_template_messages
from kvl.errors import UserError
from kvl.tokenizer import Tokenizer
from tests.reference.template import prompt_ids, render_prompt
from tests.reference.tokenizer import ReferenceTokenizer

CORPUS = [
    "Hello, world! How are you doing today?",
    "Reply with exactly one short word: hello",
    "Xin chào Việt Nam. Viết đúng một từ: chào",
    "中文分词测试：我爱北京天安门。々〻 and 、。ー are not all Han",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다. 감사합니다!",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "Emoji: 👍🏽🎉 family 👨‍👩‍👧 flags 🇻🇳🇫🇷",
    "I'm sure they'll say WE'VE DONE IT, don't you think? It's John's.",
    "numbers 1234567 3.14159 -42 1e10 0x1F",
    "def f(x):\n\treturn x ** 2  # comment\r\n\r\n    pass\n\n\n",
    "tabs\t\tand   spaces   \u00a0nbsp\u3000ideographic space",
    "mixed<|im_end|>specials<|im_user|>user<|im_middle|>inline[EOS]",
    "ÀÉÎÕÜ àéîõü ßÆØÅ ǅǈ ʰʲ ᵃ",  # Lu / Ll / Lt / Lm categories
    "",
    "   leading and trailing   ",
    "7" * 30_000 + " y",  # a run over 25,000 chars: the official pre-split shifts digit groups
]


@pytest.fixture(scope="module")
def tok(tiny_pack: Path) -> Tokenizer:
    return Tokenizer(tiny_pack)


@pytest.fixture(scope="module")
def ref(tiny_pack: Path) -> ReferenceTokenizer:
    return ReferenceTokenizer(tiny_pack)


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_encode_matches_reference(tok: Tokenizer, ref: ReferenceTokenizer, index: int) -> None:
    text = CORPUS[index]
    assert tok.encode(text) == ref.encode(text)


def test_decode_round_trip(tok: Tokenizer, ref: ReferenceTokenizer) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == ref.decode(ids)


def test_special_ids_by_name(tok: Tokenizer, ref: ReferenceTokenizer) -> None:
    for name, attr in (("<|im_end|>", "im_end"), ("[EOS]", "eos"), ("<|media_pad|>", "media_pad"),
                       ("<|media_start|>", "media_start"), ("<|media_end|>", "media_end")):
        assert getattr(tok, attr) == ref.special_id(name)
    assert tok.stop_ids == {ref.special_id("<|im_end|>"), ref.special_id("[EOS]")}
    for name in ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                 "<|media_content|>"):
        assert tok.encode(name) == [ref.special_id(name)]
        assert tok.decode([ref.special_id(name)]) == name
    # the first reserved id follows the base vocabulary
    assert tok.num_base_tokens == len(ref.ranks)


def test_specials_as_ordinary_text(tok: Tokenizer) -> None:
    ids = tok.encode_ordinary("<|im_end|>")
    assert tok.im_end not in ids
    assert tok.decode(ids) == "<|im_end|>"


def test_stream_decoder_never_splits_a_character(tok: Tokenizer) -> None:
    split_somewhere = False
    for text in CORPUS:
        ids = tok.encode(text)
        split_somewhere |= any(_is_partial_utf8(tok.token_bytes(i)) for i in ids)
        decoder = tok.stream_decoder()
        pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
    # the corpus must contain tokens that end inside a multi-byte character, else the
    # assertion above proves nothing
    assert split_somewhere


def test_stream_decoder_flushes_an_unfinished_character(tok: Tokenizer) -> None:
    euro = "€".encode()  # 3 bytes
    decoder = tok.stream_decoder()
    byte_ids = [tok._encoding.encode_single_token(bytes([b])) for b in euro[:2]]
    assert [decoder.push(i) for i in byte_ids] == ["", ""]
    assert decoder.flush() == "\ufffd"


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_missing_tokenizer_file_is_a_user_error(tiny_pack: Path, tmp_path: Path) -> None:
    copy = tmp_path / "pack"
    copy.mkdir()
    shutil.copy(tiny_pack / "tokenizer_config.json", copy)
    with pytest.raises(UserError, match="tiktoken.model"):
        Tokenizer(copy)
    (copy / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(UserError, match="tiktoken.model:1"):
        Tokenizer(copy)


# -- chat template ----------------------------------------------------------------------------

IMG_A = ImageInput(b"image-a")
IMG_B = ImageInput(b"image-b")
GRIDS = {IMG_A.digest: (4, 6), IMG_B.digest: (2, 2)}  # 6 and 1 media tokens with a 2x2 merge

CONVERSATIONS = {
    "text": [Message("user", ["What is 2+2?"])],
    "system": [Message("system", ["Be terse."]), Message("user", ["Hi"])],
    "image_text": [Message("user", [IMG_A, "Describe this."])],
    "text_then_image": [Message("user", ["Look: ", IMG_A, " ok?"])],
    "multi_image": [Message("user", [IMG_A, IMG_B, "Compare them."])],
    "later_turn_image": [Message("user", ["Hello"]), Message("assistant", ["Hi! How can I help?"]),
                         Message("user", [IMG_B, "What is in it?"])],
    "history_system_tool": [Message("system", ["S"]), Message("user", ["call it"]),
                            Message("assistant", ["calling"]), Message("tool", ["{\"r\": 1}"]),
                            Message("user", ["thanks"])],
    "multilingual": [Message("user", ["Viết đúng một từ: chào 中文"])],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_matches_reference(tiny_pack: Path, tok: Tokenizer, ref: ReferenceTokenizer,
                                    name: str, generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    hf = to_template_messages(messages)
    template = ChatTemplate(tiny_pack)
    assert template.render(hf, generation_prompt) == render_prompt(hf, generation_prompt)
    prompt = build_prompt(messages, template, tok, lambda image: GRIDS[image.digest], (2, 2),
                          add_generation_prompt=generation_prompt)
    counts = [(GRIDS[p.digest][0] // 2) * (GRIDS[p.digest][1] // 2)
              for m in messages for p in m.parts if isinstance(p, ImageInput)]
    assert prompt.tokens == prompt_ids(ref, hf, counts, generation_prompt)
    assert [i.n_tokens for i in prompt.images] == counts
    # every media position is keyed by its own image and row
    media_keys = [k for k in prompt.keys if isinstance(k, tuple)]
    assert len(media_keys) == sum(counts) == prompt.tokens.count(tok.media_pad)
    assert len(set(media_keys)) == len(media_keys)


def test_default_system_turn_only_when_missing(tiny_pack: Path) -> None:
    template = ChatTemplate(tiny_pack)
    with_default = template.render([{"role": "user", "content": "x"}])
    own = template.render([{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}])
    assert "You are a helpful assistant" in with_default
    assert "You are a helpful assistant" not in own and "mine" in own


def test_expand_media_refuses_mismatch() -> None:
    with pytest.raises(UserError, match="placeholders"):
        expand_media([1, 99, 2, 99], [3], media_pad=99)
    assert expand_media([1, 99, 2, 99], [2, 1], media_pad=99) == [1, 99, 99, 2, 99]


def test_bad_messages_are_user_errors(tiny_pack: Path, tok: Tokenizer) -> None:
    template = ChatTemplate(tiny_pack)
    grid = lambda image: (2, 2)  # noqa: E731
    with pytest.raises(UserError, match="role"):
        build_prompt([Message("robot", ["x"])], template, tok, grid, (2, 2))
    with pytest.raises(UserError, match="empty"):
        build_prompt([], template, tok, grid, (2, 2))
    with pytest.raises(UserError, match="placeholders"):
        build_prompt([Message("user", ["<|media_pad|>"])], template, tok, grid, (2, 2))
