"""Structured output against llama-server: JSON-schema extraction and tool calls, constrained, greedy.

One `viasd serve` (one model load) and llama.cpp's `llama-server` on the same GGUF answer the same
prompts in the same run, interleaved per prompt (the order of the methods rotates from prompt to
prompt): (a) `json`: JSON-schema extraction, the schema as `response_format` (`json_schema`,
strict); (b) `tools`: tool calls, the request's `tools` with `tool_choice` (default `required`).
The prompts are BFCL v4's (benchmarks/data/bfcl_structured.jsonl; its README gives source, licence
and selection). Each viasd method names its strategy in the request's `viasd` extension object:

    ar-noforced   constrained ar, without the grammar's forced-token drafts (the baseline)
    ar            constrained ar, the grammar's forced tokens drafted for free (the default)
    pld           prompt-lookup drafts; sd: drafter --drafter; viasd: VIA-SD lossless (pld drafts)
    llama-server  the same `response_format` / `tools` through llama-server's OpenAI endpoint (--jinja)

Every answer is checked alike: `json`: parsed with json.loads, validated with `jsonschema`;
`tools`: the first tool call's name is declared, its arguments parse and validate against that
function's parameters; both: exact match of the arguments against BFCL's acceptable values (strings
compared as BFCL's checker does: case, spaces and ,./-_*^ ignored). Each (prompt, method) is one
JSONL record (run id, full configuration, environment with the CPU flags, the cores other processes
kept busy just before the request (`busy_cores_before`; a warning at the end when over 0.25), the answer, the checks,
client-measured wall time, decode-only tokens/s: viasd's `decode_tokens_per_s`, and llama-server's
`timings` counted alike, (predicted_n - 1) / predicted_ms (its own `predicted_per_second` counts the
first token too); the grammar's drafted and kept tokens). A markdown table closes the
run: per task and method, the shares valid and exact, and medians of per-prompt speed-ups against
`ar-noforced` and against llama-server, decode-only (tokens/s) and wall (the time to the whole
answer: llama-server's JSON spaces its keys, a few more tokens for the same content).

    python benchmarks/structured.py --out benchmarks/out/structured.jsonl            # the full run
    python benchmarks/structured.py --limit 1 --max-tokens 32 --methods ar,llama-server --out /tmp/s.jsonl  # smoke

--out must be empty or absent (one run per file: compare rows of one run only) unless --resume,
which continues the file's run, skipping what is done. Needs `jsonschema` (the bench extra),
and a `viasd serve` that takes `response_format` and `tools` (an older one answers 400: errors in the
records). Run it alone on the machine; every request prefills its whole prompt on both servers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402
from load import LlamaServer, Server, build_llama_server, build_options, cpu_flags, log  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "bfcl_structured.jsonl"
PEER = "llama-server"
BASELINE = "ar-noforced"
METHODS = {  # name -> the request's `viasd` extension object (None: llama-server)
    BASELINE: {"strategy": "ar", "grammar_drafts": False},
    "ar": {"strategy": "ar"},
    "pld": {"strategy": "pld"},
    "sd": {"strategy": "sd"},  # needs --drafter
    "viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld"},
    PEER: None,
}


# --- answers and their checks ---------------------------------------------------------------------

def standardize(s: str) -> str:
    """BFCL's string normalization (ast_checker.standardize_string)."""
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", s).lower().replace("'", '"')


def same_value(got, want) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and float(got) == float(want)
    if isinstance(want, str):
        return isinstance(got, str) and standardize(got) == standardize(want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want))
    return got == want


def exact_match(args, reference: dict) -> bool:
    """`args` against BFCL's acceptable values per argument (`""`: may be left out); no other argument."""
    if not isinstance(args, dict) or any(k not in reference for k in args):
        return False
    for k, acceptable in reference.items():
        if k not in args:
            if "" not in acceptable:
                return False
        elif not any(v != "" and same_value(args[k], v) for v in acceptable):
            return False
    return True


def schema_errors(value, schema: dict) -> str | None:
    """The first validation error of `value` against `schema`, or None when it is valid."""
    import jsonschema

    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    return None if err is None else err.message[:200]


