"""Load test of `viasd serve` on loopback, beside llama.cpp's `llama-server` on the same GGUF.

For each deployment (one viasd process; N Ray Serve replicas; `llama-server -np MAX` as the peer) the
script starts the server itself on a free loopback port, warms each strategy up, then for every
(strategy, N clients) cell runs N clients that each send streaming greedy completions back to back
for --duration seconds; requests still running then get --grace seconds to finish (after that they
are cancelled and counted as incomplete). The strategy is chosen per request through the `viasd`
extension object, so one server (one model load) serves every strategy; llama-server serves `ar`
(plain decoding), and `llama-server-md` serves `sd`: llama-server with --drafter's GGUF as its draft
model (`-md`, its speculative settings at their defaults). Every answer is compared with the same
prompt's answer served alone (the deployment's first, 1-client cell, or a solo pass):
`equal_to_alone` is the share that matches.

Before the cells, a solo phase compares one request served alone with `viasd generate` on the same
prompt, interleaved prompt by prompt: decode-only tokens/s of each (the server's own
`decode_tokens_per_s`, and the CLI's `--json` stats), and their ratio; the served request is sent
again at once and timed too (after an idle spell and right after a decode, apart). llama-server's
records carry how it was built (`peer_build`).

Each cell is one JSONL record (run id, full configuration, environment with the CPU flags from
/proc/cpuinfo, requests/s, generated tokens/s, time to first token and latency p50 / p95, errors);
a table is printed at the end. Run it alone on the machine: the numbers are only meaningful when
nothing else competes for the cores.

    python benchmarks/load.py --deployments process,llama-server --strategies ar --clients 1,4,8,16
    python benchmarks/load.py --duration 2 --clients 1 --deployments process --max-tokens 8   # smoke

llama-server is built once by this script (--llama-server-build DIR, default
benchmarks/out/llama.cpp) from the llama-cpp-python sdist's vendored llama.cpp, with
GGML_NATIVE=OFF and the CPU's own AVX2 / AVX-512 flags and without AMX: the native build dies with
SIGILL (AMX `tilezero`) on every multi-row pass on this project's AMX machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPTS = [  # short, varied; chat completions (the model's chat template), greedy
    "Explain in three sentences why the sky is blue.",
    "def quicksort(xs):",
    "Write a short story about a robot who learns to paint.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Summarize the causes of the French Revolution.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "List five uses of a paperclip:",
    "The three laws of thermodynamics are",
]
STRATEGIES = {  # name -> the request's `viasd` extension object
    "ar": {"strategy": "ar"},
    "pld": {"strategy": "pld"},
    "sd": {"strategy": "sd"},  # needs --drafter
    "self-sd": {"strategy": "self-sd"},
    "viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld"},
    "viasd-tiered": {"strategy": "viasd", "mode": "tiered", "draft": "pld"},
}
DEPLOYMENTS = {"process": 0, "ray2": 2, "llama-server": None, "llama-server-md": None}  # name -> --replicas (None: the peer)
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.16"  # its sdist vendors the llama.cpp the peers extra pins


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`viasd serve` in a subprocess on loopback; SIGTERM (drain) then kill when done."""

    def __init__(self, model: str, replicas: int, startup_timeout: float, extra: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "viasd", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--quiet", "--max-queue", "256", "--drain-timeout", "30", *extra]
        if replicas:
            cmd += ["--replicas", str(replicas)]
        self.cmd = cmd
        log(f"[load] starting: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr, env=env)
        self.wait_ready(startup_timeout)

    name = "the server"

    def ready(self) -> bool:
        import httpx

        r = httpx.post(self.url + "/v1/completions", json={"model": "?", "prompt": "x"}, timeout=5)
        return r.status_code == 404  # the app answers (an unknown model): ready

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"[load] {self.name} exited with status {self.proc.returncode}")
            try:
                if self.ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"[load] {self.name} was not ready within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def build_llama_server(dest: Path) -> Path:
    """llama-server built from the llama-cpp-python sdist's llama.cpp into `dest` (once)."""
    return build_llama_cpp(dest, "llama-server")


def build_llama_cpp(dest: Path, target: str) -> Path:
    """llama.cpp's `target` (llama-server, llama-bench) built from the llama-cpp-python sdist's llama.cpp
    into `dest` (once; the source is kept in dest/src for the next target): GGML_NATIVE=OFF with this
    CPU's AVX2 / AVX-512 flags, no AMX (the native build dies with SIGILL on AMX machines)."""
    binary = dest / "build" / "bin" / target
    if binary.exists():
        return binary
    import tarfile
    import tempfile

    dest.mkdir(parents=True, exist_ok=True)
    build, src = dest / "build", dest / "src" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                            "-d", tmp, "-q"], check=True)
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as t:
                t.extractall(tmp, filter="data")
            shutil.rmtree(dest / "src", ignore_errors=True)
            shutil.move(str(next(Path(tmp).glob("llama_cpp_python-*/"))), dest / "src")
        shutil.rmtree(build, ignore_errors=True)  # (configured against a source that is gone)
    flags = set(cpu_flags())
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for flag, opt in (("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                      ("avx512_bf16", "GGML_AVX512_BF16")):
        opts.append(f"-D{opt}={'ON' if flag in flags else 'OFF'}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *opts], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", target], check=True)
    (dest / "build-options.json").write_text(json.dumps({"source": LLAMA_CPP_PYTHON, "cmake": opts}))
    return binary


def build_options(binary: Path) -> dict | None:
    """How `binary` was built, where `build_llama_server` built it (its `build-options.json`), else None."""
    try:
        return json.loads((binary.parents[2] / "build-options.json").read_text())
    except (IndexError, OSError, ValueError):
        return None


class LlamaServer(Server):
    """llama.cpp's `llama-server` on the same GGUF: `slots` parallel sequences of `ctx` positions each;
    `extra`: more flags (`--jinja` for tool calls)."""

    def __init__(self, binary: Path, gguf: Path, slots: int, ctx: int, threads: int, startup_timeout: float,
                 extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
                    "-c", str(slots * ctx), "-t", str(threads), "-tb", str(threads), "--no-webui", *extra]
        log(f"[load] starting: {' '.join(self.cmd)}")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready(startup_timeout)

    name = "llama-server"

    def ready(self) -> bool:
        import httpx

        return httpx.get(self.url + "/health", timeout=5).status_code == 200


async def one_request(client, url: str, model: str, prompt: str, ext: dict | None, max_tokens: int) -> dict:
    """One streaming greedy completion; `ext` None: a peer server (no `viasd` extension)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if ext is not None:
        body["viasd"] = ext
    t0 = time.perf_counter()
    ttft, tokens, record, error, text, pieces = None, 0, None, None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return {"error": f"HTTP {r.status_code}: {text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("message", "error event")
                continue
            piece = event["choices"][0].get("delta", {}).get("content") if event.get("choices") else None
            if piece:
                text.append(piece)
                pieces += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if event.get("choices") and "viasd" in event:
                record = event["viasd"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    if error:
        return {"error": error}
    stats = (record or {}).get("stats", {})
    return {"ttft": ttft if ttft is not None else latency, "latency": latency, "tokens": tokens or pieces,
            "text": "".join(text), "prompt": prompt, "decode_tokens_per_s": stats.get("decode_tokens_per_s"),
            "mean_accepted_length": stats.get("mean_accepted_length")}


async def run_cell(url: str, model: str, ext: dict | None, clients: int, duration: float, grace: float, max_tokens: int,
                   alone: dict[str, str] | None = None) -> dict:
    """One cell; `alone`: each prompt's text served alone, which every answer here is compared with
    (filled from this cell's answers when empty)."""
    import httpx

    results: list[dict] = []
    errors: list[str] = []
    start = time.perf_counter()
    deadline = start + duration

    async def client_loop(i: int, http) -> None:
        n = 0
        while time.perf_counter() < deadline:
            prompt = PROMPTS[(i + n * clients) % len(PROMPTS)]
            n += 1
            try:
                out = await one_request(http, url, model, prompt, ext, max_tokens)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # transport errors count as errors
                out = {"error": f"{type(e).__name__}: {e}"}
            (errors.append(out["error"]) if "error" in out else results.append(out))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(grace + duration + 60), limits=limits) as http:
        tasks = [asyncio.create_task(client_loop(i, http)) for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=duration + grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    lat = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    mal = [r["mean_accepted_length"] for r in results if r.get("mean_accepted_length")]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 4) if xs else None  # noqa: E731
    if alone is not None:
        for r in results:
            alone.setdefault(r["prompt"], r["text"])
        same = [r["text"] == alone[r["prompt"]] for r in results]
    return {"wall_s": round(wall, 3), "completed": len(results), "errors": len(errors), "error_samples": errors[:3],
            "incomplete": len(pending), "requests_per_s": round(len(results) / wall, 4), "tokens_per_s": round(tokens / wall, 3),
            "generated_tokens": tokens, "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "latency_p50_s": pct(lat, 50), "latency_p95_s": pct(lat, 95),
            "mean_accepted_length": round(float(np.mean(mal)), 4) if mal else None,
            "equal_to_alone": round(sum(same) / len(same), 4) if alone is not None and same else None}


def table(records: list[dict]) -> str:
    head = ("deployment", "strategy", "clients", "req/s", "tok/s", "TTFT p50", "TTFT p95", "latency p50", "latency p95", "errors",
            "incomplete", "= alone")
    fmt = lambda x: "-" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))  # noqa: E731
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        rows.append("| " + " | ".join(fmt(v) for v in (r["deployment"], r["strategy"], r["clients"], r["requests_per_s"], r["tokens_per_s"],
                                                         r["ttft_p50_s"], r["ttft_p95_s"], r["latency_p50_s"], r["latency_p95_s"],
                                                         r["errors"], r["incomplete"], r.get("equal_to_alone"))) + " |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model the server loads (default: %(default)s)")
    p.add_argument("--strategies", default="ar,pld,viasd", help=f"comma-separated, from {', '.join(STRATEGIES)} (default: %(default)s)")
    p.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients (default: %(default)s)")
    p.add_argument("--deployments", default="process,ray2",
                   help="comma-separated: process (one process), ray2 (two Ray Serve replicas), llama-server (plain), "
                        "llama-server-md (with --drafter's GGUF as its draft model) (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each cell issues requests (default: %(default)s)")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds running requests may take to finish after that (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--url", help="use this already running server (loopback) instead of starting one; --deployments names it")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a started server (default: %(default)s)")
    p.add_argument("--out", default=str(HERE / "out" / "load.jsonl"), help="JSONL records, appended (default: %(default)s)")
    p.add_argument("--llama-server", help="a llama-server binary to use (default: build one into --llama-server-build)")
    p.add_argument("--llama-server-build", default=str(HERE / "out" / "llama.cpp"),
                   help="where llama-server is built once (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server's threads (default: the cores)")
    p.add_argument("--ctx", type=int, default=1024, help="positions per llama-server slot (default: %(default)s)")
    p.add_argument("--solo", type=int, default=len(PROMPTS),
                   help="prompts of the solo phase (one request served alone against `viasd generate`; 0: none)")
    p.add_argument("--solo-repeats", type=int, default=3,
                   help="times each solo prompt is run on each side, alternating; the ratio is of the per-prompt medians "
                        "(one pair per prompt left 0.7-1.3x swings on answers of 13-16 tokens) (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `viasd serve` flags, space-separated")
    p.add_argument("--drafter", help="the drafter model of `sd` (given to `viasd serve` and to the solo phase's `viasd generate`)")
    args = p.parse_args(argv)
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.deployment_list = [d.strip() for d in args.deployments.split(",") if d.strip()]
    try:
        args.client_list = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        p.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    bad = [s for s in args.strategy_list if s not in STRATEGIES]
    if bad or not args.strategy_list:
        p.error(f"unknown strategy {bad}: choose from {', '.join(STRATEGIES)}")
    if ("sd" in args.strategy_list or "llama-server-md" in args.deployment_list) and not args.drafter:
        p.error("the sd strategy and the llama-server-md deployment need --drafter MODEL")
    if args.url is None and ([d for d in args.deployment_list if d not in DEPLOYMENTS] or not args.deployment_list):
        p.error(f"--deployments: choose from {', '.join(DEPLOYMENTS)}")
    if args.url is not None and not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        p.error("--url must be a loopback address")
    if any(c < 1 for c in args.client_list) or not args.client_list or args.duration <= 0 or args.grace < 0 or args.max_tokens < 1:
        p.error("--clients >= 1, --duration > 0, --grace >= 0 and --max-tokens >= 1")
    if args.solo_repeats < 1:
        p.error("--solo-repeats must be >= 1")
    return args


