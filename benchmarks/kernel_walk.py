"""Where the row-exact kernel's products lose against the read bandwidth (issue 41, point 1).

A one-row pass reads its weights at 73-88% of what a plain loop reads on the same machine
(`roofline.py`). This script takes the products apart, with synthetic weights of each type in the
kernel's own layout (`RowExactWeight`, `--mb` of them, more than the L3 holds), on every core: each
weight in turn, its tiles split between the threads and a barrier after each, as in a pass.

- Sweeps: a C loop over 2 GiB (roofline's read, with 512-bit loads), its buffer on 2 MB pages
  (`madvise(MADV_HUGEPAGE)`) and on 4 KB pages (`MADV_NOHUGEPAGE`), each plain and with the kernel's
  software prefetch (every line 8 Q5_0 blocks ahead into L1 and 16 into L2: 2560 and 5120 bytes); best of 5.
- Walks of the weights in the kernel's order, adding one part at a time: the weights alone
  (`weights`), with its software prefetch (`prefetch`), with the block scales (`scales`), with the
  nibbles unpacked (`unpack`); then the kernel itself (`kernel`, `rx_matmul`'s one-row path), the
  kernel over the same weights on 2 MB pages (`kernel_huge`; every other variant reads them from 4 KB
  pages), and two tiles at once in one thread (`two_tiles`, bit for bit the kernel's outputs: checked).
- `--models`: each zoo model's own products alone (every weight on the kernel, in the pass' order,
  the activation row of the right width) against its one-row pass (`pass_times`), alternated: what
  the rest of a pass (attention, norms, RoPE, the graph's barriers) adds.
- GB/s counts the bytes each variant reads (`weights` and `prefetch` leave out the scales); `share`
  is against the mean of the all-core 2 MB-page sweeps before and after.

    python benchmarks/kernel_walk.py --out benchmarks/out/kernel-walk.jsonl
    python benchmarks/kernel_walk.py --types q4_0 --models smollm2-135m --mb 64 --reps 2 --out /tmp/w.jsonl   # smoke

One JSONL record per (type, variant), per model and per sweep, with the run id, CPU flags and environment.
Needs a C compiler with OpenMP and AVX-512 VNNI (the kernel it takes apart).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Records, environment  # noqa: E402
from load import cpu_flags  # noqa: E402

TYPES = "q4_k,q5_0,q6_k,q8_0,q4_0,q4_1"  # every type the kernel takes (`rowexact.TYPES`)
MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
VARIANTS = ("weights", "prefetch", "scales", "unpack", "kernel", "kernel_huge", "two_tiles")

# The kernel's source is included whole: the walks reuse its layout helpers and prefetch, `two_tiles`
# its arithmetic, so each variant differs from the kernel only in what it names.
_SOURCE = r"""
#include "ROWEXACT_C"
#include <omp.h>

