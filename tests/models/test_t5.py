"""The T5 family (encoder-decoder): our routed decoder over transformers' encoder, against
transformers' `T5ForConditionalGeneration` on tiny random T5s built here: logits through the cache
(self- and cross-attention), greedy decoding token for token for every lossless strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from viasd import generate
from viasd.decoding.session import DecodeRequest, Session
from viasd.models.loading import load_model
from viasd.models.kvcache import LayerMask

from support import TINY_VOCAB, reference_logits, tiny_tokenizer

EOS, PAD = TINY_VOCAB.index("<eos>"), TINY_VOCAB.index("<pad>")


def save_tiny_t5(path: Path, ff: str = "relu", seed: int = 0, n_decoder_layers: int = 4, n_encoder_layers: int = 2) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(TINY_VOCAB), d_model=32, d_kv=8, d_ff=64, num_layers=n_encoder_layers,
                      num_decoder_layers=n_decoder_layers, num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, feed_forward_proj=ff, dropout_rate=0.0,
                      pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.fill_(1.0)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 if "shared" in name else 0.25)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["relu", "gated-gelu"])
def t5_dir(request, tmp_path_factory):
    return save_tiny_t5(tmp_path_factory.mktemp("t5-" + request.param), ff=request.param)


@pytest.fixture(scope="module")
def t5(t5_dir):
    return load_model(str(t5_dir), progress=False)


@pytest.fixture(scope="module")
def t5_drafter(t5_dir, tmp_path_factory):
    """A smaller T5 (2 decoder layers, 1 encoder layer) with the same vocabulary."""
    ff = "gated-gelu" if "gated" in t5_dir.name else "relu"
    path = save_tiny_t5(tmp_path_factory.mktemp("t5-drafter"), ff=ff, seed=1, n_decoder_layers=2, n_encoder_layers=1)
    return load_model(str(path), progress=False)


def hf_model(path):
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def test_config_and_families(t5):
    assert t5.decoder.is_encoder_decoder and t5.config.family == "t5" and t5.config.n_layers == 4
    assert t5.decoder.start_token == PAD


def test_decoder_logits_match_transformers_through_the_cache(t5, t5_dir):
    hf = hf_model(t5_dir)
    g = torch.Generator().manual_seed(2)
    source = torch.randint(0, 61, (13,), generator=g)
    target = torch.cat([torch.tensor([PAD]), torch.randint(0, 61, (29,), generator=g)])  # 30 decoder positions (> max distance 20)
    with torch.no_grad():
        ref = hf(input_ids=source[None], decoder_input_ids=target[None]).logits[0]
    for chunks in ([30], [1, 12, 1, 16], [1] * 30):
        cache = t5.decoder.new_cache(30)
        t5.decoder.encode(source, cache)
        out, start = [], 0
        for n in chunks:
            out.append(t5.decoder.forward(target[start : start + n], start, cache))
            start += n
        ours = torch.cat(out)
        assert (ours - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item()), chunks
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_routed_passes_keep_the_cache_invariant(t5):
    route = LayerMask(attn=(True, False, True, True), mlp=(False, True, True, True))
    source = list(range(5, 17))
    tokens = [PAD] + list(range(20, 40))
    cache = t5.decoder.new_cache(32)
    t5.decoder.encode(torch.tensor(source), cache)
    t5.decoder.forward(torch.tensor(tokens[:12]), 0, cache)
    routed = t5.decoder.forward(torch.tensor(tokens[12:17]), 12, cache, route=route)

    class Ref:  # reference_logits' cache-free recomputation, with the source encoded first
        config = t5.config

        class decoder:
            @staticmethod
            def new_cache(n):
                c = t5.decoder.new_cache(n)
                t5.decoder.encode(torch.tensor(source), c)
                return c

            forward = t5.decoder.forward

    assert torch.allclose(routed, reference_logits(Ref, tokens[:17], 12, route), atol=1e-4, rtol=1e-4)
    full = t5.decoder.forward(torch.tensor(tokens[12:21]), 12, cache)
    assert torch.allclose(full, reference_logits(Ref, tokens[:21], 0, None)[12:], atol=1e-4, rtol=1e-4)


def test_forward_without_an_encoded_source_is_an_error(t5):
    with pytest.raises(ValueError, match="encode the source"):
        t5.decoder.forward(torch.tensor([PAD]), 0, t5.decoder.new_cache(4))


def hf_greedy(path, source: list[int], n: int) -> list[int]:
    # (use_cache=False: transformers' own cache fails when the encoder has fewer layers than the decoder)
    out = hf_model(path).generate(torch.tensor([source]), max_new_tokens=n, do_sample=False, num_beams=1, use_cache=False,
                                  eos_token_id=EOS, pad_token_id=PAD, decoder_start_token_id=PAD)
    return out[0, 1:].tolist()  # without the decoder start token


LOSSLESS = [("ar", {}), ("pld", {}), ("self-sd", dict(draft_layers=(0, 3))), ("sd", "drafter"),
            ("viasd", dict(mode="lossless", draft="pld", slim_layers=(0, 1, 3))),
            ("viasd", dict(mode="lossless", draft="self", slim_layers=(0, 1, 3), draft_layers=(0, 3))),
            ("viasd", dict(mode="lossless", draft="model", slim_layers=(0, 2, 3)))]


@pytest.mark.parametrize("k,seed", [(1, 0), (4, 1)])
def test_every_lossless_strategy_equals_transformers_greedy(t5, t5_dir, t5_drafter, k, seed):
    g = torch.Generator().manual_seed(seed)
    # a source with repeats, so n-gram lookup over it has something to find
    half = torch.randint(0, 61, (6,), generator=g).tolist()
    source = half + half[:4] + [EOS]
    expected = hf_greedy(t5_dir, source, 24)
    assert len(expected) >= 8
    for strategy, extra in LOSSLESS:
        kw = dict(drafter=t5_drafter) if extra == "drafter" else dict(extra)
        if kw.get("draft") == "model":
            kw["drafter"] = t5_drafter
        res = generate(source, t5, strategy=strategy, max_new_tokens=24, k=k, chat=False, **kw)
        assert res.token_ids == expected, (strategy, kw.get("draft"), seed)


def test_tiered_viasd_and_cascade_run_on_t5(t5, t5_drafter):
    source = [5, 6, 7, 8, 5, 6, 7, EOS]
    for strategy, kw in [("viasd", dict(mode="tiered", draft="pld", slim_layers=(0, 1, 3))),
                         ("cascade", dict(draft="self", draft_layers=(0, 3)))]:
        res = generate(source, t5, strategy=strategy, max_new_tokens=12, chat=False, **kw)
        assert 1 <= len(res.token_ids) <= 12 and res.stats.to_dict()["calls"]["full"] >= 1


def test_a_decoder_only_drafter_is_refused_for_an_encoder_decoder_verifier(t5, tiny):
    from viasd.decoding.drafters import ModelDrafter

    req = DecodeRequest(prompt=[5, 6, EOS], max_new_tokens=4)
    with pytest.raises(ValueError, match="encoder-decoder drafter"):
        Session.start(t5.decoder, ModelDrafter(tiny.decoder, req.params, None, None), req, 16)


def test_ngram_drafts_come_from_the_source(t5):
    from viasd.decoding.drafters import NgramDrafter

    req = DecodeRequest(prompt=[9, 10, 11, 12, EOS], max_new_tokens=4)
    v = Session(t5.decoder, req, 16)
    d = NgramDrafter()
    d.begin(16, v)
    assert d.propose([PAD, 10], 2).tokens == [11, 12]


def test_dimr_search_refuses_an_encoder_decoder(t5):
    from viasd.errors import UsageError
    from viasd.routing.search import search_route

    with pytest.raises(UsageError, match="DIMR search calibrates on decoder-only text"):
        search_route(t5, budget=0.5, trials=1)


def test_cli_generate_on_a_t5_directory(capsys, t5_dir):
    import json

    from viasd.cli import main

    assert main(["generate", "w5 w6 w7 w5 w6 <eos>", "-m", str(t5_dir), "--no-chat", "-s", "viasd", "--draft", "pld",
                 "--slim-layers", "0", "1", "3", "-n", "6", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 1 <= res["stats"]["new_tokens"] <= 6 and res["config"]["model"] == str(t5_dir)
