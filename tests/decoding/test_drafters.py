"""N-gram prompt-lookup drafting as tables of token arrays (no model), and in front of a drafter model."""

from __future__ import annotations

import numpy as np
import pytest

from support import GREEDY, NO_EOS
from viasd.api import generate
from types import SimpleNamespace

from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.draft_length import DraftLength, propose
from viasd.decoding.drafters import Draft, LookupDrafter, ModelDrafter, NgramDrafter, ngram_lookup
from viasd.decoding.stats import DecodeStats
from viasd.execution.passes import Passes
from viasd.execution.prefix import PrefixCache


@pytest.mark.parametrize(
    "context, k, max_n, min_n, expected",
    [
        # suffix [1, 2] occurred at 0: propose what followed it
        ([1, 2, 3, 4, 1, 2], 2, 3, 1, [3, 4]),
        # k caps the proposal; the continuation may run into the suffix itself
        ([1, 2, 3, 1, 2], 5, 2, 1, [3, 1, 2]),
        # the latest earlier occurrence wins
        ([7, 1, 8, 7, 1, 9, 7, 1], 1, 2, 1, [9]),
        # longer n-grams are tried first: [5, 6] -> 0 beats the later unigram [6] -> 3
        ([5, 6, 0, 2, 6, 3, 5, 6], 1, 2, 1, [0]),
        # no match of any length
        ([1, 2, 3, 4], 3, 3, 1, []),
        # min_ngram 2 forbids the unigram match of 3
        ([3, 9, 4, 3], 2, 3, 2, []),
        ([3, 9, 4, 3], 2, 3, 1, [9, 4]),
        # a one-token context has nothing to look up
        ([3], 2, 3, 1, []),
    ],
)
def test_ngram_lookup(context, k, max_n, min_n, expected):
    assert ngram_lookup(np.array(context), k, max_n, min_n) == expected


def test_ngram_drafter_index_finds_what_the_lookup_finds():
    """The drafter's incremental n-gram index proposes what a search of the whole context proposes,
    as the context grows a few tokens a round, and after it is replaced by another one."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        drafter = NgramDrafter(max_ngram=3, min_ngram=1 + trial % 2)
        context = rng.integers(0, 6, size=int(rng.integers(1, 5))).tolist()
        for _ in range(40):
            k = int(rng.integers(1, 6))
            expected = ngram_lookup(np.array(context), k, 3, drafter.min_ngram)
            assert drafter.propose(context, k).tokens == expected, (trial, context)
            if rng.random() < 0.05:  # another request's context
                context = rng.integers(0, 6, size=int(rng.integers(1, 5))).tolist()
            else:
                context = context + rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()


def test_ngram_drafter_proposes_without_probabilities():
    draft = NgramDrafter(max_ngram=2).propose([4, 5, 6, 4, 5], 3)
    assert draft.tokens == [6, 4, 5] and draft.probs is None


def test_ngram_drafter_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)


class _Counting:
    """A drafter model stand-in: proposes `tokens`, counting its calls."""

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, 0

    def begin(self, max_len, verifier):
        pass

    def propose(self, context, k):
        self.calls += 1
        return Draft(self.tokens[:k], None)


def test_a_drafter_model_behind_prompt_lookup_is_asked_only_where_lookup_finds_nothing():
    inner = _Counting([5, 5, 5])
    drafter = LookupDrafter(inner, 3)
    found, peek = propose(drafter, [1, 2, 3, 9, 8, 1, 2, 3], 4, None)  # [1, 2, 3] occurred: 9, 8, 1, 2 followed
    assert (found.tokens, found.probs, found.looked_up, peek, inner.calls) == ([9, 8, 1, 2], None, True, None, 0)
    assert propose(drafter, [1, 2, 3, 9, 8, 1, 2, 3], 2, None)[0].tokens == [9, 8]  # at most k
    drafted, _ = propose(drafter, [1, 2, 3, 9, 2, 3], 4, None)  # only [2, 3] occurred: the model drafts
    assert (drafted.tokens, drafted.looked_up, inner.calls) == ([5, 5, 5], False, 1)
    assert drafted.cut(2).looked_up is False and found.cut(2).looked_up is True


class _Beside:
    """A request's passes beside `n` others (`Passes.others`)."""

    def __init__(self, n):
        self.n = n

    def others(self):
        return self.n

    def alone(self):
        return self.n == 0


def test_beside_other_requests_prompt_lookup_leaves_the_round_to_the_policy():
    tokens = [1, 2, 3, 9, 8, 1, 2, 3]
    for others, looked_up in ((0, True), (2, False)):
        policy = DraftLength(4, [1.0, 1.1, 1.2, 1.3, 1.4], free_drafts=False, draft_s=0.2, passes=_Beside(others))
        inner = _Counting([5, 5, 5])
        draft, _ = propose(LookupDrafter(inner, 3), tokens, 4, policy)
        assert draft.looked_up is looked_up and inner.calls == (0 if looked_up else int(len(draft) > 0))


@pytest.mark.model
def test_sd_behind_prompt_lookup_verifies_what_the_text_repeats_and_still_equals_ar(smollm2):
    """smollm2 asked to copy a list: lookup proposes the list's words as the answer repeats them (drafts
    made without the drafter model, counted apart), the full model keeps them, and the output is ar's
    with lookup and without."""
    prompt = "Copy this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape."
    ar = generate(prompt, smollm2, strategy="ar", max_new_tokens=48).token_ids
    runs = {on: generate(prompt, smollm2, drafter=smollm2, strategy="sd", max_new_tokens=48, k=4, lookup=on)
            for on in (True, False)}
    assert all(r.token_ids == ar for r in runs.values())
    found, without = (runs[on].stats.to_dict() for on in (True, False))
    assert found["lookup_drafted"] >= found["lookup_accepted"] > 0 and without["lookup_drafted"] == 0