/* the buffer's 64-byte lines XORed; a0 / a1: the line that far ahead prefetched into L1 / L2 (0: none) */
__attribute__((target("avx512f")))
static uint64_t sweep_pf(const uint8_t *p, size_t n, size_t a0, size_t a1) {
    __m512i s = _mm512_setzero_si512();
    for (size_t i = 0; i + 64 <= n; i += 64) {
        if (a0) _mm_prefetch((const char *)p + i + a0, _MM_HINT_T0);
        if (a1) _mm_prefetch((const char *)p + i + a1, _MM_HINT_T1);
        s = _mm512_xor_si512(s, _mm512_loadu_si512((const void *)(p + i)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(s);
}

double walk_sweep(const uint8_t *p, size_t n, int threads, size_t a0, size_t a1, uint64_t *sink) {
    double best = 0.0;
    for (int r = 0; r < 5; r++) {
        uint64_t acc = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel num_threads(threads) reduction(^:acc)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t lo = n / nt * t / 64 * 64, hi = t == nt - 1 ? n : n / nt * (t + 1) / 64 * 64;
            acc ^= sweep_pf(p + lo, hi - lo, a0, a1);
        }
        double dt = omp_get_wtime() - t0;
        *sink ^= acc;
        if (n / dt > best) best = n / dt;
    }
    return best;
}

/* tiles [t0, t1) of w in the kernel's order: 0 weights, 1 + prefetch, 2 + scales, 3 + unpack (every byte
   split into nibbles: more than the kernel does for 8-bit values, less for a high-bit plane) */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static uint64_t walk_tiles(const rx_weight *w, int64_t t0, int64_t t1, int variant) {
    const int64_t nblk = w->cols / w->blk, qbytes = block_bytes(w->blk, w->bits);
    __m512i acc = _mm512_setzero_si512();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t tile = t0; tile < t1; tile++)
        for (int64_t b = 0; b < nblk; b++) {
            const uint8_t *p = w->q + (tile * nblk + b) * qbytes;
            if (variant >= 1) prefetch_ahead(p, qbytes);
            for (int64_t l = 0; l < qbytes; l += 64) {
                __m512i raw = _mm512_loadu_si512((const void *)(p + l));
                if (variant >= 3) raw = _mm512_add_epi8(_mm512_and_si512(raw, low), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
                acc = _mm512_xor_si512(acc, raw);
            }
            if (variant >= 2) {
                const int64_t i = (tile * nblk + b) * 16;
                if (w->scale_mode == 1)
                    acc = _mm512_xor_si512(acc, _mm512_castsi256_si512(
                        _mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scale + i))));
                if (w->scale_mode == 2)
                    acc = _mm512_xor_si512(acc, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)((const int8_t *)w->scale + i))));
                if (w->min_mode == 2)
                    acc = _mm512_xor_si512(acc, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)((const int8_t *)w->min + i))));
                if (w->scale_mode == 2 && !(b % w->sup_blocks))
                    acc = _mm512_xor_si512(acc, _mm512_castsi256_si512(_mm256_loadu_si256(
                        (const __m256i *)(w->scale_sup + (tile * (nblk / w->sup_blocks) + b / w->sup_blocks) * 16))));
                if (w->min_mode == 2 && !(b % w->sup_blocks))
                    acc = _mm512_xor_si512(acc, _mm512_castsi256_si512(_mm256_loadu_si256(
                        (const __m256i *)(w->min_sup + (tile * (nblk / w->sup_blocks) + b / w->sup_blocks) * 16))));
            }
        }
    return (uint64_t)_mm512_reduce_add_epi64(acc);
}

/* two tiles a block at a time, one activation row: per tile the arithmetic of tile_vnni_nt (NT = 1) */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void tile2_vnni(const rx_weight *w, int64_t tile, const int BLK, const int BITS, const int SM, const int MM,
                              const int SUP, const int8_t *xq, const float *dx, const float *sx, const int32_t *qsum, float *y) {
    const rx_shape sh = shape_of(w, BLK, SM, MM, SUP);
    const int64_t nblk = sh.nblk, nsup = sh.nsup, qbytes = block_bytes(BLK, BITS);
    const int G = BLK / 4, mult = sh.min_mode == 3;
    __m512 acc[2], sup_sc[2], sup_mn[2];
    for (int u = 0; u < 2; u++) acc[u] = sup_sc[u] = sup_mn[u] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++)
        for (int u = 0; u < 2; u++) {
            const int64_t tl = tile + u;
            const uint8_t *p = w->q + (tl * nblk + b) * qbytes;
            prefetch_ahead(p, qbytes);
            __m512i wv[8];
            block_weights(p, BLK, BITS, wv);
            if (!(b & (sh.sup_blocks - 1)))
                sup_sc[u] = sup_vector(w, 0, sh.scale_mode, nsup, sh.sup_shift, tl, b),
                sup_mn[u] = sup_vector(w, 1, sh.min_mode, nsup, sh.sup_shift, tl, b);
            const __m512 sc = block_vector(w, 0, sh.scale_mode, nblk, tl, b, sup_sc[u]);
            const __m512 mn = mult ? _mm512_setzero_ps() : block_vector(w, 1, sh.min_mode, nblk, tl, b, sup_mn[u]);
            const int32_t *xa = (const int32_t *)(xq + b * BLK);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int g = 0; g < G; g += 2) {
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s0) : "v"(wv[g]), "m"(xa[g]));
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s1) : "v"(wv[g + 1]), "m"(xa[g + 1]));
            }
            __m512i isum = _mm512_add_epi32(s0, s1);
            if (mult) isum = _mm512_add_epi32(isum, _mm512_set1_epi32((int32_t)w->min_mult * qsum[b]));
            acc[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(dx[b])), acc[u]);
            if (!mult) acc[u] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[b]), acc[u]);
        }
    for (int u = 0; u < 2; u++) _mm512_storeu_ps(y + (tile + u) * 16, acc[u]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static int matmul_two_tiles(const rx_weight *w, const float *x, float *y, int ith, int nth) {
    const int64_t nblk = w->cols / w->blk, ntiles = w->rows / 16;
    if (!reserve(1, w->cols, w->blk)) return -1;
    int8_t *xq = tls.xq;
    float *dx = (float *)(((uintptr_t)(xq + w->cols) + 63) & ~(uintptr_t)63);
    float *sx = dx + nblk;
    int32_t *qsum = (int32_t *)(sx + nblk);
    quantize_row_vnni(x, w->cols, w->blk, xq, dx, sx, qsum);
    int64_t tile = ntiles * ith / nth;
    const int64_t t1 = ntiles * (ith + 1) / nth;
#define RX_T2(BLK, BITS, SM, MM, SUP) tile2_vnni(w, tile, BLK, BITS, SM, MM, SUP, xq, dx, sx, qsum, y)
#define RX_T1(BLK, BITS, SM, MM, SUP) tile_vnni_nt(w, tile, 1, BLK, BITS, SM, MM, SUP, xq, dx, sx, qsum, y, 0)
    for (; tile + 2 <= t1; tile += 2) RX_DISPATCH(w, RX_T2);
    for (; tile < t1; tile++) RX_DISPATCH(w, RX_T1);
#undef RX_T2
#undef RX_T1
    return 0;
}

/* seconds for every weight in turn, tiles split among the threads, a barrier after each:
   variant 0-3 walks, 4 the kernel, 5 two tiles at once */
double walk(const rx_weight *ws, int n, int threads, int variant, const float *x, float *y, uint64_t *sink) {
    uint64_t s = 0;
    double t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads) reduction(^:s)
    {
        const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int m = 0; m < n; m++) {
            const rx_weight *w = ws + m;
            const int64_t nt = w->rows / 16;
            if (variant == 4) matmul(w, x, w->cols, 1, y, w->rows, ith, nth, 1, NULL);
            else if (variant == 5) matmul_two_tiles(w, x, y, ith, nth);
            else s ^= walk_tiles(w, nt * ith / nth, nt * (ith + 1) / nth, variant);
            #pragma omp barrier
        }
    }
    *sink ^= s;
    return omp_get_wtime() - t0;
}

