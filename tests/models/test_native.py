"""Native weights: the GGUF's own blocks through ggml's kernels, against dequantized references, and
every lossless strategy equal to `ar` under each weight format."""

from __future__ import annotations

import pytest
import torch

from viasd.api import generate
from viasd.errors import UsageError
from viasd.models import ggml_kernels as gk
from viasd.models.loading import load_drafter, load_model
from viasd.models.native import native_names, quantize
from viasd.models.decoder import Decoder

from support import run_ar, write_tiny_gguf

Q8_0, Q4_0, Q4_1 = 8, 2, 3


def _native(w: torch.Tensor, ggml_type: int) -> gk.NativeTensor:
    return next(iter(quantize({"w": w}, None, ggml_type, names=["w"]).values()))


@pytest.mark.parametrize("ggml_type", [Q8_0, Q4_0, Q4_1, gk.F32])
def test_quant_linear_is_the_product_with_the_dequantized_weight(ggml_type):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    native = _native(w, ggml_type)
    ref_w = native.dequantize()  # ggml's own dequantization of the stored blocks
    if ggml_type == gk.F32:
        assert torch.equal(ref_w, w)
    else:
        assert 0 < (ref_w - w).abs().max() < 0.1 * w.abs().max()  # quantized: close, not equal
    lin = gk.QuantLinear([native])
    for rows in (1, 3, 8, 70):  # 70: past the cached graphs
        x = torch.randn(rows, 64, generator=g)
        ref = x @ ref_w.T
        # ggml quantizes activations to 8 bits per block as llama.cpp does: within ~1% of the scale
        tol = 1e-5 if ggml_type == gk.F32 else 0.02
        assert (lin(x) - ref).abs().max() <= tol * ref.abs().max()
        assert torch.equal(lin(x[:1]), lin(x)[:1]) or ggml_type == gk.F32  # rows are independent


def test_quant_linear_parts_of_different_types_fill_their_columns():
    g = torch.Generator().manual_seed(1)
    a, b, c = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g), torch.randn(48, 64, generator=g)
    parts = [_native(a, Q8_0), _native(b, Q8_0), _native(c, Q4_0)]
    lin = gk.QuantLinear(parts, bias=torch.arange(96.0))
    assert len(lin.parts) == 2 and lin.out_features == 96  # the two Q8_0 parts merged into one product
    x = torch.randn(5, 64, generator=g)
    y = lin(x)
    for part, cols in zip(lin.parts, (slice(0, 48), slice(48, 96))):
        assert torch.equal(y[:, cols], gk.QuantLinear([part], bias=torch.arange(96.0)[cols])(x))