def check_json(row: dict, message: dict) -> dict:
    try:
        value = json.loads(message.get("content") or "")
    except ValueError as e:
        return {"parsed": False, "schema_valid": False, "problem": f"not JSON: {e}"[:200], "exact_match": False}
    problem = schema_errors(value, row["schema"])
    return {"parsed": True, "schema_valid": problem is None, "problem": problem,
            "exact_match": exact_match(value, row["reference"]["arguments"])}


def check_tools(row: dict, message: dict) -> dict:
    """The first tool call: its name declared, its arguments JSON valid against the function's parameters."""
    calls = message.get("tool_calls") or []
    out = {"tool_calls": len(calls), "parsed": False, "schema_valid": False, "exact_match": False}
    if not calls:
        return {**out, "problem": "no tool call"}
    fn = calls[0].get("function") or {}
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in row["tools"]}
    try:
        args = fn.get("arguments")
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        return {**out, "problem": f"arguments not JSON: {e}"[:200]}
    out["parsed"] = True
    if fn.get("name") not in declared:
        return {**out, "problem": f"undeclared function {fn.get('name')!r}"}
    problem = schema_errors(args, declared[fn["name"]])
    ref = row["reference"]
    return {**out, "schema_valid": problem is None, "problem": problem,
            "exact_match": fn["name"] == ref["name"] and exact_match(args, ref["arguments"])}


# --- requests -------------------------------------------------------------------------------------

def request_body(row: dict, model: str, max_tokens: int, tool_choice, ext: dict | None) -> dict:
    body = {"model": model, "messages": row["messages"], "max_tokens": max_tokens, "temperature": 0.0}
    if row["task"] == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": row["schema_name"], "schema": row["schema"], "strict": True}}
    else:
        body["tools"] = row["tools"]
        body["tool_choice"] = tool_choice
    if ext is not None:
        body["viasd"] = ext
    else:
        body["cache_prompt"] = False  # each prompt prefilled whole, as viasd serve does with --prefix-cache-mb 0
    return body


def speeds(answer: dict, peer: bool) -> dict:
    """Decode-only tokens/s and the grammar's drafts, from the server's own statistics."""
    tokens = (answer.get("usage") or {}).get("completion_tokens")
    if peer:
        # llama-server's predicted_per_second is predicted_n over the time from its first token to its
        # last (n tokens over n - 1 intervals: 8% high for 14 tokens); counted as viasd counts its
        # decode_tokens_per_s, the tokens after the first over the time after it
        t = answer.get("timings") or {}
        n, ms = t.get("predicted_n"), t.get("predicted_ms")
        return {"completion_tokens": tokens if tokens is not None else n,
                "decode_tokens_per_s": round((n - 1) / (ms / 1e3), 3) if n and n > 1 and ms else None, "timings": t}
    st = (answer.get("viasd") or {}).get("stats") or {}
    new = st.get("new_tokens", tokens)
    kept = st.get("grammar_accepted")
    return {"completion_tokens": new, "decode_tokens_per_s": st.get("decode_tokens_per_s"),
            "grammar_drafted": st.get("grammar_drafted"), "grammar_accepted": kept,
            "grammar_share": round(kept / new, 4) if new and kept is not None else None,
            "viasd": answer.get("viasd")}