/* 0 where two tiles at once give the kernel's outputs bit for bit */
int two_tiles_differ(const rx_weight *w, const float *x, float *y1, float *y2) {
    if (matmul(w, x, w->cols, 1, y1, w->rows, 0, 1, 1, NULL) || matmul_two_tiles(w, x, y2, 0, 1)) return -1;
    return memcmp(y1, y2, sizeof(float) * w->rows) != 0;
}
"""


def build() -> ctypes.CDLL:
    from viasd.models import rowexact

    d = Path(tempfile.mkdtemp(prefix="viasd-kernel-walk-"))
    (d / "walk.c").write_text(_SOURCE.replace("ROWEXACT_C", str(Path(rowexact.__file__).with_name("rowexact.c"))))
    cc = os.environ.get("CC", "cc")
    done = subprocess.run([cc, *rowexact._FLAGS, "-fopenmp", "-o", str(d / "walk.so"), str(d / "walk.c"), "-lm"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kernel_walk: compiling failed: {done.stderr.strip()[:800]}")
    lib = ctypes.CDLL(str(d / "walk.so"))
    lib.walk_sweep.restype = lib.walk.restype = ctypes.c_double
    lib.walk_sweep.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t,
                               ctypes.POINTER(ctypes.c_uint64)]
    lib.walk.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_uint64)]
    lib.two_tiles_differ.argtypes = [ctypes.c_void_p] * 4
    return lib


def pages(nbytes: int, huge: bool) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping of `nbytes` (2 MB-aligned start) on 2 MB pages or held to 4 KB ones, touched."""
    m = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: shmem, no THP)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    start = -a.ctypes.data % (2 << 20)
    a = a[start : start + nbytes]
    a[:] = 1
    return m, a


