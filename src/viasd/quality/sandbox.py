"""A sandbox for HumanEval's pass@1: untrusted completions run in a separate process, as an
unprivileged user where possible, with CPU-time, memory, process and file-size limits (memory in
total across the program's processes where a cgroup v2 can be made: `memory_cap_mode()`), no
network, a temporary directory, and a wall-clock timeout that kills the whole process group. The
test itself runs in a trusted harness process and sees only plain values the program's function
returned (the programs: programs.py)."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

from viasd.quality.cgroup import kill_cgroup, new_cgroup, remove_cgroup
from viasd.quality.programs import HARNESS, LAUNCHER, WORKER

# Root ignores RLIMIT_NPROC, so as root the program runs as nobody, with the system Python (a
# pyenv or venv Python under /root is not readable by nobody).
_SYSTEM_PYTHON = "/usr/bin/python3"

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
    token = secrets.token_hex(16)
    mode = sandbox_mode()
    cgroup = new_cgroup(memory_mb)
    with tempfile.TemporaryDirectory(prefix="viasd-sandbox-") as tmp:
        for name, text in (("program.py", program), ("harness.py", HARNESS), ("worker.py", WORKER)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
            os.chmod(os.path.join(tmp, name), 0o644)
        # the harness's setup reaches it through a file with no name left (fd 3), the verdict through a pipe (fd 4)
        fds = {3: _unlinked_setup(tmp, {"token": token, "test": test, "entry_point": entry_point})}
        result_r, fds[4] = os.pipe()
        try:
            timed_out, returncode = _launch(tmp, fds, mode, cgroup, memory_mb, timeout_s)
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
            for fd in (fds[3], result_r, fds[4]):
                if fd >= 0:
                    os.close(fd)
            remove_cgroup(cgroup)
        return _outcome(returncode, finished, err)


def _unlinked_setup(tmp: str, setup: dict) -> int:
    """A read-only descriptor of `setup` as JSON, in a file whose name is already gone."""
    path = os.path.join(tmp, "setup")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        json.dump(setup, f)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.unlink(path)
    return fd


def _launch(tmp: str, fds: dict[int, int], mode: str, cgroup: str | None, memory_mb: int, timeout_s: float) -> tuple[bool, int]:
    """Start the harness in `tmp` with `fds` at their numbers (closed here, and set to -1, once it holds
    them), wait up to `timeout_s`, then kill whatever is left; returns (timed out, exit status)."""
    drop = os.geteuid() == 0 and os.path.exists(_SYSTEM_PYTHON)
    python = _SYSTEM_PYTHON if drop else sys.executable
    cpu_s = int(timeout_s) + 1
    # output goes to a file, not a pipe: a descendant holding stderr open can never hang the wait
    with open(os.path.join(tmp, "stderr"), "wb") as err_w:
        if mode == "namespaces":
            cmd = [shutil.which("unshare") or "unshare", *_userns_flags(), *_NS_FLAGS, sys.executable, "-I", "-S", "-c", LAUNCHER,
                   tmp, python, str(memory_mb), str(cpu_s), "1" if drop else "0"]
            preexec = None
        else:
            os.chmod(tmp, 0o777)
            cmd = [python, "-I", "-S", "harness.py"]
            preexec = lambda: _weak_limits(memory_mb, cpu_s, drop)  # noqa: E731
        proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                                env={"PATH": "/usr/bin:/bin"}, preexec_fn=_with_fds(dict(fds), preexec, cgroup),
                                close_fds=False, start_new_session=mode == "namespaces")
        for target, fd in fds.items():  # the harness holds the only copies now
            os.close(fd)
            fds[target] = -1
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # namespaces: unshare's death kills PID 1 and with it the namespace
            proc.wait()
            kill_cgroup(cgroup)
    return timed_out, proc.returncode


def _outcome(returncode: int, finished: bool, err: bytes) -> tuple[bool, str]:
    """(passed, reason) from the harness's exit status, whether it wrote the token, and its stderr."""
    if returncode == 0 and finished:
        return True, "passed"
    last = (err.decode(errors="replace").strip().splitlines() or [f"exit {returncode}"])[-1]
    if returncode == 0:
        last = "the program exited before the test harness finished (sys.exit / os._exit?)"
    return False, last[:200]


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
