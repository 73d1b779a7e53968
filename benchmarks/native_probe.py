"""Probe: what the linear products and a whole forward pass cost, per weight format.

For each model, per layer: the four products of the runtime (qkv, o, gate_up, down) at 1 and 8 rows,
for every candidate that multiplies quantized weights on this CPU, plus the float ones:
- ggml on the file's own blocks ("native": the kernels llama.cpp runs), and ggml on Q8_0 / Q4_0
  requantized from them;
- onnxruntime's MatMulNBits (4-bit, block 32; accuracy level 4 = int8 activations, as ggml);
- torch's weight-only int8 product (`aten._weight_int8pack_mm`);
- float32 and bfloat16 through oneDNN on prepacked weights (viasd's float path).
- the same blocks packed into each of ggml's extra buffer types this CPU has (AMX, CPU_REPACK), one-row
  products (what the forward graph runs with them), and into viasd's row-exact kernel (ROW_EXACT,
  models/rowexact.py: every row of a block in one call);
Then the whole forward pass at 1 and 8 tokens after a 128-token prompt and after a 600-token one, per
`--weights` format (`native`: the row-exact kernel and attention op where the CPU has them;
`native-ggml-attention`: the same products with ggml's reference flash attention; `native-ggml`:
ggml's packed layouts and attention only; `native-plain`: native weights left unpacked):
T(1), T(8), T(8)/T(1), and the peak RSS of a process that loads the model and runs it. And, where
the row-exact attention op runs, native passes with it and with ggml's reference flash attention,
interleaved call by call (`attention_ab`); and the row-exact kernel prefetching weights at every row
count against only at one or two rows (`prefetch_ab`, interleaved the same way). `--formats ''`
`--no-products` runs only those two.

    python benchmarks/native_probe.py [--models smollm2-135m,qwen2.5-coder-1.5b] [--formats ...] [--no-products] [--out FILE]

Appends JSONL records (run id, environment with CPU flags) to benchmarks/out/native-probe.jsonl (untracked).
Timings are medians of repeated calls on a quiet machine; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

from viasd.models import ggml_kernels as gk  # noqa: E402
from viasd.models import rowexact  # noqa: E402
from viasd.models.loading import load_model  # noqa: E402
from viasd.models.ggml_forward import NativeForward  # noqa: E402
from viasd.models.native import quantize  # noqa: E402
from viasd.models.layers import PackedLinear  # noqa: E402

OUT = Path(__file__).parent / "out" / "native-probe.jsonl"
Q8_0, Q4_0 = 8, 2


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def layer_products(decoder) -> list:
    layer = decoder.layers[len(decoder.layers) // 2]
    return [layer.qkv, layer.o, layer.gate_up, layer.down]


def float_weight(linear) -> torch.Tensor:
    """[out, in] float32 weight of any linear of the runtime."""
    if isinstance(linear, gk.QuantLinear):
        return torch.cat([p.dequantize() for p in linear.parts])
    return linear.weight if linear.weight is not None else None


def _ort_session(weights: list[torch.Tensor]):
    """One onnxruntime session per product: MatMulNBits with random 4-bit blocks of the right shape."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    sessions = []
    for w in weights:
        n, k = w.shape
        blocks = k // 32
        rng = torch.Generator().manual_seed(0)
        b = torch.randint(0, 256, (n, blocks, 16), dtype=torch.uint8, generator=rng).numpy()
        scales = (torch.rand(n * blocks, generator=rng) * 0.01).numpy()
        node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=32, accuracy_level=4)
        graph = helper.make_graph([node], "p", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                                  [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.inter_op_num_threads = 1
        sessions.append(ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]))
    return sessions


def packed_product(lin, kind: str):
    """x -> y through `lin`'s parts packed into ggml's `kind` buffer type (one-row products, as the
    forward graph runs them; parts the type does not take stay plain); one graph per row count."""
    parts = [gk.NativeTensor(p.data, p.ggml_type, p.cols) for p in lin.parts]
    kinds = [p.pack((kind,)) or "plain" for p in parts]
    graphs = {}

    def call(x):
        t = x.shape[0]
        if t not in graphs:
            graph = gk._Graph(n_tensors=8 * len(parts))
            xt = graph.tensor(gk.F32, parts[0].cols, t)
            ys = [gk.matmul(graph, p, xt, t) for p in parts]
            graph.finish(*ys)
            outs = [torch.empty(t, p.rows) for p in parts]
            graphs[t] = (graph, xt, ys, outs)
        graph, xt, ys, outs = graphs[t]
        graph.bind(xt, x.data_ptr())
        for y, out in zip(ys, outs):
            graph.bind(y, out.data_ptr())
        graph.run()
        return outs

    return call, kinds


