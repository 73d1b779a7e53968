"""Where viasd keeps what it builds (`cache_dir`) and how a file in it is checked: sha256 and the key
a full check was recorded against."""

from __future__ import annotations

import hashlib
import os
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