SETTLE_S = 1.5  # seconds of idle machine before each side of the solo phase


def solo_phase(url: str, args, strategy: str, run_id: str, env: dict, config: dict) -> list[dict]:
    """One request served alone against `viasd generate` on the same prompt, interleaved per prompt and
    repeated `--solo-repeats` times (generate, served, served again at once, generate, ...): decode-only
    tokens/s of each run, one record per repeat. `solo_summary` compares the per-prompt medians."""
    out = []
    # a server is timed warm, as it serves: its first request after start ran at 0.70x the next
    # ones (16.8 against 21.5-23.2 tok/s, qwen 1.5B); each `viasd generate` is a process of its own
    chat(url, args.model, "Hello.", 16, STRATEGIES[strategy])
    for prompt in PROMPTS[: args.solo]:
        for repeat in range(args.solo_repeats):
            # each side starts on an idle machine: viasd sizes its thread count from the load the rest of
            # the machine put on the cores over the last 0.5 s (compute.py), and the other side has
            # just been decoding flat out
            time.sleep(SETTLE_S)
            cli = subprocess.run([sys.executable, "-m", "viasd", "generate", prompt, "-m", args.model, "-q", "--json",
                                  "-n", str(args.max_tokens), *_cli_flags(STRATEGIES[strategy]),
                                  *(["-d", args.drafter] if args.drafter and strategy == "sd" else [])], capture_output=True, text=True)
            if cli.returncode != 0:
                raise SystemExit(f"[load] viasd generate failed: {cli.stderr[-300:]}")
            cli_rec = json.loads(cli.stdout)
            time.sleep(SETTLE_S)
            served = chat(url, args.model, prompt, args.max_tokens, STRATEGIES[strategy])
            # the same request at once again: the first follows a `viasd generate` process that loaded and
            # ran its own copy of the model, taking the caches (480 MiB L3 on the AMX Xeon), which that
            # process' own load had just filled for itself; the 1.5B's first served request ran its passes
            # 1.2x dearer (0.81-0.86x `generate`), the second at 1.00x, and one after 13.5 s of idle with
            # nothing else running as fast as the second (a probe): a server keeps its caches as it serves
            warm = chat(url, args.model, prompt, args.max_tokens, STRATEGIES[strategy])
            a, b, c = (x["stats"]["decode_tokens_per_s"] for x in (cli_rec, served["viasd"], warm["viasd"]))
            text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
            rec = {"run_id": run_id, "phase": "solo", "strategy": strategy, "prompt": prompt, "repeat": repeat,
                   "new_tokens": served["viasd"]["stats"]["new_tokens"], "generate_decode_tokens_per_s": a,
                   "served_decode_tokens_per_s": b, "ratio": round(b / a, 4) if a and b else None,
                   "served_warm_decode_tokens_per_s": c, "ratio_warm": round(c / a, 4) if a and c else None,
                   "same_text": text(served) == cli_rec["text"] and text(warm) == cli_rec["text"], "config": config, "env": env}
            out.append(rec)
            log(f"[load] solo {strategy} #{repeat}: generate {a} tok/s, served {b} tok/s, served again at once {c} tok/s")
    return out