def busy_cores(window: float = 0.5) -> float | None:
    """Cores kept busy over `window` seconds (/proc/stat), sampled while both servers are idle: what
    else runs on the machine."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # all jiffies, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / (t1 - t0)) * (os.cpu_count() or 1), 2) if t1 > t0 else None


def ask(http, url: str, row: dict, body: dict, peer: bool) -> dict:
    """One non-streamed request: the client-measured wall time, the answer, its checks and speeds."""
    t0 = time.perf_counter()
    try:
        r = http.post(url + "/v1/chat/completions", json=body)
    except Exception as e:  # a transport error is this record's error; the run goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300], "wall_s": round(time.perf_counter() - t0, 4)}
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:300]}", "wall_s": round(wall, 4)}
    answer = r.json()
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    checks = (check_json if row["task"] == "json" else check_tools)(row, message)
    out = {"ok": True, "error": None, "wall_s": round(wall, 4), "finish_reason": choice.get("finish_reason"),
           "answer": {"content": message.get("content"), "tool_calls": message.get("tool_calls")},
           "prompt_tokens": (answer.get("usage") or {}).get("prompt_tokens"), **checks, **speeds(answer, peer)}
    n = out.get("completion_tokens")
    out["wall_tokens_per_s"] = round(n / wall, 3) if n and wall > 0 else None
    return out


# --- the run --------------------------------------------------------------------------------------

def load_rows(path: Path, tasks: list[str], limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    picked = []
    for task in tasks:
        of_task = [r for r in rows if r["task"] == task]
        picked += of_task[:limit] if limit else of_task
    return picked


def read_records(out: Path) -> list[dict]:
    """The records of `out`; a torn last line (a killed run) is cut off the file."""
    if not out.exists():
        return []
    lines = out.read_text().splitlines(keepends=True)
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i != len(lines) - 1:
                raise SystemExit(f"[structured] {out}: line {i + 1} is not JSON; not resuming over it") from None
            out.write_text("".join(lines[:i]))
            log(f"[structured] cut a torn last line off {out}")
    return records


def run_id_of(records: list[dict], resume: bool, out: Path) -> str:
    """A new run id for an empty --out; with --resume, the run id of the records already there."""
    if records and not resume:
        raise SystemExit(f"[structured] {out} is not empty: give a new --out (one run per file) or --resume")
    ids = {r.get("run_id") for r in records}
    if len(ids) > 1:
        raise SystemExit(f"[structured] {out} holds several runs ({', '.join(map(str, ids))}): not resuming")
    return ids.pop() if ids else time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def start_servers(args) -> dict:
    """`viasd serve` and llama-server as the methods need them (or the given --viasd-url / --llama-url)."""
    from viasd.models.loading import zoo_gguf_verified
    from viasd.models.zoo import ZOO

    s = {"viasd": None, "peer": None, "viasd_url": args.viasd_url, "peer_url": args.llama_url, "peer_build": None}
    if any(m != PEER for m in args.method_list) and not args.viasd_url:
        extra = ["--drafter", args.drafter] if args.drafter and "sd" in args.method_list else []
        s["viasd"] = Server(args.model, 0, args.startup_timeout, extra + args.server_args.split())
        s["viasd_url"] = s["viasd"].url
    if PEER in args.method_list and not args.llama_url:
        binary = Path(args.llama_server) if args.llama_server else build_llama_server(Path(args.llama_server_build))
        s["peer_build"] = build_options(binary)
        s["peer"] = LlamaServer(binary, zoo_gguf_verified(ZOO[args.model]), 1, args.ctx, args.threads,
                                args.startup_timeout, ("--jinja",))
        s["peer_url"] = s["peer"].url
    return s


def warm_up(http, servers: dict, rows: list[dict], args) -> None:
    """One short request per method on each task's first prompt (first calls pay allocation); a failure is logged."""
    for method in args.method_list:
        peer = method == PEER
        url = servers["peer_url" if peer else "viasd_url"]
        for task in args.task_list:
            row = next((r for r in rows if r["task"] == task), None)
            if row is None:
                continue
            out = ask(http, url, row, request_body(row, args.model, 8, args.tool_choice, METHODS[method]), peer)
            if not out["ok"]:
                log(f"[structured] warm-up of {method} on {task} failed: {out['error']}")


