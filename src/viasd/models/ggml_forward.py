"""The forward pass of a decoder with native weights, as one ggml graph.

The same pass as `decoder.Decoder.forward` (the same family switches, routes and KV-cache invariant,
which `Decoder.forward` checks before and records after calling this), built with ggml's ops so that a
decoding step is one call into C instead of some twenty torch ops a layer: embedding lookup (and
Gemma's scale), per layer the norm, the Q/K/V products (+ bias), Q/K norms, RoPE, the writes of K and
V into the cache at their positions, attention, the output projection, the MLP, the residuals and
Gemma's extra norms; then the final norm and the LM head. On the row-exact kernel a product's input
norm and the residual sum after it run inside the product's op (`gk.fused_matmul`).

Graphs are built per (rows, route, last_only, cache length, first layer, layer whose incoming
stream is stored, with or without logits, LM head) and kept (a few dozen: decoding uses a handful
of block sizes, and batches of several requests' rows). Nothing in a graph depends on
the position: token ids, RoPE positions, the cache rows to write and the attention masks are
inputs, so one graph serves every step.

Batch invariance: every op computes each row on its own (the products on row-exact kernels), and
attention in decoding passes (viasd's row-exact op, `rowexact.attention_op_address`, else ggml's
reference flash attention) runs each query row over exactly the keys its mask leaves visible, in order. A row's result is
therefore the same whether it is decoded alone or inside a block of drafts, which is what lets every lossless strategy equal
`ar` token for token.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from viasd.models import ggml_kernels as gk
from viasd.models import rowexact
from viasd.models.ggml_kernels import F32, I32, QuantLinear, lib
from viasd.models.kvcache import ROW_ATTENTION_MAX, KVCache, LayerMask
from viasd.models.logits import PassOutput

if TYPE_CHECKING:  # annotations only: the decoder builds its graph from here
    from viasd.models.decoder import Decoder

F16, I64 = 1, 27
_ROPE_NEOX = 2  # rotate-half RoPE, as transformers applies it to every family here
_KEEP_GRAPHS = 48
_KEEP_GRAPH_ROWS = 128  # graphs of up to this many rows in all are kept (a batch of requests' rounds)
_CACHE_ALIGN = 256  # native caches are allocated in multiples of this many positions (fewer graphs)
_MASK_TABLE_MAX = 4096  # cache lengths up to this keep a whole causal mask (32 MB at most)


def supports(decoder: Decoder) -> bool:
    """Whether every product of `decoder` runs on native weights (then the whole pass can be a graph)."""
    return isinstance(decoder.lm_head, QuantLinear) and isinstance(decoder.embed, gk.QuantEmbedding) and all(
        isinstance(lin, QuantLinear) for layer in decoder.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


def cache_length(n: int, max_positions: int) -> int:
    return min(max_positions, -(-n // _CACHE_ALIGN) * _CACHE_ALIGN)


class NativeForward:
    """`decoder.forward` for native weights: logits [T, V] (or [1, V] with last_only) of `tokens` at
    positions start.., reading and writing `cache` along `route` (None: every layer)."""

    def __init__(self, decoder: Decoder, pack: bool | str = True, attention: str | None = None):
        self.dec = decoder
        cfg = decoder.config
        self.build_s = 0.0  # seconds spent building graphs (once per shape: `execution.timing.PassTimer` leaves them out)
        # the products' weights laid out for a faster kernel where this CPU has one for them
        # (`ggml_kernels.NativeTensor.pack`: viasd's row-exact kernel, else ggml's extra buffer types;
        # pack="ggml": ggml's only; pack="row-exact": the default choice, by name); the
        # embedding table is looked up from the plain bytes
        self.packed: dict[str, int] = {}  # buffer type (or "plain") -> weights
        self._pack = pack
        linears = [lin for layer in decoder.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [decoder.lm_head]
        self.pack_parts(*cast(list[QuantLinear], linears))  # (a native decoder's products are all the file's blocks)
        # decoding passes attend with viasd's row-exact op where the products run on the row-exact kernel
        # and the CPU has AVX-512 or AVX2 (`rowexact.attention_op_address`), else with ggml's reference flash
        # attention; attention="ggml" / "row-exact" asks for one (tests compare them)
        usable = rowexact.attention_unavailable_reason(cfg.head_dim) is None
        if attention is None:
            attention = "row-exact" if usable and gk.ROW_EXACT in self.packed else "ggml"
        elif attention == "row-exact" and not usable:
            raise gk.NativeWeightsUnavailable(rowexact.attention_unavailable_reason(cfg.head_dim))
        self.attention = attention
        self._attn_params = rowexact.AttentionParams.of(
            cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5, cfg.attn_softcap)
        self.pos32 = torch.arange(cfg.max_positions, dtype=torch.int32)
        self.pos64 = torch.arange(cfg.max_positions, dtype=torch.int64)
        self._ids32 = np.zeros(ROW_ATTENTION_MAX, dtype=np.int32)  # a pass' token ids (bound while it runs)
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._keep: list[torch.Tensor] = []  # float copies the graphs' leaves point into (norms, biases)
        self._mask_tables: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # cache length -> masks

    @property
    def _table(self) -> gk.NativeTensor:
        """The embedding table: a native decoder's is the file's blocks."""
        return cast(gk.QuantEmbedding, self.dec.embed).table

    def pack_parts(self, *linears: QuantLinear, count: bool = True) -> None:
        """Lay the weights of `linears` out for this CPU's kernels, as chosen at construction (each
        part once; `count`: tallied in `packed`)."""
        pack = self._pack
        for p in {id(p): p for lin in linears for p in lin.parts}.values():
            kind = (p.pack(row_exact=pack != "ggml") if pack else None) or "plain"
            if count:
                self.packed[kind] = self.packed.get(kind, 0) + 1

    # ------------------------------------------------------------------ building blocks
    def _f32(self, graph: gk._Graph, t: torch.Tensor) -> gk._T:
        return graph.f32(self._keep_f32(t))

    def _keep_f32(self, t: torch.Tensor) -> torch.Tensor:
        """A float32 contiguous copy of `t` (a norm, a bias) that lives as long as this object."""
        t = t.to(torch.float32).contiguous()
        self._keep.append(t)
        return t

    def _norm(self, graph: gk._Graph, x: gk._T, weight: torch.Tensor) -> gk._T:
        g = lib()
        return g.mul(graph.ctx, g.rms_norm(graph.ctx, x, self.dec.config.rms_eps), self._f32(graph, weight))

    def _fuses(self, lin: QuantLinear, residual: bool = False) -> bool:
        """Whether `lin`'s products can take their input's norm (and, `residual`, the sum after them)."""
        return all(gk.fusable(p) for p in lin.parts) and (not residual or (len(lin.parts) == 1 and lin.bias is None))

    def _normed(self, graph: gk._Graph, lin: QuantLinear, x: gk._T, norm: torch.Tensor, sizes: list[int],
                n_rows: int) -> list[gk._T]:
        """`_segments` of rms_norm(x) * norm, the norm fused into the products where they allow it."""
        if self._fuses(lin):
            return self._segments(graph, lin, x, sizes, n_rows, norm=norm)
        return self._segments(graph, lin, self._norm(graph, x, norm), sizes, n_rows)

    def _residual(self, graph: gk._Graph, lin: QuantLinear, h: gk._T, x: gk._T, post_norm: torch.Tensor | None,
                  n_rows: int) -> gk._T:
        """x + post_norm(lin(h)) (a sub-layer's output added to the stream), the sum fused into the
        product where it allows it (no post norm: Gemma's sits between the two)."""
        hidden = [self.dec.config.hidden]
        if post_norm is None and self._fuses(lin, residual=True):
            return self._segments(graph, lin, h, hidden, n_rows, residual=x)[0]
        (out,) = self._segments(graph, lin, h, hidden, n_rows)
        if post_norm is not None:
            out = self._norm(graph, out, post_norm)
        return lib().add(graph.ctx, x, out)

    def _segments(self, graph: gk._Graph, lin: QuantLinear, x: gk._T, sizes: list[int], n_rows: int,
                  norm: torch.Tensor | None = None, residual: gk._T | None = None) -> list[gk._T]:
        """x through `lin`, cut into consecutive output segments of `sizes` rows (views into the part
        holding each; a segment never straddles two parts), bias added: [size, n_rows] each. With
        `norm` / `residual` (where `_fuses(lin)`): rms_norm(x) * norm in, residual + out, fused."""
        g = lib()
        if norm is not None or residual is not None:
            w = None if norm is None else self._keep_f32(norm)
            outs = [gk.fused_matmul(graph, p, x, n_rows, w, self.dec.config.rms_eps, residual) for p in lin.parts]
        else:
            outs = [gk.matmul(graph, p, x, n_rows) for p in lin.parts]
        segs, part_i, used, offset = [], 0, 0, 0
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

    def _heads(self, graph: gk._Graph, seg: gk._T, n_heads: int, n_rows: int, norm: torch.Tensor | None,
               pos: gk._T | None, theta: float, freq_scale: float) -> gk._T:
        """[n_heads * d, T] -> [d, n_heads, T], per-head norm and RoPE applied (when given)."""
        g, d = lib(), self.dec.config.head_dim
        t = g.view_3d(graph.ctx, seg, d, n_heads, n_rows, d * 4, seg.contents.nb[1], 0)
        if norm is not None:
            t = self._norm(graph, t, norm)
        if pos is None:
            return t
        return g.rope_ext(graph.ctx, t, pos, None, d, _ROPE_NEOX, 0, theta, freq_scale, 0.0, 1.0, 32.0, 1.0)

    def _attention(self, graph: gk._Graph, q: gk._T, k: gk._T, v: gk._T, mask: gk._T, scale: float) -> gk._T:
        """Flash attention, q [d, T, H] -> [d, H, T], one op. Passes of up to ROW_ATTENTION_MAX rows (all
        of them: `Decoder.forward` splits longer ones) attend row by row: each query row and head over
        its visible keys in order, whatever the other rows; with viasd's row-exact op (`self.attention`),
        else with ggml's reference flash attention (`_Graph(exact_attention=True)`). ggml's default paths
        would not keep a row's result: one row with 512 or more keys splits them across threads and
        combines the parts, and many rows take a tiled kernel."""
        g, cfg = lib(), self.dec.config
        if graph.exact_attention and self.attention == "row-exact":
            args = (gk._T * 4)(q, k, v, mask)
            d, n_heads, n_rows = q.contents.ne[0], q.contents.ne[2], q.contents.ne[1]
            return g.custom_4d(graph.ctx, F32, d, n_heads, n_rows, 1, args, 4, rowexact.attention_op_address(), -1,
                               ctypes.addressof(self._attn_params))
        return g.flash_attn_ext(graph.ctx, q, k, v, mask, scale, 0.0, cfg.attn_softcap or 0.0)

    # ------------------------------------------------------------------ the graph
    def _build(self, parts: tuple[tuple[int, int, tuple[int, int]], ...], route: LayerMask | None, first: int = 0,
               save: int | None = None, head: QuantLinear | None = None) -> tuple:
        """The graph of a pass over one or more requests' rows: `parts`, per request (rows, its cache's
        length, the rows whose logits it returns: (first, count) of its own), in the order their rows
        are stacked.
        Every product takes all rows at once; each request's rows write and attend its own cache
        (see `Decoder.forward` for the rest). `first`, the layer it starts at (from the residual
        streams stored in each request's cache's `hidden` rows at its positions); `save`, the layer
        whose incoming stream it stores there; with no logits at all it ends at its last kept
        sub-layer; `head`: a reduced LM head's product instead of the full one."""
        cfg = self.dec.config
        n_rows = sum(n for n, _, _ in parts)
        per_layer = 48 + 14 * len(parts)  # tensors of a layer: its ops, and per request its views, writes and caches
        graph = gk._Graph(n_tensors=per_layer * cfg.n_layers + 64 + 8 * len(parts), n_nodes=per_layer * cfg.n_layers + 64 + 8 * len(parts),
                          exact_attention=max(n for n, _, _ in parts) <= ROW_ATTENTION_MAX)
        leaves = self._leaves(graph, parts, n_rows, streams=bool(first) or save is not None)
        x = self._input_stream(graph, leaves, parts, first)
        writes: list[gk._T] = []
        for i, layer in enumerate(self.dec.layers):
            if i < first:
                continue
            if i == save:  # each request's rows of the stream entering layer i, into its own cache
                self._save_stream(graph, x, leaves["items"], parts, writes)
            if route is None or route.attn[i]:
                x = self._attention_block(graph, i, layer, x, leaves, parts, n_rows, writes)
            if route is None or route.mlp[i]:
                x = self._mlp_block(graph, layer, x, n_rows)
        return self._logits(graph, x, leaves, parts, n_rows, head, writes)

    def _leaves(self, graph: gk._Graph, parts: tuple, n_rows: int, streams: bool) -> dict:
        """The graph's inputs: token ids and positions of all rows, and per request the cache rows
        written (its positions), masks, K/V caches and stored streams."""
        cfg = self.dec.config
        ids, pos = graph.tensor(I32, n_rows), graph.tensor(I32, n_rows)
        items = []
        for n, max_len, _ in parts:
            items.append({"rows": graph.tensor(I64, n), "mask": graph.tensor(F16, max_len, n),  # 0 where a row sees a key
                          "local_mask": graph.tensor(F16, max_len, n) if cfg.sliding_window is not None else None,
                          "k": [graph.tensor(F32, cfg.head_dim, max_len, cfg.n_kv_heads) for _ in self.dec.layers],
                          "v": [graph.tensor(F32, cfg.head_dim, max_len, cfg.n_kv_heads) for _ in self.dec.layers],
                          "hidden": graph.tensor(F32, cfg.hidden, max_len) if streams else None})
        return {"ids": ids, "pos": pos, "items": items}

    def _input_stream(self, graph: gk._Graph, leaves: dict, parts: tuple, first: int) -> gk._T:
        """[hidden, T]: the embedded tokens, or (from layer `first`) each request's rows of the stream
        stored in its own cache."""
        g, cfg, ctx, pos = lib(), self.dec.config, graph.ctx, leaves["pos"]
        if first:
            x, offset = None, 0
            for item, (n, _, _) in zip(leaves["items"], parts):
                own = g.get_rows(ctx, item["hidden"], pos if len(parts) == 1 else g.view_1d(ctx, pos, n, 4 * offset))
                x = own if x is None else g.concat(ctx, x, own, 1)
                offset += n
            assert x is not None  # (a pass of at least one request)
            return x
        x = g.get_rows(ctx, self._table._bind(graph), leaves["ids"])  # [hidden, T]
        if cfg.embed_scale is not None:
            x = g.scale(ctx, x, cfg.embed_scale)
        return x

    def _save_stream(self, graph: gk._Graph, x: gk._T, items: list[dict], parts: tuple, writes: list) -> None:
        """Each request's rows of the stream `x` written into its own cache's `hidden` rows."""
        g, cfg, ctx = lib(), self.dec.config, graph.ctx
        offset = 0
        for item, (n, _, _) in zip(items, parts):
            own = x if len(parts) == 1 else g.view_2d(ctx, x, cfg.hidden, n, x.contents.nb[1], offset * x.contents.nb[1])
            w = g.set_rows(ctx, item["hidden"], own, item["rows"])
            g.build_forward_expand(graph.graph, w)
            writes.append(w)
            offset += n

    def _attention_block(self, graph: gk._Graph, i: int, layer, x: gk._T, leaves: dict, parts: tuple, n_rows: int,
                         writes: list) -> gk._T:
        """x plus layer i's attention sub-layer (norm, QKV, RoPE, attention, output product)."""
        g, cfg, ctx, pos = lib(), self.dec.config, graph.ctx, leaves["pos"]
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        theta = cfg.rope_theta if layer.rope == 0 or cfg.rope_local_theta is None else cfg.rope_local_theta  # (rope 1: local)
        freq_scale = 1.0 / cfg.rope_factor if layer.rope == 0 else 1.0
        q, k, v = self._normed(graph, layer.qkv, x, layer.attn_norm, [nq, nkv, nkv], n_rows)
        q = self._heads(graph, q, cfg.n_heads, n_rows, layer.q_norm, pos, theta, freq_scale)  # [d, H, T]
        k = self._heads(graph, k, cfg.n_kv_heads, n_rows, layer.k_norm, pos, theta, freq_scale)  # [d, Hkv, T]
        v = self._heads(graph, v, cfg.n_kv_heads, n_rows, None, None, 0.0, 1.0)
        attn = self._attend(graph, i, layer, q, k, v, leaves["items"], parts, writes)  # [d, H, T]
        return self._residual(graph, layer.o, g.reshape_2d(ctx, attn, nq, n_rows), x, layer.post_attn_norm, n_rows)

    def _mlp_block(self, graph: gk._Graph, layer, x: gk._T, n_rows: int) -> gk._T:
        """x plus the layer's MLP sub-layer (norm, gate/up, activation, down product)."""
        g, cfg = lib(), self.dec.config
        gate, up = self._normed(graph, layer.gate_up, x, layer.mlp_norm, [cfg.intermediate, cfg.intermediate], n_rows)
        act = (g.swiglu_split if cfg.activation == "silu" else g.geglu_split)(graph.ctx, gate, up)
        return self._residual(graph, layer.down, act, x, layer.post_mlp_norm, n_rows)

    def _logits(self, graph: gk._Graph, x: gk._T, leaves: dict, parts: tuple, n_rows: int, head: QuantLinear | None,
                writes: list) -> tuple:
        """The final norm and LM head over the rows whose logits the parts return (none: the graph ends
        at its writes); (graph, leaves, logits tensor or None)."""
        g, cfg, ctx, dec = lib(), self.dec.config, graph.ctx, self.dec
        out_rows = _logit_rows(parts)
        if not out_rows:
            graph.finish(expand=tuple(writes))
            return graph, leaves, None
        if len(out_rows) < n_rows:  # only some rows' logits: [hidden, rows kept]
            if len(parts) == 1 and out_rows == [n_rows - 1]:  # the last row: a view
                x = g.view_2d(ctx, x, cfg.hidden, 1, x.contents.nb[1], (n_rows - 1) * x.contents.nb[1])
            else:
                leaves["out_rows"] = torch.tensor(out_rows, dtype=torch.int32)  # fixed by the parts: bound once
                sel = graph.tensor(I32, len(out_rows))
                sel.contents.data = leaves["out_rows"].data_ptr()
                x = g.get_rows(ctx, x, sel)
        head = head or cast(QuantLinear, dec.lm_head)
        if len(head.parts) == 1 and head.bias is None and self._fuses(head):  # row maxima found on the way
            norm = None if dec.norm is None else self._keep_f32(dec.norm)
            logits, leaves["maxima"] = gk.fused_head(graph, head.parts[0], x, len(out_rows), norm, cfg.rms_eps)
        else:
            (logits,) = self._normed(graph, head, x, dec.norm, [head.out_features], len(out_rows))
        graph.finish(logits, expand=tuple(writes))
        return graph, leaves, logits

    def _attend(self, graph: gk._Graph, i: int, layer, q: gk._T, k: gk._T, v: gk._T, items: list[dict],
                parts: tuple, writes: list) -> gk._T:
        """Layer i's attention for each request's rows over its own cache: its K and V rows written at
        its positions (before the attention reads them), then attention; [d, H, T] for all rows."""
        g, cfg, ctx = lib(), self.dec.config, graph.ctx
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        outs, offset = [], 0
        for item, (n, _, _) in zip(items, parts):
            own = [t if len(parts) == 1 else
                   g.view_3d(ctx, t, t.contents.ne[0], t.contents.ne[1], n, t.contents.nb[1], t.contents.nb[2],
                             offset * t.contents.nb[2]) for t in (q, k, v)]  # this request's rows: [d, heads, n]
            for cache_t, new in ((item["k"][i], own[1]), (item["v"][i], own[2])):
                w = g.set_rows(ctx, cache_t, g.permute(ctx, new, 0, 2, 1, 3), item["rows"])  # new: [d, n, Hkv]
                g.build_forward_expand(graph.graph, w)
                writes.append(w)
            outs.append(self._attention(graph, g.permute(ctx, own[0], 0, 2, 1, 3), item["k"][i], item["v"][i],  # q: [d, n, H]
                                        item["local_mask"] if layer.sliding else item["mask"], scale))  # [d, H, n]
            offset += n
        attn = outs[0]
        for o in outs[1:]:
            attn = g.concat(ctx, attn, o, 2)
        return attn

    # ------------------------------------------------------------------ a call
    def _masks(self, start: int, end: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, max_len] float16: 0 where query row j (position start+j) sees key p, -inf elsewhere.
        Rows start..end of one [max_len, max_len] mask per cache length up to _MASK_TABLE_MAX, built
        once (a view: no copy); longer caches get their rows built per call."""
        masks = self._mask_tables.get(max_len)
        if masks is None:
            cfg = self.dec.config
            table = max_len <= _MASK_TABLE_MAX
            q_pos = torch.arange(0 if table else start, max_len if table else end)[:, None]
            k_pos = torch.arange(max_len)[None, :]
            seen = k_pos <= q_pos
            neg = torch.tensor(float("-inf"), dtype=torch.float16)
            zero = torch.tensor(0.0, dtype=torch.float16)
            local = None
            if cfg.sliding_window is not None:
                local = torch.where(seen & (k_pos > q_pos - cfg.sliding_window), zero, neg).contiguous()
            masks = (torch.where(seen, zero, neg).contiguous(), local)
            if not table:
                return masks
            self._mask_tables[max_len] = masks
        mask, local = masks
        return mask[start:end], None if local is None else local[start:end]

    def __call__(self, tokens: list[int], start: int, cache: KVCache, route: LayerMask | None, last_only: bool,
                 first: int = 0, save: int | None = None, with_logits: bool = True, head=None) -> PassOutput | None:
        """(`head`: a `layers.ReducedHead`; the logits are then its N columns, [T, N].)"""
        n = len(tokens)
        rows = (0, 0) if not with_logits else (n - 1, 1) if last_only else (0, n)
        return self.run([(tokens, start, cache, rows)], route, first, save, head)[0]

    def run(self, calls: list[tuple[list[int], int, KVCache, tuple[int, int]]], route: LayerMask | None, first: int = 0,
            save: int | None = None, head=None) -> list[PassOutput | None]:
        """One pass over several requests' rows: `calls`, per request (its n token ids, start, its cache,
        (first, count): the rows whose logits it wants, of its own). Returns each request's logits
        ([count, V], with their rows' maxima where the head found them; None for none)."""
        parts = tuple((len(t), c.k.shape[2], want) for t, _, c, want in calls)
        head_linear = None if head is None else head.linear
        key = (parts, route, first, save, id(head_linear))
        built = self._graphs.get(key)
        if built is None:
            t0 = time.perf_counter()
            built = self._build(parts, route, first, save, head_linear)
            self.build_s += time.perf_counter() - t0
            if sum(n for n, _, _ in parts) <= _KEEP_GRAPH_ROWS:  # a pass of very many rows (large buffers) is not kept
                self._graphs[key] = built
                if len(self._graphs) > _KEEP_GRAPHS:
                    self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, leaves, logits_t = built
        ids = [i for t, _, _, _ in calls for i in t]  # (Python ints: `decoder.token_ids`)
        if ids and (min(ids) < 0 or max(ids) >= self._table.rows):
            raise IndexError(f"token id out of range [0, {self._table.rows})")
        pos = None if len(calls) == 1 else torch.cat([self.pos32[s : s + len(t)] for t, s, _, _ in calls])
        counts = [count for _, _, _, (_, count) in calls]
        width = (head_linear or self.dec.lm_head).out_features
        out = torch.empty(sum(counts), width) if logits_t is not None else None
        with gk.RUN_LOCK:  # binding and running a shared graph must not interleave between threads
            if len(ids) > len(self._ids32):
                self._ids32 = np.zeros(max(len(ids), 2 * len(self._ids32)), dtype=np.int32)
            self._ids32[: len(ids)] = ids
            graph.bind(leaves["ids"], self._ids32.ctypes.data)
            graph.bind(leaves["pos"], self.pos32.data_ptr() + 4 * calls[0][1] if pos is None else pos.data_ptr())
            for item, (tokens, start, cache, _) in zip(leaves["items"], calls):
                self._bind_item(graph, item, start, start + len(tokens), cache)
            if out is not None:
                graph.bind(logits_t, out.data_ptr())
            if (maxima := leaves.get("maxima")) is not None:
                maxima.arm()
            graph.run()
            found = maxima.result() if maxima is not None else None
        outs, at = [], 0
        for n in counts:
            outs.append(PassOutput(out[at : at + n], None if found is None else found[at : at + n]) if n and out is not None else None)
            at += n
        return outs

    def _bind_item(self, graph: gk._Graph, item: dict, start: int, end: int, cache: KVCache) -> None:
        """Point one request's leaves at its positions, masks and cache."""
        mask, local = self._masks(start, end, cache.k.shape[2])
        graph.bind(item["rows"], self.pos64.data_ptr() + 8 * start)
        graph.bind(item["mask"], mask.data_ptr())
        if local is not None:
            graph.bind(item["local_mask"], local.data_ptr())
        if item["hidden"] is not None:
            assert cache.hidden is not None  # (its leaf exists where the pass reads or stores streams)
            graph.bind(item["hidden"], cache.hidden.data_ptr())
        k_base, v_base, stride = cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(0) * 4
        if item.get("bound_cache") != (k_base, v_base):  # the same cache as this graph's last call: bound
            for i in range(len(item["k"])):
                graph.bind(item["k"][i], k_base + i * stride)
                graph.bind(item["v"][i], v_base + i * stride)
            item["bound_cache"] = (k_base, v_base)


def _logit_rows(parts: tuple[tuple[int, int, tuple[int, int]], ...]) -> list[int]:
    """The stacked rows whose logits a pass over `parts` returns, in order."""
    rows, at = [], 0
    for n, _, (first, count) in parts:
        rows += list(range(at + first, at + first + count))
        at += n
    return rows