def _begun(model, tokens, threshold=None, head=None, probs=False, window=0, passes=None) -> ModelDrafter:
    """A greedy drafter model over `model`, begun on a request whose committed tokens are `tokens`."""
    d = ModelDrafter(model.decoder, SamplingParams(), None, threshold, head, probs, window)
    d.begin(256, SimpleNamespace(stats=DecodeStats(), passes=passes or Passes(), tokens=tokens))
    return d


@pytest.mark.model
def test_a_draft_threshold_over_a_reduced_head_stops_where_the_expanded_drafts_stop(smollm2):
    """A greedy drafter with a reduced head and `draft_threshold` reads only the head's logits; it
    drafts the tokens, and stops at the token, that drafting over the expanded logits (which keeps q)
    does: the first whose top probability falls below the threshold."""
    ids = smollm2.tokenizer.encode("def fibonacci(n):\n    ")
    head = smollm2.decoder.reduced_head(tuple(range(8192)))

    def draft(threshold, probs):
        return _begun(smollm2, ids, threshold=threshold, head=head, probs=probs).draft_ids(ids, 8)

    tokens, q = draft(None, True)  # 8 tokens, q [8, V]
    top = q.max(-1).values.tolist()
    cut = min(range(6), key=lambda i: top[i])  # the least confident of the first six
    threshold = top[cut] * 1.0001
    stop = next(i for i, p in enumerate(top) if p < threshold)  # (at or before `cut`)
    expanded, _ = draft(threshold, True)
    compact, none = draft(threshold, False)
    assert expanded == compact == tokens[: stop + 1] and len(compact) < 8 and none is None
    assert draft(0.0, False)[0] == tokens  # a top probability is never below 0


@pytest.mark.model
def test_a_drafter_window_reads_only_the_prompts_last_tokens(smollm2):
    """With `window` N a drafter model prefills only the prompt's last N tokens but one (the last is
    read with the first draft) and drafts, round after round, what it drafts with those N tokens as
    the whole prompt; sd with a window still outputs ar's tokens."""
    ids = smollm2.tokenizer.encode("Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,")

    def drafter(window, tokens, passes=None):
        return _begun(smollm2, tokens, window=window, passes=passes)

    windowed, alone = drafter(8, ids), drafter(0, ids[-8:])
    assert (windowed.offset, windowed.cache.n_full, alone.cache.n_full) == (len(ids) - 8, 7, 7)
    first = windowed.draft_ids(ids, 4)[0]
    assert first == alone.draft_ids(ids[-8:], 4)[0] and len(first) == 4
    grown = ids + first[:2] + [first[0]]  # a round later: two drafts kept, one token of the verifier's
    assert windowed.draft_ids(grown, 4)[0] == alone.draft_ids(grown[len(ids) - 8 :], 4)[0]
    assert drafter(100 + len(ids), ids).offset == 0
    # where a prefix cache holds all of the prompt but the window or less, the drafter reads all of it
    passes = Passes(prefix=[(smollm2.decoder, PrefixCache(1 << 28))])
    assert drafter(8, ids, passes).offset == len(ids) - 8  # nothing cached yet: the window (its 7 tokens kept)
    drafter(0, ids, passes)  # the whole prompt's K/V kept
    longer = ids + first[:3] + ids[:3]
    assert passes.cached(smollm2.decoder, longer[:-1]) == len(ids) - 1  # (longer: len(ids) + 6 tokens)
    d = drafter(8, longer, passes)
    assert d.offset == 0 and d.draft_ids(longer, 4)[0] == drafter(0, longer).draft_ids(longer, 4)[0]
    ar = generate(ids, smollm2, strategy="ar", max_new_tokens=32).token_ids
    # adapt_k off: a drafter as costly as the verifier would otherwise draft nothing, by measured times
    r = generate(ids, smollm2, drafter=smollm2, strategy="sd", max_new_tokens=32, drafter_window=8, lookup=False, adapt_k=False)
    assert r.token_ids == ar and r.stats.drafted > 0


def test_every_drafting_pass_is_counted_once_with_its_rows(tiny, tiny_drafter, monkeypatch):
    """A draft's one-token passes are counted when it ends (a statistics call per pass cost ~40 us
    right after it): the statistics still hold every pass the drafter's decoder ran, with its rows and
    weight bytes, whether the draft runs to k or stops early."""
    from viasd.decoding.strategies import speculative_decode
    from viasd.decoding.session import DecodeRequest, pass_bytes

    dec = tiny_drafter.decoder
    rows: list[int] = []
    forward = type(dec).forward

    def counted(self, tokens, *args, **kw):
        if self is dec and kw.get("logits", True):  # (the prompt's pass before decoding computes no logits)
            rows.append(len(tokens))
        return forward(self, tokens, *args, **kw)

    monkeypatch.setattr(type(dec), "forward", counted)
    for k in (1, 4):
        rows.clear()
        req = DecodeRequest(prompt=[1, 5, 6, 7, 5, 6], max_new_tokens=24, params=GREEDY, eos=NO_EOS)
        speculative_decode(tiny.decoder, ModelDrafter(dec, GREEDY, None, None, probs=False), req, k=k)
        drafting = {key: n for key, n in req.stats.passes.items() if key[0] == "drafter"}
        assert sum(drafting.values()) == len(rows) > 0
        assert sorted(r for (_, _, r, _), n in drafting.items() for _ in range(n)) == sorted(rows)
        assert {b for (_, _, _, b) in drafting} == {pass_bytes(dec, None)}