def _product(w: gk.NativeTensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, in] through `w` as the forward graph multiplies it (`ggml_kernels.matmul`)."""
    return gk.ggml_product(w, x)


Q4_K, Q6_K = 12, 14


def test_packed_weights_multiply_each_row_as_decoding_does():
    """Weights in ggml's extra buffer types (AMX, CPU_REPACK: whichever this CPU has, for the types it
    packs) give the plain kernels' products within rounding, and a block of rows gives each row
    exactly what that row gives alone (the repacked kernels' several-row paths would not)."""
    kinds = [name for name, _ in gk.lib().extra_buffer_types]  # (the row-exact kernel: the test above)
    if not kinds:
        pytest.skip("this CPU's ggml has no extra buffer type")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(7, 512, generator=g)
    packed = []
    for kind in kinds:
        for ggml_type in (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K):
            plain = _native(w, ggml_type)
            ref = _product(plain, x)
            native = _native(w, ggml_type)
            if native.pack((kind,)) != kind:
                assert native.packed is None
                continue
            packed.append((kind, ggml_type))
            block = _product(native, x)
            assert (block - ref).abs().max() <= 1e-4 * ref.abs().max(), (kind, ggml_type)
            rows = torch.cat([_product(native, x[j : j + 1].clone()) for j in range(x.shape[0])])
            assert torch.equal(block, rows), (kind, ggml_type)
            assert torch.equal(_product(native, x[2:5].clone()), block[2:5]), (kind, ggml_type)
    assert packed, f"none of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K packed into {kinds}"
    # Q4_0 has a repacked kernel on every x86 CPU with AVX2 and on AMX
    assert any(t == Q4_0 for _, t in packed)


def test_several_row_kernels_give_each_row_ggmls_one_row_product():
    """Q4_K in ggml's CPU_REPACK layout and Q6_K in the file's blocks (where ggml keeps them plain):
    viasd's several-row kernels give every row of any block, and of any division of the work among
    threads, bit for bit the product ggml's one-row kernel gives that row alone."""
    from viasd.models import rowexact

    if rowexact.rows_unavailable_reason() is not None:
        pytest.skip(rowexact.rows_unavailable_reason())
    g = torch.Generator().manual_seed(5)
    # 3 chunks of 128 rows and 8 rows more, 2 super-blocks a row (off the row-exact kernel's 16-row
    # tiles: the weights these kernels multiply where that kernel runs)
    w = torch.randn(392, 512, generator=g) * 0.05
    x = torch.randn(40, 512, generator=g) * torch.rand(40, 1, generator=g) * 4
    tried = []
    for ggml_type, kind in ((Q4_K, "CPU_REPACK"), (Q6_K, "plain")):
        ggml = _native(w, ggml_type)  # ggml's own kernel: repacked (Q4_K) or plain (Q6_K)
        if kind != "plain" and ggml.pack((kind,)) != kind:
            continue
        alone = torch.cat([_product(ggml, x[j : j + 1].clone()) for j in range(x.shape[0])])
        ours = _native(w, ggml_type)
        if ours.pack() != kind + "+rows":  # (no AVX2: no several-row kernel)
            continue
        tried.append(kind)
        for n in (1, 2, 3, 8, 9, 16, 17, 40):
            assert torch.equal(_product(ours, x[:n].clone()), alone[:n]), (kind, n)
        for split in (2, 3, 5):
            assert torch.equal(rowexact.rows_matmul(ours.packed.rows_op, x, split=split), alone), (kind, split)
    if not tried:
        pytest.skip("neither Q4_K nor Q6_K takes the several-row kernels on this CPU")


def test_several_row_kernels_are_checked_against_ggml_before_use(monkeypatch):
    """A kernel that disagrees with ggml's products on this machine is not used: the weight keeps ggml's."""
    from viasd.models import rowexact

    if rowexact.rows_unavailable_reason() is not None:
        pytest.skip(rowexact.rows_unavailable_reason())
    monkeypatch.setattr(gk, "_rows_checks", {})
    real = rowexact.rows_matmul
    monkeypatch.setattr(rowexact, "rows_matmul", lambda op, x, split=1: real(op, x, split) + 1e-3)
    w = _native(torch.randn(72, 256, generator=torch.Generator().manual_seed(6)), Q6_K)  # (off 16-row tiles)
    kind = w.pack()
    assert kind is None or not kind.endswith("+rows")
    assert gk._rows_checks == {rowexact.ROWS_Q6K: False} or kind == gk.ROW_EXACT


Q5_0 = 6


def _row_exact_or_skip():
    from viasd.models import rowexact

    if rowexact.lib() is None:
        pytest.skip(rowexact.unavailable_reason())
    return rowexact


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K])
def test_row_exact_kernel_keeps_the_files_values_and_each_rows_result(ggml_type):
    """viasd's row-exact kernel (models/rowexact.py): its blocks hold exactly the file's values; its
    products are within activation rounding of the dequantized product (as ggml's); a block of rows
    (past the 8 rows that share a weight load) gives each row exactly what it gives alone; the
    portable reference kernel and the AVX-512 one agree bit for bit; and the forward graph's custom
    op computes the same as a direct call."""
    rowexact = _row_exact_or_skip()
    g = torch.Generator().manual_seed(ggml_type)
    w = torch.randn(48, 512, generator=g) * 0.05
    native = _native(w, ggml_type)
    deq = native.dequantize()
    u = rowexact._unpack(ggml_type, native.data.numpy(), 48, 512)
    scale = rowexact._block_values(u.scale, u.sup_blocks)
    values = torch.from_numpy(scale.repeat(u.blk, 1) * u.q + rowexact._block_values(u.min, u.sup_blocks, scale).repeat(u.blk, 1))
    assert torch.equal(values, deq)  # scale * q + min is the file's value, bit for bit
    kernel = rowexact.RowExactWeight(ggml_type, native.data, 48, 512)
    x = torch.randn(11, 512, generator=g)
    x[3, :32], x[4, 32:64] = 0.0, -0.0  # blocks with no scale (amax 0)
    x[5, 64:96] = torch.linspace(-2.5, 2.5, 32)  # a block whose largest values are equal, of both signs
    block = kernel(x, impl=0)
    ref = x.double() @ deq.double().T
    assert (block.double() - ref).norm() <= 0.02 * ref.norm()  # int8 activations per block: ~0.5%
    rows = torch.cat([kernel(x[j : j + 1].clone(), impl=0) for j in range(11)])
    assert torch.equal(block, rows)
    simd = [k for k, ok in ((rowexact.VNNI, rowexact.lib().rx_has_vnni()), (rowexact.AVX2, rowexact.lib().rx_has_avx2())) if ok]
    for impl in simd:  # every kernel this CPU runs gives the reference's sums, bit for bit
        assert torch.equal(kernel(x, impl=impl), block), impl
        assert torch.equal(torch.cat([kernel(x[j : j + 1].clone(), impl=impl) for j in range(11)]), block), impl
    if rowexact.available():
        assert native.pack() == gk.ROW_EXACT
        assert torch.equal(_product(native, x), block)  # the forward graph's custom op


