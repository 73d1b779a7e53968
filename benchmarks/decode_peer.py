"""Plain decoding against llama.cpp's own figure: viasd `ar` and `llama-bench` tg on the same GGUF, one run.

Issue 41's peer figure: tokens per second of greedy one-token-at-a-time decoding, as `llama-bench -p 0
-n N` reports it (its `avg_ts`: N decodes after an empty context, one repetition per call) and as
`viasd.generate(..., strategy="ar")` decodes N tokens after a short prompt (decode-only: the tokens
after the first over the time after it; weights as loaded by default, native: the same file's blocks).
Each arm's call starts with an unmeasured warm-up (llama-bench's own; 8 tokens of viasd's: the first
decode after the other process ran is slower). The two alternate per round (the order flipped every
round), so both see the same state of the machine; the summary gives the median of per-round ratios.

llama-bench is built once from the llama-cpp-python sdist's llama.cpp (as `load.py` builds llama-server:
GGML_NATIVE=OFF with this CPU's AVX2 / AVX-512 flags, no AMX) unless `--llama-bench` names a binary.

    python benchmarks/decode_peer.py --out benchmarks/out/decode-peer.jsonl
    python benchmarks/decode_peer.py --models smollm2-135m,qwen2.5-coder-1.5b --rounds 7 --out /tmp/d.jsonl

One JSONL record per (model, round, arm) with the run id, tokens/s, the configuration, llama-bench's
build and CPU line, and the environment (CPU flags). Start from an empty output file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Records, environment, median  # noqa: E402
from load import build_llama_cpp, build_options  # noqa: E402

HERE = Path(__file__).resolve().parent
# a prompt whose greedy answer runs past the tokens decoded (a decode-only rate over the same count)
PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def llama_bench(binary: Path, gguf: Path, n: int, threads: int) -> dict:
    """One `llama-bench` tg call: its JSON record (avg_ts: tokens per second of n one-token decodes)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(n), "-r", "1", "-t", str(threads), "-o", "jsonl"],
                         capture_output=True, text=True, check=True)
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("{")]
    return json.loads(line)


def viasd_ar(model, ids: list[int], n: int) -> dict:
    from viasd import generate

    s = generate(ids, model, strategy="ar", max_new_tokens=n).stats
    return {"tokens": s.new_tokens, "tokens_per_s": s.decode_tokens_per_s, "wall_s": s.wall_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m", help="zoo aliases, comma-separated (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two arms per model (default: %(default)s)")
    ap.add_argument("-n", "--tokens", type=int, default=64, help="tokens decoded per call, as llama-bench's tg N (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-bench's threads (default: the cores)")
    ap.add_argument("--llama-bench", type=Path, help="a llama-bench binary (default: build one into --llama-cpp-build)")
    ap.add_argument("--llama-cpp-build", type=Path, default=HERE / "out" / "llama.cpp",
                    help="where llama.cpp's tools are built once (default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL records (must be empty or absent)")
    args = ap.parse_args()
    from viasd.models.loading import load_model, zoo_gguf_verified
    from viasd.models.zoo import ZOO

    models = args.models.split(",")
    if bad := [m for m in models if m not in ZOO]:
        ap.error(f"--models: not zoo aliases: {', '.join(bad)} (choose from {', '.join(ZOO)})")
    if args.rounds < 1 or args.tokens < 2:
        ap.error("--rounds must be >= 1 and --tokens >= 2")
    if args.out.exists() and args.out.stat().st_size:
        ap.error(f"{args.out} is not empty: compare within one run only (start from an empty file)")
    binary = args.llama_bench or build_llama_cpp(args.llama_cpp_build, "llama-bench")
    if not binary.is_file():
        ap.error(f"--llama-bench: {binary}: no such file")
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    records = Records(args.out, {**environment(), "llama_bench": str(binary), "llama_cpp_build": build_options(binary)})
    print(f"run {run_id}; {args.threads} threads; {records.env['cpu_flags']}")
    print(f"{'model':22s} {'viasd ar tok/s':>16s} {'llama-bench tg':>16s} {'ratio (median)':>15s}")
    for name in models:
        model = load_model(name, progress=False)
        gguf = zoo_gguf_verified(ZOO[name], progress=False)
        ids = model.encode(PROMPT)
        viasd_ar(model, ids, 8)  # warm-up (graphs, kernels); llama-bench warms up inside each call
        config = {"model": name, "gguf": gguf.name, "tokens": args.tokens, "threads": args.threads, "prompt_tokens": len(ids),
                  "weights": model.weights, "kernels": model.kernels}
        rates: dict[str, list[float]] = {"viasd-ar": [], "llama-bench": []}
        for i in range(args.rounds):
            for arm in ("viasd-ar", "llama-bench") if i % 2 == 0 else ("llama-bench", "viasd-ar"):
                if arm == "viasd-ar":
                    viasd_ar(model, ids, 8)  # a warm-up before each measured call, as llama-bench runs one in each call
                    r = viasd_ar(model, ids, args.tokens)
                    rec = {"tokens_per_s": round(r["tokens_per_s"], 3), "tokens": r["tokens"], "wall_s": round(r["wall_s"], 4)}
                else:
                    b = llama_bench(binary, gguf, args.tokens, args.threads)
                    rec = {"tokens_per_s": round(b["avg_ts"], 3), "tokens": b["n_gen"],
                           "llama_bench": {k: b.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "n_threads",
                                                                 "model_type", "model_size", "n_batch", "type_k", "samples_ts")}}
                rates[arm].append(rec["tokens_per_s"])
                records.write(run_id=run_id, round=i, arm=arm, **rec, config=config)
        ratios = [a / b for a, b in zip(rates["viasd-ar"], rates["llama-bench"]) if b > 0]
        print(f"{name:22s} {median(rates['viasd-ar']):16.1f} {median(rates['llama-bench']):16.1f} {median(ratios):14.2f}x", flush=True)
        del model
    print(f"records: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
