"""A GGUF file's weights in their own format, named as transformers names them.

`read_native(path, config)` memory-maps the file and returns, for every 2-D weight the
runtime multiplies or looks up (projections, embeddings, the LM head), a `NativeTensor` over the file's
own blocks, keyed by the transformers name (`model.layers.0.self_attn.q_proj.weight`). Norms and biases
are not returned: they come from the float conversion like every other weight. llama.cpp stores the Q
and K projections of the `llama` architecture with their rows permuted for its RoPE layout; the same
rows are put back in transformers' order here, exactly as transformers does when it dequantizes.
Where each tensor lies in the file comes from gguf's reader the first time and from a small index in
the cache after that (`tensor_index`).

`quantize(state, ggml_type)` makes native weights from float ones (ggml's own quantizer), for models
that come without a GGUF file, tests among them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from viasd.errors import CorruptFileError
from viasd.models import ggml_kernels as gk
from viasd.models.runtime import ModelConfig
from viasd.validation import atomic_write_text

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


_INDEX_VERSION = 1


def tensor_index(path: Path) -> dict[str, tuple[int, tuple[int, ...], int, int]]:
    """{tensor name: (ggml type, shape in ggml's order, offset of its data in the file, bytes)} of a
    GGUF file. gguf's reader parses every metadata field to find them, the tokenizer's strings among
    them: 5 s for smollm2's file and ~15 s for qwen 1.5B's here, at every load. So the first read
    writes this index to the cache (`<cache>/gguf-index/`, keyed by the file's resolved path, size and
    modification time; written atomically) and later loads read it in milliseconds."""
    from viasd.models.loading import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_INDEX_VERSION}".encode()).hexdigest()[:24]
    index_path = cache_dir() / "gguf-index" / f"{key}.json"
    try:
        tensors = json.loads(index_path.read_text())["tensors"]
        return {name: (int(t), tuple(int(x) for x in shape), int(off), int(n)) for name, (t, shape, off, n) in tensors.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no index yet (or a damaged one): read the file's header
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on a damaged file
        raise CorruptFileError(f"{path}: unreadable GGUF ({type(e).__name__}: {e})") from None
    index = {t.name: (int(t.tensor_type), tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes))
             for t in reader.tensors}
    try:
        atomic_write_text(index_path, json.dumps({"file": str(path.resolve()), "tensors": index}))
    except OSError:  # a read-only or full cache: the next load reads the header again
        pass
    return index


def read_native(path: Path, config: ModelConfig) -> dict[str, gk.NativeTensor]:
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_name = _GGUF_ARCH.get(config.architecture)
    if arch_name is None:
        raise CorruptFileError(f"{path.name}: no native weight layout for architecture {config.architecture!r}")
    tensors = tensor_index(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
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
        ggml_type, shape, offset, n_bytes = t
        cols, rows = int(shape[0]), int(np.prod(shape[1:]))
        if offset + n_bytes > mapped.shape[0] or n_bytes % rows:
            raise CorruptFileError(f"{path}: tensor {gguf_name}.weight is not whole rows within the file (truncated?)")
        with warnings.catch_warnings():  # the file is mapped read-only; nothing writes to weights
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.asarray(mapped[offset : offset + n_bytes]).reshape(rows, -1))
        native = gk.NativeTensor(data, ggml_type, cols)
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
