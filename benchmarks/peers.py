"""Peer benchmark: llama.cpp against viasd on the same GGUF file and prompts, in one run.

llama.cpp runs through llama-cpp-python (built from source at install: `pip install -e '.[peers]'`):
its plain greedy decoding ("llama.cpp") and its prompt-lookup decoding ("llama.cpp-lookup",
`LlamaPromptLookupDecoding`). viasd runs the methods given (`viasd bench` names: ar, pld, sd,
viasd-lossless:pld, ...) with its default weights (native: the same file's blocks). Every method sees
the same prompt token ids (the viasd tokenizer's chat template), interleaved per prompt, greedy.

    python benchmarks/peers.py -m smollm2-135m --tasks spec_bench --limit 1 -n 64 \\
        --out benchmarks/out/peers-smollm2.jsonl

Each record: run id, method, prompt, token ids, wall time, time to first token, decode-only tokens/s
(tokens after the first over the time after it), the configuration and the environment (CPU flags).
The summary gives medians of per-prompt ratios against llama.cpp's plain decoding, decode-only and
wall, and the share of prompts on which viasd's greedy output equals llama.cpp's. Start from an empty
output file: the script refuses to append to one that has records of another run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment  # noqa: E402

from viasd import generate  # noqa: E402
from viasd.bench import load_tasks, parse_methods  # noqa: E402
from viasd.models.loading import load_model, zoo_gguf_verified  # noqa: E402
from viasd.models.zoo import ZOO  # noqa: E402

PEERS = ("llama.cpp", "llama.cpp-lookup")


def _llama(path: Path, lookup: int | None, n_ctx: int, threads: int):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        sys.exit("benchmarks/peers.py needs llama-cpp-python: pip install -e '.[peers]' (builds llama.cpp from source)")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # n_batch = n_ctx: llama-cpp-python sizes its logits array by n_batch, and with a draft model a
    # prompt longer than one batch then fails ("could not broadcast ... into shape (0,)")
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                 draft_model=draft, seed=0)


def llama_worker(gguf: str, lookup: int, n_ctx: int, threads: int) -> int:
    """The llama.cpp side, in a process of its own (llama-cpp-python bundles its own ggml, which must
    not meet viasd's in one process): one JSON request a line on stdin, one result a line on stdout."""
    import llama_cpp

    peers = {"llama.cpp": _llama(Path(gguf), None, n_ctx, threads), "llama.cpp-lookup": _llama(Path(gguf), lookup, n_ctx, threads)}
    print(json.dumps({"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = run_llama(peers[req["method"]], req["ids"], req["n"], set(req["eos"]))
        except Exception as e:  # noqa: BLE001  (recorded, and the run goes on)
            out = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(out), flush=True)
    return 0


class LlamaPeer:
    """The parent's handle on the worker process."""

    def __init__(self, gguf: Path, lookup: int, n_ctx: int, threads: int, path: str | None):
        import os
        import subprocess

        env = dict(os.environ)
        if path:  # another llama-cpp-python build (pip install --target DIR), e.g. one without AMX
            env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, __file__, "--llama-worker", str(gguf), "--lookup", str(lookup),
                                      "--threads", str(threads), "--n-ctx", str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self.proc.stdout.readline())

    def run(self, method: str, ids: list[int], n: int, eos: set[int]) -> dict:
        self.proc.stdin.write(json.dumps({"method": method, "ids": ids, "n": n, "eos": sorted(eos)}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"the llama.cpp worker died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run_llama(llm, prompt: list[int], n: int, eos: set[int]) -> dict:
    """Greedy decoding of up to n tokens (stops after an end token, which is kept, as viasd does)."""
    llm.reset()  # no prefix reuse across prompts: every method prefills the whole prompt
    out, t0, first = [], time.perf_counter(), None
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter() - t0
        out.append(int(tok))
        if len(out) >= n or tok in eos:
            break
    wall = time.perf_counter() - t0
    return {"token_ids": out, "wall_s": wall, "first_token_s": first}


def decode_rate(r: dict) -> float:
    n, wall, first = len(r["token_ids"]), r["wall_s"], r["first_token_s"]
    return (n - 1) / (wall - first) if n > 1 and first is not None and wall > first else 0.0


def table(path: Path, run: str | None = None) -> str:
    """The Markdown table (as in docs/performance.md) of one run of a records file: per method, medians
    over prompts of its decode rate, its decode and wall speed ratios to llama.cpp's plain decoding and
    its decode ratio to viasd `ar`, its time to first token, and on how many prompts its tokens equal
    `ar`'s and llama.cpp's."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = sorted({r["run_id"] for r in records})
    if run is None and len(runs) > 1:
        sys.exit(f"{path} holds {len(runs)} runs ({', '.join(runs)}): name one with --run")
    records = [r for r in records if r["run_id"] == (run or runs[0])]
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for r in records:
        by_prompt.setdefault((r["task"], r["prompt_id"]), {})[r["method"]] = r
    methods = list(dict.fromkeys(r["method"] for r in records))
    med = statistics.median
    lines = ["| method | decode tok/s | decode x llama.cpp | wall x llama.cpp | decode x `ar` | TTFT ms | same tokens as `ar` "
             "| as llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        rows = [(p, p[m]) for p in by_prompt.values() if m in p]
        rate = lambda r: r["decode_tokens_per_s"]  # noqa: E731
        per_token = lambda r: r["new_tokens"] / r["wall_s"]  # noqa: E731
        d_llama = [rate(r) / rate(p["llama.cpp"]) for p, r in rows if rate(r) > 0 and rate(p["llama.cpp"]) > 0]
        w_llama = [per_token(r) / per_token(p["llama.cpp"]) for p, r in rows]
        d_ar = [rate(r) / rate(p["ar"]) for p, r in rows if "ar" in p and rate(r) > 0 and rate(p["ar"]) > 0]
        same_ar = sum(r["token_ids"] == p["ar"]["token_ids"] for p, r in rows if "ar" in p)
        same_llama = sum(r["token_ids"] == p["llama.cpp"]["token_ids"] for p, r in rows)
        name = m if m.startswith("llama.cpp") else f"`{m}`"
        lines.append(f"| {name} | {med([rate(r) for _, r in rows]):.1f} | {med(d_llama):.2f} | {med(w_llama):.2f} | "
                     f"{med(d_ar):.2f} | {1000 * med([r['first_token_s'] for _, r in rows]):.0f} | {same_ar}/{len(rows)} | "
                     f"{same_llama}/{len(rows)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m", help="a zoo alias (its GGUF is what both run)")
    ap.add_argument("--drafter", help="a zoo alias for viasd's sd / :model methods")
    ap.add_argument("--methods", default="ar,pld,viasd-lossless:pld", help="viasd methods (viasd bench names)")
    ap.add_argument("--tasks", default="spec_bench")
    ap.add_argument("--limit", type=int, default=1, help="prompts per task")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64)
    ap.add_argument("--lookup", type=int, default=4, help="llama.cpp prompt lookup: tokens drafted per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--llama-worker", metavar="GGUF", help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context (prompts that do not fit are skipped)")
    ap.add_argument("--peer-path", help="a directory holding another llama-cpp-python build, for the llama.cpp side")
    ap.add_argument("--table", type=Path, metavar="FILE", help="print the Markdown table of a records file (one run) and exit")
    ap.add_argument("--run", help="with --table: the run id to tabulate, when the file holds several")
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker(args.llama_worker, args.lookup, args.n_ctx, args.threads)
    if args.table:
        if not args.table.is_file():
            ap.error(f"{args.table}: no such file")
        print(table(args.table, args.run))
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.model not in ZOO:
        ap.error(f"--model must be a zoo alias ({', '.join(ZOO)})")
    if args.out.exists() and args.out.stat().st_size:
        ap.error(f"{args.out} is not empty: compare methods within one run only (start from an empty file)")
    import torch

    torch.set_num_threads(args.threads)
    methods = parse_methods(args.methods)
    prompts = load_tasks(args.tasks, args.limit)
    model = load_model(args.model, progress=False)
    drafter = load_model(args.drafter, progress=False) if args.drafter else None
    gguf = zoo_gguf_verified(ZOO[args.model], progress=False)
    peer = LlamaPeer(gguf, args.lookup, args.n_ctx, args.threads, args.peer_path)
    eos = set(model.eos_token_ids)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    env = {**environment(), "llama_cpp_python": peer.info["version"], "llama_cpp_system_info": peer.info["system_info"],
           "weights": model.weights, "kernels": model.kernels, "drafter_kernels": drafter.kernels if drafter else None}

    # warm-up (not recorded): first calls build graphs and caches
    warm = model.encode("Hello")
    for name in PEERS:
        peer.run(name, warm, 4, eos)
    for _, settings in methods:  # every method once: graphs, and the pass costs --adapt-k measures once per model
        generate(warm, model, drafter=drafter if settings.get("strategy") == "sd" or settings.get("draft") == "model" else None,
                 max_new_tokens=4, **settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ratios: dict[str, dict[str, list[float]]] = {}
    same: dict[str, list[bool]] = {}
    with open(args.out, "w") as f:
        for p in prompts:
            ids = model.encode(p.text)
            if len(ids) + args.max_new_tokens + args.lookup + 8 > args.n_ctx:
                print(f"{p.task}/{p.id}: {len(ids)} prompt tokens do not fit llama.cpp's context ({args.n_ctx}): skipped", flush=True)
                continue
            results = {}
            for name in PEERS:
                results[name] = peer.run(name, ids, args.max_new_tokens, eos)
                if "error" in results[name]:
                    sys.exit(f"{p.task}/{p.id}: {name} failed: {results[name]['error']}")
            for name, settings in methods:
                r = generate(ids, model, drafter=drafter if settings.get("strategy") == "sd" or settings.get("draft") == "model" else None,
                             max_new_tokens=args.max_new_tokens, **settings)
                s = r.stats.to_dict()
                results[name] = {"token_ids": r.token_ids, "wall_s": s["wall_s"], "first_token_s": s["first_token_s"], "stats": s}
            for name, r in results.items():
                rec = {"run_id": run_id, "task": p.task, "prompt_id": p.id, "method": name, "prompt_tokens": len(ids),
                       "new_tokens": len(r["token_ids"]), "wall_s": round(r["wall_s"], 4),
                       "first_token_s": round(r["first_token_s"] or 0, 4),
                       "decode_tokens_per_s": round(decode_rate(r), 3), "token_ids": r["token_ids"],
                       "equals_llama_cpp": r["token_ids"] == results["llama.cpp"]["token_ids"],
                       "config": {"model": args.model, "drafter": args.drafter, "max_new_tokens": args.max_new_tokens,
                                  "lookup": args.lookup, "threads": args.threads, "settings": dict(methods).get(name)},
                       "stats": r.get("stats"), "env": env}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                base = results["llama.cpp"]
                ratios.setdefault(name, {"decode": [], "wall": []})
                if decode_rate(base) > 0 and decode_rate(r) > 0:
                    ratios[name]["decode"].append(decode_rate(r) / decode_rate(base))
                if r["wall_s"] > 0:
                    # per token: methods may stop at an end token at different lengths
                    ratios[name]["wall"].append((len(r["token_ids"]) / r["wall_s"]) / (len(base["token_ids"]) / base["wall_s"]))
                same.setdefault(name, []).append(r["token_ids"] == base["token_ids"])
            print(f"{p.task}/{p.id}: " + ", ".join(f"{n} {decode_rate(r):.1f}" for n, r in results.items()) + " decode tok/s", flush=True)
    print(f"\nrun {run_id}: {len(same.get('llama.cpp', []))} prompts, {args.model}, weights {model.weights}, "
          f"CPU {env['cpu']} {env['cpu_flags']}")
    print(f"llama.cpp {peer.info['version']}: {peer.info['system_info']}")
    print(f"{'method':28s} {'decode x llama.cpp':>19s} {'wall x llama.cpp':>17s} {'same tokens':>12s}")
    for name in ratios:
        d, w = ratios[name]["decode"], ratios[name]["wall"]
        print(f"{name:28s} {statistics.median(d) if d else float('nan'):19.2f} {statistics.median(w) if w else float('nan'):17.2f} "
              f"{sum(same[name])}/{len(same[name]):>8}")
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
