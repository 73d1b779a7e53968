"""Task quality metrics, from well-kept libraries (sacrebleu, rouge-score), and a sandbox for
HumanEval's pass@1: untrusted completions run in a separate process, as an unprivileged user
where possible, with CPU-time, memory, process and file-size limits (memory in total across the
program's processes where a cgroup v2 can be made: `memory_cap_mode()`), no network, a temporary
directory, and a wall-clock timeout that kills the whole process group. The test itself runs in a
trusted harness process and sees only plain values the program's function returned."""

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

# Plain values between the two processes below, as strict JSON (exact builtin types only, so no
# object of the program's own class ever reaches the test): int {"i": hex}, float {"f": hex},
# complex {"c": [re, im]}, tuple {"t": [...]}, dict {"d": [[k, v], ...]}, set {"s": [...]},
# frozenset {"z": [...]}, bytes {"b": hex}; str, list, bool and None as themselves.
_CODEC = r"""
def _enc(v):
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return {"i": hex(v)}
    if t is float:
        return {"f": v.hex()}
    if t is complex:
        return {"c": [v.real.hex(), v.imag.hex()]}
    if t is list:
        return [_enc(x) for x in v]
    if t is tuple:
        return {"t": [_enc(x) for x in v]}
    if t is dict:
        return {"d": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "z": [_enc(x) for x in v]}
    if t is bytes:
        return {"b": v.hex()}
    raise TypeError("returned a %s, not a plain value (int, float, str, list, tuple, dict, set, bytes, None)" % t.__name__)

def _dec(x):
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is list:
        return [_dec(y) for y in x]
    if t is dict and len(x) == 1:
        (k, y), = x.items()
        if k == "i" and type(y) is str:
            return int(y, 16)
        if k == "f" and type(y) is str:
            return float.fromhex(y)
        if k == "c" and type(y) is list and len(y) == 2:
            return complex(float.fromhex(y[0]), float.fromhex(y[1]))
        if k == "t" and type(y) is list:
            return tuple(_dec(z) for z in y)
        if k == "d" and type(y) is list:
            return {_dec(a): _dec(b) for a, b in y}
        if k == "s" and type(y) is list:
            return set(_dec(z) for z in y)
        if k == "z" and type(y) is list:
            return frozenset(_dec(z) for z in y)
        if k == "b" and type(y) is str:
            return bytes.fromhex(y)
    raise ValueError("not an encoded plain value")
"""

# The sandbox runs two processes. The trusted harness (harness.py) reads its setup - a random
# token, and for HumanEval the test code and the entry point - from fd 3, which it then closes;
# marks itself non-dumpable (no ptrace, /proc/PID/mem or /proc/PID/fd for its peers); and starts
# the untrusted program in a fresh interpreter (worker.py) whose only channels are two pipes, with
# no capabilities. The test runs in the harness: `candidate(...)` is a call sent to the worker,
# and what comes back is decoded as plain data, so an object with its own `__eq__` never reaches
# the test, and nothing of the token or the test is in the program's memory or files. The harness
# writes the token to fd 4 (a pipe the parent reads) only when the test passed (HumanEval) or the
# program ran to its end and exited 0 (a plain program).
_HARNESS = r"""
import ctypes, json, os, signal, sys, traceback
""" + _CODEC + r"""
def _read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)

class _Remote:
    def __init__(self, name, req, resp):
        self.name, self.req, self.resp = name, req, resp
    def __call__(self, *args, **kwargs):
        line = json.dumps([self.name, [_enc(a) for a in args], {k: _enc(v) for k, v in kwargs.items()}])
        self.req.write(line.encode() + b"\n")
        self.req.flush()
        reply = self.resp.readline(64 << 20)
        if not reply:
            raise RuntimeError("the program died during a call to %s" % self.name)
        reply = json.loads(reply)
        if type(reply) is not list or not reply:
            raise RuntimeError("the program sent a malformed reply")
        if reply[0] == "ok" and len(reply) == 2:
            return _dec(reply[1])
        if reply[0] == "err" and len(reply) == 3 and type(reply[1]) is str and type(reply[2]) is str:
            kind = getattr(__builtins__, reply[1], None) if reply[1].isidentifier() else None
            if not (isinstance(kind, type) and issubclass(kind, Exception)):
                kind = RuntimeError
            raise kind("%s (in the program: %s)" % (reply[2][:200], reply[1]))
        raise RuntimeError("the program sent a malformed reply")

def _high(fd):
    import fcntl
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return new

def _harness():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    setup = json.loads(_read_all(3))
    os.close(3)
    token = setup["token"].encode()
    req_r, req_w = (_high(fd) for fd in os.pipe())
    resp_r, resp_w = (_high(fd) for fd in os.pipe())
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the untrusted side: pipes at fds 3 and 4, nothing else open, no capabilities, then exec
        try:
            os.dup2(req_r, 3)
            os.dup2(resp_w, 4)
            os.closerange(5, 1 << 16)
            for cap in range(64):
                libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: a root in the namespace keeps no capabilities
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            os.execv(sys.executable, [sys.executable, "-I", "-S", "worker.py"])
        except BaseException as e:
            os.write(2, ("sandbox: %s\n" % e).encode())
        os._exit(126)
    os.close(req_r)
    os.close(resp_w)
    req, resp = os.fdopen(req_w, "wb"), os.fdopen(resp_r, "rb")
    ok = False
    try:
        ready = resp.readline(64)
        if ready == b'["ready"]\n':
            if setup.get("test") is None:
                req.close()
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                pid = None
                ok = code == 0
                if not ok:
                    sys.exit(code if code > 0 else 128 - code)
            else:
                ns = {"__name__": "__viasd_test__", "__builtins__": __builtins__}
                exec(compile(setup["test"], "test.py", "exec"), ns)
                candidate = ns[setup["entry_point"]] = _Remote(setup["entry_point"], req, resp)  # the test may call it by name
                ns["check"](candidate)
                ok = True
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        sys.stderr.write(traceback.format_exception_only(type(e), e)[-1])
        sys.stderr.flush()
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    if not ok:
        sys.exit(1)
    os.write(4, token)
    os.close(4)
_harness()
"""