def chat(url: str, model: str, prompt: str, max_tokens: int, ext: dict) -> dict:
    """One greedy, non-streamed chat completion with the `viasd` extension object `ext`; its answer."""
    import httpx

    r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": prompt}],
                                                       "max_tokens": max_tokens, "temperature": 0.0, "viasd": ext}, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"[load] the server answered {r.status_code}: {r.text[-400:]}")
    return r.json()


def solo_ratio(solos: list[dict], strategy: str, served: str = "served_decode_tokens_per_s") -> tuple[float, float, float] | None:
    """Served / generate decode tokens/s: per prompt, the ratio of the two sides' medians over the
    repeats; then (median, min, max) over prompts. `served`: the field of the served side."""
    by_prompt: dict[str, list[dict]] = {}
    for r in solos:
        if r["strategy"] == strategy and r.get(served) and r["generate_decode_tokens_per_s"]:
            by_prompt.setdefault(r["prompt"], []).append(r)
    if not by_prompt:
        return None
    ratios = [float(np.median([r[served] for r in rs]) / np.median([r["generate_decode_tokens_per_s"] for r in rs]))
              for rs in by_prompt.values()]
    return float(np.median(ratios)), min(ratios), max(ratios)


def solo_summary(solos: list[dict], strategy: str) -> str | None:
    """One line: the served / generate ratio (`solo_ratio`) after an idle spell and served again at once."""
    cold, warm = solo_ratio(solos, strategy), solo_ratio(solos, strategy, "served_warm_decode_tokens_per_s")
    if cold is None:
        return None
    rs = [r for r in solos if r["strategy"] == strategy]
    line = (f"solo {strategy}: served / generate decode tok/s, median over prompts of the per-prompt medians' ratio: "
            f"{cold[0]:.3f} (per prompt {cold[1]:.2f}-{cold[2]:.2f})")
    if warm is not None:
        line += f"; served again at once {warm[0]:.3f} ({warm[1]:.2f}-{warm[2]:.2f})"
    return line + f"; same text {sum(r['same_text'] for r in rs)}/{len(rs)}"