@pytest.mark.parametrize("ggml_type, bits, block_bytes, high_bytes", [(Q5_0, 5, 320, 64), (Q6_K, 6, 192, 64)])
def test_row_exact_planes_read_the_files_bytes_and_give_the_same_sums(ggml_type, bits, block_bytes, high_bytes):
    """Q5_0 packed as 4-bit and 1-bit planes, Q6_K as 4-bit and 2-bit planes, hold the file's bytes
    (Q6_K's super-block scale as the file's half), and every kernel this CPU runs multiplies them bit
    for bit as the reference does, with every bit pattern of the high bits in play (the values
    themselves: the test above)."""
    rowexact = _row_exact_or_skip()
    g = torch.Generator().manual_seed(50)
    native = _native(torch.randn(64, 1024, generator=g) * 0.05, ggml_type)
    planes = rowexact.RowExactWeight(ggml_type, native.data, 64, 1024, impl=rowexact.REFERENCE)
    assert planes.bits == bits
    assert planes.nbytes == native.nbytes
    assert planes.q.view(-1, block_bytes)[:, -high_bytes:].unique().numel() == 256  # each tile's block: nibbles, then high bits
    x = torch.randn(6, 1024, generator=g)
    want = planes(x, impl=rowexact.REFERENCE)
    for impl, ok in ((rowexact.AVX2, rowexact.lib().rx_has_avx2()), (rowexact.VNNI, rowexact.lib().rx_has_vnni())):
        if ok:
            assert torch.equal(planes(x, impl=impl), want), impl
            assert torch.equal(torch.cat([planes(x[j : j + 1].clone(), impl=impl) for j in range(6)]), want), impl


def test_row_exact_kernel_refuses_what_it_cannot_hold():
    rowexact = _row_exact_or_skip()
    native = _native(torch.randn(40, 64), Q8_0)
    with pytest.raises(ValueError, match="multiple of 16 rows, got 40"):
        rowexact.RowExactWeight(Q8_0, native.data, 40, 64)
    assert native.pack() != gk.ROW_EXACT  # such a weight stays with ggml's kernels
    with pytest.raises(UsageError, match="pack must be True, False, 'ggml' or 'row-exact', got 'amx'"):
        load_model("smollm2-135m", pack="amx")
    f32 = _native(torch.randn(16, 64), gk.F32)
    with pytest.raises(ValueError, match="does not take ggml type 0"):
        rowexact.RowExactWeight(gk.F32, f32.data, 16, 64)


