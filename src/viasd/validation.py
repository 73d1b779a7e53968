"""One validation layer for the CLI and the Python API: every check here raises a typed
`viasd.errors.UsageError` (exit 2) with a one-line message, before any model is loaded.

Also the file-writing helpers every command shares: an up-front writability check (so a long run
never ends in a traceback over an unwritable output), atomic writes (temporary file + rename, so a
killed run never leaves half a file), strict JSON (no NaN / Infinity tokens) and a JSON reader that
turns every way a file can be wrong into one message.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from viasd.errors import InvalidArgumentError, InvalidPromptError, MalformedFileError, NotWritableError, UsageError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
DEVICE_TYPES = ("cpu", "cuda", "mps")
# --weights: the model file's own format ("native"), or every weight dequantized to a float type
WEIGHT_FORMATS = ("native", "float32", "bfloat16", "float16")
# what a load may re-quantize native weights to (a drafter's by default: its precision changes only how
# many drafts are accepted, never the output), and the drafters' default
REQUANT_FORMATS = ("q4_0",)
DRAFTER_REQUANT = "q4_0"
DRAFTER_FORMATS = WEIGHT_FORMATS + REQUANT_FORMATS  # --drafter-weights
# the most any user-named input file (route, thresholds, bench task file) may hold: /dev/zero, a
# huge or endless file is refused with one line instead of being read whole into memory
MAX_INPUT_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------ numbers


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """An int (not a bool, float or string) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise InvalidArgumentError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgumentError(f"{name} must be <= {hi}, got {value}")
    return value


def check_float(name: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False, allow_inf: bool = False) -> float:
    """A real number (not a bool or string), finite (unless `allow_inf`: +inf only), in the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise InvalidArgumentError(f"{name} must be a number, got NaN")
    if math.isinf(value) and not (allow_inf and value > 0):
        raise InvalidArgumentError(f"{name} must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidArgumentError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise InvalidArgumentError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {value}")
    return value


def check_seed(value, name: str = "seed", hi: int = SEED_MAX) -> int:
    return check_int(name, value, 0, hi)


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"unknown {name} {value!r}: choose from {', '.join(choices)}")
    return value


def check_device(device) -> str:
    """A torch device name that exists on this machine ('cpu', 'cuda', 'cuda:1', 'mps')."""
    import torch

    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise InvalidArgumentError(f"device must be a string such as 'cpu', got {device!r}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps") from None
    if parsed.type not in DEVICE_TYPES:
        raise InvalidArgumentError(f"unsupported device {device!r}: use cpu, cuda, cuda:N or mps")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {device!r}: no CUDA device is available here (use --device cpu)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InvalidArgumentError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise InvalidArgumentError(f"device {device!r}: MPS is not available here (use --device cpu)")
    return device


def check_layers(name: str, layers) -> tuple[int, ...] | None:
    """None, or a sequence of layer indices (ints); ranges are checked against the model later."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes, bytearray)) or not isinstance(layers, Sequence):
        raise InvalidArgumentError(f"{name} must be a list of layer indices, got {layers!r}")
    return tuple(check_int(f"{name} entry", x, 0) for x in layers)


# -------------------------------------------------------------------------------------------- text


def check_text(name: str, text) -> str:
    """A str that encodes to UTF-8: no lone surrogates (what Python makes of undecodable argv bytes)."""
    if not isinstance(text, str):
        raise InvalidPromptError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidPromptError(f"{name} is not valid UTF-8 text (undecodable byte or lone surrogate at character {e.start})") from None
    return text