def anon_huge_mb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) // 1024 for line in f if line.startswith("AnonHugePages:")), 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=TYPES, help="comma-separated ggml types (default: %(default)s)")
    p.add_argument("--rows", type=int, default=4864, help="each weight's rows (a multiple of 16; default %(default)s)")
    p.add_argument("--mb", type=float, default=640, help="megabytes of weights per type (default %(default)s)")
    p.add_argument("--reps", type=int, default=6, help="walks per variant, interleaved; the first dropped (default %(default)s)")
    p.add_argument("--models", default=MODELS,
                   help="zoo models whose products to time against their passes ('' for none; default %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.out.exists() and args.out.stat().st_size:
        p.error(f"{args.out} is not empty: one run per file")
    if args.rows <= 0 or args.rows % 16 or args.reps < 2 or args.mb <= 0:
        p.error("--rows must be a positive multiple of 16, --reps at least 2, --mb positive")
    from gguf import GGMLQuantizationType

    from viasd import compute
    from viasd.models import rowexact

    flags = cpu_flags()
    if rowexact.best_kernel() != 1:
        p.error("the row-exact kernel does not run its AVX-512 VNNI path on this CPU: nothing to take apart")
    names = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    known = {t.name.lower(): int(t) for t in GGMLQuantizationType if int(t) in rowexact.TYPES}
    if unknown := [t for t in names if t not in known]:
        p.error(f"--types: {', '.join(unknown)} not among the kernel's types ({', '.join(known)})")
    types = {t: known[t] for t in names}
    from viasd.models.zoo import ZOO

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in models if m not in ZOO]:
        p.error(f"--models: {', '.join(unknown)} not in the zoo ({', '.join(ZOO)})")
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, {**environment(), "cpu_flags": flags})
    print(f"run {run_id}; {args.threads} threads")
    # all of it on viasd's compute thread: a second thread's OpenMP team (torch's ops here, the walks)
    # throttles libgomp's spinning and the walks' barriers then sleep (viasd.compute; 20 GB/s against 27)
    compute.run(lambda: measure(args, types, models, records, run_id))
    return 0


