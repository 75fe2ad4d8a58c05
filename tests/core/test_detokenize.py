"""Incremental detokenization: deltas add up to the full text; stop strings are never emitted."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.detokenize import IncrementalDetokenizer


class Utf8ByteTokenizer:
    """One token per UTF-8 byte, so multi-byte characters span tokens."""

    has_chat_template = False

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages):  # pragma: no cover - unused
        raise NotImplementedError


TOKENIZER = Utf8ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab é€\n", max_size=30), split=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_deltas_concatenate_to_full_text(text: str, split: list[int]) -> None:
    ids = TOKENIZER.encode(text)
    detok = IncrementalDetokenizer(TOKENIZER)
    out, i, k = "", 0, 0
    while i < len(ids):
        step = split[k % len(split)]
        out += detok.add(ids[i : i + step]).text
        assert "\ufffd" not in out
        i, k = i + step, k + 1
    out += detok.flush()
    assert out == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stop=st.text(alphabet="abc", min_size=1, max_size=3))
def test_stop_string_is_never_emitted(text: str, stop: str) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, stop=[stop])
    out = ""
    for token in TOKENIZER.encode(text):
        delta = detok.add([token])
        out += delta.text
        if delta.stopped:
            break
    else:
        out += detok.flush()
    if stop in text:
        assert out == text[: text.index(stop)]
        assert detok.stopped
    else:
        assert out == text


def test_add_until_stop_consumes_up_to_the_token_completing_the_match():
    detok = IncrementalDetokenizer(TOKENIZER, ["END"])
    consumed, delta = detok.add_until_stop(TOKENIZER.encode("abcENDxyz"))
    assert (consumed, delta.text, delta.stopped, delta.stop_string) == (6, "abc", True, "END")
    assert detok.add_until_stop(TOKENIZER.encode("more")) == (0, type(delta)("", True, "END"))
    plain = IncrementalDetokenizer(TOKENIZER)
    consumed, delta = plain.add_until_stop(TOKENIZER.encode("abcEND"))
    assert (consumed, delta.text, delta.stopped) == (6, "abcEND", False)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       min_tokens=st.integers(0, 32), cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_strings_wait_for_min_tokens(text: str, stops: list[str], min_tokens: int, cuts: list[int]) -> None:
    """vLLM V1's rule: a stop string ending within the first ``min_tokens`` tokens does not stop; the first one
    ending in a later token does (one byte = one token here), and the text is cut right before it, also when one
    stop string is a prefix of another (held back meanwhile) and when tokens arrive several at a time."""
    ids = TOKENIZER.encode(text)
    matches = [(i + len(stop), i) for stop in stops for i in range(len(text))
               if text.startswith(stop, i) and i + len(stop) > min_tokens]
    detok = IncrementalDetokenizer(TOKENIZER, stops, min_tokens=min_tokens)
    consumed, delta = detok.add_until_stop(ids)
    out = delta.text + ("" if delta.stopped else detok.flush())
    if not matches:
        assert not delta.stopped and out == text and consumed == len(ids)
    else:
        end = min(matches)[0]
        start = min(i for e, i in matches if e == end)
        assert delta.stopped and consumed == end
        assert out == text[:start]
    chunked = IncrementalDetokenizer(TOKENIZER, stops, min_tokens=min_tokens)
    points = sorted({min(len(ids), c) for c in cuts})
    pieces = [chunked.add(ids[a:b]).text for a, b in zip([0, *points], [*points, len(ids)])]
    assert "".join(pieces) + chunked.flush() == out and chunked.stopped == delta.stopped


class SpecialTokenizer(Utf8ByteTokenizer):
    """Utf8ByteTokenizer plus special tokens 300 ``<A>`` (a parser's marker) and 301 ``<B>`` (any other)."""

    SPECIAL = {300: "<A>", 301: "<B>"}

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out, run = "", []
        for token in [*token_ids, None]:
            if token is None or token in self.SPECIAL:
                out += bytes(run).decode("utf-8", errors="replace")
                run = []
                if token is not None and not skip_special_tokens:
                    out += self.SPECIAL[token]
            else:
                run.append(token)
        return out


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.one_of(st.text(alphabet="ab é", max_size=4), st.sampled_from([300, 301])), max_size=12),
       split=st.lists(st.integers(1, 4), min_size=1, max_size=20))
