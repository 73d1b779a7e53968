"""Each committed token's log-probability under the full model (`logprobs`), and who settled it
(`sources`): the same for every lossless strategy, and what the model itself computes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from viasd import generate
from viasd.decoding.stats import Source
from viasd.errors import UsageError

from support import reference_logits

LOSSLESS = {  # name -> generate settings; "drafter": another model (mostly rejected) or the verifier itself (all kept)
    "ar": dict(strategy="ar"),
    "pld": dict(strategy="pld", adapt_k=False),
    "sd": dict(strategy="sd", k=3, adapt_k=False, drafter="other"),
    "sd, drafting itself": dict(strategy="sd", k=3, adapt_k=False, drafter="self"),
    "self-sd": dict(strategy="self-sd", draft_layers=(0, 2), adapt_k=False),
    "viasd lossless": dict(strategy="viasd", slim_layers=(0, 1, 3), adapt_k=False),
    "viasd lossless, model drafts": dict(strategy="viasd", slim_layers=(0, 1, 3), draft="model", adapt_k=False, drafter="other"),
    "viasd lossless, drafting itself": dict(strategy="viasd", slim_layers=(0, 1, 3), draft="model", adapt_k=False, drafter="self"),
}
PROMPT = [5, 9, 5, 9, 5, 9, 5]  # repeats: prompt lookup finds drafts


@pytest.mark.parametrize("weights", ["float", "native"])
def test_logprobs_are_the_full_model_s_and_equal_across_lossless_strategies(tiny, tiny_drafter, tiny_q8, weights):
    model = tiny if weights == "float" else tiny_q8
    runs = {}
    for name, settings in LOSSLESS.items():
        settings = dict(settings)
        drafter = {"other": tiny_drafter, "self": model, None: None}[settings.pop("drafter", None)]
        runs[name] = generate(PROMPT, model, drafter=drafter, max_new_tokens=24, logprobs=4, progress=False, **settings)
    ar = runs["ar"]
    # ar's: log_softmax of the model's own logits before each new token, recomputed without a cache
    tokens = PROMPT + ar.token_ids
    expected = torch.log_softmax(reference_logits(model, tokens, 0, None)[len(PROMPT) - 1 : -1].float(), -1)  # [24, V]
    for i, (t, lp) in enumerate(zip(ar.token_ids, ar.logprobs)):
        assert lp.logprob == pytest.approx(float(expected[i, t]), abs=1e-4)
        assert [i for i, _ in lp.top] == expected[i].topk(4).indices.tolist()
        assert lp.top[0][0] == t  # greedy: the chosen token is the most likely
    for name, r in runs.items():
        assert r.token_ids == ar.token_ids, name
        assert len(r.logprobs) == len(r.token_ids) == len(r.sources)
        for a, b in zip(r.logprobs, ar.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), name
            assert [i for i, _ in a.top] == [i for i, _ in b.top], name
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4), name
    # who settled each token: counted in the statistics, and drafts did get kept
    for name, r in runs.items():
        assert Counter(r.sources) == +r.stats.sources, name
        assert sum(r.stats.to_dict()["sources"].values()) == r.stats.new_tokens, name
    assert set(runs["ar"].sources) == {Source.FULL}
    assert all(runs[n].stats.sources[Source.DRAFT] > 0 for n in ("sd, drafting itself", "viasd lossless, drafting itself"))
    for name in ("viasd lossless, model drafts", "viasd lossless, drafting itself"):
        viasd = runs[name].stats
        assert viasd.sources[Source.SLIM] == viasd.tiers[2] and viasd.sources[Source.DRAFT] == viasd.tiers[1], name
    assert runs["viasd lossless, model drafts"].stats.sources[Source.SLIM] > 0


def test_logprobs_are_refused_where_the_full_model_does_not_see_every_token(tiny):
    with pytest.raises(UsageError, match="tiered"):
        generate(PROMPT, tiny, strategy="viasd", mode="tiered", logprobs=1, progress=False)
    with pytest.raises(UsageError, match="logprobs"):
        generate(PROMPT, tiny, logprobs=21, progress=False)