@pytest.mark.parametrize("head_dim,softcap", [(64, None), (16, None), (128, 30.0)])
def test_row_exact_attention_is_softmax_attention_and_keeps_each_rows_result(head_dim, softcap):
    """viasd's row-exact attention op: the softmax attention of each query row over the keys its mask
    leaves visible (grouped K/V heads, key counts off the 16-key chunks, a row that sees nothing, a
    sliding window, Gemma's softcap); and a row's result is bit for bit the same alone or among others."""
    rowexact = _row_exact_or_skip()
    if rowexact.attention_unavailable_reason(head_dim):
        pytest.skip(rowexact.attention_unavailable_reason(head_dim))
    g = torch.Generator().manual_seed(head_dim)
    T, H, Hkv, N = 6, 6, 2, 75
    q, k, v = (torch.randn(T, H, head_dim, generator=g), torch.randn(Hkv, N, head_dim, generator=g),
               torch.randn(Hkv, N, head_dim, generator=g))
    seen = torch.zeros(T, N, dtype=torch.bool)
    for t, (lo, hi) in enumerate([(0, 1), (0, 17), (0, 33), (20, 64), (0, 75), (0, 0)]):  # the last row sees no key
        seen[t, lo:hi] = True
    mask = torch.where(seen, 0.0, float("-inf"))
    scale = head_dim ** -0.5
    out = rowexact.attention(q, k, v, mask, scale, softcap)
    kk, vv = (x.double().repeat_interleave(H // Hkv, 0) for x in (k, v))
    s = torch.einsum("thd,hnd->thn", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s + mask.double()[:, None, :]
    ref = torch.einsum("thn,hnd->thd", torch.nan_to_num(s.softmax(-1)), vv)
    assert torch.allclose(out.double(), ref, atol=2e-6), (out.double() - ref).abs().max()
    assert torch.equal(out[-1], torch.zeros(H, head_dim))  # nothing visible: zeros, as ggml's reference
    alone = torch.cat([rowexact.attention(q[t : t + 1], k, v, mask[t : t + 1], scale, softcap) for t in range(T)])
    assert torch.equal(alone, out)


def test_native_forward_attends_with_the_row_exact_op_where_it_runs(tiny_native):
    """Decoding passes attend with the row-exact op where the products run on the row-exact kernel
    (else ggml's reference flash attention), and both give the same logits within activation rounding."""
    from viasd.models import ggml_forward, rowexact

    dec = tiny_native.decoder
    expected = "row-exact" if gk.ROW_EXACT in dec._graph.packed and not rowexact.attention_unavailable_reason(16) else "ggml"
    assert dec._graph.attention == expected
    ids = torch.arange(3, 40) % 64
    outs = {}
    for attention in ("row-exact", "ggml"):
        if attention == "row-exact" and rowexact.attention_unavailable_reason(dec.config.head_dim):
            continue
        graph = dec._graph
        try:
            dec._graph = ggml_forward.NativeForward(dec, pack=graph._pack, attention=attention)
            cache = dec.new_cache(len(ids))
            dec.forward(ids[:30], 0, cache)
            outs[attention] = dec.forward(ids[30:], 30, cache)
        finally:
            dec._graph = graph
    if len(outs) == 2:
        # the attention outputs agree to float rounding (see the test above); the int8 quantization of
        # the next product's activations can round one of them differently: ~1% of a logit at most
        a, b = outs["row-exact"], outs["ggml"]
        assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_products_with_the_norm_and_residual_fused_in_give_the_separate_ops_logits(tiny_native):
    """Where the products run on the row-exact kernel, the RMS norm before them and the residual sum
    after them are fused into the product op (fewer ops, fewer barriers), with ggml's float
    operations: every logit is bit for bit what the separate ops give, prompt and decoding passes."""
    from viasd.models import ggml_forward

    dec = tiny_native.decoder
    fused = dec._graph
    plain = ggml_forward.NativeForward(dec, pack=fused._pack)
    plain._fuses = lambda lin, residual=False: False
    ids = (torch.arange(40) * 7 + 3) % 64
    outs, nodes = {}, {}
    try:
        for name, graph in (("fused", fused), ("plain", plain)):
            dec._graph = graph
            cache = dec.new_cache(len(ids))
            outs[name] = [dec.forward(ids[:30], 0, cache), dec.forward(ids[30:31], 30, cache),
                          dec.forward(ids[31:35], 31, cache), dec.forward(ids[35:], 35, cache, last_only=True)]
            g = gk.lib()
            nodes[name] = sum(g.graph_n_nodes(built[0].graph) for built in graph._graphs.values())
    finally:
        dec._graph = fused
    for a, b in zip(outs["fused"], outs["plain"]):
        assert torch.equal(a, b)
    if gk.ROW_EXACT in fused.packed:
        assert nodes["fused"] < nodes["plain"]
    else:
        assert nodes["fused"] == nodes["plain"]


def test_a_pass_finds_each_rows_first_maximum_as_its_head_writes_the_logits(tiny_native):
    """Greedy decoding reads the argmax of a pass' logits from what the LM head's op found while writing
    them (no scan of the row): for every pass shape, and for its rows taken, it is numpy's argmax;
    logits without it are scanned."""
    import numpy as np

    from viasd.decoding.acceptance import first_maxima
    from viasd.models.logits import PassOutput

    dec = tiny_native.decoder
    fused_head = gk.ROW_EXACT in dec._graph.packed
    ids = (torch.arange(40) * 11 + 2) % 64
    cache = dec.new_cache(len(ids))
    head = dec.reduced_head(list(range(1, 64, 2)))  # (32 rows: whole tiles of the row-exact kernel)
    outs = [dec.forward(ids[:30], 0, cache, scored=True), dec.forward(ids[30:31], 30, cache, scored=True),
            dec.forward(ids[31:35], 31, cache, scored=True), dec.forward(ids[35:], 35, cache, last_only=True, scored=True),
            dec.forward(ids[:5], 0, dec.new_cache(8), head=head, expand=False, scored=True)]
    for out in outs:
        expected = np.argmax(out.logits.numpy(), -1).tolist()
        assert out.argmax == (expected if fused_head else None)
        assert first_maxima(out.logits, out.argmax) == first_maxima(out.logits) == expected
        for r in range(out.logits.shape[0]):
            assert out[r].argmax == ([expected[r]] if fused_head else None)
            assert first_maxima(out[r].logits, out[r].argmax) == [expected[r]]
        assert first_maxima(out[1:].logits, out[1:].argmax) == expected[1:]
    # the expanded reduced head (-inf outside the head's ids) carries its rows' maxima over, mapped to ids
    expanded = dec.forward(ids[:5], 0, dec.new_cache(8), head=head, scored=True)
    expected = np.argmax(expanded.logits.numpy(), -1).tolist()
    assert expanded.argmax == (expected if fused_head else None) and first_maxima(expanded.logits) == expected
    assert torch.equal(expanded.logits, dec.forward(ids[:5], 0, dec.new_cache(8), head=head))
    assert set(expected) <= set(range(1, 64, 2))
    rows = torch.full((2, len(head)), float("-inf"))  # rows of -inf alone: expanded, their first maximum is id 0
    assert head.expand(PassOutput(rows, [0, 0])).argmax is None and first_maxima(head.expand(PassOutput(rows)).logits) == [0, 0]


@pytest.mark.parametrize("kernel", ["best", "avx2", "reference"])
def test_the_heads_row_maxima_keep_the_first_of_equal_logits(tiny, kernel, monkeypatch):
    """Ties go to the lowest token id, as numpy and torch break them, across tiles and threads: the head
    (tied to the embedding) has three equal rows in different tiles and zeros elsewhere, so each row's
    maximum is either the three equal logits or the zeros. The VNNI and AVX2 kernels find them; the
    reference kernel leaves the logits to be scanned."""
    import numpy as np

    from viasd.decoding.acceptance import first_maxima
    from viasd.models.loading import load_state_dict

    rowexact = _row_exact_or_skip()
    if kernel == "avx2" and not rowexact.lib().rx_has_avx2():
        pytest.skip("no AVX2 on this CPU")
    if kernel != "best":
        monkeypatch.setattr(rowexact, "best_kernel", lambda: rowexact.AVX2 if kernel == "avx2" else rowexact.REFERENCE)
    state = dict(load_state_dict(tiny.path))
    name = "model.embed_tokens.weight"
    emb = torch.zeros_like(state[name])
    for i in (5, 21, 40):
        emb[i] = state[name][7]
    state[name] = emb
    dec = Decoder.from_state_dict(tiny.config, state, native=quantize(state, tiny.config, Q8_0), pack=True)
    assert gk.ROW_EXACT in dec._graph.packed and rowexact.lib() is not None
    scored = dec.forward(torch.tensor([5, 21, 40, 3, 5, 40]), 0, dec.new_cache(8), scored=True)
    out = scored.logits
    for row in out:
        assert (row == row.max()).sum() >= 2  # a tie at every row's maximum
    expected = np.argmax(out.numpy(), -1).tolist()
    assert set(expected) <= {0, 5} and first_maxima(out) == expected
    assert scored.argmax == (None if kernel == "reference" else expected)


def test_row_maxima_combine_the_threads_first_maxima():
    """Each thread reports the first maximum of its ascending range of outputs; the row's is the first
    thread's among equal values; a thread with no outputs (-1) is skipped, a NaN (-2) makes it unknown."""
    from viasd.models.rowexact import FusedOp, RowMaxima

    op = FusedOp()
    m = RowMaxima(op, 3)
    m.arm()
    assert m.result() is None  # the op did not run (or tracked more rows than this)
    op.best_threads = 3
    m.index[:3] = [[4, 4, 4], [20, 20, -1], [40, 40, -1]]
    m.value[:3] = [[1.0, 2.0, 0.5], [1.0, 3.0, 0.0], [2.0, 3.0, 0.0]]
    assert m.result() == [40, 20, 4]
    m.index[1, 0] = -2
    assert m.result() is None


def test_quant_embedding_rows_and_range():
    w = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    native = _native(w, Q8_0)
    emb = gk.QuantEmbedding(native)
    full = native.dequantize()
    assert torch.equal(emb(torch.tensor([3, 0, 49, 3])), full[[3, 0, 49, 3]])
    with pytest.raises(IndexError, match=r"out of range \[0, 50\)"):
        emb(torch.tensor([50]))


# ------------------------------------------------------------------ the tiny model in a native format

@pytest.fixture(scope="module", params=[(Q8_0, True), (Q4_0, True), (Q4_0, "ggml"), (Q4_1, "row-exact")],
                ids=["q8_0", "q4_0", "q4_0-ggml", "q4_1-row-exact"])
def tiny_native(request, tiny):
    """The tiny Llama with its projections, embedding and head quantized by ggml; its products on the
    default kernels (the row-exact one where this CPU runs it) or on ggml's only."""
    from viasd.models import rowexact
    from viasd.models.loading import LoadedModel, load_state_dict

    ggml_type, pack = request.param
    if pack == "row-exact" and not rowexact.available():
        pytest.skip(rowexact.unavailable_reason())
    state = load_state_dict(tiny.path)
    native = quantize(state, tiny.config, ggml_type)
    assert set(native) == set(native_names(tiny.config)) - ({"lm_head.weight"} if "lm_head.weight" not in state else set())
    decoder = Decoder.from_state_dict(tiny.config, state, native=native, pack=pack)
    assert decoder.native
    # each product's weight packed for this CPU's kernels where it has one, else plain
    ggml_kinds = {name for name, _ in gk.lib().extra_buffer_types} | {"plain"}
    if pack == "ggml" or not rowexact.available():
        assert set(decoder._graph.packed) <= ggml_kinds
    else:  # the row-exact kernel wherever it runs, asked for by name or not
        assert set(decoder._graph.packed) == {gk.ROW_EXACT}
    return LoadedModel(name="tiny-native", path=tiny.path, config=tiny.config, decoder=decoder, tokenizer=tiny.tokenizer,
                       weights="native")


LOSSLESS = [("pld", {}), ("pld", dict(adapt_k=False)), ("self-sd", {}), ("viasd", dict(mode="lossless", draft="pld")),
            ("viasd", dict(mode="lossless", draft="self"))]


def test_tiny_native_lossless_strategies_equal_ar(tiny_native):
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6]
    expected = run_ar(tiny_native, prompt, 24)
    for strategy, extra in LOSSLESS:
        res = generate(prompt, tiny_native, strategy=strategy, max_new_tokens=24, k=4, **extra)
        assert res.token_ids == expected, (strategy, extra)


def test_tiny_native_cache_matches_cache_free_reference(tiny_native):
    from support import reference_logits
    from viasd.models.kvcache import LayerMask

    tokens = list(range(3, 30))
    dec = tiny_native.decoder
    cache = dec.new_cache(len(tokens))
    ids = torch.tensor(tokens)
    out = torch.cat([dec.forward(ids[:20], 0, cache), dec.forward(ids[20:21], 20, cache), dec.forward(ids[21:], 21, cache)])
    assert torch.allclose(out, reference_logits(tiny_native, tokens, 0, None), atol=1e-4)
    route = LayerMask.from_layers(dec.config.n_layers, [0])
    routed = dec.forward(ids[20:24], 20, _prefilled(dec, ids, 20), route=route)
    assert torch.allclose(routed, reference_logits(tiny_native, tokens[:24], 20, route), atol=1e-4)


def test_native_pass_is_batch_invariant(tiny_native):
    """A row's logits do not depend on the other rows of its pass: a block, token by token, or in
    uneven chunks, bit for bit (what makes every lossless strategy equal ar)."""
    dec = tiny_native.decoder
    assert dec._graph is not None  # the whole pass is one ggml graph
    ids = torch.arange(3, 40) % 64
    whole = dec.forward(ids, 0, dec.new_cache(len(ids)))
    for chunks in ([len(ids)], [1] * len(ids), [20, 1, 7, 9]):
        cache, out, start = dec.new_cache(len(ids)), [], 0
        for n in chunks:
            out.append(dec.forward(ids[start : start + n], start, cache))
            start += n
        assert torch.equal(torch.cat(out), whole), chunks
    # a cache of 512 positions or more: ggml then splits a single query row's keys across threads
    long = torch.arange(300) * 7 % 61
    block, rows = dec.new_cache(400), dec.new_cache(400)
    assert block.k.shape[2] >= 512
    dec.forward(long[:290], 0, block)
    dec.forward(long[:290], 0, rows)
    out_block = dec.forward(long[290:], 290, block)
    out_rows = torch.cat([dec.forward(long[j : j + 1], j, rows) for j in range(290, 300)])
    assert torch.equal(out_block, out_rows)


def _prefilled(dec, ids, n):
    cache = dec.new_cache(len(ids))
    dec.forward(ids[:n], 0, cache)
    return cache


# ------------------------------------------------------------------ smollm2-135m: the file's own Q4_1 blocks

@pytest.mark.model
def test_native_weights_are_the_files_blocks(smollm2):
    """ggml's dequantization of the native weights equals transformers' of the same GGUF: the names,
    the Q/K row order (llama.cpp permutes it) and the blocks are the file's."""
    plain = load_model("smollm2-135m", progress=False, weights="float32", pack=False)  # unpacked: .weight readable
    assert smollm2.weights == "native" and smollm2.decoder.native and not plain.decoder.native
    for i in (0, 17):
        for name in ("qkv", "o", "gate_up", "down"):
            ours = torch.cat([p.dequantize() for p in getattr(smollm2.decoder.layers[i], name).parts])
            assert torch.allclose(ours, getattr(plain.decoder.layers[i], name).weight, atol=1e-6), (i, name)
    ids = torch.tensor([1, 9690, 198, 2683])
    assert torch.allclose(smollm2.decoder.embed(ids), plain.decoder.embed(ids), atol=1e-6)


def test_native_from_a_gguf_file_reads_its_blocks(fake_gguf):
    """A GGUF of the tiny model as llama.cpp lays it out (Q/K rows permuted, Q8_0 blocks): the native
    load puts the rows back in transformers' order."""
    native = load_model(str(fake_gguf), progress=False)
    plain = load_model(str(fake_gguf), progress=False, weights="float32", pack=False)
    assert native.weights == "native" and plain.weights == "float32"
    for layer, ref in zip(native.decoder.layers, plain.decoder.layers):
        w = torch.cat([p.dequantize() for p in layer.qkv.parts])
        assert (w - ref.qkv.weight).abs().max() < 0.02  # Q8_0 of the same rows, in the same order
    # the same file with float32 tensors: the native path (names, row order, embedding, tied head)
    # computes the float model's logits
    f32 = load_model(str(write_tiny_gguf(fake_gguf.parent / "tiny-f32.gguf", plain.path, "F32")), progress=False)
    assert f32.weights == "native" and f32.decoder.native
    ids = torch.arange(1, 40)
    a = f32.decoder.forward(ids, 0, f32.decoder.new_cache(40))
    b = plain.decoder.forward(ids, 0, plain.decoder.new_cache(40))
    assert (a - b).abs().max() < 1e-4


def test_a_drafter_loads_the_files_blocks_requantized_to_q4_0_and_sd_still_equals_ar(fake_gguf, tiny):
    """`load_drafter`: by default the file's Q8_0 blocks re-quantized to Q4_0 (each weight within
    Q4_0's step of the file's); asked, the file's own; a float model's weights unchanged. Drafting
    with the re-quantized drafter leaves sd's output ar's."""
    drafter = load_drafter(str(fake_gguf), progress=False)
    model = load_model(str(fake_gguf), progress=False)
    assert drafter.weights == "q4_0" and model.weights == "native"
    for a, b in zip(drafter.decoder.layers, model.decoder.layers):
        assert {p.ggml_type for p in a.qkv.parts + a.down.parts} == {Q4_0}
        wa, wb = (torch.cat([p.dequantize() for p in layer.qkv.parts]) for layer in (a, b))
        # Q4_0: a block's values are d * (-8..7), d its largest magnitude / 8: within one step of the file's
        step = wb.reshape(-1, 32).abs().amax(1, keepdim=True) / 8
        assert not torch.equal(wa, wb) and ((wa - wb).reshape(-1, 32).abs() <= step * 1.01).all()
    assert load_drafter(str(fake_gguf), drafter_weights="native", progress=False).weights == "native"
    assert load_drafter(str(fake_gguf), "float32", progress=False).weights == "float32"  # the verifier's float format
    assert load_drafter(str(tiny.path), progress=False).weights == "float32"  # no GGUF: its own float weights
    prompt = list(range(3, 20))
    expected = run_ar(model, prompt, 24, model.eos_token_ids)
    assert generate(prompt, model, drafter=drafter, strategy="sd", max_new_tokens=24, k=4).token_ids == expected
    with pytest.raises(UsageError, match="drafter weights must be one of native, float32, bfloat16, float16, q4_0, got 'int4'"):
        load_drafter(str(fake_gguf), drafter_weights="int4")
    with pytest.raises(UsageError, match="requantize must be one of q4_0 or None, got 'q5_0'"):
        load_model(str(fake_gguf), requantize="q5_0")


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_native_logits_are_the_float_models_within_quantization(name, smollm2, smollm2_f32, gemma3, gemma3_f32):
    native, ref = {"smollm2": (smollm2, smollm2_f32), "gemma3": (gemma3, gemma3_f32)}[name]
    ids = torch.tensor(native.encode("The capital of France is Paris, and the capital of Germany is", chat=False))
    a = native.decoder.forward(ids, 0, native.decoder.new_cache(len(ids)))
    b = ref.decoder.forward(ids, 0, ref.decoder.new_cache(len(ids)))
    # 8-bit activations against float32 ones, same weights: measured 2.5 / 38 (smollm2)
    assert (a - b).abs().max() < 0.1 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    chunked = torch.cat([native.decoder.forward(ids[:5], 0, c := native.decoder.new_cache(len(ids))),
                         native.decoder.forward(ids[5:], 5, c)])
    assert torch.equal(chunked, a)


@pytest.mark.model
@pytest.mark.parametrize("weights", ["native", "float32", "bfloat16"])
def test_smollm2_lossless_strategies_equal_ar_per_weight_format(weights, smollm2, smollm2_f32):
    model = {"native": smollm2, "float32": smollm2_f32}.get(weights) or load_model("smollm2-135m", progress=False, weights=weights)
    assert model.weights == weights
    prompt = model.encode("List the days of the week: Monday, Tuesday, Wednesday,")
    expected = run_ar(model, prompt, 24, model.eos_token_ids)
    for strategy, extra in LOSSLESS:
        res = generate(prompt, model, strategy=strategy, max_new_tokens=24, k=4, **extra)
        assert res.token_ids == expected, (weights, strategy, extra)


# ------------------------------------------------------------------ choosing the format

def test_native_on_a_float_directory_runs_its_own_float_weights(tiny):
    assert tiny.weights == "float32" and not tiny.decoder.native
    assert load_model(str(tiny.path), progress=False, weights="native").weights == "float32"


def test_weights_and_dtype_errors(tiny):
    with pytest.raises(UsageError, match="weights must be one of native, float32, bfloat16, float16, got 'int4'"):
        load_model(str(tiny.path), weights="int4")
    with pytest.raises(UsageError, match="disagree"):
        load_model(str(tiny.path), weights="float32", dtype=torch.bfloat16)
    assert load_model(str(tiny.path), progress=False, dtype=torch.bfloat16).weights == "bfloat16"


def test_without_the_ggml_kernels_native_falls_back_or_says_why(fake_gguf, monkeypatch, capsys):
    def missing():
        raise gk.NativeWeightsUnavailable("native weights need the ggml kernels (the ggml-py package)")

    monkeypatch.setattr(gk, "lib", missing)
    model = load_model(str(fake_gguf), progress=False)  # the default: float32, said on stderr
    assert model.weights == "float32"
    assert "native weights need the ggml kernels" in capsys.readouterr().err
    with pytest.raises(UsageError, match="ggml-py"):
        load_model(str(fake_gguf), progress=False, weights="native")


def test_tiny_native_reduced_head_and_resumed_pass_are_exact(tiny_native):
    """On native weights a reduced head's logits are the full head's bit for bit at its ids (rows of
    the file's blocks, multiplied alone), and a full pass resumed after a slim pass equals a full pass."""
    from test_decoder import resumed_after_slim

    from viasd.models.kvcache import LayerMask

    dec = tiny_native.decoder
    vocab = list(range(1, 64, 4))
    head = dec.reduced_head(vocab)
    assert isinstance(head.linear, type(dec.lm_head)) and len(head) == 16
    a, b = dec.new_cache(32), dec.new_cache(32)
    full = dec.forward(torch.tensor([3, 9, 4, 7]), 0, a)
    reduced = dec.forward(torch.tensor([3, 9, 4, 7]), 0, b, head=head)
    assert torch.equal(reduced[:, vocab], full[:, vocab]) and torch.isinf(reduced[:, 0]).all()
    compact = dec.forward(torch.tensor([3, 9, 4, 7]), 0, dec.new_cache(32), head=head, expand=False)
    assert torch.equal(compact, full[:, vocab])  # [T, 16]: the head's ids alone, in order
    route = LayerMask(attn=(True, True, False, True), mlp=(True, True, True, False))
    for lower_rows in (0, 1):
        expected, got = resumed_after_slim(tiny_native, route, [3, 9, 4, 11], [5, 8, 2, 40], lower_rows)
        assert torch.equal(got, expected)


def test_tensor_index_is_read_once_then_from_the_cache(tmp_path, tiny_dir, monkeypatch):
    """Where each tensor lies in a GGUF file: from gguf's reader the first time, from the cache's index
    after that (the reader is not called again), the same weights bit for bit; a file changed since
    (another size) is read again, and a truncated one is refused, not mapped past its end."""
    import gguf as gguf_module

    from viasd.models import native as native_module
    from viasd.models.config import ModelConfig

    monkeypatch.setenv("VIASD_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_dir)
    from transformers import AutoConfig

    from viasd.errors import CorruptFileError

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_dir))
    reads = []
    reader = gguf_module.GGUFReader
    monkeypatch.setattr(gguf_module, "GGUFReader", lambda p: reads.append(p) or reader(p))
    first = native_module.read_native(path, config)
    second = native_module.read_native(path, config)
    assert len(reads) == 1 and len(list((tmp_path / "cache" / "gguf-index").iterdir())) == 1
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name].data, second[name].data) and first[name].ggml_type == second[name].ggml_type, name
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 64])  # cut: another size, so the index no longer applies
    with pytest.raises(CorruptFileError):
        native_module.read_native(path, config)
    assert len(reads) == 2


