"""Speculative decoding against llama.cpp's own: viasd's `sd` and `llama-server --model-draft`, one
request at a time, on the same GGUF files and prompt token ids, in one run.

A user who wants a 1.5B model decoded faster on a CPU with a 0.5B drafter would otherwise run
`llama-server -m BIG.gguf -md SMALL.gguf`. This script runs, per prompt and in an order that rotates
from prompt to prompt: viasd's methods in this process (`viasd.generate`, as `viasd generate` runs
them: native weights, the drafter re-quantized as `sd` loads it), then `llama-server` plain and with
the draft model at each `--draft-max` (llama.cpp's default 16, and viasd's --k 4; its other
speculative settings at their defaults). Both sides decode greedily from the same prompt ids (the viasd
tokenizer's chat template; llama-server's `/completion` takes ids), up to `-n` tokens, keeping an end
token. With `--served`, each viasd method also goes through `viasd serve` (`/v1/completions` with
the ids, its prefix cache off, as generate keeps none between calls; llama-server keeps its slot's
last prompt, which shares only the chat template's opening with the next). Before each side the
machine idles `SETTLE_S` seconds (viasd sizes its thread count from the load of the moment before,
`viasd.compute`).

Decode-only tokens/s is (tokens after the first) / (time after the first token) on both sides: viasd's
`decode_tokens_per_s`; llama-server's `timings` (`predicted_ms` starts when its first token is
sampled, so (predicted_n - 1) / predicted_ms). llama-server's draft model reads the prompt at its first
drafting step, inside `predicted_ms`; viasd's drafter reads it before the first token: on long
prompts compare the wall ratios too. Each record: run id, method, prompt, token ids, wall
time, decode rate, drafted and accepted tokens, the configuration and the environment (CPU flags),
and llama-server's build (`peer_build`). The summary gives medians of per-prompt ratios against viasd
`ar` and against plain llama-server, decode-only and wall (per token), and on how many prompts each
method's tokens equal viasd `ar`'s.

    python benchmarks/spec_peer.py --served --out benchmarks/out/spec-peer.jsonl   # ~17 minutes
    python benchmarks/spec_peer.py --table benchmarks/out/spec-peer.jsonl

llama-server is built once by `load.py`'s `build_llama_server` (`--llama-server BIN` to use another
build): GGML_NATIVE=OFF with this CPU's AVX2 / AVX-512 flags, no AMX.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from load import SETTLE_S, LlamaServer, Server, build_llama_server, build_options  # noqa: E402

from viasd import generate  # noqa: E402
from viasd.bench import drafter_of, load_tasks, parse_methods  # noqa: E402
from viasd.errors import UsageError  # noqa: E402
from viasd.models.loading import load_model, zoo_gguf_verified  # noqa: E402
from viasd.models.zoo import ZOO  # noqa: E402

HERE = Path(__file__).resolve().parent
PLAIN = "llama-server"
SERVE = "viasd serve"


def draft_name(n_max: int) -> str:
    return f"llama-server -md, draft-max {n_max}"


def llama_complete(server: LlamaServer, ids: list[int], n: int) -> dict:
    """One greedy, non-streamed completion of prompt `ids`. (llama-server keeps its slot's last prompt,
    as its speculation requires, which shares only the chat template's opening with the next.)"""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(server.url + "/completion", json={"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                                     "return_tokens": True, "stream": False}, timeout=900)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"llama-server answered {r.status_code}: {r.text[-300:]}")
    body = r.json()
    t = body["timings"]
    tokens = [int(i) for i in body["tokens"]]
    decode = (t["predicted_n"] - 1) / (t["predicted_ms"] / 1000) if t["predicted_n"] > 1 and t["predicted_ms"] > 0 else 0.0
    return {"token_ids": tokens, "text": body["content"], "counted_tokens": t["predicted_n"], "wall_s": wall,
            "first_token_s": t["prompt_ms"] / 1000, "decode_tokens_per_s": decode, "drafted": t.get("draft_n"),
            "accepted": t.get("draft_n_accepted"), "timings": t}


def served_complete(server: Server, model: str, ids: list[int], settings: dict, n: int) -> dict:
    """One greedy, non-streamed completion of prompt `ids` by `viasd serve` (its `viasd` extension
    object carries the method's settings); decode-only tokens/s as the server measured it."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": n,
                                                         "temperature": 0.0, "viasd": settings}, timeout=900)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"viasd serve answered {r.status_code}: {r.text[-300:]}")
    body = r.json()
    st = body["viasd"]["stats"]
    return {"token_ids": None, "text": body["choices"][0]["text"], "counted_tokens": st["new_tokens"], "wall_s": wall,
            "first_token_s": st["first_token_s"], "decode_tokens_per_s": st["decode_tokens_per_s"] or 0.0,
            "drafted": st["drafted"], "accepted": st["accepted"], "stats": st}


def viasd_complete(ids: list[int], model, drafter, settings: dict, n: int) -> dict:
    """`drafter`: the method's drafter model, as `viasd bench` picks it (`bench.drafter_of`), or None."""
    r = generate(ids, model, drafter=drafter, max_new_tokens=n, **settings)
    s = r.stats.to_dict()
    return {"token_ids": list(r.token_ids), "text": r.text, "wall_s": s["wall_s"], "first_token_s": s["first_token_s"],
            "decode_tokens_per_s": s["decode_tokens_per_s"] or 0.0, "drafted": s["drafted"], "accepted": s["accepted"],
            "stats": s}


def decoded(r: dict) -> int:
    """Tokens a side decoded (llama-server's own count, which may exceed the tokens it returned)."""
    return r.get("counted_tokens") or r["new_tokens"]


def same_tokens(r: dict, base: dict) -> bool:
    """`r`'s output is `base`'s: token ids where both sides return them, else text (`viasd serve`
    returns text). At the -n cut llama-server with a draft model returns up to a round's tokens fewer
    than it decoded and counts: there the shorter is compared with the longer one's start, where both
    decoded as many tokens."""
    ids = r["token_ids"] is not None and base["token_ids"] is not None
    a, b = (r["token_ids"], base["token_ids"]) if ids else (r["text"], base["text"])
    n = min(len(a), len(b))
    return a[:n] == b[:n] and (len(a) == len(b) or decoded(r) == decoded(base))


def summary(records: list[dict]) -> str:
    """Per method: median decode tok/s, medians of per-prompt ratios to viasd `ar` and to plain
    llama-server (decode-only, and wall per token), drafts accepted, tokens equal to `ar`'s."""
    by_prompt: dict[tuple, dict[str, dict]] = {}
    for r in records:
        by_prompt.setdefault((r["task"], r["prompt_id"]), {})[r["method"]] = r
    methods = list(dict.fromkeys(r["method"] for r in records))
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    rate = lambda r: r["decode_tokens_per_s"]  # noqa: E731
    per_token = lambda r: decoded(r) / r["wall_s"]  # noqa: E731

    def ratios(m: str, base: str, f) -> list[float]:
        return [f(p[m]) / f(p[base]) for p in by_prompt.values() if m in p and base in p and f(p[m]) > 0 and f(p[base]) > 0]

    lines = ["| method | decode tok/s | decode x viasd `ar` | wall x viasd `ar` | decode x llama-server | wall x llama-server "
             "| drafts accepted | same tokens as `ar` | as llama-server |", "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        rows = [p[m] for p in by_prompt.values() if m in p]
        drafted = sum(r["drafted"] or 0 for r in rows)
        accepted = f"{sum(r['accepted'] or 0 for r in rows) / drafted:.0%}" if drafted else "-"
        same = {base: sum(same_tokens(p[m], p[base]) for p in by_prompt.values() if m in p and base in p) for base in ("ar", PLAIN)}
        name = m if m.startswith("llama") else f"{SERVE} `{m[len(SERVE) + 1:]}`" if m.startswith(SERVE) else f"viasd `{m}`"
        lines.append(f"| {name} | {med([rate(r) for r in rows]):.1f} | {med(ratios(m, 'ar', rate)):.2f} | "
                     f"{med(ratios(m, 'ar', per_token)):.2f} | {med(ratios(m, PLAIN, rate)):.2f} | "
                     f"{med(ratios(m, PLAIN, per_token)):.2f} | {accepted} | {same['ar']}/{len(rows)} | {same[PLAIN]}/{len(rows)} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="the verifier, a zoo alias")
    ap.add_argument("-d", "--drafter", default="qwen2.5-coder-0.5b", help="the drafter, a zoo alias of the same vocabulary")
    ap.add_argument("--methods", default="ar,sd", help="viasd methods (`viasd bench` names; sd drafts with --drafter)")
    ap.add_argument("--draft-max", default="16,4", help="llama-server --draft-max values, one method each")
    ap.add_argument("--tasks", default="spec_bench,human_eval")
    ap.add_argument("--limit", type=int, default=2, help="prompts per task (Spec-Bench: per category)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--served", action="store_true", help="also each viasd method through `viasd serve` (one request at a time)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads (viasd follows the machine)")
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server's context (prompts that do not fit are skipped)")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built into benchmarks/out/llama.cpp)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, metavar="FILE", help="print the summary of a records file (one run) and exit")
    args = ap.parse_args(argv)
    try:
        args.draft_max = [int(x) for x in args.draft_max.split(",") if x]
    except ValueError:
        args.draft_max = [0]
    if not all(n >= 1 for n in args.draft_max):
        ap.error("--draft-max takes comma-separated positive integers")
    if args.table is not None and not args.table.is_file():
        ap.error(f"--table {args.table}: no such file")
    if args.table is None:
        if args.out is None:
            ap.error("--out is required")
        if args.out.exists() and args.out.stat().st_size:
            ap.error(f"{args.out} is not empty: compare methods within one run only (start from an empty file)")
        try:
            methods = parse_methods(args.methods)
        except UsageError as e:
            ap.error(f"--methods: {e}")
        for name, settings in methods:
            if (why := drafter_of(settings, {args.drafter: args.drafter})[1]) is not None:
                ap.error(f"--methods: {name} {why} (the one drafter is --drafter)")
        args.method_list = methods
        if "ar" not in {name for name, _ in methods}:
            ap.error("--methods needs ar: every ratio is taken against it")
        for alias in (args.model, args.drafter):
            if alias not in ZOO:
                ap.error(f"{alias!r} is not a zoo alias ({', '.join(ZOO)})")
    return args


def start_servers(args, servers: dict[str, LlamaServer]) -> Path:
    """llama-server plain and with the draft model at each --draft-max, into `servers` (so that the
    caller stops those started when a later one fails); the binary."""
    gguf, draft_gguf = (zoo_gguf_verified(ZOO[a], progress=False) for a in (args.model, args.drafter))
    binary = args.llama_server or build_llama_server(HERE / "out" / "llama.cpp")
    servers[PLAIN] = LlamaServer(binary, gguf, 1, args.ctx, args.threads, 300)
    for n_max in args.draft_max:
        servers[draft_name(n_max)] = LlamaServer(
            binary, gguf, 1, args.ctx, args.threads, 300,
            extra=("-md", str(draft_gguf), "--draft-max", str(n_max), "-cd", str(args.ctx), "-td", str(args.threads),
                   "-tbd", str(args.threads)))
    return binary


def record(run_id: str, p, side: tuple[str, str, dict | None], order: list[str], ids: list[int], r: dict, config: dict,
           env: dict) -> dict:
    name, way, settings = side
    draft_max = int(name.rsplit(" ", 1)[1]) if way == "llama" and name != PLAIN else None
    return {"run_id": run_id, "task": p.task, "prompt_id": p.id, "method": name, "way": way, "order": order.index(name),
            "prompt_tokens": len(ids), "new_tokens": decoded({**r, "new_tokens": len(r["token_ids"] or [])}), "text": r["text"],
            "wall_s": round(r["wall_s"], 4), "first_token_s": round(r["first_token_s"] or 0, 4),
            "decode_tokens_per_s": round(r["decode_tokens_per_s"], 3), "drafted": r["drafted"], "accepted": r["accepted"],
            "token_ids": r["token_ids"], "returned_tokens": None if r["token_ids"] is None else len(r["token_ids"]),
            "config": {**config, "settings": settings, "draft_max": draft_max},
            "stats": r.get("stats"), "timings": r.get("timings"), "env": env}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        records = [json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]
        if len(runs := {r["run_id"] for r in records}) != 1:
            sys.exit(f"{args.table} holds {len(runs)} runs: one run a file (start each from an empty file)")
        print(summary(records))
        return 0
    methods = args.method_list
    prompts = load_tasks(args.tasks, args.limit)
    model = load_model(args.model, progress=False)
    drafter = load_model(args.drafter, progress=False)
    servers: dict[str, LlamaServer | Server] = {}
    records = []
    try:
        binary = start_servers(args, servers)
        if args.served:
            # no prefix cache: each side sends every prompt, and generate prefills each in full
            servers[SERVE] = Server(args.model, 0, 600, ["--drafter", args.drafter, "--prefix-cache-mb", "0"])
        run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        env = {**environment(), "weights": model.weights, "kernels": model.kernels, "drafter_kernels": drafter.kernels,
               "peer_build": build_options(binary), "peer_binary": str(binary)}
        config = {"model": args.model, "drafter": args.drafter, "max_new_tokens": args.max_new_tokens, "tasks": args.tasks,
                  "limit": args.limit, "threads_llama": args.threads, "ctx_llama": args.ctx}
        sides = ([(name, "generate", dict(s)) for name, s in methods]
                 + [(f"{SERVE} {name}", "serve", dict(s)) for name, s in methods if args.served]
                 + [(name, "llama", None) for name in servers if name != SERVE])

        def run(side: tuple[str, str, dict | None], ids: list[int], n: int) -> dict:
            name, way, settings = side
            if way == "generate":
                return viasd_complete(ids, model, drafter_of(settings, {args.drafter: drafter})[0], settings, n)
            if way == "serve":
                return served_complete(servers[SERVE], args.model, ids, settings, n)
            return llama_complete(servers[name], ids, n)

        warm = model.encode("Hello")  # (not recorded: first calls build graphs, caches and pass costs)
        for side in sides:
            run(side, warm, 8)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for i, p in enumerate(prompts):
                ids = model.encode(p.text)
                if len(ids) + args.max_new_tokens + max(args.draft_max, default=0) + 8 > args.ctx:
                    print(f"{p.task}/{p.id}: {len(ids)} prompt tokens do not fit llama-server's context: skipped", flush=True)
                    continue
                order = sides[i % len(sides):] + sides[: i % len(sides)]  # each side first in turn
                results = {}
                for side in order:
                    time.sleep(SETTLE_S)
                    results[side[0]] = run(side, ids, args.max_new_tokens)
                for side in sides:
                    records.append(record(run_id, p, side, [n for n, _, _ in order], ids, results[side[0]], config, env))
                    f.write(json.dumps(records[-1]) + "\n")
                    f.flush()
                print(f"{p.task}/{p.id}: " + ", ".join(f"{n} {results[n]['decode_tokens_per_s']:.1f}" for n, _, _ in sides)
                      + " decode tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print(f"\nrun {run_id}: {len({(r['task'], r['prompt_id']) for r in records})} prompts, {args.model} with "
          f"{args.drafter}, CPU {env.get('cpu')} {env.get('cpu_flags')}\nllama-server build: {env['peer_build']}")
    print(summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
