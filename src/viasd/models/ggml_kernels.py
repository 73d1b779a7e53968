"""The model file's own quantized weights, multiplied by ggml's CPU kernels (the ones llama.cpp runs).

ggml comes from the `ggml-py` package (its C library is built from source when it is installed, for
the CPU it is built on). That package's Python module declares ggml's structs as an older ggml laid
them out, so this module binds the functions it needs itself, from the headers of the pinned version,
and checks the tensor layout against the library when it loads.

- `NativeTensor`: a 2-D weight as the file stores it (rows of quantized blocks).
- `QuantLinear` / `QuantEmbedding`: one product / one lookup as a small cached graph per row count
  (used on their own where a model is only partly native, and by the tests).
- `_Graph`: a ggml graph over memory the caller owns, its intermediates laid out once with liveness
  reuse; `models/ggml_forward.py` builds the whole forward pass as one of these.
- `NativeTensor.pack` / `matmul`: a weight laid out for viasd's row-exact batched kernel (a ggml custom
  op; models/rowexact.py) where the CPU runs it, else copied into one of ggml's extra buffer types
  for this CPU (AMX, CPU_REPACK: the same blocks, laid out for faster kernels, as llama.cpp loads
  them) and multiplied one row at a time (see `matmul`: either way every row's result is
  independent of its block).
Graphs run one at a time on one persistent thread pool (`RUN_LOCK`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading
from typing import TYPE_CHECKING, Any, TypeAlias
from pathlib import Path

import torch

from viasd import compute
from viasd.errors import ViasdError
from viasd.models import rowexact
from viasd.models.ggml_abi import (BF16, F16, F32, GGML_MAX_DIMS, GGML_MAX_N_THREADS, GGML_MAX_NAME, GGML_MAX_OP_PARAMS,  # noqa: F401
                                   GGML_MAX_SRC, I32, _OBJECT_SIZE, _CPlan, _InitParams, _Tensor, _ThreadpoolParams)

KEEP_GRAPH_ROWS = 64  # graphs for up to this many rows are kept; longer (prefill) ones are built per call


class NativeWeightsUnavailable(ViasdError):
    """The ggml kernels cannot be loaded here (package missing or built for another CPU)."""


if TYPE_CHECKING:
    _T: TypeAlias = ctypes._Pointer[_Tensor]  # a `ggml_tensor *`
else:
    _T = ctypes.POINTER(_Tensor)
_P = ctypes.c_void_p
_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LOG_WARN = 3  # enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT


def _log(level: int, text: bytes, _data) -> None:
    """ggml's log: warnings and errors to stderr; its debug lines (one per repacked tensor) dropped."""
    if level >= _LOG_WARN and text:
        sys.stderr.write(text.decode(errors="replace"))


