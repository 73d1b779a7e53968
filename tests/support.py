"""Helpers the tests share: tiny random-weights models saved as real transformers directories (and a
GGUF of one), greedy and sampled reference decodes, exact marginals, bench fixtures' data. Test files
import them as `from support import ...` (pytest puts tests/ on the path as it loads tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from viasd.api import GenerateConfig
from viasd.bench import load_tasks
from viasd.decoding.acceptance import SamplingParams, logits_to_probs
from viasd.decoding.strategies import autoregressive_decode, speculative_decode
from viasd.decoding.session import DecodeRequest
from viasd.models.loading import LoadedModel
from viasd.models.kvcache import LayerMask

GREEDY = SamplingParams()


NO_EOS: frozenset[int] = frozenset()


TINY_VOCAB = [f"w{i}" for i in range(61)] + ["<eos>", "<unk>", "<pad>"]  # 64 tokens


def tiny_tokenizer(words: list[str] = TINY_VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")


def bpe_tokenizer(vocab_size: int, corpus: list[str]):
    """A byte-level BPE tokenizer (as SmolLM2's and Qwen's are) trained on `corpus`, with an <eos>;
    its alphabet is printable ASCII, tab and newline, so that any sequence of its tokens is text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [bytes_to_unicode()[b] for b in [9, 10, *range(32, 127)]]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