def measure(args, types: dict[str, int], models: list[str], records: Records, run_id: str) -> None:
    """The sweeps and every type's walks (on the compute thread)."""
    import torch

    from viasd.models import rowexact
    from viasd.models.native import _quantize_chunk, _quantized

    lib, sink = build(), ctypes.c_uint64()

    sweep_bytes = 2 << 30
    buffers = {kind: pages(sweep_bytes, kind == "2MB") for kind in ("2MB", "4KB")}

    def sweeps(tag: str) -> float:
        """Every sweep once (GB/s); returns the all-core 2 MB-page plain one."""
        out = {}
        for kind, (_, a) in buffers.items():
            for label, a0, a1 in (("plain", 0, 0), ("prefetch", 8 * 320, 16 * 320)):  # (Q5_0's blocks' distances)
                for threads in (1, args.threads):
                    gbs = lib.walk_sweep(a.ctypes.data, a.size, threads, a0, a1, ctypes.byref(sink)) / 1e9
                    out[(kind, label, threads)] = gbs
                    records.write(run_id=run_id, kind="sweep", when=tag, pages=kind, loop=label, threads=threads, gb_per_s=round(gbs, 3))
        print(f"sweeps {tag}: " + ", ".join(f"{k[0]} {k[1]} x{k[2]} {v:.1f}" for k, v in out.items()) + " GB/s", flush=True)
        return out[("2MB", "plain", args.threads)]

    chunk = _quantize_chunk()
    for name, ggml_type in types.items():
        cols = 1024 if name.endswith("_k") else 896  # (K-quants: super-blocks of 256)
        template = _quantized(torch.randn(args.rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02, ggml_type, chunk)
        one = rowexact.RowExactWeight(ggml_type, template.data, args.rows, cols)
        n = max(2, int(args.mb * 1e6 // one.nbytes))
        weights = [rowexact.RowExactWeight(ggml_type, template.data, args.rows, cols) for _ in range(n)]
        small = relocate(weights, huge=False)
        before_huge = anon_huge_mb()
        huge = [rowexact.RowExactWeight(ggml_type, template.data, args.rows, cols) for _ in range(n)]
        arena = relocate(huge, huge=True)
        huge_mb = anon_huge_mb() - before_huge
        ops = {v: (rowexact._Weight * n)(*[w.op.w for w in (huge if v == "kernel_huge" else weights)]) for v in VARIANTS}
        x = torch.randn(cols, generator=torch.Generator().manual_seed(1))
        y1, y2 = torch.empty(args.rows), torch.empty(args.rows)
        differ = lib.two_tiles_differ(ctypes.byref(weights[0].op.w), x.data_ptr(), y1.data_ptr(), y2.data_ptr())
        code = {"weights": 0, "prefetch": 1, "scales": 2, "unpack": 3, "kernel": 4, "kernel_huge": 4, "two_tiles": 5}
        q_bytes, all_bytes = weights[0].q.numel() * n, weights[0].nbytes * n
        limit_before = sweeps(f"before {name}")
        seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for v in VARIANTS:
                seconds[v].append(lib.walk(ops[v], n, args.threads, code[v], x.data_ptr(), y1.data_ptr(), ctypes.byref(sink)))
        limit = (limit_before + sweeps(f"after {name}")) / 2
        row = []
        for v in VARIANTS:
            read = q_bytes if v in ("weights", "prefetch") else all_bytes
            s = statistics.median(seconds[v][1:])
            gbs = read / s / 1e9
            records.write(run_id=run_id, kind="walk", type=name, variant=v, weights=n, rows=args.rows, cols=cols, bytes_read=read,
                          seconds=s, samples_s=seconds[v], gb_per_s=round(gbs, 3), limit_gb_per_s=round(limit, 3),
                          share=round(gbs / limit, 4), threads=args.threads, two_tiles_equal=differ == 0,
                          huge_pages_mb=huge_mb if v == "kernel_huge" else None)
            row.append(f"{v} {gbs:.1f} ({gbs / limit:.0%})")
        print(f"{name} ({n} weights of {args.rows}x{cols}; two tiles {'equal' if differ == 0 else 'DIFFER'}; "
              f"{huge_mb} MB on 2 MB pages): " + ", ".join(row) + " GB/s", flush=True)
        del weights, huge, arena, small, ops
    for name in models:
        walk_model(name, lib, sweeps, records, run_id, args)


def walk_model(name: str, lib, sweeps, records: Records, run_id: str, args) -> None:
    """A zoo model's products alone against its one-row pass, alternated `args.reps` + 1 times."""
    import torch

    from viasd.execution.timing import pass_times
    from viasd.models import rowexact
    from viasd.models.ggml_kernels import ROW_EXACT
    from viasd.models.loading import load_model

    model = load_model(name, progress=False)
    dec = model.decoder
    lins = [lin for layer in dec.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [dec.lm_head]
    parts = [part for lin in lins for part in getattr(lin, "parts", [])]
    weights = [part.packed.tensor for part in parts if getattr(part, "packed", None) is not None and part.packed.kind == ROW_EXACT]
    if not weights or len(weights) < len(parts):
        print(f"{name}: {len(parts) - len(weights)} of its {len(parts)} products are not on the row-exact kernel; skipped")
        return
    sink = ctypes.c_uint64()
    ops = (rowexact._Weight * len(weights))(*[w.op.w for w in weights])
    x, y = torch.randn(max(w.cols for w in weights)), torch.empty(max(w.rows for w in weights))
    nbytes = sum(w.nbytes for w in weights)
    limit_before = sweeps(f"before {name}")
    products, passes = [], []
    for _ in range(args.reps + 1):
        products.append(lib.walk(ops, len(weights), args.threads, 4, x.data_ptr(), y.data_ptr(), ctypes.byref(sink)))
        passes.append(pass_times(dec, 1, reps=9, keep=False)[0])
    limit = (limit_before + sweeps(f"after {name}")) / 2
    prod, one = statistics.median(products[1:]), statistics.median(passes[1:])
    pass_bytes = dec.weight_bytes(None, 0, True)
    records.write(run_id=run_id, kind="model", model=name, products=len(weights), product_bytes=nbytes, products_s=prod,
                  pass_s=one, pass_bytes=pass_bytes, products_share=round(nbytes / prod / 1e9 / limit, 4),
                  pass_share=round(pass_bytes / one / 1e9 / limit, 4), limit_gb_per_s=round(limit, 3),
                  samples_s={"products": products, "pass": passes}, threads=args.threads)
    print(f"{name}: {len(weights)} products alone {prod * 1e3:.2f} ms ({nbytes / prod / 1e9 / limit:.0%}), the one-row pass "
          f"{one * 1e3:.2f} ms ({pass_bytes / one / 1e9 / limit:.0%}): the rest {(one - prod) * 1e3:.2f} ms", flush=True)


def relocate(weights, huge: bool) -> tuple[mmap.mmap, np.ndarray]:
    """Copy each weight's blocks and scales into one mapping on 2 MB pages (or held to 4 KB ones) and
    point its op there (the kernel reads its op struct by address). Keep the result alive."""
    import torch

    fields = ("q", "scale", "min", "scale_sup", "min_sup")
    items = []
    for w in weights:
        by_ptr = {t.data_ptr(): t for t in [w.q, *w._arrays]}
        items += [(w, f, by_ptr[getattr(w.op.w, f)]) for f in fields if getattr(w.op.w, f)]
    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for _, _, t in items)
    mapping, arena = pages(size, huge)
    off = 0
    for w, f, t in items:
        n = t.numel() * t.element_size()
        arena[off : off + n] = t.contiguous().view(-1).view(torch.uint8).numpy()
        setattr(w.op.w, f, arena.ctypes.data + off)
        off += -(-n // 64) * 64
    return mapping, arena


if __name__ == "__main__":
    raise SystemExit(main())