def _cli_flags(ext: dict) -> list[str]:
    flags = []
    for k, v in ext.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return flags


def main(argv=None) -> int:
    import httpx

    args = parse_args(argv)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    env = {**environment(), "cpu_flags": cpu_flags()}
    config = {k: v for k, v in vars(args).items() if not k.endswith("_list")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(rec: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")

    records, solos = [], []
    for deployment in (args.deployment_list if args.url is None else [args.deployment_list[0] if args.deployment_list else "external"]):
        server, peer, peer_build = None, deployment in ("llama-server", "llama-server-md"), None
        if args.url is None and peer:
            from viasd.models.loading import zoo_gguf_verified
            from viasd.models.zoo import ZOO

            binary = Path(args.llama_server) if args.llama_server else build_llama_server(Path(args.llama_server_build))
            peer_build = build_options(binary)
            draft = ("-md", str(zoo_gguf_verified(ZOO[args.drafter])), "-cd", str(args.ctx), "-td", str(args.threads), "-tbd",
                     str(args.threads)) if deployment == "llama-server-md" else ()
            server = LlamaServer(binary, zoo_gguf_verified(ZOO[args.model]), max(args.client_list), args.ctx, args.threads,
                                 args.startup_timeout, extra=draft)
            url = server.url
        elif args.url is None:
            server = Server(args.model, DEPLOYMENTS[deployment], args.startup_timeout,
                            args.server_args.split() + (["--drafter", args.drafter] if args.drafter else []))
            url = server.url
        else:
            url = args.url.rstrip("/")
        strategies = (["sd"] if deployment == "llama-server-md" else ["ar"]) if peer else args.strategy_list
        try:
            for strategy in strategies:  # warm-up: one request per strategy (first calls pay allocation)
                body = {"model": args.model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}
                if not peer:
                    body["viasd"] = STRATEGIES[strategy]
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
                if r.status_code != 200:
                    raise SystemExit(f"[load] warm-up of {strategy} failed: HTTP {r.status_code} {r.text[:300]}")
            for strategy in strategies:
                if not peer and deployment == "process" and args.solo:
                    for rec in solo_phase(url, args, strategy, run_id, env, config):
                        write(rec)
                        solos.append(rec)
                alone: dict[str, str] = {}
                for n in args.client_list:
                    log(f"[load] {deployment} {strategy} {n} client(s) for {args.duration:g} s")
                    cell = asyncio.run(run_cell(url, args.model, None if peer else STRATEGIES[strategy], n, args.duration,
                                                args.grace, args.max_tokens, alone))
                    rec = {"run_id": run_id, "deployment": deployment, "strategy": strategy,
                           "request_viasd": None if peer else STRATEGIES[strategy], "clients": n, "duration_s": args.duration,
                           **cell, "url": url, "server_cmd": server.cmd if server else None, "peer_build": peer_build, "config": config,
                           "env": env}
                    write(rec)
                    records.append(rec)
                    log(f"[load]   {cell['completed']} requests, {cell['requests_per_s']} req/s, {cell['tokens_per_s']} tok/s, "
                        f"errors {cell['errors']}, equal to alone {cell['equal_to_alone']}")
        finally:
            if server is not None:
                server.stop()
    print(table(records))
    if solos:
        print()
        for strategy in args.strategy_list:
            if (line := solo_summary(solos, strategy)) is not None:
                print(line)
    log(f"[load] run {run_id}: {len(records) + len(solos)} record(s) appended to {out}")
    return 0 if all(r["errors"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