def _library_dir() -> Path:
    spec = importlib.util.find_spec("ggml")
    if spec is None or not spec.submodule_search_locations:
        raise NativeWeightsUnavailable(
            "native weights need the ggml kernels (the ggml-py package, built at install): "
            "pip install 'ggml-py==0.10.1', or use --weights float32"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


# The functions bound, per area: attribute of `lib()` -> (C function, restype, *argtypes).
_GRAPH_FUNCTIONS: dict[str, tuple[Any, ...]] = {
    "init": ("ggml_init", _P, _InitParams),
    "free": ("ggml_free", None, _P),
    "graph_overhead_custom": ("ggml_graph_overhead_custom", ctypes.c_size_t, ctypes.c_size_t, ctypes.c_bool),
    "new_tensor_1d": ("ggml_new_tensor_1d", _T, _P, ctypes.c_int, ctypes.c_int64),
    "new_tensor_2d": ("ggml_new_tensor_2d", _T, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64),
    "new_tensor_3d": ("ggml_new_tensor_3d", _T, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64),
    "mul_mat": ("ggml_mul_mat", _T, _P, _T, _T),
    "get_rows": ("ggml_get_rows", _T, _P, _T, _T),
    "new_graph_custom": ("ggml_new_graph_custom", _P, _P, ctypes.c_size_t, ctypes.c_bool),
    "build_forward_expand": ("ggml_build_forward_expand", None, _P, _T),
    "row_size": ("ggml_row_size", ctypes.c_size_t, ctypes.c_int, ctypes.c_int64),
    "blck_size": ("ggml_blck_size", ctypes.c_int64, ctypes.c_int),
    "type_name": ("ggml_type_name", ctypes.c_char_p, ctypes.c_int),
    "graph_n_nodes": ("ggml_graph_n_nodes", ctypes.c_int, _P),
    "graph_node": ("ggml_graph_node", _T, _P, ctypes.c_int),
    "nbytes": ("ggml_nbytes", ctypes.c_size_t, _T),
    "graph_plan": ("ggml_graph_plan", _CPlan, _P, ctypes.c_int, _P),
    "graph_compute": ("ggml_graph_compute", ctypes.c_int, _P, ctypes.POINTER(_CPlan)),
}
_LAYER_OPS: dict[str, tuple[Any, ...]] = {  # the ops of a decoder layer
    "rms_norm": ("ggml_rms_norm", _T, _P, _T, ctypes.c_float),
    "mul": ("ggml_mul", _T, _P, _T, _T),
    "add": ("ggml_add", _T, _P, _T, _T),
    "cont": ("ggml_cont", _T, _P, _T),
    "swiglu_split": ("ggml_swiglu_split", _T, _P, _T, _T),  # silu(a) * b
    "geglu_split": ("ggml_geglu_split", _T, _P, _T, _T),  # gelu_tanh(a) * b
    "view_1d": ("ggml_view_1d", _T, _P, _T, ctypes.c_int64, ctypes.c_size_t),
    "view_2d": ("ggml_view_2d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t),
    "view_3d": ("ggml_view_3d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t,
                ctypes.c_size_t),
    "scale": ("ggml_scale", _T, _P, _T, ctypes.c_float),
    "concat": ("ggml_concat", _T, _P, _T, _T, ctypes.c_int),
    "permute": ("ggml_permute", _T, _P, _T, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int),
    "reshape_2d": ("ggml_reshape_2d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64),
    "set_rows": ("ggml_set_rows", _T, _P, _T, _T, _T),
    "flash_attn_ext": ("ggml_flash_attn_ext", _T, _P, _T, _T, _T, _T, ctypes.c_float, ctypes.c_float,
                       ctypes.c_float),
    "rope_ext": ("ggml_rope_ext", _T, _P, _T, _T, _T, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                 ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float),
    "reshape_3d": ("ggml_reshape_3d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64),
    "custom_4d": ("ggml_custom_4d", _T, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.POINTER(_T), ctypes.c_int, _P, ctypes.c_int, _P),
}
_BACKEND_FUNCTIONS: dict[str, tuple[Any, ...]] = {  # backend buffers: the extra buffer types that hold repacked weights
    "buft_name": ("ggml_backend_buft_name", ctypes.c_char_p, _P),
    "buft_alloc_buffer": ("ggml_backend_buft_alloc_buffer", _P, _P, ctypes.c_size_t),
    "buft_get_alloc_size": ("ggml_backend_buft_get_alloc_size", ctypes.c_size_t, _P, _T),
    "buffer_get_base": ("ggml_backend_buffer_get_base", _P, _P),
    "buffer_free": ("ggml_backend_buffer_free", None, _P),
    "tensor_alloc": ("ggml_backend_tensor_alloc", ctypes.c_int, _P, _T, _P),
    "tensor_set": ("ggml_backend_tensor_set", None, _T, _P, ctypes.c_size_t, ctypes.c_size_t),
    "dev_supports_op": ("ggml_backend_dev_supports_op", ctypes.c_bool, _P, _T),
}


class _Lib:
    """ctypes bindings of the ggml functions used here, and one thread pool for every graph."""

    if TYPE_CHECKING:  # the bindings are set from the function tables above, by name
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, n_threads: int):
        libdir = _library_dir()
        try:
            base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
            cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise NativeWeightsUnavailable(
                f"the ggml library could not be loaded ({e}); reinstall ggml-py or use --weights float32") from None

        self._libs = (base, cpu)
        self.tensor_overhead = self.fn("ggml_tensor_overhead", ctypes.c_size_t)
        if self.tensor_overhead() != ctypes.sizeof(_Tensor) + _OBJECT_SIZE:
            raise NativeWeightsUnavailable(
                f"the installed ggml library lays out its tensors differently from the version viasd binds "
                f"({self.tensor_overhead()} bytes, expected {ctypes.sizeof(_Tensor) + _OBJECT_SIZE}): "
                "install ggml-py==0.10.1, or use --weights float32"
            )
        for table in (_GRAPH_FUNCTIONS, _LAYER_OPS, _BACKEND_FUNCTIONS):
            for attr, (name, res, *args) in table.items():
                setattr(self, attr, self.fn(name, res, *args))
        self._start_cpu(n_threads)
        self._find_extra_buffer_types()

    def _start_cpu(self, n_threads: int) -> None:
        """ggml's CPU backend initialised: the thread pool, the CPU's features, the log callback."""
        fn = self.fn
        fn("ggml_cpu_init", None)()
        params = fn("ggml_threadpool_params_default", _ThreadpoolParams, ctypes.c_int)(n_threads)
        self.n_threads = n_threads
        self.threadpool = fn("ggml_threadpool_new", _P, ctypes.POINTER(_ThreadpoolParams))(ctypes.byref(params))
        self.has = {name: bool(fn(f"ggml_cpu_has_{name}", ctypes.c_int)())
                    for name in ("avx2", "avx512", "avx512_bf16", "amx_int8", "llamafile")}
        self._log_callback = _LogCallback(_log)  # kept alive: ggml calls it
        fn("ggml_log_set", None, _LogCallback, _P)(self._log_callback, None)

    def _find_extra_buffer_types(self) -> None:
        """The CPU device and the extra buffer types it offers for repacked weights."""
        fn = self.fn
        reg = fn("ggml_backend_cpu_reg", _P)()
        self.cpu_device = fn("ggml_backend_reg_dev_get", _P, _P, ctypes.c_size_t)(reg, 0)
        get_extra = fn("ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)(reg, b"ggml_backend_dev_get_extra_bufts")
        self.extra_buffer_types: list[tuple[str, int]] = []  # (name, buffer type), ggml's order of preference
        if get_extra:
            types = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(get_extra)(self.cpu_device)
            i = 0
            while types and types[i]:
                self.extra_buffer_types.append((self.buft_name(types[i]).decode(), types[i]))
                i += 1

    def fn(self, name: str, res, *args):
        """Bind a function of the library: fn(name, restype, *argtypes)."""
        lib = next(lib for lib in self._libs if hasattr(lib, name))
        f = getattr(lib, name)
        f.restype, f.argtypes = res, list(args)
        return f


_lib: _Lib | None = None
_lock = threading.Lock()


def lib() -> _Lib:
    """The bound library (loaded once; graphs are planned for every core (or VIASD_THREADS) and run
    on as many threads as `compute.budget()` gives them)."""
    global _lib
    with _lock:
        if _lib is None:
            b = compute.budget()
            _lib = _Lib(max(b.cores, b.fixed or 1))
        return _lib


def type_name(ggml_type: int) -> str:
    return lib().type_name(ggml_type).decode()


def row_bytes(ggml_type: int, n: int) -> int:
    return int(lib().row_size(ggml_type, n))


# One graph at a time: graphs share the thread pool, and a call binds its inputs and outputs to a
# cached graph before running it, so binding and running must not interleave between threads.
RUN_LOCK = threading.RLock()


def _addr(t: _T) -> int:
    return ctypes.addressof(t.contents)


class _Graph:
    """One ggml graph over a no-alloc context, with its plan, work buffer and memory; run() computes it.

    Leaves are bound to memory the caller owns: weights and norms once (`f32`, `NativeTensor._bind`),
    per-call inputs and outputs before each run (`bind`). Every other node gets a place in the
    graph's own buffer when it is finished, reused once the node is no longer read (liveness, in
    execution order, as ggml's graph allocator does); views point into what they view, and views
    of a per-call leaf (a KV cache written in place) are re-pointed by `bind`.
    """

    def __init__(self, n_tensors: int, n_nodes: int = 16, exact_attention: bool = False):
        g = lib()
        self.exact_attention = exact_attention
        self._mem = torch.empty(n_tensors * g.tensor_overhead() + g.graph_overhead_custom(n_nodes, False) + 1024, dtype=torch.uint8)
        self.ctx = g.init(_InitParams(self._mem.numel(), self._mem.data_ptr(), True))
        self.graph = g.new_graph_custom(self.ctx, n_nodes, False)
        self.plan: _CPlan | None = None
        self._work: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self._fixups: dict[int, list[tuple[_Tensor, int]]] = {}  # per-call leaf -> [(view, offset)]
        self._element_strides: list[_T] = []  # AMX row-batch products (see `matmul`)
        self._reshaped_outputs: dict[int, _T] = {}  # output (a reshape) -> the node it reshapes
        self.keep: list = []  # the ops' userdata structs, alive as long as the graph

    def tensor(self, ggml_type: int, *ne: int) -> _T:
        g = lib()
        make = {1: g.new_tensor_1d, 2: g.new_tensor_2d, 3: g.new_tensor_3d}[len(ne)]
        return make(self.ctx, ggml_type, *ne)

    def f32(self, t: torch.Tensor) -> _T:
        """A leaf over a float32 torch tensor's memory (1-D or 2-D, contiguous; the caller keeps it alive)."""
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() > 2:
            raise ValueError("ggml leaves need contiguous 1-D or 2-D float32 tensors")
        leaf = self.tensor(F32, *reversed(t.shape))
        leaf.contents.data = t.data_ptr()
        return leaf

    def finish(self, *outputs: _T, expand: tuple[_T, ...] = ()) -> None:
        """Close the graph on `outputs` (bound per call) and lay out its intermediate nodes.
        `expand`: nodes to run, in this order, before anything the outputs need (KV cache writes)."""
        g = lib()
        for t in (*expand, *outputs):
            g.build_forward_expand(self.graph, t)
        nodes = [g.graph_node(self.graph, i) for i in range(g.graph_n_nodes(self.graph))]
        per_call = self._per_call(outputs)
        offsets, top = _lay_out(nodes, per_call)
        self._buffer = torch.empty(max(top, 1), dtype=torch.uint8)
        base = self._buffer.data_ptr()
        for node in nodes:
            t = node.contents
            if ctypes.addressof(t) in offsets:
                t.data = base + offsets[ctypes.addressof(t)]
        self._point_views(nodes)
        for t in self._element_strides:
            # ggml-py 0.10.1's AMX kernel adds a batch's byte offset to a float pointer: its output's
            # batch stride is given in floats, now that its memory is laid out by the byte size
            t.contents.nb[2] //= 4
            t.contents.nb[3] //= 4
        self._plan()

    def _per_call(self, outputs: tuple[_T, ...]) -> set[int]:
        """Addresses of the nodes bound per call: the outputs, and the node each reshaping output
        reshapes (it writes where the output is bound)."""
        g = lib()
        per_call = {_addr(o) for o in outputs}
        for o in outputs:
            if o.contents.view_src:
                if o.contents.view_offs or g.nbytes(o) != g.nbytes(ctypes.cast(o.contents.view_src, _T)):
                    raise ValueError("a graph output may only be a node or a whole reshape of one")
                self._reshaped_outputs[_addr(o)] = ctypes.cast(o.contents.view_src, _T)
                per_call.add(o.contents.view_src)
        return per_call

    def _point_views(self, nodes: list[_T]) -> None:
        """Views point into what they view; those of a per-call leaf are re-pointed by `bind`."""
        for node in nodes:
            t = node.contents
            if t.view_src:
                src = ctypes.cast(t.view_src, _T).contents
                if src.data:
                    t.data = src.data + t.view_offs
                else:  # a view of a per-call leaf
                    self._fixups.setdefault(t.view_src, []).append((t, t.view_offs))

    def _plan(self) -> None:
        """ggml's plan for every thread of the pool, and its work buffer."""
        g = lib()
        self.plan = g.graph_plan(self.graph, g.n_threads, g.threadpool)
        self.planned_threads = g.n_threads
        # ggml's reference flash attention: each (query row, head) over the keys in order, whatever the
        # other rows (its split-KV path for one row and its tiled path for many sum in other orders)
        self.plan.use_ref = self.exact_attention
        self._work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = self._work.data_ptr()

    def bind(self, leaf: _T, ptr: int) -> None:
        """Point a per-call leaf (or output) at `ptr`, and the views of it with it."""
        leaf.contents.data = ptr
        if (node := self._reshaped_outputs.get(_addr(leaf))) is not None:
            node.contents.data = ptr
        for view, offset in self._fixups.get(_addr(leaf), ()):
            view.data = ptr + offset

    def run(self) -> None:
        assert self.plan is not None, "run before finish"
        with RUN_LOCK:
            # the threads the machine leaves free now; a plan for more threads has room for fewer
            self.plan.n_threads = min(compute.budget().apply(), self.planned_threads)
            status = lib().graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")

    def __del__(self):
        if _lib is not None and getattr(self, "ctx", None):
            _lib.free(self.ctx)
            self.ctx = None


def _last_uses(nodes: list[_T]) -> dict[int, int]:
    """Root tensor (a view's is what it views) -> index of the last node that writes or reads it."""
    root = lambda t: t.view_src or ctypes.addressof(t)  # noqa: E731  (view_src is always the root)
    last_use: dict[int, int] = {}
    for j, node in enumerate(nodes):
        t = node.contents
        last_use[root(t)] = max(last_use.get(root(t), j), j)
        for src in t.src:
            if src:
                r = root(ctypes.cast(src, _T).contents)
                last_use[r] = max(last_use.get(r, j), j)
    return last_use


def _lay_out(nodes: list[_T], per_call: set[int]) -> tuple[dict[int, int], int]:
    """(node address -> offset in the graph's buffer, the buffer's size) for every node that needs
    memory of its own (not a view, not bound per call, not already placed): each node's place is
    reused once it is read for the last time, in execution order."""
    g = lib()
    last_use = _last_uses(nodes)
    arena = _Arena()
    offsets: dict[int, int] = {}
    live: dict[int, tuple[int, int]] = {}  # root -> (offset, size) while it is still read
    for j, node in enumerate(nodes):
        t = node.contents
        a = ctypes.addressof(t)
        if not t.view_src and a not in per_call and not t.data:
            size = (g.nbytes(node) + 63) // 64 * 64
            offsets[a] = arena.alloc(size)
            live[a] = (offsets[a], size)
        for r in [r for r in live if last_use.get(r, -1) <= j]:  # read for the last time by node j
            arena.release(*live.pop(r))
    return offsets, arena.top


class _Arena:
    """First-fit blocks of one buffer: `top` its size so far, `free` its released (offset, size)
    blocks, sorted by offset, neighbours merged."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.top = 0

    def alloc(self, size: int) -> int:
        free = self.free
        for i, (off, sz) in enumerate(free):
            if sz >= size:
                free[i : i + 1] = [(off + size, sz - size)] if sz > size else []
                return off
        self.top += size
        return self.top - size

    def release(self, off: int, size: int) -> None:
        free = self.free
        free.append((off, size))
        free.sort()
        merged = [free[0]]
        for o, sz in free[1:]:
            if merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((o, sz))
        free[:] = merged


class NativeTensor:
    """A 2-D weight in the file's format: `data` [rows, row_bytes] uint8, `ggml_type`, `cols` elements a row."""

    def __init__(self, data: torch.Tensor, ggml_type: int, cols: int):
        self.data, self.ggml_type, self.cols = data.contiguous(), int(ggml_type), int(cols)
        self.rows = self.data.shape[0]
        self.packed: _Packed | None = None  # a copy in an extra buffer type (`pack`)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != row_bytes(self.ggml_type, cols):
            raise ValueError(f"weight data {tuple(self.data.shape)} is not {self.rows} rows of {cols} {type_name(self.ggml_type)} values")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows_at(self, index: torch.Tensor) -> NativeTensor:
        return NativeTensor(self.data.index_select(0, index), self.ggml_type, self.cols)

    @staticmethod
    def cat(parts: list[NativeTensor]) -> NativeTensor:
        return NativeTensor(torch.cat([p.data for p in parts]), parts[0].ggml_type, parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32, through ggml's own get_rows (the reference for tests and --weights float32)."""
        return QuantEmbedding(self)(torch.arange(self.rows))

    def _bind(self, graph: _Graph) -> _T:
        t = graph.tensor(self.ggml_type, self.cols, self.rows)
        t.contents.data = self.data.data_ptr()
        return t

    def pack(self, allowed: tuple[str, ...] | None = None, row_exact: bool = True) -> str | None:
        """Lay the weight out for a faster kernel. First choice (`row_exact`): viasd's row-exact
        batched kernel (`ROW_EXACT`, models/rowexact.py), where this CPU runs it (AVX-512 VNNI or AVX2)
        and it takes the type and shape. Else the first of ggml's extra buffer types here that
        multiplies it (AMX, then CPU_REPACK), as llama.cpp does when it loads a model: the same blocks,
        rearranged for that CPU's kernels; not into one measured slower for its type
        (`_SLOWER_PACKED`) unless `allowed` names the kinds to try. With the default choice
        (`row_exact`, no `allowed`), Q4_K weights in CPU_REPACK and Q6_K weights left plain are
        multiplied by viasd's several-row kernels over ggml's layouts (`_rows_op`: each row what
        ggml's one-row kernel gives it; "+rows" in the kind's name).
        Returns the kind's name, or None (kept plain). The plain bytes stay (embedding lookups and
        `dequantize` read them)."""
        if self.packed is not None:
            return self.packed.label
        g = lib()
        wanted = row_exact if allowed is None else ROW_EXACT in allowed
        rows = row_exact and allowed is None  # the several-row kernels over ggml's layouts
        if wanted and self.ggml_type in rowexact.TYPES and self.rows % 16 == 0 and rowexact.available():
            return self._pack_row_exact()
        for name, buft in g.extra_buffer_types:
            if name not in allowed if allowed is not None else self.ggml_type in _SLOWER_PACKED.get(name, ()):
                continue
            if self._pack_into(name, buft, rows):
                assert self.packed is not None  # (set by _pack_into)
                return self.packed.label
        # Q6_K, which ggml keeps plain here: its one-row results, several rows at a time
        if self.ggml_type == Q6_K and rows and (op := _rows_op(self, rowexact.ROWS_Q6K, self.data.data_ptr())):
            self.packed = _Packed("plain", None)
            self.packed.rows_op = op
            return self.packed.label
        return None

    def _pack_into(self, name: str, buft: int, rows: bool) -> bool:
        """Lay the weight out in ggml's extra buffer type `buft` (`name`), if that type multiplies it
        by a row batch; whether it did. `rows`: Q4_K in CPU_REPACK through the several-row kernel."""
        g = lib()
        mem = torch.empty(4 * g.tensor_overhead() + 1024, dtype=torch.uint8)
        ctx = g.init(_InitParams(mem.numel(), mem.data_ptr(), True))
        w = g.new_tensor_2d(ctx, self.ggml_type, self.cols, self.rows)
        # does this type multiply `w` (its type and shape) by a row batch? asked as llama.cpp asks:
        # a product whose weight sits in an empty buffer of the type
        probe = g.mul_mat(ctx, w, g.new_tensor_3d(ctx, F32, self.cols, 1, 2))
        dummy = g.buft_alloc_buffer(buft, 0)
        w.contents.buffer = dummy
        ok = bool(dummy) and g.dev_supports_op(g.cpu_device, probe)
        w.contents.buffer = None
        if dummy:
            g.buffer_free(dummy)
        if not ok:
            g.free(ctx)
            return False
        buffer = g.buft_alloc_buffer(buft, g.buft_get_alloc_size(buft, w))
        if not buffer or g.tensor_alloc(buffer, w, g.buffer_get_base(buffer)) != 0:
            g.free(ctx)
            raise MemoryError(f"ggml could not allocate {name} memory for a {self.rows}x{self.cols} weight")
        g.tensor_set(w, self.data.data_ptr(), 0, self.nbytes)  # converts to the type's layout
        # one weight for every row of a batch: its batch strides are 0 (the AMX kernel offsets the
        # weight by batch index times these; ggml only reads them for dims of size 1 otherwise)
        w.contents.nb[2] = w.contents.nb[3] = 0
        self.packed = _Packed(name, w, mem, ctx, buffer)
        if name == "CPU_REPACK" and self.ggml_type == Q4_K and rows:
            self.packed.rows_op = _rows_op(self, rowexact.ROWS_Q4K8, w.contents.data)
        return True

    def _pack_row_exact(self) -> str:
        self.packed = _Packed(ROW_EXACT, rowexact.RowExactWeight(self.ggml_type, self.data, self.rows, self.cols))
        return ROW_EXACT


# weight types a buffer type holds but multiplies more slowly one row at a time than the plain kernel
# (`python benchmarks/pack_types.py` measures it)
_SLOWER_PACKED = {"AMX": (14,)}  # Q6_K


ROW_EXACT = "ROW_EXACT"  # viasd's own row-exact batched kernel (models/rowexact.py)
Q4_K, Q6_K = 12, 14
_rows_checks: dict[int, bool] = {}  # kind -> whether the several-row kernel gave ggml's products here


def _rows_op(w: NativeTensor, kind: int, data_ptr: int) -> rowexact.GgmlRowsOp | None:
    """The several-row kernel for a weight in one of ggml's layouts (`rowexact.GgmlRowsOp`: every row
    what ggml's one-row kernel gives it, each extra row at a fraction of a one-row pass), or None
    where it cannot run or, checked on the first such weight of the process, does not give ggml's
    products bit for bit (another ggml build or layout): the weight then keeps ggml's products."""
    if rowexact.rows_unavailable_reason() is not None or w.cols % 256 or w.rows % 8:
        return None
    quantize = ctypes.cast(lib().fn("quantize_row_q8_K", None), ctypes.c_void_p).value
    op = rowexact.rows_op(kind, data_ptr, w.rows, w.cols, quantize)
    if kind not in _rows_checks:
        x = torch.randn(3, w.cols, generator=torch.Generator().manual_seed(0))
        ref = torch.cat([ggml_product(w, x[i : i + 1]) for i in range(3)])  # one row at a time
        _rows_checks[kind] = torch.equal(rowexact.rows_matmul(op, x), ref)
    return op if _rows_checks[kind] else None


def ggml_product(w: NativeTensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, cols] through `w` as it is packed now (`matmul`, as the forward graph multiplies it), in a
    graph of its own (checks, tests)."""
    graph = _Graph(8)
    xt = graph.tensor(F32, w.cols, x.shape[0])
    y = matmul(graph, w, xt, x.shape[0])
    graph.finish(y)
    out = torch.empty(x.shape[0], w.rows)
    graph.bind(xt, x.data_ptr())
    graph.bind(y, out.data_ptr())
    graph.run()
    return out


class _Packed:
    """A weight tensor in an extra buffer (its own context and buffer, freed with it), or a weight
    in the row-exact kernel's layout (`tensor` is then a `rowexact.RowExactWeight`)."""

    def __init__(self, kind: str, tensor, mem: torch.Tensor | None = None, ctx: int | None = None, buffer: int | None = None):
        self.kind, self.tensor, self._mem, self._ctx, self._buffer = kind, tensor, mem, ctx, buffer
        self.rows_op: rowexact.GgmlRowsOp | None = None  # viasd's several-row kernel over ggml's layout (`_rows_op`)

    @property
    def label(self) -> str:
        """The kind, as records count it ("CPU_REPACK+rows", "plain+rows": multiplied by `rows_op`)."""
        return self.kind + "+rows" if self.rows_op is not None else self.kind

    def __del__(self):
        if _lib is not None and self._buffer:
            _lib.buffer_free(self._buffer)
            _lib.free(self._ctx)
            self._buffer = None


def fusable(w: NativeTensor) -> bool:
    """Whether `matmul` can take the input's RMS norm and a residual into the product (`fused_matmul`)."""
    return w.packed is not None and w.packed.kind == ROW_EXACT


def fused_matmul(graph: _Graph, w: NativeTensor, x: _T, n_rows: int, norm: torch.Tensor | None, eps: float,
                 residual: _T | None) -> _T:
    """`residual + W (rms_norm(x, eps) * norm)` as one op (either part optional: norm None, residual
    None), with ggml's float operations for both, on the row-exact kernel (`fusable(w)`): the two
    threads meet once instead of three or five times. `norm`: float32, contiguous, kept alive by
    the caller."""
    return _fused(graph, w, x, n_rows, norm, eps, residual)[0]


def fused_head(graph: _Graph, w: NativeTensor, x: _T, n_rows: int, norm: torch.Tensor | None,
               eps: float) -> tuple[_T, rowexact.RowMaxima | None]:
    """`fused_matmul` without a residual, for an LM head: also each row's first maximum, found as the
    logits are written (`rowexact.RowMaxima`; None for more rows than it tracks)."""
    out, op = _fused(graph, w, x, n_rows, norm, eps, None)
    if n_rows > rowexact.BEST_ROWS:
        return out, None
    maxima = rowexact.RowMaxima(op, n_rows)
    graph.keep.append(maxima)
    return out, maxima


def _fused(graph: _Graph, w: NativeTensor, x: _T, n_rows: int, norm: torch.Tensor | None, eps: float,
           residual: _T | None) -> tuple[_T, rowexact.FusedOp]:
    assert w.packed is not None  # (a row-exact weight: `_fuses`)
    op = rowexact.FusedOp(ctypes.addressof(w.packed.tensor.op), None if norm is None else norm.data_ptr(), eps,
                          int(residual is not None))
    graph.keep.append(op)
    args = (_T * 2)(x, residual) if residual is not None else (_T * 1)(x)
    return lib().custom_4d(graph.ctx, F32, w.rows, n_rows, 1, 1, args, len(args), rowexact.fused_op_address(), -1,
                           ctypes.addressof(op)), op


def matmul(graph: _Graph, w: NativeTensor, x: _T, n_rows: int) -> _T:
    """x [in, T] through weight `w`: [w.rows, T] (ggml's mul_mat).

    A packed weight multiplies the rows as a batch of T one-row products ([in, 1, T]): its kernels
    take other paths for several rows (AMX tiles, 4-row repacked GEMMs) that sum in another order than
    their one-row path, so a row would come out differently in a block of drafts than decoded alone.
    One-row products give every row the same result in any block (and the one-row kernels are the
    fast ones: decoding is one row). Plain weights compute every row alike at any row count. A weight
    with a several-row kernel (`_Packed.rows_op`) gets the one-row results for all its rows in one
    op that reads each weight once for 8 rows.
    """
    g = lib()
    if w.packed is None:
        return g.mul_mat(graph.ctx, w._bind(graph), x)
    if w.packed.kind == ROW_EXACT:  # every row alike by construction: one op for the whole block
        args = (_T * 1)(x)
        return g.custom_4d(graph.ctx, F32, w.rows, n_rows, 1, 1, args, 1, rowexact.op_address(), -1,
                           ctypes.addressof(w.packed.tensor.op))
    if w.packed.rows_op is not None:  # ggml's one-row results, the rows sharing each weight load
        args = (_T * 1)(x)
        return g.custom_4d(graph.ctx, F32, w.rows, n_rows, 1, 1, args, 1, rowexact.rows_op_address(), -1,
                           ctypes.addressof(w.packed.rows_op))
    rows = g.reshape_3d(graph.ctx, x, w.cols, 1, n_rows)
    y = g.mul_mat(graph.ctx, w.packed.tensor, rows)  # [w.rows, 1, T]
    if w.packed.kind == "AMX" and n_rows > 1:
        graph._element_strides.append(y)
    return g.reshape_2d(graph.ctx, y, w.rows, n_rows)


class QuantLinear:
    """y = x @ W.T (+ b) for weights in the file's format: one ggml product per part, one graph per call.

    `parts` are stacked along the output: W = cat(parts). Parts of one type are merged into one product
    when built; parts of different types (a Q4_K_M file keeps some in Q6_K) write side by side into one
    output row. x: [T, in] float32 -> [T, out] float32.
    """

    def __init__(self, parts: list[NativeTensor], bias: torch.Tensor | None = None):
        merged: list[NativeTensor] = []
        for p in parts:
            if merged and merged[-1].ggml_type == p.ggml_type:
                merged[-1] = NativeTensor.cat([merged[-1], p])
            else:
                merged.append(p)
        if len({p.cols for p in merged}) != 1:
            raise ValueError("parts of one linear layer must share their input size")
        self.parts = merged
        self.in_features, self.out_features = merged[0].cols, sum(p.rows for p in merged)
        self.bias = bias
        self._graphs: dict[int, tuple[_Graph, _T, list[tuple[_T, int]]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _build(self, n_rows: int) -> tuple[_Graph, _T, list[tuple[_T, int]]]:  # its outputs: (tensor, byte offset)
        graph = _Graph(n_tensors=2 * len(self.parts) + 1)
        x = graph.tensor(F32, self.in_features, n_rows)
        outs, offset = [], 0
        for p in self.parts:
            y = lib().mul_mat(graph.ctx, p._bind(graph), x)  # [n_rows, p.rows] written at column `offset`
            y.contents.nb[1] = self.out_features * 4
            y.contents.nb[2] = y.contents.nb[3] = self.out_features * 4 * n_rows
            outs.append((y, offset * 4))
            offset += p.rows
        graph.finish(*(y for y, _ in outs))
        return graph, x, outs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        n_rows = x.shape[0]
        built = self._graphs.get(n_rows) or self._build(n_rows)
        if n_rows <= KEEP_GRAPH_ROWS:
            self._graphs[n_rows] = built
        graph, xt, outs = built
        out = torch.empty(n_rows, self.out_features, dtype=torch.float32)
        with RUN_LOCK:
            xt.contents.data = x.data_ptr()
            base = out.data_ptr()
            for y, offset in outs:
                y.contents.data = base + offset
            graph.run()
        if self.bias is not None:
            out += self.bias
        return out.view(*shape[:-1], self.out_features)


class QuantEmbedding:
    """Rows of a table in the file's format, dequantized by ggml: ids [T] -> [T, cols] float32."""

    def __init__(self, table: NativeTensor):
        self.table = table
        self._graphs: dict[int, tuple[_Graph, _T, _T]] = {}

    def _build(self, n: int) -> tuple[_Graph, _T, _T]:
        graph = _Graph(n_tensors=3)
        ids = graph.tensor(I32, n)
        y = lib().get_rows(graph.ctx, self.table._bind(graph), ids)
        graph.finish(y)
        return graph, ids, y

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1).to(torch.int32).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.table.rows):
            raise IndexError(f"token id out of range [0, {self.table.rows})")
        n = ids.numel()
        built = self._graphs.get(n) or self._build(n)
        if n <= KEEP_GRAPH_ROWS:
            self._graphs[n] = built
        graph, idt, y = built
        out = torch.empty(n, self.table.cols, dtype=torch.float32)
        with RUN_LOCK:
            idt.contents.data = ids.data_ptr()
            y.contents.data = out.data_ptr()
            graph.run()
        return out

