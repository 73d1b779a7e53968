"""llama.cpp's own GGUF converter for the tests: `convert_hf_to_gguf.py` and its `gguf-py` from the
llama-cpp-python sdist that `benchmarks/` builds llama.cpp from, fetched from PyPI once per machine into
the tests' cache, so that a tiny transformers model becomes the same file a user downloads. Test files
import it as `from llama_convert import ...`."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.16"  # the version benchmarks/load.py builds llama.cpp from

# The converter names a byte-level BPE pre-tokenizer by hashing how it splits a fixed text and refuses
# hashes it does not list; a tokenizer trained for a test has none, and splits as GPT-2's does.
_RUN = """
import sys
src, model_dir, *jobs = sys.argv[1:]
sys.path[:0] = [src, src + "/gguf-py"]
import convert_hf_to_gguf as c
known = c.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
c.TextModel.get_vocab_base_pre = pre
for outtype, out in zip(jobs[::2], jobs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out]
    c.main()
"""

def converter_dir() -> Path:
    """The folder holding llama.cpp's `convert_hf_to_gguf.py` and `gguf-py/` (fetched once; the test
    skips, saying why, where PyPI cannot be reached)."""
    root = Path(os.environ.get("VIASD_TEST_CACHE") or Path.home() / ".cache" / "viasd-tests")
    dest = root / SDIST.replace("==", "-")
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                              "-d", tmp], capture_output=True, text=True)
        if got.returncode:
            pytest.skip(f"llama.cpp's converter could not be fetched ({SDIST}): {got.stderr.strip()[-200:]}")
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        out = Path(tmp) / "out"
        with tarfile.open(sdist) as t:
            top = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            members = [m for m in t.getmembers()
                       if m.name == top + "convert_hf_to_gguf.py" or m.name.startswith(top + "gguf-py/")]
            t.extractall(out, members=members, filter="data")
        if not dest.exists():  # another worker may have finished first
            os.replace(out / top, dest)
    return dest


def convert(model_dir: Path, outs: dict[str, Path]) -> dict[str, Path]:
    """`model_dir` (a transformers directory) as llama.cpp's converter writes it: {outtype: file}, outtype
    one of f32, f16, bf16, q8_0 (one process for them all: the converter imports torch)."""
    jobs = [str(x) for outtype, out in outs.items() for x in (outtype, out)]
    got = subprocess.run([sys.executable, "-c", _RUN, str(converter_dir()), str(model_dir), *jobs],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]
    return outs


def rewrite_gguf(src: Path, out: Path, qtype: str | None = None, head_qtype: str | None = None,
                 fields: dict | None = None, tensors: dict | None = None) -> Path:
    """`src` with every 2-D weight quantized to `qtype` and `output.weight` to `head_qtype` by ggml's own
    quantizer (`ggml_quantize_chunk`, what llama-quantize calls; Q4_K_M keeps the head in Q6_K; a
    weight whose rows are not whole blocks of the type stays as it is, as llama-quantize leaves it),
    `fields` ({key: (value, GGUFValueType)}) set and `tensors` ({name: float32 array}) added."""
    import gguf
    import torch

    from viasd.models.native import quantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for key, (value, kind) in (fields or {}).items():
        writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        data = t.data
        name = head_qtype if t.name == "output.weight" else qtype
        want = gguf.GGMLQuantizationType[name] if name else None
        if want is not None and len(t.shape) == 2 and t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) \
                and data.shape[-1] % gguf.GGML_QUANT_SIZES[want][0] == 0:
            w = torch.from_numpy(data.astype("float32"))  # [rows, cols]
            q = quantize({"w": w}, None, int(want), names=["w"])["w"].data.numpy()
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=want)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