def run(args, rows: list[dict], servers: dict, records: list[dict], run_id: str, env: dict) -> list[dict]:
    """Every (prompt, method) not yet in `records`, interleaved per prompt; each record appended at once."""
    import httpx

    done = {(r["prompt_id"], r["method"]) for r in records}
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not k.endswith("_list")}
    cmds = {m: (servers["peer"] if m == PEER else servers["viasd"]) for m in args.method_list}
    with httpx.Client(timeout=httpx.Timeout(args.request_timeout)) as http:
        warm_up(http, servers, rows, args)
        for i, row in enumerate(rows):
            order = args.method_list[i % len(args.method_list):] + args.method_list[:i % len(args.method_list)]
            for position, method in enumerate(order):
                if (row["id"], method) in done:
                    continue
                peer = method == PEER
                body = request_body(row, args.model, args.max_tokens, args.tool_choice, METHODS[method])
                load = busy_cores()  # our servers idle: what else runs (timings mean little then)
                out = ask(http, servers["peer_url" if peer else "viasd_url"], row, body, peer)
                rec = {"run_id": run_id, "task": row["task"], "prompt_id": row["id"], "source": row["source"], "method": method,
                       "request_viasd": METHODS[method], "position": position, "busy_cores_before": load, **out,
                       "server_cmd": cmds[method].cmd if cmds[method] else None,
                       "peer_build": servers["peer_build"] if peer else None, "config": config, "env": env}
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                records.append(rec)
                log(f"[structured] {row['id']} {method}: {'ok' if out['ok'] else out['error'][:120]}"
                    + (f", valid {out['schema_valid']}, exact {out['exact_match']}, {out['completion_tokens']} tok, "
                       f"decode {out['decode_tokens_per_s']} tok/s, wall {out['wall_s']} s" if out["ok"] else ""))
    return records


# --- the summary ----------------------------------------------------------------------------------

def ratio(records: list[dict], method: str, against: str, field: str) -> float | None:
    """Median over prompts of `method`'s speed-up over `against` on the same prompt: the ratio of their
    `field`, a rate (tokens/s), or of `against`'s over `method`'s for a time (`wall_s`: the answer's
    time, which compares answers of different lengths, as llama-server's and viasd's are)."""
    by = {(r["prompt_id"], r["method"]): r.get(field) for r in records if r.get("ok")}
    time_like = field == "wall_s"  # a time, not a rate (decode_tokens_per_s also ends in _s)
    rs = [(by[(p, against)] / by[(p, method)]) if time_like else (by[(p, method)] / by[(p, against)])
          for p, m in by if m == method and by.get((p, method)) and by.get((p, against))]
    return statistics.median(rs) if rs else None


def answer_key(r: dict):
    """What a record answered: its text and its tool calls' names and arguments (not their ids)."""
    a = r.get("answer") or {}
    calls = [(c.get("function") or {}).get("name") for c in a.get("tool_calls") or []]
    args = [(c.get("function") or {}).get("arguments") for c in a.get("tool_calls") or []]
    return a.get("content") or None, calls, args


def same_answer(rs: list[dict], method: str) -> float | None:
    """The share of prompts where `method` answered exactly what the baseline did (greedy lossless: all)."""
    base = {r["prompt_id"]: answer_key(r) for r in rs if r["method"] == BASELINE and r.get("ok")}
    same = [answer_key(r) == base[r["prompt_id"]] for r in rs if r["method"] == method and r.get("ok") and r["prompt_id"] in base]
    return sum(same) / len(same) if same else None


def summary_row(rs: list[dict], method: str) -> list:
    mine = [r for r in rs if r["method"] == method]
    ok = [r for r in mine if r.get("ok")]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    share = lambda key: sum(bool(r.get(key)) for r in mine) / len(mine) if mine else None  # noqa: E731
    grammar = [r["grammar_share"] for r in ok if r.get("grammar_share") is not None]
    return [method, len(mine), len(mine) - len(ok), share("schema_valid"), share("exact_match"),
            med([r["decode_tokens_per_s"] for r in ok if r.get("decode_tokens_per_s")]),
            med([r["wall_tokens_per_s"] for r in ok if r.get("wall_tokens_per_s")]), med(grammar), same_answer(rs, method),
            ratio(rs, method, BASELINE, "decode_tokens_per_s"), ratio(rs, method, BASELINE, "wall_s"),
            ratio(rs, method, PEER, "decode_tokens_per_s"), ratio(rs, method, PEER, "wall_s")]


