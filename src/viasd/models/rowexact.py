"""Row-exact batched products of native weights: viasd's own kernel (`rowexact.c`).

Why our own: speculative decoding verifies k drafts in one pass, and a lossless strategy needs each
row of that pass to come out exactly as it would alone. ggml's one-row kernels are row-exact but
a pass of k rows costs about k/2 one-row passes here (`benchmarks/native_probe.py`: T(8)/T(1) 4.1-4.4);
its batched kernels (AMX tiles, CPU_REPACK GEMMs) sum several rows in another order than one row, and
its AMX several-row path crashes in ggml-py 0.10.1. This kernel sums every (row, output) pair in the
same order whatever the rows of the call, and shares each weight load among up to 8 rows.

The weights keep the file's values exactly: each block of the GGUF (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0)
becomes unsigned integers q with a float scale and min per block of 16 or 32 (w = scale * q + min),
stored 4-bit for 4-bit types, Q5_0 in 4-bit and 1-bit planes, Q6_K in 4-bit and 2-bit planes, 8-bit
otherwise (Q8_0). Activations are quantized per block of each row to
int8, as ggml quantizes them (to Q8 blocks) for its own integer dot products.

The C source is compiled on first use with the system C compiler (the one that built ggml-py) into
the cache directory. It also holds the row-exact attention op (`attention_op_address`): each query
row and head over the keys its mask leaves visible, with the same float operations whatever the other
rows, 16 keys at a time (ggml's reference flash attention, which is row-exact too, takes one key at
a time with scalar exponentials: 5-8x slower on this project's AVX-512 machine).

Three product kernels compute the same sums, bit for bit: AVX-512 VNNI, AVX2 (each the default where
the CPU runs it: see `unavailable_reason`) and a portable reference (tests). Where there is no
compiler or the CPU has neither, `available()` is False and native weights keep ggml's kernels.

The same library holds several-row kernels over ggml's own layouts (`GgmlRowsOp`, AVX2): Q4_K as
CPU_REPACK lays it out and Q6_K in the file's blocks, each row bit for bit what ggml's one-row kernel
gives it, each weight unpacked once for up to 16 rows (for weights the row-exact kernel cannot hold:
a row count off its 16-row tiles).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

# ggml types this kernel takes (enum ggml_type values)
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
TYPES = (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
_SOURCE = Path(__file__).with_name("rowexact.c")


class _Weight(ctypes.Structure):  # struct rx_weight
    _fields_ = [("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("blk", ctypes.c_int32), ("bits", ctypes.c_int32),
                ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p),
                ("scale_sup", ctypes.c_void_p), ("min_sup", ctypes.c_void_p),
                ("scale_mode", ctypes.c_int32), ("min_mode", ctypes.c_int32), ("sup_blocks", ctypes.c_int32),
                ("min_mult", ctypes.c_float)]


class _Op(ctypes.Structure):  # struct rx_op
    _fields_ = [("w", _Weight), ("impl", ctypes.c_int32)]


class FusedOp(ctypes.Structure):  # struct rx_fused_op
    _fields_ = [("op", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("add", ctypes.c_int32),
                ("best_value", ctypes.c_void_p), ("best_index", ctypes.c_void_p), ("best_rows", ctypes.c_int32),
                ("best_threads", ctypes.c_int32)]


_BEST_THREADS, BEST_ROWS = 64, 64  # RX_BEST_THREADS, RX_BEST_ROWS


class RowMaxima:
    """Each output row's first maximum, found by an LM head's fused op while its threads write the
    logits (`rx_fused_op.best_*`): greedy decoding then never scans them (a cold 152k-float row took
    ~0.17 ms on the AMX Xeon, the 0.5B drafter's 32k head ~0.1 ms; a verifier pass is 34 ms)."""

    def __init__(self, op: FusedOp, rows: int):
        self.op, self.rows = op, rows
        self.value = np.zeros((_BEST_THREADS, rows), dtype=np.float32)  # [thread, row]
        self.index = np.full((_BEST_THREADS, rows), -1, dtype=np.int32)
        op.best_value, op.best_index, op.best_rows = self.value.ctypes.data, self.index.ctypes.data, rows

    def arm(self) -> None:
        """Before the op runs: what it leaves unset reads as unknown (more rows than it tracks)."""
        self.op.best_threads = 0

    def result(self) -> list[int] | None:
        """After the op ran: the index of each row's first maximum, None where any is unknown. Threads
        own ascending ranges of outputs, so the first thread holding the maximum holds its first
        occurrence."""
        nth = self.op.best_threads
        if nth <= 0:
            return None
        index, value = self.index[:nth].T.tolist(), self.value[:nth].T.tolist()  # [row][thread]
        out = []
        for ii, vv in zip(index[: self.rows], value[: self.rows]):
            best, top = -1, 0.0
            for i, v in zip(ii, vv):
                if i == -2:
                    return None
                if i >= 0 and (best < 0 or v > top):
                    best, top = i, v
            if best < 0:
                return None
            out.append(best)
        return out


_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lock = threading.Lock()


_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off")


def _build_key(cc: str) -> str:
    """sha256 of what the kernel is built from: the source, the compiler, its flags, the platform."""
    return hashlib.sha256(_SOURCE.read_bytes() + cc.encode() + " ".join(_FLAGS).encode() + sys.platform.encode()).hexdigest()


@functools.cache
def source_digest() -> str:
    """sha256 of the kernels' C source: what a kept measurement of their speed stands for
    (`execution.timing.pass_times`)."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()


def _record_path(so: Path) -> Path:
    return so.with_suffix(".json")


def kernel_damage(so: Path, build_key: str | None = None) -> str | None:
    """Why a compiled kernel in the cache cannot be trusted, or None: its record (written beside it
    when it was built: the .so's sha256 and the build key of the source and flags it came from) is
    missing or unreadable, was made for another build, or its sha256 differs (truncated, garbled or
    replaced). `build_key`: the current build's (else the one the file name carries)."""
    from viasd.models.cache import sha256_file
    from viasd.validation import read_json_bounded

    try:
        rec = read_json_bounded(_record_path(so))
        sha, built_from = rec["sha256"], rec["built_from"]
        if not (isinstance(sha, str) and isinstance(built_from, str)):
            raise TypeError
    except FileNotFoundError:
        return "no checksum recorded for it"
    except Exception:
        return "its checksum record is unreadable"
    if built_from != build_key if build_key else not so.stem.endswith("-" + built_from[:16]):
        return "it was built from another source or other flags"
    try:
        if sha256_file(so) != sha:
            return "its sha256 differs from the one recorded when it was built"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None


def _compile() -> Path:
    """The compiled kernel in `<cache>/kernels/`, built (and recorded with its checksums) if absent,
    rebuilt if it does not match its record. A `kernels` path that is not a directory, or a damaged
    kernel that cannot be rebuilt, is a one-line `CorruptCacheError` (never a silent switch to
    ggml's kernels, which would change the output)."""
    from viasd.errors import CorruptCacheError
    from viasd.models.cache import cache_dir, sha256_file
    from viasd.validation import atomic_write_text

    kernels = cache_dir() / "kernels"
    if kernels.exists() and not kernels.is_dir():
        raise CorruptCacheError(f"{kernels} is a file, not a directory: delete it (viasd compiles its row-exact kernel there)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc) found")
    key = _build_key(cc)
    target = kernels / f"rowexact-{key[:16]}.so"
    damaged = None
    if target.exists():
        damaged = kernel_damage(target, key)
        if damaged is None:
            return target
        print(f"viasd: the compiled kernel {target} is damaged ({damaged}); rebuilding it", file=sys.stderr, flush=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cc, *_FLAGS, "-o", str(out), str(_SOURCE), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
            # the record first, then the kernel: a reader in between sees a mismatch and rebuilds
            atomic_write_text(_record_path(target), json.dumps({"sha256": sha256_file(out), "built_from": key}))
            os.replace(out, target)  # atomic: another process may be compiling the same file
    except OSError as e:
        if damaged is None:
            raise  # no compiler or no cache: native weights keep ggml's kernels (documented)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CorruptCacheError(f"{target} is damaged ({damaged}) and could not be rebuilt ({first}): "
                                f"delete {target} and run again") from None
    return target


def lib() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built (see `unavailable_reason`)."""
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                cdll = ctypes.CDLL(str(_compile()))
            except OSError as e:
                _lib_error = str(e)
                return None
            from viasd.models.ggml_abi import _Tensor

            cdll.rx_set_layout(ctypes.c_size_t(_Tensor.ne.offset), ctypes.c_size_t(_Tensor.nb.offset),
                               ctypes.c_size_t(_Tensor.src.offset), ctypes.c_size_t(_Tensor.data.offset))
            cdll.rx_matmul.restype = ctypes.c_int
            cdll.rx_matmul.argtypes = [ctypes.POINTER(_Weight), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            _lib = cdll
        return _lib


def _loaded() -> ctypes.CDLL:
    """`lib()`, where the caller runs only once it loaded (`available`)."""
    cdll = lib()
    if cdll is None:
        raise RuntimeError(f"the row-exact kernels are unavailable: {_lib_error}")
    return cdll


def _address(fn) -> int:
    """A C function's address (ggml's custom ops take it)."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None  # (a function of a loaded library)
    return address


REFERENCE, VNNI, AVX2 = 0, 1, 2  # the kernels (`impl`): portable reference, AVX-512 VNNI, AVX2


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it can): it needs AVX-512 VNNI, or AVX2 with FMA and F16C.
    Where it runs it is every native weight's first choice (`NativeTensor.pack`). On the AVX2 EPYC it
    beat ggml's CPU_REPACK layout (with viasd's several-row kernels) and plain Q6_K blocks too, once its
    block scales were found without integer divisions: qwen2.5-coder-1.5b decoded `ar` 1.14-1.56x
    faster on three prompts (median 1.49x) and passed 8 rows in 210 against 283 ms
    (`benchmarks/pack_choice.py`)."""
    cdll = lib()
    if cdll is None:
        return f"the row-exact kernel could not be compiled: {_lib_error}"
    if cdll.rx_has_vnni() or cdll.rx_has_avx2():
        return None
    return "the CPU lacks AVX-512 VNNI and AVX2"


def available() -> bool:
    return unavailable_reason() is None


def best_kernel() -> int:
    """The fastest kernel this CPU runs (REFERENCE where it has neither AVX-512 VNNI nor AVX2)."""
    cdll = lib()
    if cdll is None:
        raise OSError(unavailable_reason())
    return VNNI if cdll.rx_has_vnni() else AVX2 if cdll.rx_has_avx2() else REFERENCE


def op_address() -> int:
    """Address of the ggml custom-op function (`ggml_custom_4d`'s fun)."""
    return _address(_loaded().rx_ggml_op)


def fused_op_address() -> int:
    """Address of the product with its input's RMS norm and a residual fused in (`rx_ggml_fused_op`;
    userdata a `FusedOp`)."""
    return _address(_loaded().rx_ggml_fused_op)


def set_prefetch_rows(rows: int) -> None:
    """The VNNI and AVX2 kernels prefetch a tile's weights a few blocks ahead in passes of up to `rows`
    rows (default 8, all of them). Results never depend on it; benchmarks lower it to measure what it saves."""
    cdll = lib()
    if cdll is not None:
        cdll.rx_set_prefetch_rows(ctypes.c_int(rows))


class AttentionParams(ctypes.Structure):  # struct rx_attn_params
    _fields_ = [("scale", ctypes.c_float), ("softcap", ctypes.c_float)]

    @classmethod
    def of(cls, scale: float, softcap: float | None) -> AttentionParams:
        """As ggml's flash attention applies them: softcap * tanh(scale / softcap * q.k) with a softcap."""
        return cls(scale / softcap if softcap else scale, softcap or 0.0)


def attention_unavailable_reason(head_dim: int) -> str | None:
    """Why the row-exact attention op (`rx_attn_op`) cannot run here (None: it can)."""
    cdll = lib()
    if cdll is None:
        return f"the row-exact kernels could not be compiled: {_lib_error}"
    if not cdll.rx_has_attention():
        return "the CPU lacks AVX-512 and AVX2 with FMA and F16C"
    if head_dim % 16 or head_dim > 256:
        return f"head size {head_dim} is not a multiple of 16 up to 256"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """The row-exact attention on tensors, on the calling thread (tests; graphs use the custom op):
    q [T, H, d], k / v [Hkv, n_keys, d] float32, mask [T, n_keys] (0 where a row sees a key, -inf
    elsewhere; taken as float16) -> [T, H, d]."""
    reason = attention_unavailable_reason(q.shape[-1])
    if reason:
        raise OSError(reason)
    q, k, v = (t.to(torch.float32).contiguous() for t in (q, k, v))
    mask = mask.to(torch.float16).contiguous()
    out = torch.empty_like(q)
    prm = AttentionParams.of(scale, softcap)
    status = _loaded().rx_attention(ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
                                ctypes.c_void_p(mask.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                ctypes.c_int64(q.shape[0]), ctypes.c_int64(q.shape[1]), ctypes.c_int64(k.shape[0]),
                                ctypes.c_int64(k.shape[1]), ctypes.c_int(q.shape[2]), ctypes.c_float(prm.scale),
                                ctypes.c_float(prm.softcap))
    if status != 0:
        raise MemoryError("the row-exact attention could not allocate its score buffer")
    return out


def attention_op_address() -> int:
    """Address of the row-exact attention custom op: dst [d, H, T] from q [d, T, H], the K and V cache
    [d, n_keys, Hkv] float32 and the mask [n_keys, T] float16; userdata an `AttentionParams`."""
    return _address(_loaded().rx_attn_op)


# ---------------------------------------------------------------- unpacking the file's blocks
def _f16(b: np.ndarray, rows: int) -> np.ndarray:
    """Half-precision fields [n_blocks, 2] bytes -> [rows, n_blocks / rows] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(rows, -1)


class _Blocks:
    """A weight's blocks unpacked: w = scale * q + min per block of `blk` inputs, q unsigned (`bits` wide).

    Each of scale / min is stored as exactly as the file allows, in few bytes:
    ("half", [rows, nblk] f16), ("two-level", [rows, nsup] f32 per super-block times [rows, nblk] int8),
    or for min ("mult", c): c * scale.
    """

    def __init__(self, q, blk, bits, scale, min_, sup_blocks=1):
        self.q, self.blk, self.bits, self.scale, self.min, self.sup_blocks = q, blk, bits, scale, min_, sup_blocks


def _unpack(ggml_type: int, data: np.ndarray, rows: int, cols: int) -> _Blocks:
    """The file's blocks (ggml's layouts, as gguf-py's `quants` reads them) -> `_Blocks`."""
    q: np.ndarray  # [rows, cols] quants, uint8 (by layout)
    high: np.ndarray
    if ggml_type == Q4_0:  # d f16, 16 bytes: low nibbles elements 0-15, high 16-31; w = d * (q - 8)
        b = data.reshape(-1, 18)
        q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1)
        return _Blocks(q.reshape(rows, cols), 32, 4, ("half", _f16(b[:, :2], rows)), ("mult", -8.0))
    if ggml_type == Q4_1:  # d f16, m f16, 16 bytes: low nibbles elements 0-15, high 16-31
        b = data.reshape(-1, 20)
        q = np.concatenate([b[:, 4:] & 15, b[:, 4:] >> 4], axis=1)
        return _Blocks(q.reshape(rows, cols), 32, 4, ("half", _f16(b[:, :2], rows)), ("half", _f16(b[:, 2:4], rows)))
    if ggml_type == Q5_0:  # d f16, qh u32 (fifth bits), 16 bytes of nibbles; w = d * (q - 16)
        b = data.reshape(-1, 22)
        qh, qs = np.ascontiguousarray(b[:, 2:6]).view(np.uint32), b[:, 6:]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = np.concatenate([qs & 15, qs >> 4], axis=1) | (high << 4)
        return _Blocks(q.reshape(rows, cols), 32, 8, ("half", _f16(b[:, :2], rows)), ("mult", -16.0))
    if ggml_type == Q8_0:  # d f16, 32 int8; w = d * (q + 128) - 128 d
        b = data.reshape(-1, 34)
        q = (np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _Blocks(q.reshape(rows, cols), 32, 8, ("half", _f16(b[:, :2], rows)), ("mult", -128.0))
    if ggml_type == Q4_K:  # 256 a super-block: d, dmin f16, 12 bytes of 6-bit scales and mins, 128 of nibbles
        b = data.reshape(-1, 144)
        s = b[:, 4:16].reshape(-1, 3, 4)
        lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
        sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 2) & 48)], axis=1).astype(np.int8)  # [n, 8]
        mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], axis=1).astype(np.int8)
        qs = b[:, 16:].reshape(-1, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2)  # [n, 4, 2, 32]: sub-blocks 2c (low nibbles), 2c + 1 (high)
        return _Blocks(q.reshape(rows, cols), 32, 4, ("two-level", _f16(b[:, :2], rows), sc.reshape(rows, -1)),
                       ("two-level", -_f16(b[:, 2:4], rows), mn.reshape(rows, -1)), sup_blocks=8)
    if ggml_type == Q6_K:  # 256 a super-block: 128 low nibbles, 64 of 2-bit highs, 16 int8 scales, d f16
        b = data.reshape(-1, 210)
        ql, qh = b[:, :128], b[:, 128:192]
        low = np.stack([ql.reshape(-1, 2, 64) & 15, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, 8, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = low | (high.reshape(-1, 8, 32) << 4)  # w = scale * (q - 32)
        scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
        return _Blocks(q.reshape(rows, cols), 16, 8, ("two-level", _f16(b[:, 208:], rows), scales.reshape(rows, -1)),
                       ("mult", -32.0), sup_blocks=16)
    raise ValueError(f"the row-exact kernel does not take ggml type {ggml_type}")


def _block_values(spec: tuple, sup_blocks: int, scale: np.ndarray | None = None) -> np.ndarray:
    """[rows, nblk] float32 values of a scale / min spec, as the kernel computes them (exact products):
    what the tests compare with the file's dequantized values."""
    if spec[0] == "half":
        return spec[1]
    if spec[0] == "mult":
        assert scale is not None  # (a multiple of the scale)
        return (np.float32(spec[1]) * scale).astype(np.float32)
    return (np.repeat(spec[1], sup_blocks, axis=1) * spec[2].astype(np.float32)).astype(np.float32)


class RowExactWeight:
    """A weight in the kernel's layout (tiles of 16 rows; see rowexact.c), and its custom-op struct."""

    def __init__(self, ggml_type: int, data: torch.Tensor, rows: int, cols: int, impl: int | None = None):
        """impl: the kernel the op runs (default: the fastest this CPU runs)."""
        if rows % 16:
            raise ValueError(f"the row-exact kernel needs a multiple of 16 rows, got {rows}")
        impl = best_kernel() if impl is None else impl
        u = _unpack(ggml_type, data.numpy(), rows, cols)
        # Q5_0 and Q6_K in planes: the file's bytes, not 1.5x / 1.3x them as 8-bit values
        bits = 5 if ggml_type == Q5_0 else 6 if ggml_type == Q6_K else u.bits
        blk, nblk, tiles = u.blk, cols // u.blk, rows // 16
        t = u.q.reshape(tiles, 16, nblk, blk).transpose(0, 2, 1, 3)  # [tile, block, r, i]
        if bits == 8:  # [tile, block, g, r, j]
            packed = t.reshape(tiles, nblk, 16, blk // 4, 4).transpose(0, 1, 3, 2, 4)
        else:  # low nibble: group v, high nibble: group v + blk/8
            half = (t & 15).reshape(tiles, nblk, 16, 2, blk // 8, 4)
            packed = (half[:, :, :, 0] | (half[:, :, :, 1] << 4)).transpose(0, 1, 3, 2, 4)
            if bits > 4:  # then the high bits, h = bits - 4 a value: bits h*g .. of byte 4r + j = bits 4 .. of q[r][4g + j]
                h = bits - 4
                shift = (h * np.arange(blk // 4, dtype=np.uint8)).reshape(1, 1, 1, -1, 1)
                high = (t >> 4).reshape(tiles, nblk, 16, blk // 4, 4) << shift
                highs = high.sum(axis=3, dtype=np.uint8).reshape(tiles, nblk, -1)
                packed = np.concatenate([packed.reshape(tiles, nblk, -1), highs], axis=2)
        self.q = torch.from_numpy(np.ascontiguousarray(packed).reshape(-1))

        def lanes(a: np.ndarray, dtype) -> torch.Tensor:  # [rows, n] -> [tile, n, 16]
            return torch.from_numpy(np.ascontiguousarray(a.astype(dtype).reshape(tiles, 16, -1).transpose(0, 2, 1)).reshape(-1))

        modes, self._arrays = {}, []
        ptrs: dict[str, int | None] = {}
        for which, spec in (("scale", u.scale), ("min", u.min)):
            if spec[0] == "mult":
                modes[which], ptrs[which], ptrs[which + "_sup"] = 3, None, None
                continue
            if spec[0] == "half":
                arr, sup, modes[which] = lanes(spec[1], np.float16), None, 1
            else:
                arr, sup, modes[which] = lanes(spec[2], np.int8), lanes(spec[1], np.float16), 2  # (the file's halves: exact)
            self._arrays += [a for a in (arr, sup) if a is not None]
            ptrs[which], ptrs[which + "_sup"] = arr.data_ptr(), None if sup is None else sup.data_ptr()
        self.rows, self.cols, self.blk, self.bits = rows, cols, blk, bits
        self.op = _Op(_Weight(rows, cols, blk, bits, self.q.data_ptr(), ptrs["scale"], ptrs["min"], ptrs["scale_sup"],
                              ptrs["min_sup"], modes["scale"], modes["min"], u.sup_blocks,
                              float(u.min[1]) if u.min[0] == "mult" else 0.0),
                      impl)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + sum(a.numel() * a.element_size() for a in self._arrays)

    def __call__(self, x: torch.Tensor, impl: int | None = None) -> torch.Tensor:
        """x [T, cols] float32 -> [T, rows], on the calling thread (tests; graphs use the custom op).
        impl: REFERENCE, VNNI or AVX2 (default: the op's, the fastest this CPU runs)."""
        x = x.to(torch.float32).contiguous()
        y = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        status = _loaded().rx_matmul(ctypes.byref(self.op.w), x.data_ptr(), self.cols, x.shape[0], y.data_ptr(), self.rows,
                                 0, 1, self.op.impl if impl is None else impl)
        if status != 0:
            raise MemoryError("the row-exact kernel could not allocate its activation buffer")
        return y


# ---------------------------------------------------------------- ggml's one-row results, several rows
ROWS_Q4K8, ROWS_Q6K = 0, 1  # the weights `rx_rows_matmul` takes: Q4_K as ggml's CPU_REPACK lays it out
# for AVX2 (block_q4_Kx8; its one-row kernel ggml_gemv_q4_K_8x8_q8_K), Q6_K in the file's blocks
# (ggml_vec_dot_q6_K_q8_K)


class GgmlRowsOp(ctypes.Structure):  # struct rx_rows_op
    """A weight multiplied by `rx_rows_matmul`: each row bit for bit what ggml's one-row kernel for
    its layout gives it, several rows sharing each weight load (see rowexact.c)."""

    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("quantize", ctypes.c_void_p), ("kind", ctypes.c_int32)]


def rows_unavailable_reason() -> str | None:
    """Why the several-row kernels over ggml's layouts cannot run here (None: they can)."""
    cdll = lib()
    if cdll is None:
        return f"the row-exact kernels could not be compiled: {_lib_error}"
    if not cdll.rx_has_avx2():
        return "the CPU lacks AVX2"
    return None


def rows_op(kind: int, data_ptr: int, rows: int, cols: int, quantize_ptr: int | None) -> GgmlRowsOp:
    """The op struct for a weight at `data_ptr` (`quantize_ptr`: ggml's quantize_row_q8_K)."""
    if rows % (8 if kind == ROWS_Q4K8 else 1) or cols % 256:
        raise ValueError(f"a {'repacked Q4_K' if kind == ROWS_Q4K8 else 'Q6_K'} weight of {rows}x{cols} does not fit the kernel")
    return GgmlRowsOp(data_ptr, rows, cols, quantize_ptr, kind)


def rows_matmul(op: GgmlRowsOp, x: torch.Tensor, split: int = 1) -> torch.Tensor:
    """x [T, cols] float32 -> [T, rows] through the several-row kernel, on the calling thread (checks,
    tests); `split`: the work divided as among that many threads, their parts computed in turn."""
    cdll = _loaded()
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], op.rows, dtype=torch.float32)
    cdll.rx_rows_matmul.restype = ctypes.c_int
    cdll.rx_rows_matmul.argtypes = [ctypes.POINTER(GgmlRowsOp), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    for ith in range(split):
        if cdll.rx_rows_matmul(ctypes.byref(op), x.data_ptr(), op.cols, x.shape[0], y.data_ptr(), op.rows, ith, split) != 0:
            raise MemoryError("the several-row kernel could not allocate its activation buffer")
    return y


def rows_op_address() -> int:
    """Address of the several-row custom op: dst [rows, T] from src[0] [cols, T]; userdata a `GgmlRowsOp`."""
    return _address(_loaded().rx_rows_ggml_op)