def decode_utf8(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidPromptError(f"{name} is not valid UTF-8 (bad byte 0x{data[e.start]:02x} at offset {e.start})") from None


def check_token_ids(ids, vocab_size: int | None = None) -> list[int]:
    """A prompt given as token ids: a non-empty list of ints in [0, vocab_size). bytes, floats and
    bools are refused rather than converted."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raise InvalidPromptError("the prompt is bytes: give text (str) or a list of token ids (ints)")
    if hasattr(ids, "tolist") and hasattr(ids, "ndim") and ids.ndim == 1:  # a torch / numpy vector
        ids = ids.tolist()
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise InvalidPromptError(f"the prompt must be text, chat messages or a list of token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidPromptError(f"token id {i} is not an integer: {t!r}")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"be in [0, {vocab_size})" if vocab_size is not None else "be >= 0"
            raise InvalidPromptError(f"token id {i} ({t}) is outside the vocabulary: ids must {bound}")
        out.append(t)
    if not out:
        raise InvalidPromptError("the prompt is empty")
    return out


# ------------------------------------------------------------------------------------------- files


def check_writable_file(path: str | Path, what: str = "output") -> Path:
    """Make sure `path` can be written as a file, before any work: its directory is created if
    missing, must be a directory we can create files in, and `path` must not be a directory."""
    path = Path(path)
    if path.is_dir():
        raise NotWritableError(f"{what} {path} is a directory, not a file")
    _check_writable_dir(path.parent if str(path.parent) else Path("."), f"{what} {path}")
    if path.exists() and not os.access(path, os.W_OK):
        raise NotWritableError(f"{what} {path} is not writable")
    return path


def check_writable_dir(path: str | Path, what: str = "output directory") -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotWritableError(f"{what} {path} exists and is not a directory")
    _check_writable_dir(path, f"{what} {path}")
    return path


def _check_writable_dir(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotWritableError(f"{what}: {_first_file(d)} is a file, not a directory") from None
    except OSError as e:
        raise NotWritableError(f"{what}: cannot create directory {d} ({e.strerror or e})") from None
    if not d.is_dir():
        raise NotWritableError(f"{what}: {d} is not a directory")
    try:  # the real test: /proc, read-only mounts and ACLs all answer here
        fd, probe = tempfile.mkstemp(dir=d, prefix=".viasd-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise NotWritableError(f"{what}: cannot write in {d} ({e.strerror or e})") from None


def _first_file(d: Path) -> Path:
    for p in [d, *d.parents]:
        if p.exists() and not p.is_dir():
            return p
    return d


def lock_beside(path: str | Path, what: str, wait_s: float = 0.0) -> int | None:
    """An exclusive flock on PATH.lock, created beside `path`: its open descriptor (closing it
    releases the lock), or None when another process still holds it after `wait_s` seconds. The
    lock file stays behind (removing it would race a third process)."""
    import fcntl
    import time

    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise NotWritableError(f"{what} {path}: cannot create its lock file {lock} ({e.strerror or e})") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


# -------------------------------------------------------------------------------------------- JSON


def _strict(obj):
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def dumps_strict(obj, **kw) -> str:
    """JSON any strict parser reads: NaN -> null, +-inf -> "inf" / "-inf" (read back by `as_float`)."""
    return json.dumps(_strict(obj), allow_nan=False, **kw)


def as_float(value) -> float | None:
    """A number from strict JSON, reading back "inf" / "-inf" / "Infinity"; None if not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity", "+infinity", "-inf", "-infinity"):
        return float("-inf") if value.strip().startswith("-") else float("inf")
    return None


# ---------------------------------------------------------------------------------- reading files
# Every small file viasd reads (route, thresholds, task and results files; the JSON it keeps in the
# cache) goes through `read_bounded`: opened without waiting (a named pipe with no writer, a socket or
# a terminal would block `open()` or `read()` for good), refused unless a regular file (devices only
# where a caller allows them, for `read_capped`'s one-line refusals), read up to a cap. Binary files
# (weights, GGUF, calibration sets) are opened with `open_regular`.

_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"))


def special_kind(mode: int) -> str | None:
    """What a file of `st_mode` is when it is a FIFO, socket or device (None for anything else)."""
    return next((name for test, name in _SPECIAL if test(mode)), None)


class UnreadableFileError(OSError):
    """A file `read_bounded` / `open_regular` refused or could not read: `fault` is "directory",
    "special" (a FIFO, socket or device: `detail` says which), "large" (more than `cap` bytes),
    "memory" or "os" (`detail`: the system's reason). A missing file is a FileNotFoundError instead."""

    def __init__(self, path, fault: str, detail: str = "", cap: int = 0):
        self.path, self.fault, self.detail, self.cap = Path(path), fault, detail, cap
        super().__init__(self.describe())

    def describe(self, what: str = "") -> str:
        """One line naming the file and the fault (`what`: the kind of file it should be)."""
        f, p = f"{what} file" if what else "file", self.path
        if self.fault == "directory":
            return f"{p}: is a directory, not a {f}"
        if self.fault == "special":
            return f"{p}: is {self.detail}, not a regular {f}"
        if self.fault == "large":
            return f"{p}: {f} is larger than {_size(self.cap)}, the most viasd reads (is it the right file?)"
        if self.fault == "memory":
            return f"{p}: {f} is too large to read (the limit is {_size(self.cap)})"
        return f"{p}: cannot read {f} ({self.detail})"


def _open_checked(path: Path, devices: bool) -> tuple[int, os.stat_result]:
    """A read-only descriptor of `path` opened without blocking, and its stat; refuses a directory and
    a FIFO or socket (a device too unless `devices`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # a socket cannot be opened (ENXIO): say what it is
        try:
            kind = special_kind(os.stat(path).st_mode)
        except OSError:
            kind = None
        raise UnreadableFileError(path, "special", kind) if kind else UnreadableFileError(path, "os", e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        kind = special_kind(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            raise UnreadableFileError(path, "directory")
        if kind and not (devices and (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode))):
            raise UnreadableFileError(path, "special", kind)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str | Path):
    """`open(path, "rb")` of a regular file only, never blocking: FileNotFoundError when missing,
    UnreadableFileError (an OSError) for a directory, FIFO, socket or device."""
    fd, _ = _open_checked(Path(path), devices=False)
    return os.fdopen(fd, "rb")


def read_bounded(path: str | Path, cap: int, devices: bool = False) -> bytes:
    """The bytes of `path`, at most `cap` of them, without ever blocking: reads up to cap + 1 bytes and
    refuses a file holding more (so /dev/zero or an endless file costs one bounded read, never all
    memory). FileNotFoundError when missing; UnreadableFileError (an OSError) for a directory, a FIFO or
    socket (a device too, unless `devices`: then it is read up to the cap), a read error or too much."""
    path = Path(path)
    fd, st = _open_checked(path, devices)
    chunks, n = [], 0
    try:
        hint = st.st_size + 1 if stat.S_ISREG(st.st_mode) else cap + 1
        while n <= cap:
            chunk = os.read(fd, min(cap + 1 - n, max(hint - n, 1 << 16)))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    except OSError as e:  # (a device with nothing to read now: EAGAIN, not a wait)
        raise UnreadableFileError(path, "os", e.strerror or str(e)) from None
    except MemoryError:
        raise UnreadableFileError(path, "memory", cap=cap) from None
    finally:
        os.close(fd)
    if n > cap:
        raise UnreadableFileError(path, "large", cap=cap)
    return b"".join(chunks)


def parse_json(data: bytes, where: str = "JSON"):
    """JSON from UTF-8 bytes; every way content can be wrong (not UTF-8, not JSON, nested too deeply
    for the parser) is a ValueError."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None


def read_json_bounded(path: str | Path, cap: int | None = None):
    """A JSON file viasd keeps (in the cache, beside a model): FileNotFoundError when missing, another
    OSError when it cannot be read as a regular file of at most `cap` bytes (default MAX_INPUT_BYTES),
    ValueError for any content that is not JSON; never blocks, never a RecursionError."""
    return parse_json(read_bounded(path, MAX_INPUT_BYTES if cap is None else cap), str(path))


def read_capped(path: str | Path, what: str, error: type[UsageError] = MalformedFileError,
                cap: int | None = None) -> bytes:
    """The bytes of a user-named input file, at most `cap` of them (`read_bounded`; a device such as
    /dev/zero is read up to the cap). Missing, a directory, a FIFO or socket, unreadable or too large:
    one `error` naming the file."""
    path = Path(path)
    try:
        return read_bounded(path, MAX_INPUT_BYTES if cap is None else cap, devices=True)
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except UnreadableFileError as e:
        raise error(e.describe(what)) from None
    except OSError as e:
        raise error(f"{path}: cannot read {what} file ({e.strerror or e})") from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def read_json(path: str | Path, what: str, error: type[UsageError] = MalformedFileError):
    """Parse a JSON file; every way it can fail (missing, a directory, a FIFO, unreadable, not UTF-8,
    not JSON, nested too deeply) is one `error` (a UsageError) naming the file."""
    path = Path(path)
    text = read_capped(path, what, error)
    try:
        return json.loads(decode_utf8(text, f"{what} file {path}"))
    except ValueError as e:
        raise error(f"{path}: not a readable {what} JSON file ({e})") from None
    except RecursionError:
        raise error(f"{path}: not a readable {what} JSON file (nested too deeply)") from None


def require_dict(data, path, what: str, error: type[UsageError] = MalformedFileError) -> dict:
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} file must hold a JSON object, not {_json_type(data)}")
    return data


def require_schema(data, path, error: type[UsageError] = MalformedFileError):
    """A JSON schema read from `path`: an object or a boolean (`true`: anything, `false`: nothing)."""
    if not isinstance(data, (dict, bool)):
        raise error(f"{path}: a JSON schema is an object or a boolean, not {_json_type(data)}")
    return data


def _json_type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def check_thresholds(values: dict, path) -> dict[str, float]:
    """Threshold values read from a file: numbers (or "inf" for slim_entropy) in range."""
    out = {}
    for name, value in values.items():
        v = as_float(value)
        if v is None:
            raise MalformedFileError(f"{path}: threshold {name} must be a number, got {value!r}")
        try:
            if name == "slim_entropy":
                out[name] = check_float(name, v, 0.0, allow_inf=True)
            else:
                out[name] = check_float(name, v, 0.0, 2.0)
        except InvalidArgumentError as e:
            raise MalformedFileError(f"{path}: {e}") from None
    return out