def table(records: list[dict], methods: list[str]) -> str:
    head = ("task", "method", "n", "errors", "schema-valid", "exact args", "decode tok/s", "wall tok/s", "grammar-drafted share",
            f"= {BASELINE}",
            f"decode / {BASELINE}", f"wall / {BASELINE}", f"decode / {PEER}", f"wall / {PEER}")
    fmt = lambda x: "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in sorted({r["task"] for r in records}) + ["all"]:
        rs = [r for r in records if task in ("all", r["task"])]
        for method in methods:
            if any(r["method"] == method for r in rs):
                lines.append("| " + " | ".join(fmt(v) for v in [task, *summary_row(rs, method)]) + " |")
    return "\n".join(lines) + ("\n\nmedians over prompts; wall tok/s: completion tokens over the client-measured request time; "
                               "ratios (> 1: faster): medians of per-prompt ratios, decode: of decode-only tokens/s, wall: "
                               "of the client-measured times to the whole answer (answers' lengths differ between servers); "
                               f"= {BASELINE}: the share of prompts answered exactly as {BASELINE} answered")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="zoo model both servers load (default: %(default)s)")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="the sd method's drafter (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from %(default)s")
    p.add_argument("--tasks", default="json,tools", help="comma-separated: json, tools (default: %(default)s)")
    p.add_argument("--data", type=Path, default=DATA, help="the prompts' JSONL (default: %(default)s)")
    p.add_argument("--limit", type=int, help="the first N prompts of each task (default: all)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--tool-choice", default="required", help="tool_choice of the tool-call requests (default: %(default)s)")
    p.add_argument("--out", type=Path, default=HERE / "out" / "structured.jsonl", help="JSONL records (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out, skipping the (prompt, method) pairs recorded (errors included)")
    p.add_argument("--viasd-url", help="a running `viasd serve` on loopback to use instead of starting one")
    p.add_argument("--llama-url", help="a running llama-server (--jinja) on loopback to use instead of starting one")
    p.add_argument("--llama-server", help="a llama-server binary (default: build one into --llama-server-build)")
    p.add_argument("--llama-server-build", default=str(HERE / "out" / "llama.cpp"),
                   help="where load.py's build lives (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server's threads (default: the cores)")
    p.add_argument("--ctx", type=int, default=4096, help="llama-server's context (default: %(default)s)")
    p.add_argument("--server-args", default="--prefix-cache-mb 0",
                   help="extra `viasd serve` flags, space-separated (default: %(default)s: the same prompt, sent once per "
                        "method, is prefilled whole each time, so wall times compare)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a started server (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take (default: %(default)s)")
    args = p.parse_args(argv)
    args.method_list = [m for m in args.methods.split(",") if m]
    args.task_list = [t for t in args.tasks.split(",") if t]
    if not args.method_list or any(m not in METHODS for m in args.method_list) or len(set(args.method_list)) != len(args.method_list):
        p.error(f"--methods: distinct names from {', '.join(METHODS)}")
    if not args.task_list or any(t not in ("json", "tools") for t in args.task_list):
        p.error("--tasks: json, tools")
    for url in (args.viasd_url, args.llama_url):
        if url and not url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
            p.error("--viasd-url / --llama-url must be loopback addresses")
    if args.max_tokens < 1 or (args.limit is not None and args.limit < 1):
        p.error("--max-tokens and --limit must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = load_rows(args.data, args.task_list, args.limit)
    records = read_records(args.out)
    run_id = run_id_of(records, args.resume, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["prompt_id"], r["method"]) for r in records}
    if all((row["id"], m) in done for row in rows for m in args.method_list):
        log(f"[structured] {args.out}: every (prompt, method) is done")
        print(table(records, args.method_list))
        return 0 if all(r.get("ok") for r in records) else 1
    env = {**environment(), "cpu_flags": cpu_flags()}
    servers = start_servers(args)
    try:
        records = run(args, rows, servers, records, run_id, env)
    finally:
        for key in ("viasd", "peer"):
            if servers[key] is not None:
                servers[key].stop()
    print(table(records, args.method_list))
    busy = [r["busy_cores_before"] for r in records if (r.get("busy_cores_before") or 0) > 0.25]
    if busy:
        log(f"[structured] warning: before {len(busy)} of {len(records)} requests other processes kept over a quarter of a "
            f"core busy (up to {max(busy)} cores): llama-server's spinning threads suffer most; rerun alone")
    log(f"[structured] run {run_id}: {len(records)} record(s) in {args.out}")
    return 0 if all(r.get("ok") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
