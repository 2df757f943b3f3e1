"""Prompt encoding, incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from tiny import byte_tokenizer

from dflash2 import InvalidPromptError
from dflash2.tokenize import IncrementalDetokenizer, StopMatcher, common_prefix, encode_prompt

TEXTS = [
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🎉🚀 and ZWJ 👩‍💻",
    "plain ascii text",
    "mixed: 中文, ελληνικά, עברית",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_split_a_character(text: str) -> None:
    tok = byte_tokenizer()
    ids = tok(text).input_ids
    assert len(ids) > len(text) or text.isascii()  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_incomplete_character_at_the_end_is_flushed() -> None:
    tok = byte_tokenizer()
    ids = tok("ab€").input_ids[:-1]  # cut the 3-byte euro sign short
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == "ab"
    assert detok.flush() == tok.decode(ids)[2:]


def test_special_tokens_are_skipped() -> None:
    tok = byte_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.eos_token_id) == ""
    assert detok.push(ord("x")) == "x"


def test_stop_matcher_cuts_and_holds_back() -> None:
    stop = StopMatcher(["\n\n", "END"])
    assert stop.push("hello E") == "hello "  # "E" could start "END"
    assert stop.push("N") == ""
    assert stop.push("Dx") == ""  # "END" completed
    assert stop.stopped


def test_stop_matcher_releases_false_alarms() -> None:
    stop = StopMatcher(["END"])
    assert stop.push("EN") == ""
    assert stop.push("ough") == "ENough"
    assert stop.push("E") == ""
    assert stop.flush() == "E"
    assert not stop.stopped


def test_stop_across_many_pieces() -> None:
    stop = StopMatcher(["<|end|>"])
    out = "".join(stop.push(c) for c in "answer<|end|>more")
    assert out == "answer" and stop.stopped


def test_encode_raw_text_and_messages() -> None:
    tok = byte_tokenizer()
    assert encode_prompt(tok, "hi") == tok("hi").input_ids
    chat = encode_prompt(tok, [{"role": "user", "content": "hi"}])
    expected = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(chat) == expected


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (42, "str or a list"),
        ("", "zero tokens"),
        ([], "empty"),
        ([{"role": "user"}], "content"),
        (["hello"], "message 0"),
        ([{"role": "user", "content": 3}], "content"),
    ],
)
def test_bad_prompts(prompt: object, match: str) -> None:
    with pytest.raises(InvalidPromptError, match=match):
        encode_prompt(byte_tokenizer(), prompt)


def test_no_chat_template() -> None:
    tok = byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(InvalidPromptError, match="chat template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("a", "b", "limit", "expected"),
    [
        ([1, 2, 3], [1, 2, 4], None, 2),
        ([1, 2, 3], [1, 2, 3, 4], None, 3),
        ((1, 2, 3), [1, 2, 3], 2, 2),
        ([5], [6], None, 0),
        ([], [1], None, 0),
        ([1, 2], [1, 2], 0, 0),
        ([1, 2], [1, 2], -1, 0),
    ],
)
def test_common_prefix(a: list[int], b: list[int], limit: int | None, expected: int) -> None:
    assert common_prefix(a, b, limit) == expected
