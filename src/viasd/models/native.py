"""A GGUF file's weights in their own format, named as transformers names them.

`read_native(path, config)` memory-maps the file (gguf's reader) and returns, for every 2-D weight the
runtime multiplies or looks up (projections, embeddings, the LM head), a `NativeTensor` over the file's
own blocks, keyed by the transformers name (`model.layers.0.self_attn.q_proj.weight`). Norms and biases
are not returned: they come from the float conversion like every other weight. llama.cpp stores the Q
and K projections of the `llama` architecture with their rows permuted for its RoPE layout; the same
rows are put back in transformers' order here, exactly as transformers does when it dequantizes.

`quantize(state, ggml_type)` makes native weights from float ones (ggml's own quantizer), for models
that come without a GGUF file, tests among them.
"""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import numpy as np
import torch

from viasd.errors import CorruptFileError
from viasd.models import ggml_kernels as gk
from viasd.models.runtime import ModelConfig

# the GGUF architecture name of each transformers model_type the runtime reads natively
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3"}
NATIVE_ARCHITECTURES = tuple(_GGUF_ARCH)
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# types ggml multiplies on the CPU (every GGUF weight type llama.cpp writes for these models)
_FLOAT_TYPES = (gk.F32, gk.F16, gk.BF16)


def native_names(config: ModelConfig) -> list[str]:
    names = [f"model.layers.{i}.{p}.weight" for i in range(config.n_layers) for p in _PROJECTIONS]
    names.append("model.embed_tokens.weight")
    if not config.tied_embeddings:
        names.append("lm_head.weight")
    return names


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation (transformers' `_reverse_permute_weights`)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


def read_native(path: Path, config: ModelConfig) -> dict[str, gk.NativeTensor]:
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    arch_name = _GGUF_ARCH.get(config.architecture)
    if arch_name is None:
        raise CorruptFileError(f"{path.name}: no native weight layout for architecture {config.architecture!r}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on a damaged file
        raise CorruptFileError(f"{path}: unreadable GGUF ({type(e).__name__}: {e})") from None
    tensors = {t.name: t for t in reader.tensors}
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name)
    name_map = get_tensor_name_map(arch, config.n_layers)
    out: dict[str, gk.NativeTensor] = {}
    for hf_name in native_names(config):
        gguf_name = name_map.get_name(hf_name.removesuffix(".weight"))
        t = tensors.get(f"{gguf_name}.weight")
        if t is None:
            if hf_name == "lm_head.weight":  # untied in config.json, but the file shares the embedding
                continue
            raise CorruptFileError(f"{path.name}: no tensor {gguf_name}.weight (for {hf_name})")
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
        with warnings.catch_warnings():  # the file is mapped read-only; nothing writes to weights
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(t.data).reshape(rows, -1).view(np.uint8))
        native = gk.NativeTensor(data, int(t.tensor_type), cols)
        if arch_name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = config.n_heads if "q_proj" in hf_name else config.n_kv_heads
            native = native.rows_at(_unpermute_rows(rows, n_head))
        out[hf_name] = native
    return out


def quantize(state: dict[str, torch.Tensor], config: ModelConfig | None, ggml_type: int,
             names: list[str] | None = None) -> dict[str, gk.NativeTensor]:
    """Native weights of `ggml_type` (Q8_0, Q4_0, ...) quantized from the float ones in `state`: those
    a native model holds (`native_names(config)`), or the given `names`."""
    g = gk.lib()
    quantize_chunk = g.fn("ggml_quantize_chunk", ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
    out = {}
    for name in names if names is not None else native_names(config):
        if name not in state and name == "lm_head.weight":
            continue
        w = state[name].to(torch.float32).contiguous()
        rows, cols = w.shape
        data = torch.empty(rows, gk.row_bytes(ggml_type, cols), dtype=torch.uint8)
        quantize_chunk(ggml_type, w.data_ptr(), data.data_ptr(), 0, rows, cols, None)
        out[name] = gk.NativeTensor(data, ggml_type, cols)
    return out
