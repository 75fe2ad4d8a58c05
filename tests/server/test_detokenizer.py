"""IncrementalDetokenizer as the server uses it: several stop strings (earliest wins), stops split
across tokens and multi-byte characters, the prompt context for leading spaces, bounded windows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.detokenize import IncrementalDetokenizer


class Utf8ByteTokenizer:
    """One token per UTF-8 byte (so characters span tokens); records every decode window."""

    has_chat_template = False

    def __init__(self) -> None:
        self.windows: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.windows.append(len(token_ids))
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        raise AssertionError("unused")


class LeadingSpaceTokenizer:
    """SentencePiece-like: token ids index WORDS; ``decode`` joins them with spaces and, like
    sentencepiece, drops the space in front of the first piece it decodes."""

    WORDS = ["<bos>", "hello", "world", "again", "!"]
    has_chat_template = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + [self.WORDS.index(word) for word in text.split()]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(" " + self.WORDS[t] for t in token_ids if t or not skip_special_tokens).removeprefix(" ")

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        raise AssertionError("unused")


def run(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> tuple[str, bool]:
    out, i, k = "", 0, 0
    while i < len(ids):
        delta = detok.add(ids[i : i + sizes[k % len(sizes)]])
        out += delta.text
        if delta.stopped:
            return out, True
        i, k = i + sizes[k % len(sizes)], k + 1
    return out + detok.flush(), detok.stopped


STOP_TEXT = st.text(alphabet="abé€ ", max_size=40)
STOPS = st.lists(st.text(alphabet="abé€ ", min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=STOP_TEXT, stops=STOPS)
def test_generation_stops_at_the_first_stop_string_to_appear(text: str, stops: list[str]) -> None:
    """Token by token: the first stop string to complete ends the text, cut where it starts (if
    several complete with the same character, the one starting first)."""
    tokenizer = Utf8ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, stops)
    out, stopped = run(detok, tokenizer.encode(text), [1])
    ends = [text.find(stop) + len(stop) for stop in stops if stop in text]
    if ends:
        seen = text[: min(ends)]
        assert out == seen[: min(seen.find(stop) for stop in stops if stop in seen)] and stopped
    else:
        assert out == text and not stopped
    assert detok.text == out and "\ufffd" not in out


@settings(max_examples=300, deadline=None)
@given(text=STOP_TEXT, stops=STOPS, sizes=st.lists(st.integers(1, 6), min_size=1, max_size=10))
def test_no_stop_string_is_ever_emitted_whatever_the_chunking(text: str, stops: list[str], sizes: list[int]) -> None:
    tokenizer = Utf8ByteTokenizer()
    out, stopped = run(IncrementalDetokenizer(tokenizer, stops), tokenizer.encode(text), sizes)
    assert text.startswith(out) and not any(stop in out for stop in stops)
    assert stopped == any(stop in text for stop in stops)
    assert stopped or out == text
    if stopped:
        assert any(text[len(out) :].startswith(stop) for stop in stops)


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop() -> None:
    tokenizer = Utf8ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, ["END"])
    assert detok.add(tokenizer.encode("abc E")).text == "abc "
    assert detok.add(tokenizer.encode("N")).text == ""
    assert detok.add(tokenizer.encode("d")).text == "ENd"
    assert detok.add(tokenizer.encode("EN")).text == ""
    assert detok.flush() == "EN" and detok.text == "abc ENdEN"


def test_an_unfinished_character_is_held_until_flush() -> None:
    tokenizer = Utf8ByteTokenizer()
    euro = "€".encode()
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add([*b"ab", euro[0]]).text == "ab"
    assert detok.add([euro[1]]).text == ""
    assert detok.flush() == "\ufffd"


def test_stop_string_after_an_emitted_multibyte_character() -> None:
    tokenizer = Utf8ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, ["€x"])
    out, stopped = run(detok, tokenizer.encode("a€b€x tail"), [1])
    assert (out, stopped, detok.stop_string) == ("a€b", True, "€x")
    assert detok.add(tokenizer.encode("more")).stopped and detok.flush() == ""


def test_prompt_context_keeps_the_first_tokens_leading_space() -> None:
    tokenizer = LeadingSpaceTokenizer()
    prompt = tokenizer.encode("hello")
    output = tokenizer.encode("world again !", add_special_tokens=False)
    with_context = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    without = IncrementalDetokenizer(tokenizer)
    assert run(with_context, output, [1])[0] == " world again !"
    assert run(without, output, [1])[0] == "world again !"
    assert with_context.token_ids == output


def test_decode_windows_stay_small_on_long_outputs() -> None:
    tokenizer = Utf8ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, ["zz"], prompt_ids=tokenizer.encode("prompt"))
    text = "héllo wörld € " * 200
    out, _ = run(detok, tokenizer.encode(text), [1])
    assert out == text
    assert max(tokenizer.windows) <= 8, "the detokenizer re-decodes the whole output"
