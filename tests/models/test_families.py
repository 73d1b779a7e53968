"""The Gemma family (gemma2, gemma3) in the lean runtime: logits against transformers' own models on
tiny random configurations (sliding windows exceeded, soft-capping on), the cache invariant, and
every lossless strategy equal to `ar`."""

from __future__ import annotations

import pytest
import torch

from viasd import generate
from viasd.decoding.drafters import ModelDrafter, NgramDrafter, SelfDrafter
from viasd.errors import UnsupportedArchitectureError
from viasd.models.loading import load_model
from viasd.models.config import ModelConfig
from viasd.models.kvcache import LayerMask

from support import GREEDY, reference_logits, run_ar, run_sd, save_tiny_gemma
from test_decoder import cached_logits, hf_logits

GEMMAS = ["gemma2", "gemma3_text"]


@pytest.fixture(scope="module", params=GEMMAS)
def gemma_dir(request, tmp_path_factory):
    return save_tiny_gemma(tmp_path_factory.mktemp(request.param), arch=request.param)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_model(str(gemma_dir), progress=False)


def test_family_switches_are_read_from_the_config(gemma):
    cfg = gemma.config
    assert cfg.family == "gemma" and cfg.sandwich_norms and cfg.activation == "gelu_tanh"
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.attn_scale == pytest.approx(24 ** -0.5)
    assert cfg.sliding_window == 8 and cfg.sliding_layers == (True, False, True, False)
    if cfg.architecture == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.qk_norm) == (5.0, 8.0, False)
    else:
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.qk_norm) == (None, None, True)
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


def test_logits_match_transformers_beyond_the_window(gemma, gemma_dir):
    """40 tokens through a window of 8: the sliding layers' masks matter from position 8 on."""
    ids = torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(gemma_dir, ids)
    for chunks in ([40], [17, 1, 1, 8, 13], [1] * 40, [9, 11, 20]):
        ours = cached_logits(gemma, ids, chunks)
        assert (ours - ref).abs().max() < 1e-4, chunks
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_the_switches_change_the_result(gemma, gemma_dir):
    """Guard against a vacuous comparison: without the window (or the caps) the logits differ."""
    ids = torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(gemma_dir, ids)
    from dataclasses import replace

    from viasd.models.loading import load_state_dict
    from viasd.models.decoder import Decoder

    variants = {"no window": replace(gemma.config, sliding_window=None, sliding_layers=(False,) * 4)}
    if gemma.config.architecture == "gemma2":
        variants["no attention cap"] = replace(gemma.config, attn_softcap=None)
        variants["no final cap"] = replace(gemma.config, final_softcap=None)
    state = load_state_dict(gemma_dir)
    for name, cfg in variants.items():
        dec = Decoder.from_state_dict(cfg, state)
        out = dec.forward(ids, 0, dec.new_cache(40))
        assert (out - ref).abs().max() > 1e-2, name


def test_routed_passes_keep_the_cache_invariant(gemma):
    """Routed passes past n_full, then a full pass, beyond the window: equal to the cache-free reference."""
    n = gemma.config.n_layers
    route = LayerMask.from_layers(n, [0, 3])
    tokens = torch.randint(0, 61, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = gemma.decoder.new_cache(40)
    gemma.decoder.forward(torch.tensor(tokens[:20]), 0, cache)
    routed = gemma.decoder.forward(torch.tensor(tokens[20:26]), 20, cache, route=route)
    assert torch.allclose(routed, reference_logits(gemma, tokens[:26], 20, route), atol=1e-4, rtol=1e-4)
    full = gemma.decoder.forward(torch.tensor(tokens[20:30]), 20, cache)
    assert torch.allclose(full, reference_logits(gemma, tokens[:30], 0, None)[20:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,seed", [(1, 0), (4, 1)])
def test_lossless_strategies_equal_ar(gemma, gemma_dir, tmp_path, k, seed):
    drafter = load_model(str(save_tiny_gemma(tmp_path / "drafter", arch=gemma.config.architecture, seed=1, n_layers=2)), progress=False)
    n = gemma.config.n_layers
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 61, (6 + 3 * seed,), generator=g).tolist()
    expected = run_ar(gemma, prompt, 24, gemma.eos_token_ids)  # up to 24 new tokens: past the window of 8
    drafters = {
        "same-model": ModelDrafter(gemma.decoder, GREEDY, None, None),
        "other-model": ModelDrafter(drafter.decoder, GREEDY, None, None),
        "pld": NgramDrafter(),
        "self route": SelfDrafter(gemma.decoder, LayerMask.from_layers(n, [0, 3]), GREEDY, None, None),
    }
    for name, d in drafters.items():
        out, _ = run_sd(gemma, d, prompt, 24, k=k, eos=gemma.eos_token_ids)
        assert out == expected, (name, seed)
    for strategy, extra in [("viasd", dict(mode="lossless", draft="pld")), ("viasd", dict(mode="lossless", draft="self")),
                            ("sd", dict(drafter=drafter)), ("self-sd", {})]:
        res = generate(prompt, gemma, strategy=strategy, max_new_tokens=24, chat=False, k=k,
                       slim_layers=(0, 1, 3), draft_layers=(0, 3), **extra)
        assert res.token_ids == expected, (strategy, extra.get("draft"), seed)


def test_unsupported_architecture_has_a_one_line_error():
    from transformers import AutoConfig

    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported architecture 'gpt2': the runtime supports llama, .*gemma2"):
        ModelConfig.from_hf(AutoConfig.for_model("gpt2"))


def test_models_lists_the_families(capsys):
    from viasd.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and "not supported" not in out
    assert "llama: llama (SmolLM2), qwen2, mistral" in out and "gemma: gemma2, gemma3" in out


# ------------------------------------------------------------------ gemma3-270m from the zoo

PROMPTS = ["The capital of France is Paris, and the capital of Germany is",
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""']


@pytest.mark.model
def test_gemma3_270m_logits_match_transformers(gemma3_f32):
    from transformers import AutoModelForCausalLM

    gemma3 = gemma3_f32  # transformers dequantizes the GGUF to float32: compare like with like

    hf = AutoModelForCausalLM.from_pretrained(gemma3.path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    for prompt in PROMPTS:
        ids = torch.tensor(gemma3.encode(prompt, chat=False))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        ours = cached_logits(gemma3, ids, [len(ids) - 3, 1, 2])
        # measured 4e-5 / 8e-5 absolute at logit scales 24 / 34 (prepacked oneDNN products)
        assert (ours - ref).abs().max() < 1e-5 * ref.abs().max()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.model
def test_gemma3_270m_lossless_strategies_equal_ar(gemma3):
    prompt = gemma3.encode("Repeat after me: one two three, one two three, one two", chat=False)
    expected = run_ar(gemma3, prompt, 8, gemma3.eos_token_ids)
    for strategy, extra in [("pld", {}), ("self-sd", {}), ("viasd", dict(mode="lossless", draft="pld")),
                            ("viasd", dict(mode="lossless", draft="self"))]:
        res = generate(prompt, gemma3, strategy=strategy, max_new_tokens=8, k=3, **extra)
        assert res.token_ids == expected, (strategy, extra)


@pytest.mark.model
def test_generate_streams_gemma3_270m(capsys, gemma3):
    from viasd.cli import main

    assert main(["generate", "The capital of France is", "-m", "gemma3-270m", "-s", "ar", "-n", "6", "-q"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tok/s" in err