def test_a_long_pending_run_is_checked_on_the_logits_ar_computes(tiny_native):
    """A full pass over more rows than ROW_ATTENTION_MAX (tiered mode's pending run) gives each row the
    logits decoding computes for it one row at a time, bit for bit: it goes in row-exact chunks."""
    from viasd.decoding.acceptance import SamplingParams
    from viasd.decoding.stats import DecodeStats
    from viasd.decoding.session import DecodeRequest, Session
    from viasd.models.kvcache import ROW_ATTENTION_MAX

    prompt, n = [1, 5, 6, 7], ROW_ATTENTION_MAX + 40
    seq = prompt + run_ar(tiny_native, prompt, n)
    dec, L = tiny_native.decoder, len(prompt)
    cache = dec.new_cache(256)
    dec.forward(torch.tensor(prompt), 0, cache, last_only=True)
    one_by_one = [dec.forward(torch.tensor(seq[p : p + 1]), p, cache)[0] for p in range(L, len(seq))]  # as `ar` runs
    req = DecodeRequest(prompt=prompt, max_new_tokens=n + 1, params=SamplingParams(), eos=frozenset(), stats=DecodeStats())
    v = Session.start(dec, None, req, 256)
    assert v.tokens == seq[: L + 1]
    logits = v.full(seq[L + 1 :]).logits  # every later token checked in one pass, as a long pending run is
    assert len(logits) == len(one_by_one)
    for i, (row, ref) in enumerate(zip(logits, one_by_one)):
        assert torch.equal(row, ref), f"position {L + i}"