# The untrusted side: the program, then calls from the harness until it closes the request pipe.
_WORKER = r"""
import json, os, sys
""" + _CODEC + r"""
def _worker():
    req, resp = os.fdopen(3, "rb"), os.fdopen(4, "wb")
    with open("program.py", encoding="utf-8") as f:
        code = compile(f.read(), os.path.abspath("program.py"), "exec")
    ns = {"__name__": "__main__", "__file__": os.path.abspath("program.py"), "__builtins__": __builtins__}
    exec(code, ns)
    sys.stdout.flush()
    resp.write(b'["ready"]\n')
    resp.flush()
    for line in req:
        try:
            name, args, kwargs = json.loads(line)
            out = ["ok", _enc(ns[name](*[_dec(a) for a in args], **{k: _dec(v) for k, v in kwargs.items()}))]
        except BaseException as e:
            out = ["err", type(e).__name__, str(e)[:200]]
        resp.write(json.dumps(out).encode() + b"\n")
        resp.flush()
_worker()
"""

# PID 1 of the sandbox's namespaces (runs as root inside them): private tmpfs on /tmp, /var/tmp and
# /dev/shm, then the program as a child (limits, nobody) while PID 1 reaps every process; when the
# program exits PID 1 exits, and the kernel kills whatever is left in the PID namespace.
_LAUNCHER = r"""
import ctypes, os, resource, sys
work, python, mem_mb, cpu_s, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
files = {n: open(os.path.join(work, n), "rb").read() for n in ("program.py", "harness.py", "worker.py")}
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


def run_untrusted(program: str, timeout_s: float = 10.0, memory_mb: int = 1024, *, test: str | None = None,
                  entry_point: str | None = None) -> tuple[bool, str]:
    """Run a Python program in the sandbox. Returns (passed, reason).

    Without `test`: passed when the program ran to its end and exited 0, within the limits. With
    `test` (trusted code defining `check(candidate)`, run outside the program's process) and
    `entry_point`: passed when `check` returns, `candidate` being the program's function
    `entry_point`, called across the process boundary with plain values in and out."""
    import json
    import secrets

    token = secrets.token_hex(16)
    mode = sandbox_mode()
    cgroup = _new_cgroup(memory_mb)
    with tempfile.TemporaryDirectory(prefix="viasd-sandbox-") as tmp:
        for name, text in (("program.py", program), ("harness.py", _HARNESS), ("worker.py", _WORKER)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
            os.chmod(os.path.join(tmp, name), 0o644)
        # the harness's setup reaches it through a file with no name left (fd 3), the verdict through a pipe (fd 4)
        setup = os.path.join(tmp, "setup")
        with open(setup, "w", encoding="utf-8", errors="surrogatepass") as f:
            json.dump({"token": token, "test": test, "entry_point": entry_point}, f)
        setup_r = os.open(setup, os.O_RDONLY | os.O_CLOEXEC)
        os.unlink(setup)
        result_r, result_w = os.pipe()
        drop = os.geteuid() == 0 and os.path.exists(_SYSTEM_PYTHON)
        python = _SYSTEM_PYTHON if drop else sys.executable
        cpu_s = int(timeout_s) + 1
        # output goes to a file, not a pipe: a descendant holding stderr open can never hang the wait
        try:
            with open(os.path.join(tmp, "stderr"), "wb") as err_w:
                fds = {3: setup_r, 4: result_w}
                if mode == "namespaces":
                    cmd = [shutil.which("unshare"), *_userns_flags(), *_NS_FLAGS, sys.executable, "-I", "-S", "-c", _LAUNCHER,
                           tmp, python, str(memory_mb), str(cpu_s), "1" if drop else "0"]
                    preexec = None
                else:
                    os.chmod(tmp, 0o777)
                    cmd = [python, "-I", "-S", "harness.py"]
                    preexec = lambda: _weak_limits(memory_mb, cpu_s, drop)  # noqa: E731
                proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                                        env={"PATH": "/usr/bin:/bin"}, preexec_fn=_with_fds(fds, preexec, cgroup),
                                        close_fds=False, start_new_session=mode == "namespaces")
                os.close(setup_r)  # the harness holds the only copies now
                os.close(result_w)
                setup_r = result_w = -1
                try:
                    proc.wait(timeout=timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc)  # namespaces: unshare's death kills PID 1 and with it the namespace
                    proc.wait()
                    _kill_cgroup(cgroup)
            if timed_out:
                return False, "timeout"
            with open(os.path.join(tmp, "stderr"), "rb") as f:
                err = f.read()[-65536:]
            os.set_blocking(result_r, False)
            try:
                verdict = os.read(result_r, 64)
            except BlockingIOError:
                verdict = b""
            finished = secrets.compare_digest(verdict, token.encode())
        finally:
            for fd in (setup_r, result_r, result_w):
                if fd >= 0:
                    os.close(fd)
            _remove_cgroup(cgroup)
        if proc.returncode == 0 and finished:
            return True, "passed"
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        if proc.returncode == 0:
            last = "the program exited before the test harness finished (sys.exit / os._exit?)"
        return False, last[:200]


# ------------------------------------------------------------------- total memory: a cgroup v2

_memory_cap: str | None = None


def memory_cap_mode() -> str:
    """How the sandbox caps memory, probed once: "cgroup" (a cgroup v2 under this process's own,
    with memory.max = the run's limit for the program and all its children together, and pids.max),
    or "rlimit" (no writable cgroup v2 with the memory controller here: RLIMIT_AS per process plus
    RLIMIT_NPROC 32, so at most 32 x the limit in total)."""
    global _memory_cap
    if _memory_cap is None:
        probe = _new_cgroup(64)
        _memory_cap = "cgroup" if probe is not None else "rlimit"
        _remove_cgroup(probe)
    return _memory_cap


def _own_cgroup() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        with open("/proc/self/mounts") as f:
            mount = next((line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]), None)
    except OSError:
        return None
    if rel is None or mount is None:
        return None
    return os.path.join(mount, rel.lstrip("/"))


def _new_cgroup(memory_mb: int) -> str | None:
    """A fresh cgroup v2 for one run (memory.max, pids.max), or None where none can be made."""
    if _memory_cap == "rlimit":
        return None
    parent = _own_cgroup()
    if parent is None:
        return None
    try:
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return None
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if "memory" not in enabled:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")  # refused (EBUSY) where the parent holds processes: then no cgroup
        import secrets

        path = os.path.join(parent, f"viasd-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(path)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(memory_mb << 20))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            with open(os.path.join(path, "memory.swap.max"), "w") as f:
                f.write("0")
        if os.path.exists(os.path.join(path, "pids.max")):
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write("64")
        return path
    except OSError:
        _remove_cgroup(path)
        return None


def _kill_cgroup(path: str | None) -> None:
    if path is not None and os.path.exists(os.path.join(path, "cgroup.kill")):
        try:
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass


def _remove_cgroup(path: str | None) -> None:
    if path is None:
        return
    for _ in range(50):  # rmdir waits for the kernel to finish reaping the members
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            import time

            time.sleep(0.02)


def _with_fds(fds: dict[int, int], then, cgroup: str | None = None):
    """preexec_fn: join the run's cgroup (if any), place the harness's setup and result descriptors
    at fds 3 and 4, then run `then`."""

    def setup():
        import fcntl

        if cgroup is not None:
            try:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write("0")  # this process, and everything it starts
            except OSError:
                pass  # not allowed to move here after all: the per-process limits still hold
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
    """pass@1 of one completion: the prompt and completion run in the sandbox; the problem's test
    runs in the trusted harness, calling the completed function across the process boundary."""
    return run_untrusted(problem["prompt"] + completion + "\n", timeout_s, test=problem["prompt"] + "\n\n" + problem["test"] + "\n",
                         entry_point=problem["entry_point"])


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