def product_candidates(native_model) -> dict:
    """name -> (list of callables x -> y, bytes of weights) for one layer's four products."""
    natives = layer_products(native_model.decoder)
    floats = [float_weight(q) for q in natives]
    types = "/".join(sorted({gk.type_name(p.ggml_type) for q in natives for p in q.parts}))
    cands = {f"ggml-native ({types})": (natives, sum(q.nbytes for q in natives))}
    kinds = ([gk.ROW_EXACT] if rowexact.available() else []) + [kind for kind, _ in gk.lib().extra_buffer_types]
    for kind in kinds:  # the file's blocks repacked for this CPU (ggml's: one row at a time)
        packed = [packed_product(q, kind) for q in natives]
        if any(k != "plain" for _, kinds in packed for k in kinds):
            label = "+".join(sorted({k for _, kinds in packed for k in kinds}))
            how = "all rows in one call" if kind == gk.ROW_EXACT else "one-row products"
            cands[f"ggml-native packed ({label}, {how})"] = ([c for c, _ in packed], sum(q.nbytes for q in natives))
    for qtype, label in ((Q8_0, "ggml-Q8_0"), (Q4_0, "ggml-Q4_0")):
        qs = [gk.QuantLinear([next(iter(quantize({"w": w}, None, qtype, names=["w"]).values()))]) for w in floats]
        cands[label] = (qs, sum(q.nbytes for q in qs))
    f32 = [PackedLinear(w.clone()) for w in floats]
    cands["float32-onednn"] = (f32, sum(w.numel() * 4 for w in floats))
    bf16 = [PackedLinear(w.to(torch.bfloat16)) for w in floats]
    cands["bfloat16-onednn"] = ([lambda x, lin=lin: lin(x.to(torch.bfloat16)) for lin in bf16], sum(w.numel() * 2 for w in floats))
    int8 = []
    for w in floats:
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        wq = torch.round(w / scale[:, None]).to(torch.int8).contiguous()
        int8.append(lambda x, wq=wq, s=scale: torch.ops.aten._weight_int8pack_mm(x, wq, s))
    cands["torch-int8-weight-only"] = (int8, sum(w.numel() for w in floats))
    try:
        sessions = _ort_session(floats)
        cands["onnxruntime-MatMulNBits-4bit"] = (
            [lambda x, s=s: torch.from_numpy(s.run(None, {"A": x.numpy()})[0]) for s in sessions],
            sum(w.numel() // 2 + w.numel() // 32 * 4 for w in floats))
    except ImportError:
        pass
    return cands


def forward_times(model, prompt_len: int = 128, long_len: int = 600) -> dict:
    """T(1), T(8) after `prompt_len` tokens (and after `long_len`: "1@long", "8@long"), and the prefill."""
    dec = model.decoder
    ids = torch.randint(100, 1000, (long_len + 8,), generator=torch.Generator().manual_seed(0))
    out = {}
    for n, suffix in ((prompt_len, ""), (long_len, "@long")):
        cache = dec.new_cache(n + 16)
        dec.forward(ids[:n], 0, cache)
        for t in (1, 8):
            def step(t=t, n=n, cache=cache):
                dec.forward(ids[n : n + t], n, cache)
                cache.rollback(n)
            out[f"{t}{suffix}"] = median_ms(step, reps=20)
    prefill_cache = dec.new_cache(prompt_len)
    out["prefill"] = median_ms(lambda: (dec.forward(ids[:prompt_len], 0, prefill_cache), prefill_cache.rollback(0)), reps=5, warmup=1)
    return out


def interleaved_passes(model, setups: dict, contexts=(128, 600), reps: int = 30) -> list[dict]:
    """Native decoding passes at 1 and 8 rows under each of `setups` (name -> a function that puts the
    decoder in that state), alternating call by call (interleaved, so drift on a shared machine hits
    them alike). Median ms per (context, rows, setup)."""
    dec = model.decoder
    ids = torch.randint(100, 1000, (max(contexts) + 8,), generator=torch.Generator().manual_seed(0))
    out = []
    for n in contexts:
        cache = dec.new_cache(n + 16)
        dec.forward(ids[:n], 0, cache)
        for t in (1, 8):
            times = {k: [] for k in setups}
            for rep in range(reps + 3):
                for k, setup in setups.items():
                    setup()
                    start = time.perf_counter()
                    dec.forward(ids[n : n + t], n, cache)
                    if rep >= 3:
                        times[k].append(time.perf_counter() - start)
                    cache.rollback(n)
            out.append({"context": n, "rows": t, "ms": {k: 1000 * statistics.median(v) for k, v in times.items()}})
    return out


def attention_ab(model, contexts=(128, 600), reps: int = 30) -> list[dict]:
    """Native decoding passes attending with viasd's row-exact op against ggml's reference flash
    attention, the same products otherwise, interleaved call by call."""
    dec = model.decoder
    graphs = {"row-exact": dec._graph, "ggml": NativeForward(dec, pack=True, attention="ggml")}

    def use(g):
        return lambda: setattr(dec, "_graph", g)
    try:
        recs = interleaved_passes(model, {k: use(g) for k, g in graphs.items()}, contexts, reps)
    finally:
        dec._graph = graphs["row-exact"]
    return [{"context": r["context"], "rows": r["rows"], "ms_row_exact": round(r["ms"]["row-exact"], 3),
             "ms_ggml": round(r["ms"]["ggml"], 3), "ratio": round(r["ms"]["row-exact"] / r["ms"]["ggml"], 3)} for r in recs]


def prefetch_ab(model, contexts=(128, 600), reps: int = 30) -> list[dict]:
    """The row-exact kernel prefetching weights at every row count (the default) against only in
    passes of up to two rows (before session 9), interleaved call by call: T(1), T(8) and T(8)/T(1)
    under each."""
    def rows(n):
        return lambda: rowexact.set_prefetch_rows(n)
    try:
        recs = interleaved_passes(model, {"all": rows(8), "up_to_2": rows(2)}, contexts, reps)
    finally:
        rowexact.set_prefetch_rows(8)
    out = []
    for n in contexts:
        one, eight = ({r["rows"]: r for r in recs if r["context"] == n}[t]["ms"] for t in (1, 8))
        out.append({"context": n, **{f"ms_{t}_{k}": round(m[k], 3) for t, m in ((1, one), (8, eight)) for k in m},
                    **{f"ratio_8_1_{k}": round(eight[k] / one[k], 3) for k in one}})
    return out


def rss_child(model: str, weights: str, pack: bool = True) -> float:
    """Peak RSS (MB) of a fresh process that loads `model` with `weights` and runs a forward pass."""
    code = (f"import resource, torch; from viasd.models.loading import load_model; m = load_model({model!r}, progress=False, "
            f"weights={weights!r}, pack={pack!r}); c = m.decoder.new_cache(64); m.decoder.forward(torch.arange(1, 33), 0, c); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="native,native-ggml-attention,native-ggml,native-plain,float32,bfloat16",
                    help="weight formats for the whole pass (native-ggml-attention: native, attending with ggml's "
                         "reference flash attention instead of viasd's row-exact op; native-ggml: ggml's packed "
                         "layouts and attention only; native-plain: native weights left unpacked)")
    ap.add_argument("--no-products", action="store_true", help="skip the per-layer product candidates")
    ap.add_argument("--no-attention-ab", action="store_true",
                    help="skip the interleaved comparison of the row-exact attention op with ggml's")
    ap.add_argument("--no-prefetch-ab", action="store_true",
                    help="skip the interleaved comparison of the row-exact kernel prefetching weights at every row "
                         "count against only at one or two rows")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    args = ap.parse_args()
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    env = {**environment(), "ggml": gk.lib().has}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        def emit(rec):
            rec = {"run_id": run_id, **rec, "env": env}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(json.dumps({k: v for k, v in rec.items() if k != "env"}), flush=True)

        for name in args.models.split(","):
            native = load_model(name, progress=False, weights="native")
            x = {t: torch.randn(t, native.config.hidden) for t in (1, 8)}
            x_down = {t: torch.randn(t, native.config.intermediate) for t in (1, 8)}
            for cand, (prods, nbytes) in ({} if args.no_products else product_candidates(native)).items():
                ms = {}
                for t in (1, 8):
                    def layer(t=t, prods=prods):
                        for i, p in enumerate(prods):  # down takes the intermediate size
                            p(x[t] if i != 3 else x_down[t])
                    ms[t] = median_ms(layer)
                emit({"kind": "layer_products", "model": name, "candidate": cand, "weight_mb": round(nbytes / 2**20, 2),
                      "ms_1": round(ms[1], 4), "ms_8": round(ms[8], 4), "ratio_8_1": round(ms[8] / ms[1], 3)})
            if not args.no_attention_ab and native.decoder._graph is not None and native.decoder._graph.attention == "row-exact":
                for rec in attention_ab(native):
                    emit({"kind": "attention_ab", "model": name, **rec})
            if not args.no_prefetch_ab and gk.ROW_EXACT in (native.kernels or {}):
                for rec in prefetch_ab(native):
                    emit({"kind": "prefetch_ab", "model": name, **rec})
            del native
            for fmt in filter(None, args.formats.split(",")):
                # native-plain: unpacked; native-ggml: ggml's packed layouts only (no row-exact kernel)
                weights = fmt.removesuffix("-ggml-attention").removesuffix("-plain").removesuffix("-ggml")
                pack = False if fmt.endswith("-plain") else "ggml" if fmt.endswith("-ggml") else True
                model = load_model(name, progress=False, weights=weights, pack=pack)
                if fmt.endswith("-ggml-attention"):
                    model.decoder._graph = NativeForward(model.decoder, pack=pack, attention="ggml")
                graph = model.decoder._graph
                ft = forward_times(model)
                emit({"kind": "forward", "model": name, "weights": fmt, "kernels": model.kernels,
                      "attention": graph.attention if graph is not None else "torch", "ms_1": round(ft["1"], 3),
                      "ms_8": round(ft["8"], 3), "ratio_8_1": round(ft["8"] / ft["1"], 3),
                      "ms_1_ctx600": round(ft["1@long"], 3), "ms_8_ctx600": round(ft["8@long"], 3),
                      "ratio_8_1_ctx600": round(ft["8@long"] / ft["1@long"], 3), "prefill_128_ms": round(ft["prefill"], 2),
                      "peak_rss_mb": None if args.no_rss else round(rss_child(name, weights, pack), 1)})
                del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
