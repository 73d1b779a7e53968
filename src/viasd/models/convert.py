"""GGUF -> transformers directory, and the checks of the converted cache.

GGUF files are dequantised by transformers once and cached as safetensors + tokenizer files under
`cache_dir()/models/`, written to a temporary directory and renamed into place, so an interrupted
conversion never leaves a half-written model and a second load takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from viasd.errors import CorruptFileError, CorruptGGUFError, UnsupportedArchitectureError
from viasd.models.cache import _log, cache_dir, file_key, remove_orphans, sampled_hash, sha256_file
from viasd.models.config import SUPPORTED_ARCHITECTURES
from viasd.models.download import _write_zoo_stamp, _zoo_stamp, zoo_gguf_path
from viasd.models.zoo import ZOO
from viasd.validation import open_regular, read_json_bounded

_META = "viasd-model.json"


# ----------------------------------------------------------------------------------- GGUF -> HF dir


def gguf_architecture(path: Path) -> str:
    """Read `general.architecture` from a GGUF header; clear error for files that are not GGUF."""
    with open_regular(path) as f:
        if f.read(4) != b"GGUF":
            raise CorruptFileError(f"{path}: not a GGUF file (bad magic bytes)")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        field_ = reader.fields["general.architecture"]
        arch = bytes(field_.parts[field_.data[0]]).decode()
        scaling_field = reader.fields.get(f"{arch}.rope.scaling.type")
        scaling = bytes(scaling_field.parts[scaling_field.data[0]]).decode() if scaling_field is not None else "none"
        rope_freqs = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    except Exception as e:  # gguf raises assorted errors on truncated files
        raise CorruptFileError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    # transformers' GGUF reader drops these, and the model would decode with plain RoPE, silently wrong
    if rope_freqs or scaling not in ("none", "linear"):
        what = "Llama 3.1+ RoPE frequencies (rope_freqs)" if rope_freqs else f"RoPE scaling {scaling!r}"
        raise UnsupportedArchitectureError(f"{path.name}: {what} not supported yet")
    return arch


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
        _refuse_dropped(gguf, arch, state, model.config.tie_word_embeddings)
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


def _refuse_dropped(gguf: Path, arch: str, state: dict, tied: bool) -> None:
    """transformers' GGUF reader keeps only the tensors its model class has (a Llama's attention biases
    are dropped): a file tensor with no place in the converted model would decode silently wrong."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    from viasd.models.native import NATIVE_GGUF_ARCHITECTURES, tensor_index

    if arch not in NATIVE_GGUF_ARCHITECTURES:
        return
    kind = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    n_layers = 1 + max((int(k.split(".")[2]) for k in state if k.startswith("model.layers.")), default=-1)
    names = get_tensor_name_map(kind, n_layers)
    kept = {f"{names.get_name(base)}.{suffix}" for base, _, suffix in (k.rpartition(".") for k in state)}
    unused = {"rope_freqs.weight"} | ({"output.weight"} if tied else set())  # rope_freqs: refused before
    dropped = sorted(n for n in tensor_index(gguf) if n not in kept and n not in unused)
    if dropped:
        raise UnsupportedArchitectureError(
            f"{gguf.name}: tensors {', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''} have no place in "
            f"transformers' {arch} model: not supported yet")


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
