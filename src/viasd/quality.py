"""Task quality metrics, from well-kept libraries (sacrebleu, rouge-score), and a sandbox for
HumanEval's pass@1: untrusted completions run in a separate process, as an unprivileged user
where possible, with CPU-time, memory, process and file-size limits, no network, a temporary
directory, and a wall-clock timeout that kills the whole process group."""

from __future__ import annotations

import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def rouge_l(prediction: str, reference: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score(reference, prediction)["rougeL"].fmeasure


def bleu(prediction: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(prediction, [reference]).score


def chrf(prediction: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_chrf(prediction, [reference]).score


def final_number(text: str) -> str | None:
    """The last number in `text` (GSM8K answers: the part after '####' when present)."""
    if "####" in text:
        text = text.split("####")[-1]
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def math_exact_match(prediction: str, reference: str) -> float:
    want, got = final_number(reference), final_number(prediction)
    if want is None or got is None:
        return 0.0
    try:
        return float(abs(float(want) - float(got)) < 1e-6)
    except ValueError:
        return float(want == got)


def answer_match(prediction: str, answers: list[str]) -> float:
    norm = " ".join(prediction.lower().split())
    return float(any(" ".join(a.lower().split()) in norm for a in answers if a.strip()))


def humaneval_completion(text: str) -> str:
    """Cut a raw completion where the function body ends (the usual HumanEval stop sequences)."""
    cut = len(text)
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```"):
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


# Root ignores RLIMIT_NPROC, so as root the program runs as nobody, with the system Python (a
# pyenv or venv Python under /root is not readable by nobody).
_SYSTEM_PYTHON = "/usr/bin/python3"

# The program runs inside this harness, which writes a random token (read from fd 3, then closed)
# to fd 4 only after the whole program ran: `sys.exit(0)` / `os._exit(0)` / a fatal signal in the
# program leave no token and so never count as a pass.
_HARNESS = r"""
import os, sys
def _viasd_harness():
    token = os.read(3, 64)
    os.close(3)
    with open("program.py", encoding="utf-8") as f:
        code = compile(f.read(), os.path.abspath("program.py"), "exec")
    exec(code, {"__name__": "__main__", "__file__": os.path.abspath("program.py"), "__builtins__": __builtins__})
    sys.stdout.flush()
    os.write(4, token)
    os.close(4)
_viasd_harness()
"""

# PID 1 of the sandbox's namespaces (runs as root inside them): private tmpfs on /tmp, /var/tmp and
# /dev/shm, then the program as a child (limits, nobody) while PID 1 reaps every process; when the
# program exits PID 1 exits, and the kernel kills whatever is left in the PID namespace.
_LAUNCHER = r"""
import ctypes, os, resource, sys
work, python, mem_mb, cpu_s, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
files = {n: open(os.path.join(work, n), "rb").read() for n in ("program.py", "harness.py")}
libc = ctypes.CDLL(None, use_errno=True)
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4, b"size=64m,mode=1777") != 0:  # nosuid, nodev
        os.write(2, ("sandbox: cannot mount a private tmpfs on %s (errno %d)\n" % (d, ctypes.get_errno())).encode())
        os._exit(125)
home = "/tmp/sandbox"
os.mkdir(home, 0o755)
for n, data in files.items():
    with open(os.path.join(home, n), "wb") as f:
        f.write(data)
if drop:
    os.chown(home, 65534, 65534)
pid = os.fork()
if pid == 0:
    try:
        os.chdir(home)
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        if drop:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))
        os.execve(python, [python, "-I", "-S", "harness.py"], {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp"})
    except BaseException as e:
        os.write(2, ("sandbox: %s\n" % e).encode())
    os._exit(126)
while True:  # PID 1 reaps orphans (no zombies), until the program itself is done
    try:
        done, status = os.wait()
    except ChildProcessError:
        os._exit(125)
    if done == pid:
        break
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""

_NS_FLAGS = ["--pid", "--fork", "--kill-child=SIGKILL", "--mount", "--mount-proc", "--net", "--ipc", "--propagation", "private"]
_mode: str | None = None


def sandbox_mode() -> str:
    """"namespaces": PID, mount, network and IPC namespaces with private /tmp, /var/tmp and /dev/shm
    (everything the program starts dies with it); "weak": no namespaces available (no `unshare`, not
    root and no user namespaces), a process group and resource limits only. `VIASD_SANDBOX=weak` forces it."""
    global _mode
    if os.environ.get("VIASD_SANDBOX") == "weak":
        return "weak"
    if _mode is None:
        _mode = "weak"
        exe = shutil.which("unshare")
        if exe and sys.platform.startswith("linux"):
            try:
                probe = subprocess.run([exe, *_userns_flags(), *_NS_FLAGS, "true"], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
                if probe.returncode == 0:
                    _mode = "namespaces"  # then a real run: private tmpfs mounts and the drop to nobody must work too
                    if run_untrusted("x = 1\n", timeout_s=20) != (True, "passed"):
                        _mode = "weak"
            except (OSError, subprocess.SubprocessError):
                _mode = "weak"
    return _mode


def _userns_flags() -> list[str]:
    return [] if os.geteuid() == 0 else ["--user", "--map-root-user"]


def _weak_limits(memory_mb: int, cpu_s: int, drop_to_nobody: bool) -> None:  # runs in the child before exec
    os.setsid()
    try:  # no network: a fresh, empty network namespace (needs root; skipped otherwise)
        ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
    except Exception:
        pass
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    if drop_to_nobody:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))


def run_untrusted(program: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> tuple[bool, str]:
    """Run a Python program in the sandbox. Returns (passed, reason): passed only when the program
    ran to its end (the harness's token arrived) and exited 0, within the limits."""
    import secrets

    token = secrets.token_hex(16).encode()
    mode = sandbox_mode()
    with tempfile.TemporaryDirectory(prefix="viasd-sandbox-") as tmp:
        for name, text in (("program.py", program), ("harness.py", _HARNESS)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
            os.chmod(os.path.join(tmp, name), 0o644)
        with open(os.path.join(tmp, "token"), "wb") as f:
            f.write(token)
        drop = os.geteuid() == 0 and os.path.exists(_SYSTEM_PYTHON)
        python = _SYSTEM_PYTHON if drop else sys.executable
        cpu_s = int(timeout_s) + 1
        # output goes to files, not pipes: a descendant holding stderr open can never hang the wait
        with open(os.path.join(tmp, "token"), "rb") as token_r, open(os.path.join(tmp, "result"), "wb") as result_w, \
                open(os.path.join(tmp, "stderr"), "wb") as err_w:
            fds = {3: token_r.fileno(), 4: result_w.fileno()}
            if mode == "namespaces":
                cmd = [shutil.which("unshare"), *_userns_flags(), *_NS_FLAGS, sys.executable, "-I", "-S", "-c", _LAUNCHER,
                       tmp, python, str(memory_mb), str(cpu_s), "1" if drop else "0"]
                preexec = None
            else:
                os.chmod(tmp, 0o777)
                cmd = [python, "-I", "-S", "harness.py"]
                preexec = lambda: _weak_limits(memory_mb, cpu_s, drop)  # noqa: E731
            proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                                    env={"PATH": "/usr/bin:/bin"}, preexec_fn=_with_fds(fds, preexec),
                                    close_fds=False, start_new_session=mode == "namespaces")
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # namespaces: unshare's death kills PID 1 and with it the namespace
                proc.wait()
        if timed_out:
            return False, "timeout"
        with open(os.path.join(tmp, "stderr"), "rb") as f:
            err = f.read()[-65536:]
        with open(os.path.join(tmp, "result"), "rb") as f:
            finished = f.read() == token
        if proc.returncode == 0 and finished:
            return True, "passed"
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        if proc.returncode == 0:
            last = "the program exited before the test harness finished (sys.exit / os._exit?)"
        return False, last[:200]


def _with_fds(fds: dict[int, int], then):
    """preexec_fn: place the harness's token and result files at fds 3 and 4, then run `then`."""

    def setup():
        import fcntl

        high = {target: fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100) for target, fd in fds.items()}
        for target, fd in high.items():
            os.dup2(fd, target)  # dup2's copy is inheritable
        if then is not None:
            then()

    return setup


def _kill_group(proc: subprocess.Popen) -> None:
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def humaneval_pass(problem: dict, completion: str, timeout_s: float = 10.0) -> tuple[bool, str]:
    program = problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    return run_untrusted(program, timeout_s)


# what a `file:` task row (its "metric" field) or `file:PATH:METRIC` may ask for: name -> metrics of
# (prediction, reference); answer_match takes a list of acceptable answers (a string is one answer)
METRICS = {
    "rougeL": lambda text, ref: {"rougeL": rouge_l(text, _first(ref))},
    "bleu": lambda text, ref: {"bleu": bleu(text, _first(ref)), "chrf": chrf(text, _first(ref))},
    "chrf": lambda text, ref: {"chrf": chrf(text, _first(ref))},
    "exact_match": lambda text, ref: {"exact_match": math_exact_match(text, _first(ref))},
    "answer_match": lambda text, ref: {"answer_match": answer_match(text, ref if isinstance(ref, list) else [ref])},
}


# Spec-Bench categories with a metric of their own (other tasks with a text reference: ROUGE-L)
_CATEGORY_METRICS = {"translation": "bleu", "summarization": "rougeL", "math_reasoning": "exact_match", "rag": "answer_match"}


def _first(reference):
    return reference[0] if isinstance(reference, list) and reference else reference


def score(task: str, text: str, reference=None, problem: dict | None = None, metric: str | None = None) -> dict[str, float]:
    """Quality metrics for one output of a task ("spec_bench/<category>", "human_eval", "file:...").
    `metric` (one of METRICS) overrides the task's own choice; without a reference there is none."""
    category = task.split("/")[-1]
    if task == "human_eval" and problem is not None:
        ok, _ = humaneval_pass(problem, humaneval_completion(text))
        return {"pass@1": float(ok)}
    if reference is None:
        return {}
    if metric is not None:
        return METRICS[metric](text, reference)
    ref = _first(reference)  # Spec-Bench keeps its reference as a one-item list
    metric = _CATEGORY_METRICS.get(category) or ("rougeL" if isinstance(ref, str) else None)
    return METRICS[metric](text, ref) if metric else {}
