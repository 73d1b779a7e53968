"""Single-request decoding beside a busy process: the thread count that follows the machine
(`viasd.compute.ThreadBudget`, the default) against a fixed count of every core
(VIASD_THREADS=<cores>, what viasd did before), idle and beside one process that keeps a core busy.

Each (prompt, condition) is one `viasd generate --json` process, or with `--served` one request to a
`viasd serve` process of that thread policy (two servers, started once), sent after `IDLE_S` seconds
in which the server had nothing to do, as a server's requests come (the thread count's path after an
idle spell); the four conditions run in a rotating order prompt by prompt, so that drift of the
machine's speed falls on all of them alike. Records (JSONL, one per decode, with the run id,
configuration and CPU flags) go to --out; the summary gives each condition's median decode-only
tokens/s and the busy / idle ratio of each thread policy, as medians of per-prompt ratios.

    python benchmarks/busy.py --model smollm2-135m --prompts 6 --max-tokens 64 [--served]
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from load import PROMPTS, Server, chat, cpu_flags  # noqa: E402

HERE = Path(__file__).resolve().parent
BUSY = "while True: pass"  # one core kept busy
IDLE_S = 3.0  # a served request's idle spell before it: longer than the thread count's `ThreadBudget.STALE`


def policy_env(fixed: int | None) -> dict:
    env = dict(os.environ)
    env.pop("VIASD_THREADS", None)
    if fixed is not None:
        env["VIASD_THREADS"] = str(fixed)
    return env


def decode(model: str, prompt: str, n: int, strategy: str, fixed: int | None) -> dict:
    env = policy_env(fixed)
    r = subprocess.run([sys.executable, "-m", "viasd", "generate", prompt, "-m", model, "-s", strategy, "-n", str(n), "-q", "--json"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"viasd generate failed: {r.stderr[-400:]}")
    return json.loads(r.stdout)["stats"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategy", default="ar")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(HERE / "out" / "busy.jsonl"))
    p.add_argument("--served", action="store_true", help="requests to `viasd serve` after an idle spell, not `viasd generate` processes")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    env = {**environment(), "cpu_flags": cpu_flags(), "cores": cores}
    conditions = [("adaptive", None, False), ("fixed", cores, False), ("adaptive", None, True), ("fixed", cores, True)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rates: dict[tuple[str, bool], list[float]] = {}
    servers: dict[str, Server] = {}
    try:
        if args.served:
            for policy, fixed, _ in conditions[:2]:
                servers[policy] = Server(args.model, 0, 600, ["--strategy", args.strategy], env=policy_env(fixed))
                chat(servers[policy].url, args.model, "Hello.", 16, {"strategy": args.strategy})  # warm: graphs built
        run_prompts(args, conditions, servers, rates, run_id, env, out)
    finally:
        for server in servers.values():
            server.stop()
    print(f"run {run_id} ({args.model}, {args.strategy}, {args.max_tokens} tokens, {cores} cores"
          f"{', served after ' + str(IDLE_S) + ' s idle' if args.served else ''})")
    for policy in ("adaptive", "fixed"):
        idle, busy = rates[(policy, False)], rates[(policy, True)]
        ratios = [b / a for a, b in zip(idle, busy) if a]
        print(f"{policy:8}: idle {np.median(idle):.1f} tok/s, beside a busy process {np.median(busy):.1f} tok/s, "
              f"busy / idle (median per prompt) {np.median(ratios):.2f}")
    print(f"adaptive / fixed beside a busy process (median per prompt): "
          f"{np.median([a / b for a, b in zip(rates[('adaptive', True)], rates[('fixed', True)]) if b]):.2f}")
    return 0


def run_prompts(args, conditions, servers: dict, rates: dict, run_id: str, env: dict, out: Path) -> None:
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        order = conditions[i % 4:] + conditions[: i % 4]
        for policy, fixed, busy in order:
            hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
            try:
                if servers:  # the server idles, the neighbour (if any) running all along
                    time.sleep(IDLE_S)
                    stats = chat(servers[policy].url, args.model, prompt, args.max_tokens, {"strategy": args.strategy})["viasd"]["stats"]
                else:
                    if hog is not None:
                        time.sleep(0.5)  # the neighbour is running before the decode starts
                    stats = decode(args.model, prompt, args.max_tokens, args.strategy, fixed)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            rate = stats["decode_tokens_per_s"]
            rates.setdefault((policy, busy), []).append(rate)
            rec = {"run_id": run_id, "prompt": prompt, "policy": policy, "threads_fixed": fixed, "busy_neighbour": busy,
                   "decode_tokens_per_s": rate, "new_tokens": stats["new_tokens"], "config": vars(args), "env": env}
            with open(out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[busy] {policy:8} {'busy' if busy else 'idle'}: {rate} tok/s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