# the tiny models' widths, Llama-style and Gemma-style alike
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def save_tiny(path: Path, arch: str = "llama", seed: int = 0, n_layers: int = 4, words: list[str] = TINY_VOCAB, scale: float = 1.0,
              tokenizer=None) -> Path:
    """A random-weights transformers model of `arch` in `path` (config, safetensors, tokenizer: a
    word-level one of `words`, or `tokenizer`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id if tokenizer is not None else words.index("<eos>") if "<eos>" in words else None
    vocab = len(tokenizer) if tokenizer is not None else len(words)
    tokenizer = tokenizer or tiny_tokenizer(words)
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab,
        num_hidden_layers=n_layers,
        **TINY_SHAPE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=arch != "qwen2",
        eos_token_id=eos,
        **({"sliding_window": None, "use_sliding_window": False} if arch != "llama" else {}),
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # spread the weights so greedy paths are not degenerate
            p.normal_(0.0, 0.3 * scale)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_gemma(path: Path, arch: str = "gemma3_text", seed: int = 0, n_layers: int = 4, window: int = 8,
                    words: list[str] = TINY_VOCAB, scale: float = 1.0) -> Path:
    """A random-weights Gemma 2 or Gemma 3 (text) model: sliding layers of `window` keys interleaved
    with global ones (gemma3: its own local RoPE base; gemma2: attention and final soft-capping)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {}
    if arch == "gemma2":
        # small caps so that capping changes the result (random logits reach ~30)
        extra = dict(attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    else:
        extra = dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(words),
        num_hidden_layers=n_layers,
        **TINY_SHAPE,
        head_dim=16,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        sliding_window=window,
        layer_types=["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(n_layers)],
        tie_word_embeddings=True,
        pad_token_id=words.index("<pad>"),
        bos_token_id=None,
        eos_token_id=words.index("<eos>"),
        **extra,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms multiply by (1 + w): w near 0; the embedding is scaled by sqrt(hidden)
            p.normal_(0.0, (0.1 if "norm" in name else 0.3 if "embed" not in name else 0.05) * scale)
    model.save_pretrained(path)
    tiny_tokenizer(words).save_pretrained(path)
    return path


def write_tiny_gguf(path: Path, model_dir: Path, qtype: str = "Q8_0") -> Path:
    """A GGUF file of a tiny Llama directory's weights, laid out as llama.cpp writes it: its names,
    Q/K rows permuted for llama.cpp's RoPE, projections and embedding quantized to `qtype`."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    state = load_file(model_dir / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf.num_hidden_layers)
    writer = gguf.GGUFWriter(path, "llama")
    for name, w in state.items():
        w = w.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's convert_hf_to_gguf permute()
            n_head = hf.num_attention_heads if "q_proj" in name else hf.num_key_value_heads
            w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        base, suffix = name.rsplit(".", 1)
        out = f"{names.get_name(base)}.{suffix}"
        if w.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(out, gguf.quants.quantize(w, q), raw_shape=gguf.quants.quant_shape_to_byte_shape(w.shape, q), raw_dtype=q)
        else:
            writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def native_q8(model: LoadedModel) -> LoadedModel:
    """`model` with its products, embedding and head in Q8_0: native weights, so that a pass is one
    ggml graph and several requests' passes can be one (continuous batching)."""
    from viasd.models.loading import load_state_dict
    from viasd.models.native import quantize
    from viasd.models.decoder import Decoder

    state = load_state_dict(model.path)
    decoder = Decoder.from_state_dict(model.config, state, native=quantize(state, model.config, 8), pack=True)  # 8: Q8_0
    assert decoder._graph is not None
    return LoadedModel(name=model.name, path=model.path, config=model.config, decoder=decoder,
                       tokenizer=model.tokenizer, weights="native")


def run_ar(model: LoadedModel, prompt: list[int], n: int, eos: frozenset[int] = NO_EOS) -> list[int]:
    """Plain greedy decoding: what every lossless strategy must reproduce."""
    return autoregressive_decode(model.decoder, DecodeRequest(prompt=prompt, max_new_tokens=n, params=GREEDY, eos=eos))


def run_sd(model, drafter, prompt, n, k=4, eos=NO_EOS):
    req = DecodeRequest(prompt=prompt, max_new_tokens=n, params=GREEDY, eos=eos)
    return speculative_decode(model.decoder, drafter, req, k), req.stats


def reference_logits(model: LoadedModel, tokens: list[int], n_full: int, route: LayerMask | None) -> torch.Tensor:
    """Cache-free reference: recompute everything in a fresh cache. Positions < n_full by the full
    model, the rest along `route` (the routed model's definition under the n_full invariant).
    Returns the logits of positions n_full .. len(tokens)-1."""
    cache = model.decoder.new_cache(len(tokens))
    ids = torch.tensor(tokens)
    if n_full:
        model.decoder.forward(ids[:n_full], 0, cache)
    return model.decoder.forward(ids[n_full:], n_full, cache, route=route)


def exact_marginals(model: LoadedModel, prompt: list[int], params: SamplingParams, n: int = 2) -> list[torch.Tensor]:
    """P(i-th new token) under the verifier for i = 1..n, by enumerating every continuation."""
    def probs(ids):
        cache = model.decoder.new_cache(len(ids))
        return logits_to_probs(model.decoder.forward(torch.tensor(ids), 0, cache, last_only=True)[0], params)

    marginals: list[torch.Tensor] = [0] * n

    def walk(ids: list[int], weight: float, depth: int) -> None:
        p = probs(ids)
        marginals[depth] = marginals[depth] + weight * p
        if depth + 1 < n:
            for t in torch.nonzero(p > 0).flatten().tolist():
                walk(ids + [t], weight * float(p[t]), depth + 1)

    walk(list(prompt), 1.0, 0)
    return marginals


def bench_tasks(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"prompt": p, "reference": r}) for p, r in [
        ("w1 w2 w3 w1 w2", "w3 w1"), ("w5 w6 w5 w6", "w5"), ("w9 w8 w7", "w7 w8")]) + "\n")
    return load_tasks(f"file:{tasks}", None)


BENCH_METHODS = "ar,pld,viasd-lossless:pld,viasd-tiered:self,sd"


BENCH_BASE = GenerateConfig.from_settings(max_new_tokens=8, chat=False, slim_layers=(0, 1, 3))


def load_records_tolerant(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out
