"""What the chat page's extras cost a served request: per-token provenance (`viasd.provenance`) and
`logprobs`, against the same streamed request without them, `viasd generate` and llama-server.

One `viasd serve` (one model load) answers every arm; for each prompt the arms run back to back, their
order rotated from prompt to prompt, each repeated `--repeats` times:
    plain        streamed chat completion, no extras (what any OpenAI client sends)
    provenance   the same with `"viasd": {"provenance": true}` (what the chat page sends)
    logprobs     the same with `logprobs: true, top_logprobs: 5`
    generate     `viasd generate --json` on the same prompt (a process of its own: it loads the model)
    llama-server the same streamed request to llama.cpp's server on the same GGUF (--llama-server BIN), `ar`
Greedy; every viasd arm's text must equal `plain`'s. Decode-only tokens/s: the server's own statistics
(viasd's `decode_tokens_per_s`; llama-server's timings counted the same way, the tokens after the first
over the time after it) and, for the streamed arms, the client's (chunks after the first over the time
after it). One JSONL record per request (run id, configuration, environment with the CPU flags); the
summary gives medians over prompts of per-prompt ratios to `plain`.

    python benchmarks/provenance.py --out benchmarks/out/provenance.jsonl
    python benchmarks/provenance.py --prompts 1 --repeats 1 --max-tokens 16 --model smollm2-135m --out /tmp/p.jsonl  # smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment  # noqa: E402
from load import PROMPTS, LlamaServer, Server, _cli_flags, build_options, cpu_flags, log  # noqa: E402
from structured import run_id_of  # noqa: E402

ARMS = {  # name -> extra request fields (None: not a request to viasd serve)
    "plain": {},
    "provenance": {"viasd": {"provenance": True}},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "generate": None,
    "llama-server": None,
}
SETTLE_S = 1.0  # idle before each arm: viasd sizes its threads from the load of the last 0.5 s


def stream(url: str, body: dict) -> dict:
    """One streamed chat completion: its text, the server's last-chunk statistics, client timings."""
    import httpx

    t0 = time.perf_counter()
    stamps, text, last = [], [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"[provenance] the server answered {r.status_code}: {r.read()[-300:]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            piece = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
            last = event
    client = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 and stamps[-1] > stamps[0] else None
    return {"text": "".join(text), "wall_s": round(time.perf_counter() - t0, 4), "chunks": len(stamps),
            "client_decode_chunks_per_s": round(client, 3) if client else None, "last": last}


def viasd_arm(url: str, args, prompt: str, arm: str) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": 0.0, **ARMS[arm]}
    body["viasd"] = {**args.ext, **body.get("viasd", {})}
    out = stream(url, body)
    st = (out.pop("last").get("viasd") or {}).get("stats") or {}
    return {**out, "new_tokens": st.get("new_tokens"), "decode_tokens_per_s": st.get("decode_tokens_per_s"),
            "sources": st.get("sources")}


def peer_arm(url: str, args, prompt: str) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": 0.0, "cache_prompt": False, "timings_per_token": False}
    out = stream(url, body)
    t = out.pop("last").get("timings") or {}
    n, ms = t.get("predicted_n"), t.get("predicted_ms")
    return {**out, "new_tokens": n, "decode_tokens_per_s": round((n - 1) / (ms / 1e3), 3) if n and n > 1 and ms else None}


def generate_arm(args, prompt: str) -> dict:
    t0 = time.perf_counter()
    cli = subprocess.run([sys.executable, "-m", "viasd", "generate", prompt, "-m", args.model, "-q", "--json",
                          "-n", str(args.max_tokens), *_cli_flags(args.ext)], capture_output=True, text=True)
    if cli.returncode != 0:
        raise SystemExit(f"[provenance] viasd generate failed: {cli.stderr[-300:]}")
    rec = json.loads(cli.stdout)
    return {"text": rec["text"], "wall_s": round(time.perf_counter() - t0, 4), "new_tokens": rec["stats"]["new_tokens"],
            "decode_tokens_per_s": rec["stats"]["decode_tokens_per_s"]}


def summary(records: list[dict], arms: list[str]) -> list[str]:
    """Per arm: the median over prompts of (the arm's median decode tok/s / plain's), with the range."""
    lines = []
    for field in ("decode_tokens_per_s", "client_decode_chunks_per_s"):
        for arm in arms:
            if arm == "plain":
                continue
            ratios = []
            for prompt in dict.fromkeys(r["prompt"] for r in records):
                mine = [r[field] for r in records if r["prompt"] == prompt and r["arm"] == arm and r.get(field)]
                base = [r[field] for r in records if r["prompt"] == prompt and r["arm"] == "plain" and r.get(field)]
                if mine and base:
                    ratios.append(float(np.median(mine) / np.median(base)))
            if ratios:
                lines.append(f"{arm:>12} / plain, {field}: median {np.median(ratios):.3f} (per prompt {min(ratios):.3f}-{max(ratios):.3f}, "
                             f"{len(ratios)} prompts)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--strategy", default="viasd", help="the viasd arms' strategy (default: %(default)s, lossless, pld drafts)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of load.py's prompts (default: all %(default)s)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--arms", default="plain,provenance,logprobs,generate", help=f"of {','.join(ARMS)}")
    p.add_argument("--llama-server", help="a llama-server binary (as benchmarks/load.py builds it) for the llama-server arm")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if bad := [a for a in arms if a not in ARMS]:
        p.error(f"unknown arm(s) {bad}: choose from {', '.join(ARMS)}")
    if "llama-server" in arms and not args.llama_server:
        p.error("the llama-server arm needs --llama-server BIN")
    args.ext = {"strategy": args.strategy, **({"mode": "lossless", "draft": "pld"} if args.strategy == "viasd" else {})}
    existing = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    run_id = run_id_of(existing, False, args.out)
    env = {**environment(), "cpu_flags": cpu_flags()}
    config = {"model": args.model, "ext": args.ext, "max_tokens": args.max_tokens, "repeats": args.repeats, "arms": arms}
    server = Server(args.model, 0, 600, ["--prefix-cache-mb", "0"])
    peer = None
    if "llama-server" in arms:
        from viasd.models.loading import zoo_gguf_verified
        from viasd.models.zoo import ZOO

        peer = LlamaServer(Path(args.llama_server), zoo_gguf_verified(ZOO[args.model]), 1, 4096, 2, 600)
        config["peer_build"] = build_options(Path(args.llama_server))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    try:
        viasd_arm(server.url, args, "Hello.", "plain")  # a server is timed warm, as it serves
        if peer is not None:
            peer_arm(peer.url, args, "Hello.")
        for i, prompt in enumerate(PROMPTS[: args.prompts]):
            order = arms[i % len(arms):] + arms[: i % len(arms)]
            for repeat in range(args.repeats):
                for arm in order:
                    time.sleep(SETTLE_S)
                    out = (generate_arm(args, prompt) if arm == "generate" else peer_arm(peer.url, args, prompt)
                           if arm == "llama-server" else viasd_arm(server.url, args, prompt, arm))
                    rec = {"run_id": run_id, "prompt": prompt, "arm": arm, "repeat": repeat, **out, "config": config, "env": env}
                    records.append(rec)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    log(f"[provenance] {arm:>12} #{repeat} {prompt[:30]!r}: decode {out['decode_tokens_per_s']} tok/s")
    finally:
        server.stop()
        if peer is not None:
            peer.stop()
    plain = {r["prompt"]: r["text"] for r in records if r["arm"] == "plain"}
    same = [r["text"] == plain[r["prompt"]] for r in records if r["arm"] in ("provenance", "logprobs", "generate")]
    print(f"run {run_id}: {sum(same)}/{len(same)} viasd answers equal plain's")
    for line in summary(records, arms):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
