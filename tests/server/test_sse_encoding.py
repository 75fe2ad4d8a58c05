"""``sse()``: every payload the server can build comes out as one valid UTF-8 JSON event that decodes back to it
(orjson's fast path, ``json`` for what orjson refuses: ints past 64 bits, lone surrogates)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gemmaserve.server.responses import SSE_DONE, sse

ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates included
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | ANY_TEXT
PAYLOADS = st.dictionaries(ANY_TEXT, st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                                                  | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=12),
                           max_size=6)


@given(PAYLOADS)
def test_every_payload_is_one_utf8_json_event(payload: dict) -> None:
    event = sse(payload)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[len(b"data: "):-2].decode("utf-8")) == payload


def test_done_and_non_string_keys() -> None:
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert json.loads(sse({"k": {7: "x"}})[6:-2]) == {"k": {"7": "x"}}  # as json.dumps keyed it