def test_shown_special_tokens_stay_and_the_others_are_hidden(pieces, split) -> None:
    """``shown_special_ids`` (the tool-call / reasoning parsers' markers) show although ``skip_special_tokens``
    hides every other special token, however the tokens arrive."""
    tokenizer = SpecialTokenizer()
    ids = [token for piece in pieces for token in ([piece] if isinstance(piece, int) else list(piece.encode()))]
    want = "".join("<A>" if piece == 300 else "" if piece == 301 else piece for piece in pieces)
    for shown, expected in ((frozenset({300}), want), (frozenset(), want.replace("<A>", ""))):
        detok = IncrementalDetokenizer(tokenizer, shown_special_ids=shown)
        out, i, k = "", 0, 0
        while i < len(ids):
            step = split[k % len(split)]
            out += detok.add(ids[i : i + step]).text
            i, k = i + step, k + 1
        assert out + detok.flush() == expected


class FusingByteTokenizer(Utf8ByteTokenizer):
    """One token per byte, decoded as a byte-fallback decoder does: bytes that end in an unfinished character all
    become U+FFFD, one per byte, whole characters among them included."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = bytes(token_ids)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(data)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab é€𓀀", max_size=12), cut=st.integers(1, 3),
       split=st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_an_unfinished_last_character_flushes_as_one_replacement(text: str, cut: int, split: list[int]) -> None:
    """The reply ends inside a character (max_tokens cut its bytes): the whole characters before it, then one
    U+FFFD (it was one per byte, and whole characters decoded in the same run turned into U+FFFD too)."""
    tokenizer = FusingByteTokenizer()
    ids = tokenizer.encode(text + "𓀀")[: -cut]  # 1-3 bytes of a 4-byte character are missing
    detok = IncrementalDetokenizer(tokenizer)
    out, i, k = "", 0, 0
    while i < len(ids):
        out += detok.add(ids[i : i + split[k % len(split)]]).text
        i, k = i + split[k % len(split)], k + 1
    assert out + detok.flush() == text + "\ufffd"


class _NaiveHeldBack(IncrementalDetokenizer):
    """The detokenizer with the plain search the matchers replace: every suffix size of the unemitted text."""

    def _held_back(self, full: str, start: int) -> int:
        if self.include_stop_str:
            return 0
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(full) - start), longest, -1):
                if full.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abé", max_size=40), stops=st.lists(st.text(alphabet="abé", min_size=1, max_size=6),
                                                                 min_size=1, max_size=3),
       min_tokens=st.integers(0, 6), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=10))
def test_the_held_back_tail_is_the_plain_searchs(text: str, stops: list[str], min_tokens: int,
                                                 cuts: list[int]) -> None:
    """The incremental matchers hold back exactly what searching every suffix does, step by step, whatever the
    chunking, multi-byte characters and min_tokens (a stop string matched inside the floor continues the match)."""
    ids = TOKENIZER.encode(text)
    fast, plain = (cls(TOKENIZER, stops, min_tokens=min_tokens) for cls in (IncrementalDetokenizer, _NaiveHeldBack))
    at, k = 0, 0
    while at < len(ids):
        step = ids[at: at + cuts[k % len(cuts)]]
        assert fast.add(step) == plain.add(step), (text, stops, at)
        at, k = at + len(step), k + 1
    assert fast.flush() == plain.flush()


@settings(max_examples=300, deadline=None)
@given(stop=st.text(alphabet="ab", min_size=1, max_size=8), text=st.text(alphabet="ab", max_size=40),
       cuts=st.lists(st.integers(0, 5), max_size=8))
def test_stop_prefix_matcher_states(stop: str, text: str, cuts: list[int]) -> None:
    """After any split of the stream, the state is the longest prefix of the stop string ending the text."""
    from gemmaserve.detokenize import StopPrefixMatcher

    matcher, fed = StopPrefixMatcher(stop), ""
    for cut in [*cuts, len(text)]:
        piece, text = text[:cut], text[cut:]
        fed += piece
        state = matcher.feed(piece)
        assert state == max(size for size in range(len(stop) + 1) if fed.endswith(stop[:size]))


def test_a_long_stop_string_the_text_keeps_matching_costs_linear_work() -> None:
    """A 20,000-character stop string whose prefix the output keeps matching (a hostile request can force that):
    the matchers' work grows with the text, where the plain search copied every prefix at every step (~2e8
    characters per token by the end). Counted in border-table entries, not timed."""
    from gemmaserve.detokenize import StopPrefixMatcher

    stop = "a" * 20_000 + "b"
    detok = IncrementalDetokenizer(TOKENIZER, [stop])
    for _ in range(2_000):
        assert detok.add([ord("a")]).text == ""
    (matcher,) = detok._matchers
    assert matcher.state == 2_000 and len(matcher._borders) <= 2_001
    assert isinstance(matcher, StopPrefixMatcher)


class _CountingTokenizer(FusingByteTokenizer):
    """One token per byte plus a hidden special token 301 (decodes to nothing), counting the ids it decodes;
    ``fusing``: decoded as FusingByteTokenizer does, else each invalid byte is one U+FFFD."""

    def __init__(self, fusing: bool = True) -> None:
        self.decoded = 0
        self.fusing = fusing

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.decoded += len(token_ids)
        kept = [token for token in token_ids if token != 301]
        return super().decode(kept) if self.fusing else bytes(kept).decode("utf-8", errors="replace")


def _streamed(tokenizer, ids: list[int], split: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    out, i, k = "", 0, 0
    while i < len(ids):
        step = split[k % len(split)]
        out += detok.add(ids[i : i + step]).text
        i, k = i + step, k + 1
    return out + detok.flush()


def test_long_runs_of_invisible_tokens_or_invalid_bytes_cost_linear_work() -> None:
    """Thousands of tokens that decode to nothing (hidden special tokens) or end in U+FFFD at every step (a byte no
    character can finish: a client can ask for them through logit_bias) cost each later token the same few
    decoded tokens (the window used to grow: ~N^2 / 2 decoded ids); text around them comes out whole."""
    count = 4000
    for run, expected in (([301] * count, "ab"), ([0x80] * count, None)):
        tokenizer = _CountingTokenizer(fusing=False)
        out = _streamed(tokenizer, [*b"a", *run, *b"b"], [1])
        assert tokenizer.decoded < 60 * count, tokenizer.decoded
        if expected is not None:
            assert out == expected
        else:  # one U+FFFD per invalid byte, the text around them kept
            assert out.startswith("a") and out.endswith("b") and set(out[1:-1]) == {"\ufffd"}
            assert len(out) - 2 >= count - 4


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.one_of(st.text(alphabet="ab é€𓀀", min_size=1, max_size=6),
                                 st.integers(17, 40).map(lambda n: [301] * n)), max_size=8),
       split=st.lists(st.integers(1, 7), min_size=1, max_size=10))
def test_valid_text_survives_long_pending_runs_however_it_is_grouped(pieces, split) -> None:
    """Runs of more than the window's pending limit (hidden special tokens, or steps that keep ending inside a
    character because of how the tokens are grouped) leave valid text exactly as decoding it whole gives it."""
    ids = [token for piece in pieces for token in (piece if isinstance(piece, list) else list(piece.encode()))]
    expected = "".join(piece for piece in pieces if isinstance(piece, str))
    assert _streamed(_CountingTokenizer(), ids, split) == expected
    assert _streamed(_CountingTokenizer(), ids, [max(1, len(ids))]) == expected


def test_hidden_tokens_among_or_after_a_characters_bytes_keep_it_whole() -> None:
    """Hidden special tokens between a character's bytes, or after the bytes of an unfinished last one, are not
    bytes: the character is whole (or one U+FFFD at the end), streamed or decoded at once."""
    cases = [([*"é€".encode(), 0xF0, *[301] * 4], "é€\ufffd"),
             ([*b"Hi", 0xF0, *[301] * 9], "Hi\ufffd"),
             ([0xE2, *[301] * 20, 0x82, 0xAC, *b" and more"], "\u20ac and more"),
             ([0xE2, 0x82, *[301] * 17, 0xAC, *b" and more"], "\u20ac and more")]
    for ids, expected in cases:
        for split in ([1], [3, 1], [len(ids)]):
            assert _streamed(_CountingTokenizer(), ids, split) == expected, (ids, split)
