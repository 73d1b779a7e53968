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
that come without a GGUF file, tests among them; `requantize(tensors, name)` re-quantizes a file's
weights to a smaller type at load (a drafter's: `load_model(requantize="q4_0")`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from viasd.errors import CorruptFileError, CorruptGGUFError
from viasd.models import ggml_kernels as gk
from viasd.models.config import ModelConfig
from viasd.validation import atomic_write_text, read_json_bounded

# the GGUF architecture name of each transformers model_type the runtime reads natively
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3"}
NATIVE_ARCHITECTURES = tuple(_GGUF_ARCH)
NATIVE_GGUF_ARCHITECTURES = frozenset(_GGUF_ARCH.values())
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


_INDEX_VERSION = 2


def _index_checksum(body: dict) -> str:
    """sha256 of an index's content and the key of the GGUF it was built for."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _gguf_types() -> dict[int, tuple[int, int]]:
    """{ggml type: (elements per block, bytes per block)} of every type gguf knows."""
    from gguf import GGML_QUANT_SIZES

    return {int(t): (int(b), int(n)) for t, (b, n) in GGML_QUANT_SIZES.items()}


def _index_problem(index: dict, file_size: int) -> str | None:
    """Why a tensor index (from the cache or fresh from the file) cannot describe a sound GGUF of
    `file_size` bytes: an unknown type, a byte size that is not what its type and shape take, data
    outside the file or overlapping another tensor's. None when it is sound."""
    types = _gguf_types()
    spans = []
    for name, (ggml_type, shape, offset, n_bytes) in index.items():
        if ggml_type not in types:
            return f"tensor {name} has an unknown ggml type {ggml_type}"
        block, block_bytes = types[ggml_type]
        if not shape or any(x <= 0 for x in shape) or shape[0] % block:
            return f"tensor {name} has shape {list(shape)}, not whole blocks of its type {ggml_type}"
        want = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        if n_bytes != want:
            return f"tensor {name} holds {n_bytes} bytes, its type {ggml_type} and shape {list(shape)} take {want}"
        if offset < 0 or offset + n_bytes > file_size:
            return f"tensor {name} lies outside the file (truncated?)"
        spans.append((offset, offset + n_bytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            return f"tensors {a} and {b} overlap"
    return None


def _read_index(index_path: Path, body_key: dict) -> dict | None:
    """The cached index at `index_path` if it is whole, built for this file (`body_key`) and its
    checksum matches; None otherwise (it is then rebuilt). Never raises for any content."""
    try:
        doc = read_json_bounded(index_path)
        body = {k: doc[k] for k in ("file", "key", "tensors")}
        if doc["checksum"] != _index_checksum(body) or {k: body[k] for k in body_key} != body_key:
            raise ValueError("checksum mismatch")
        out = {}
        for name, (t, shape, off, n) in body["tensors"].items():
            if not (isinstance(name, str) and all(type(x) is int for x in (t, off, n, *shape))):
                raise ValueError("malformed entry")
            out[name] = (t, tuple(shape), off, n)
        return out
    except FileNotFoundError:
        return None
    except Exception:  # any damage to its content: rebuilt from the file
        _log_rebuild(index_path)
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _log_rebuild(index_path: Path) -> None:
    import sys

    print(f"viasd: the tensor index {index_path} is damaged; rebuilding it from the GGUF file", file=sys.stderr, flush=True)


def index_damage(index_path: Path) -> str | None:
    """Why a cached tensor index is damaged (unreadable, checksum mismatch, unsound), or None
    (`viasd models --verify`)."""
    try:
        doc = read_json_bounded(index_path)
    except Exception as e:
        return f"unreadable ({type(e).__name__})"
    try:
        if "checksum" not in doc:
            return "no checksum (written by an older viasd)"
        body = {k: doc[k] for k in ("file", "key", "tensors")}
        if doc["checksum"] != _index_checksum(body):
            return "its checksum does not match its content"
        tensors = {name: (int(t), tuple(int(x) for x in shape), int(off), int(n))
                   for name, (t, shape, off, n) in body["tensors"].items()}
        why = _index_problem(tensors, int(body["key"][0]))
    except Exception as e:
        return f"malformed ({type(e).__name__})"
    return why


def tensor_index(path: Path) -> dict[str, tuple[int, tuple[int, ...], int, int]]:
    """{tensor name: (ggml type, shape in ggml's order, offset of its data in the file, bytes)} of a
    GGUF file. gguf's reader parses every metadata field to find them, the tokenizer's strings among
    them: 5 s for smollm2's file and ~15 s for qwen 1.5B's here, at every load. So the first read
    writes this index to the cache (`<cache>/gguf-index/`, keyed by the file's resolved path and
    `file_key` (size, mtime_ns, inode); written atomically) and later loads read it in milliseconds.
    The index records a checksum of its content and of the key it was built for: one that does not
    match (or is damaged in any way) is rebuilt from the file. Every index, read or fresh, is checked
    for sizes that match each tensor's type and shape, data within the file and no overlaps."""
    from viasd.models.cache import cache_dir, file_key

    key = file_key(path)
    resolved = str(path.resolve())
    name = hashlib.sha256(f"{resolved}|{key}|{_INDEX_VERSION}".encode()).hexdigest()[:24]
    index_path = cache_dir() / "gguf-index" / f"{name}.json"
    cached = _read_index(index_path, {"file": resolved, "key": key})
    if cached is not None and _index_problem(cached, key[0]) is None:
        return cached
    if cached is not None:
        _log_rebuild(index_path)
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on a damaged file
        raise CorruptGGUFError(f"{path}: unreadable GGUF ({type(e).__name__}: {_first_line(e)})") from None
    index = {t.name: (int(t.tensor_type), tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes))
             for t in reader.tensors}
    why = _index_problem(index, key[0])
    if why:
        raise CorruptGGUFError(f"{path}: {why}: the file is damaged; replace it{_replace_hint(path)}")
    body = {"file": resolved, "key": key, "tensors": {k: [t, list(shape), off, n] for k, (t, shape, off, n) in index.items()}}
    try:
        atomic_write_text(index_path, json.dumps({**body, "checksum": _index_checksum(body)}))
    except OSError:  # a read-only or full cache: the next load reads the header again
        pass
    return index


def _replace_hint(path: Path) -> str:
    """For a zoo download: how to replace it."""
    from viasd.models.cache import cache_dir

    try:
        if path.resolve().is_relative_to((cache_dir() / "downloads").resolve()):
            return " (delete it and run again: it is fetched again)"
    except OSError:
        pass
    return ""


# byte offsets of the half-precision scale / min fields in each block of the quantized types
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 9: (0, 2), 10: (80, 82), 11: (108,), 12: (0, 2),
               13: (0, 2), 14: (208,), 16: (0,), 17: (0,), 18: (0,), 19: (0,), 20: (0,), 21: (0,), 22: (0,), 23: (0,)}


def _nonfinite(ggml_type: int, data: np.ndarray) -> str | None:
    """What is not finite in a tensor's raw bytes (`data`, [rows, row bytes] uint8), or None: every
    value of a float tensor, every block's half-precision scales / mins of a quantized one (one
    vectorised pass over a fraction of the bytes)."""
    if ggml_type in (gk.F32, gk.F16):
        values = data.reshape(-1).view(np.float32 if ggml_type == gk.F32 else np.float16)
        return None if np.isfinite(values).all() else "values that are NaN or infinite"
    if ggml_type == gk.BF16:  # exponent bits all set: inf or NaN
        bits = data.reshape(-1).view(np.uint16)
        return None if not ((bits & 0x7F80) == 0x7F80).any() else "values that are NaN or infinite"
    fields = _F16_FIELDS.get(ggml_type)
    if fields is None:
        return None
    block_bytes = _gguf_types()[ggml_type][1]
    if block_bytes % 2 or data.ctypes.data % 2:
        halves = lambda at: np.ascontiguousarray(data.reshape(-1, block_bytes)[:, at : at + 2]).view(np.uint16)[:, 0]  # noqa: E731
    else:  # every block size with f16 fields is even: strided views, no copies
        u16 = data.reshape(-1).view(np.uint16).reshape(-1, block_bytes // 2)
        halves = lambda at: u16[:, at // 2]  # noqa: E731
    for at in fields:
        if (np.bitwise_and(halves(at), 0x7C00) == 0x7C00).any():  # exponent bits all set: inf or NaN
            return "block scales that are NaN or infinite"
    return None


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
            raise CorruptGGUFError(f"{path}: no tensor {gguf_name}.weight (for {hf_name})")
        ggml_type, shape, offset, n_bytes = t
        cols, rows = int(shape[0]), int(np.prod(shape[1:]))
        if offset + n_bytes > mapped.shape[0] or n_bytes % rows:
            raise CorruptGGUFError(f"{path}: tensor {gguf_name}.weight is not whole rows within the file (truncated?)")
        raw = np.asarray(mapped[offset : offset + n_bytes]).reshape(rows, -1)
        bad = _nonfinite(ggml_type, raw)
        if bad:
            raise CorruptGGUFError(f"{path}: tensor {gguf_name}.weight has {bad}: the file's tensor data is damaged; "
                                   f"replace it{_replace_hint(path)}")
        with warnings.catch_warnings():  # the file is mapped read-only; nothing writes to weights
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
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
    chunk = _quantize_chunk()
    if names is None:
        assert config is not None, "quantize needs the model's config or the names"
        names = native_names(config)
    return {name: _quantized(state[name], ggml_type, chunk) for name in names
            if name in state or name != "lm_head.weight"}


def requantize(tensors: dict[str, gk.NativeTensor], name: str) -> dict[str, gk.NativeTensor]:
    """The same weights in the ggml type `name` (one of `validation.REQUANT_FORMATS`): each dequantized
    by ggml, then quantized by ggml's own quantizer (those already of that type kept as they are)."""
    from gguf import GGMLQuantizationType

    ggml_type, chunk = int(GGMLQuantizationType[name.upper()]), _quantize_chunk()
    return {k: t if t.ggml_type == ggml_type else _quantized(t.dequantize(), ggml_type, chunk) for k, t in tensors.items()}


def _quantize_chunk():
    return gk.lib().fn("ggml_quantize_chunk", ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


def _quantized(w: torch.Tensor, ggml_type: int, quantize_chunk) -> gk.NativeTensor:
    """[rows, cols] float weights -> their `ggml_type` blocks (ggml's `ggml_quantize_chunk`)."""
    w = w.to(torch.float32).contiguous()
    rows, cols = w.shape
    data = torch.empty(rows, gk.row_bytes(ggml_type, cols), dtype=torch.uint8)
    quantize_chunk(ggml_type, w.data_ptr(), data.data_ptr(), 0, rows, cols, None)
    return gk.NativeTensor(data, ggml_type, cols)
