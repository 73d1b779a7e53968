"""Where viasd keeps what it builds (`cache_dir`) and how a file in it is checked: sha256, the key
a full check was recorded against, and a sampled hash; the orphans of killed work removed, and the
directory checked to be writable."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

from viasd.validation import open_regular


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
    with open_regular(path) as f, _progress(size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def file_key(path: Path) -> list[int]:
    """(size, mtime_ns, inode) of a file: what a full sha256 check is recorded against. A file whose
    key is unchanged since its last full check is not hashed again (a warm load stays fast); any write
    to it, or a replacement, changes the key and so brings the full check back."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr, leave=False)


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
