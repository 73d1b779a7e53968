"""`viasd serve`'s stop strings: `StopText`, and the engine hook they rely on (no server)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd import generate  # noqa: E402
from viasd.server.engine import StopText  # noqa: E402
from helpers import COUNTING  # noqa: E402


@pytest.mark.parametrize("pieces, stops, sent, hit", [
    (["Hello", " wor", "ld. Bye"], ["."], "Hello world", 11),
    (["ab", "cX", "Yd"], ["XY"], "abc", 3),  # a stop split across pieces, held back meanwhile
    (["ab", "cX", "Zd"], ["XY"], "abcXZd", None),  # a false start is released
    (["one two", " three"], [], "one two three", None),
    (["xx<|e", "nd|>yy"], ["<|end|>", "zz"], "xx", 2),
])
def test_stop_text_cuts_at_the_first_stop_and_holds_back_prefixes(pieces, stops, sent, hit):
    s = StopText(stops)
    out = "".join(s.feed(p) for p in pieces)
    assert (out, s.hit) == (sent, hit)


def test_stop_text_never_sends_a_stop_prefix_early():
    s = StopText(["END"])
    assert s.feed("abcE") == "abc"
    assert s.feed("N") == ""
    assert s.feed("x") == "ENx"


@pytest.mark.model
@pytest.mark.parametrize("strategy", ["ar", "pld", "viasd"])
def test_stop_generation_from_on_text_returns_the_committed_prefix(smollm2, strategy):
    """The engine hook the server relies on for stop strings and cancellation."""
    from viasd.api import StopGeneration

    kw = dict(strategy=strategy, max_new_tokens=16, chat=False, progress=False, k=3)
    full = generate(COUNTING, smollm2, **kw)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 2:
            raise StopGeneration()

    part = generate(COUNTING, smollm2, on_text=on_text, **kw)
    assert 1 <= len(part.token_ids) < len(full.token_ids)
    assert part.token_ids == full.token_ids[: len(part.token_ids)]  # exactly what was committed, nothing more
    assert part.stats.new_tokens == len(part.token_ids) and part.stats.wall_s > 0
    assert part.text == "".join(pieces)
