"""The model file's own quantized weights, multiplied by ggml's CPU kernels (the ones llama.cpp runs).

ggml comes from the `ggml-py` package (its C library is built from source when it is installed, for
the CPU it is built on). That package's Python module declares ggml's structs as an older ggml laid
them out, so this module binds the few functions it needs itself, from the headers of the pinned
version, and checks the struct size against the library when it loads.

What runs in ggml: the linear products (`QuantLinear`: y = x @ W.T with W in the file's block format,
activations quantized per row by ggml as llama.cpp does) and embedding lookups (`QuantEmbedding`). Each
graph is built once per (weights, number of rows) and reused: a call sets two data pointers and runs
it on a persistent thread pool. Everything else in the forward pass (norms, RoPE, attention, the KV
cache, routes) stays in torch, unchanged.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from pathlib import Path

import torch

from viasd.errors import ViasdError

# enum ggml_type values the loader may meet (the GGUF's tensor types use the same numbers)
F32, F16, BF16, I32 = 0, 1, 30, 26
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME, GGML_MAX_N_THREADS = 4, 10, 64, 64, 512
_OBJECT_SIZE = 32  # sizeof(struct ggml_object)
_PLAN_CACHE_ROWS = 64  # graphs for up to this many rows are kept; longer (prefill) ones are built per call


class NativeWeightsUnavailable(ViasdError):
    """The ggml kernels cannot be loaded here (package missing or built for another CPU)."""


class _Tensor(ctypes.Structure):  # struct ggml_tensor (ggml.h of ggml-py 0.10.1)
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


_T = ctypes.POINTER(_Tensor)
_P = ctypes.c_void_p


def _library_dir() -> Path:
    spec = importlib.util.find_spec("ggml")
    if spec is None or not spec.submodule_search_locations:
        raise NativeWeightsUnavailable(
            "native weights need the ggml kernels (the ggml-py package, built at install): "
            "pip install 'ggml-py==0.10.1', or use --weights float32"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


class _Lib:
    """ctypes bindings of the ggml functions used here, and one thread pool for every graph."""

    def __init__(self, n_threads: int):
        libdir = _library_dir()
        try:
            base = ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
            cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise NativeWeightsUnavailable(f"the ggml library could not be loaded ({e}); reinstall ggml-py or use --weights float32") from None

        self._libs = (base, cpu)
        fn = self.fn
        self.tensor_overhead = fn("ggml_tensor_overhead", ctypes.c_size_t)
        if self.tensor_overhead() != ctypes.sizeof(_Tensor) + _OBJECT_SIZE:
            raise NativeWeightsUnavailable(
                f"the installed ggml library lays out its tensors differently from the version viasd binds "
                f"({self.tensor_overhead()} bytes, expected {ctypes.sizeof(_Tensor) + _OBJECT_SIZE}): "
                "install ggml-py==0.10.1, or use --weights float32"
            )
        self.init = fn("ggml_init", _P, _InitParams)
        self.free = fn("ggml_free", None, _P)
        self.graph_overhead_custom = fn("ggml_graph_overhead_custom", ctypes.c_size_t, ctypes.c_size_t, ctypes.c_bool)
        self.new_tensor_1d = fn("ggml_new_tensor_1d", _T, _P, ctypes.c_int, ctypes.c_int64)
        self.new_tensor_2d = fn("ggml_new_tensor_2d", _T, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        self.mul_mat = fn("ggml_mul_mat", _T, _P, _T, _T)
        self.get_rows = fn("ggml_get_rows", _T, _P, _T, _T)
        self.new_graph_custom = fn("ggml_new_graph_custom", _P, _P, ctypes.c_size_t, ctypes.c_bool)
        self.build_forward_expand = fn("ggml_build_forward_expand", None, _P, _T)
        self.row_size = fn("ggml_row_size", ctypes.c_size_t, ctypes.c_int, ctypes.c_int64)
        self.blck_size = fn("ggml_blck_size", ctypes.c_int64, ctypes.c_int)
        self.type_name = fn("ggml_type_name", ctypes.c_char_p, ctypes.c_int)
        self.graph_n_nodes = fn("ggml_graph_n_nodes", ctypes.c_int, _P)
        self.graph_node = fn("ggml_graph_node", _T, _P, ctypes.c_int)
        self.nbytes = fn("ggml_nbytes", ctypes.c_size_t, _T)
        # the ops of a decoder layer
        self.rms_norm = fn("ggml_rms_norm", _T, _P, _T, ctypes.c_float)
        self.mul = fn("ggml_mul", _T, _P, _T, _T)
        self.add = fn("ggml_add", _T, _P, _T, _T)
        self.cont = fn("ggml_cont", _T, _P, _T)
        self.swiglu_split = fn("ggml_swiglu_split", _T, _P, _T, _T)  # silu(a) * b
        self.geglu_split = fn("ggml_geglu_split", _T, _P, _T, _T)  # gelu_tanh(a) * b
        self.view_2d = fn("ggml_view_2d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t)
        self.view_3d = fn("ggml_view_3d", _T, _P, _T, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_size_t)
        self.rope_ext = fn("ggml_rope_ext", _T, _P, _T, _T, _T, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                           ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float)
        self.graph_plan = fn("ggml_graph_plan", _CPlan, _P, ctypes.c_int, _P)
        self.graph_compute = fn("ggml_graph_compute", ctypes.c_int, _P, ctypes.POINTER(_CPlan))
        fn("ggml_cpu_init", None)()
        params = fn("ggml_threadpool_params_default", _ThreadpoolParams, ctypes.c_int)(n_threads)
        self.n_threads = n_threads
        self.threadpool = fn("ggml_threadpool_new", _P, ctypes.POINTER(_ThreadpoolParams))(ctypes.byref(params))
        self.has = {name: bool(fn(f"ggml_cpu_has_{name}", ctypes.c_int)()) for name in ("avx2", "avx512", "avx512_bf16", "llamafile")}

    def fn(self, name: str, res, *args):
        """Bind a function of the library: fn(name, restype, *argtypes)."""
        lib = next(lib for lib in self._libs if hasattr(lib, name))
        f = getattr(lib, name)
        f.restype, f.argtypes = res, list(args)
        return f


_lib: _Lib | None = None
_lock = threading.Lock()


def lib() -> _Lib:
    """The bound library (loaded once; its thread pool has torch's thread count)."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _Lib(torch.get_num_threads())
        return _lib


def available() -> bool:
    try:
        lib()
        return True
    except NativeWeightsUnavailable:
        return False


def type_name(ggml_type: int) -> str:
    return lib().type_name(ggml_type).decode()


def row_bytes(ggml_type: int, n: int) -> int:
    return int(lib().row_size(ggml_type, n))


class _Arena:
    """Memory for the intermediate tensors of cached graphs. Graphs run one at a time (`RUN_LOCK`) and
    copy nothing out of it but their outputs, so every graph lays its intermediates out from the start
    of the same arena; a graph needing more than the arena holds gets a new, larger one (older graphs
    keep the one they were built on)."""

    def __init__(self):
        self.buffers = [torch.empty(0, dtype=torch.uint8)]  # the last is current; graphs still use the others

    def at_least(self, nbytes: int) -> int:
        if nbytes > self.buffers[-1].numel():
            self.buffers.append(torch.empty(max(nbytes, 2 * self.buffers[-1].numel()), dtype=torch.uint8))
        return self.buffers[-1].data_ptr()


_ARENA = _Arena()
RUN_LOCK = threading.Lock()  # one graph at a time: they share the arena and the thread pool


class _Graph:
    """One ggml graph over a no-alloc context, with its plan and work buffer; run() computes it.

    Leaves are bound to memory the caller owns (weights, norms, and the per-call inputs and outputs,
    rebound before each run); every other node gets a fixed place in an arena when the graph is
    finished: the shared one for graphs that are kept (`shared`), else one of its own.
    """

    def __init__(self, n_tensors: int, n_nodes: int = 16, shared: bool = True):
        g = lib()
        self._mem = torch.empty(n_tensors * g.tensor_overhead() + g.graph_overhead_custom(n_nodes, False) + 1024, dtype=torch.uint8)
        self.ctx = g.init(_InitParams(self._mem.numel(), self._mem.data_ptr(), True))
        self.graph = g.new_graph_custom(self.ctx, n_nodes, False)
        self.plan: _CPlan | None = None
        self._work: torch.Tensor | None = None
        self._shared = shared
        self._own: torch.Tensor | None = None

    def tensor(self, ggml_type: int, *ne: int) -> _T:
        g = lib()
        return g.new_tensor_1d(self.ctx, ggml_type, *ne) if len(ne) == 1 else g.new_tensor_2d(self.ctx, ggml_type, *ne)

    def f32(self, t: torch.Tensor) -> _T:
        """A leaf over a float32 torch tensor's memory (1-D or 2-D, contiguous; the caller keeps it alive)."""
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() > 2:
            raise ValueError("ggml leaves need contiguous 1-D or 2-D float32 tensors")
        leaf = self.tensor(F32, *reversed(t.shape))
        leaf.contents.data = t.data_ptr()
        return leaf

    def finish(self, *outputs: _T) -> None:
        g = lib()
        for out in outputs:
            g.build_forward_expand(self.graph, out)
        keep = {ctypes.addressof(o.contents) for o in outputs}
        nodes = [g.graph_node(self.graph, i) for i in range(g.graph_n_nodes(self.graph))]
        offsets, total = [], 0
        for node in nodes:  # bump allocation, 64-byte aligned, in execution order
            t = node.contents
            if t.view_src or ctypes.addressof(t) in keep:
                offsets.append(None)
                continue
            offsets.append(total)
            total += (g.nbytes(node) + 63) // 64 * 64
        if self._shared:
            base = _ARENA.at_least(total)
        else:
            self._own = torch.empty(max(total, 1), dtype=torch.uint8)
            base = self._own.data_ptr()
        for node, offset in zip(nodes, offsets):
            t = node.contents
            if offset is not None:
                t.data = base + offset
            elif t.view_src:
                src = ctypes.cast(t.view_src, _T).contents
                if not src.data:
                    raise ValueError("a view of a per-call input or output cannot be laid out ahead")
                t.data = src.data + t.view_offs
        self.plan = g.graph_plan(self.graph, g.n_threads, g.threadpool)
        self._work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = self._work.data_ptr()

    def run(self) -> None:
        with RUN_LOCK:
            status = lib().graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")

    def __del__(self):
        if _lib is not None and getattr(self, "ctx", None):
            _lib.free(self.ctx)
            self.ctx = None


class NativeTensor:
    """A 2-D weight in the file's format: `data` [rows, row_bytes] uint8, `ggml_type`, `cols` elements a row."""

    def __init__(self, data: torch.Tensor, ggml_type: int, cols: int):
        self.data, self.ggml_type, self.cols = data.contiguous(), int(ggml_type), int(cols)
        self.rows = self.data.shape[0]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != row_bytes(self.ggml_type, cols):
            raise ValueError(f"weight data {tuple(self.data.shape)} is not {self.rows} rows of {cols} {type_name(self.ggml_type)} values")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows_at(self, index: torch.Tensor) -> "NativeTensor":
        return NativeTensor(self.data.index_select(0, index), self.ggml_type, self.cols)

    @staticmethod
    def cat(parts: "list[NativeTensor]") -> "NativeTensor":
        return NativeTensor(torch.cat([p.data for p in parts]), parts[0].ggml_type, parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32, through ggml's own get_rows (the reference for tests and --weights float32)."""
        return QuantEmbedding(self)(torch.arange(self.rows))

    def _bind(self, graph: _Graph) -> _T:
        t = graph.tensor(self.ggml_type, self.cols, self.rows)
        t.contents.data = self.data.data_ptr()
        return t


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
        self._graphs: dict[int, tuple[_Graph, _T, list[_T]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def _build(self, n_rows: int) -> tuple[_Graph, _T, list[_T]]:
        graph = _Graph(n_tensors=2 * len(self.parts) + 1, shared=n_rows <= _PLAN_CACHE_ROWS)
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
        if n_rows <= _PLAN_CACHE_ROWS:
            self._graphs[n_rows] = built
        graph, xt, outs = built
        out = torch.empty(n_rows, self.out_features, dtype=torch.float32)
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
        graph = _Graph(n_tensors=3, shared=n <= _PLAN_CACHE_ROWS)
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
        if n <= _PLAN_CACHE_ROWS:
            self._graphs[n] = built
        graph, idt, y = built
        out = torch.empty(n, self.table.cols, dtype=torch.float32)
        idt.contents.data = ids.data_ptr()
        y.contents.data = out.data_ptr()
        graph.run()
        return out


_ROPE_NEOX = 2  # rotate-half RoPE, as transformers applies it to every family here


class NativeLayer:
    """The dense math of one decoder layer in the file's format, as ggml graphs: one graph from the
    layer input to the roped Q, K and V (norm, projections, bias, Q/K norms, RoPE), one from the
    attention output to the layer output (output projection, residual, MLP; or either part alone
    when a route skips the other). Attention and the KV cache stay with the runtime's forward pass.

    Every row is computed on its own (ggml's quantized products quantize and multiply each row
    separately), so a row's result does not depend on the other rows of its pass.
    """

    def __init__(self, layer, cfg, positions: torch.Tensor):
        self.layer, self.cfg = layer, cfg
        self.positions = positions  # [max_positions] int32: RoPE positions are a slice of it
        self.theta = cfg.rope_theta if layer.rope == 0 else cfg.rope_local_theta
        self.freq_scale = 1.0 / cfg.rope_factor if layer.rope == 0 else 1.0
        self._graphs: dict[tuple, tuple] = {}
        self._keep: list[torch.Tensor] = []  # torch memory the graphs' leaves point into

    # ---------------------------------------------------------------- building
    def _f32(self, graph: _Graph, t: torch.Tensor) -> _T:
        t = t.to(torch.float32).contiguous()
        self._keep.append(t)
        return graph.f32(t)

    def _segments(self, graph: _Graph, lin: QuantLinear, x: _T, sizes: list[int], n_rows: int) -> list[_T]:
        """The products of `lin` with x, cut into consecutive output segments of `sizes` rows (views
        into the part that holds each; a segment never straddles two parts), bias added."""
        g = lib()
        outs, segs, part_i, used = [g.mul_mat(graph.ctx, p._bind(graph), x) for p in lin.parts], [], 0, 0
        offset = 0
        for size in sizes:
            while used >= lin.parts[part_i].rows:
                part_i, used = part_i + 1, 0
            part, out = lin.parts[part_i], outs[part_i]
            if used + size > part.rows:
                raise ValueError("an output segment straddles two weight parts")
            seg = out if size == part.rows else g.view_2d(graph.ctx, out, size, n_rows, out.contents.nb[1], used * 4)
            if lin.bias is not None:
                seg = g.add(graph.ctx, seg, self._f32(graph, lin.bias[offset : offset + size]))
            segs.append(seg)
            used, offset = used + size, offset + size
        return segs

    def _norm(self, graph: _Graph, x: _T, weight: torch.Tensor) -> _T:
        g = lib()
        return g.mul(graph.ctx, g.rms_norm(graph.ctx, x, self.cfg.rms_eps), self._f32(graph, weight))

    def _heads(self, graph: _Graph, seg: _T, n_heads: int, n_rows: int, norm: torch.Tensor | None, pos: _T) -> _T:
        g, d = lib(), self.cfg.head_dim
        t = g.view_3d(graph.ctx, seg, d, n_heads, n_rows, d * 4, seg.contents.nb[1], 0)  # [T, heads, d]
        if norm is not None:
            t = self._norm(graph, t, norm)
        return g.rope_ext(graph.ctx, t, pos, None, d, _ROPE_NEOX, 0, self.theta, self.freq_scale, 0.0, 1.0, 32.0, 1.0)

    def _build_in(self, n_rows: int, shared: bool):
        g, cfg, layer = lib(), self.cfg, self.layer
        graph = _Graph(n_tensors=64, n_nodes=64, shared=shared)
        x, pos = graph.tensor(F32, cfg.hidden, n_rows), graph.tensor(I32, n_rows)
        h = self._norm(graph, x, layer.attn_norm)
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = self._segments(graph, layer.qkv, h, [nq, nkv, nkv], n_rows)
        q = self._heads(graph, q, cfg.n_heads, n_rows, layer.q_norm, pos)
        k = self._heads(graph, k, cfg.n_kv_heads, n_rows, layer.k_norm, pos)
        v = g.cont(graph.ctx, v)
        graph.finish(q, k, v)
        return graph, (x, pos), (q, k, v)

    def _build_out(self, n_rows: int, shared: bool, attn: bool, mlp: bool):
        g, cfg, layer = lib(), self.cfg, self.layer
        graph = _Graph(n_tensors=64, n_nodes=64, shared=shared)
        x = graph.tensor(F32, cfg.hidden, n_rows)
        inputs = [x]
        if attn:
            a_in = graph.tensor(F32, cfg.n_heads * cfg.head_dim, n_rows)
            inputs.append(a_in)
            (a,) = self._segments(graph, layer.o, a_in, [cfg.hidden], n_rows)
            if layer.post_attn_norm is not None:
                a = self._norm(graph, a, layer.post_attn_norm)
            x = g.add(graph.ctx, x, a)
        if mlp:
            h = self._norm(graph, x, layer.mlp_norm)
            gate, up = self._segments(graph, layer.gate_up, h, [cfg.intermediate, cfg.intermediate], n_rows)
            act = (g.swiglu_split if cfg.activation == "silu" else g.geglu_split)(graph.ctx, gate, up)
            (m,) = self._segments(graph, layer.down, act, [cfg.hidden], n_rows)
            if layer.post_mlp_norm is not None:
                m = self._norm(graph, m, layer.post_mlp_norm)
            x = g.add(graph.ctx, x, m)
        graph.finish(x)
        return graph, inputs, x

    def _get(self, key: tuple, n_rows: int, build):
        built = self._graphs.get(key)
        if built is None:
            built = build(n_rows, n_rows <= _PLAN_CACHE_ROWS)
            if n_rows <= _PLAN_CACHE_ROWS:
                self._graphs[key] = built
        return built

    # ---------------------------------------------------------------- calls
    def attn_in(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] at positions start.. -> q [T, n_heads, d], k and v [T, n_kv_heads, d] (q, k roped)."""
        cfg, n = self.cfg, x.shape[0]
        graph, (xt, pos), outs = self._get(("in", n), n, self._build_in)
        x = x.contiguous()
        q = torch.empty(n, cfg.n_heads, cfg.head_dim)
        k, v = torch.empty(n, cfg.n_kv_heads, cfg.head_dim), torch.empty(n, cfg.n_kv_heads, cfg.head_dim)
        xt.contents.data, pos.contents.data = x.data_ptr(), self.positions.data_ptr() + 4 * start
        for t, out in zip(outs, (q, k, v)):
            t.contents.data = out.data_ptr()
        graph.run()
        return q, k, v

    def out(self, x: torch.Tensor, attn: torch.Tensor | None, mlp: bool) -> torch.Tensor:
        """The layer's output from its input x [T, hidden]: + attention output `attn` [T, n_heads * d]
        through the output projection (when given), then + the MLP (when `mlp`)."""
        n = x.shape[0]
        key = ("out", n, attn is not None, mlp)
        graph, inputs, y = self._get(key, n, lambda rows, shared: self._build_out(rows, shared, attn is not None, mlp))
        x = x.contiguous()
        inputs[0].contents.data = x.data_ptr()
        if attn is not None:
            attn = attn.contiguous()
            inputs[1].contents.data = attn.data_ptr()
        out = torch.empty_like(x)
        y.contents.data = out.data_ptr()
        graph.run()
        return out
