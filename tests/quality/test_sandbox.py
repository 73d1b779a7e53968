"""Issue 14, class 8: the HumanEval sandbox. Nothing a program starts outlives it, nothing it writes
to /tmp or /dev/shm persists, a leftover holder of stderr cannot hang the run, a fork bomb leaves no
zombies, and only a program that ran to the end of the test harness passes."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest

from viasd.datasets import human_eval
from viasd.quality import humaneval_pass, run_untrusted, sandbox_mode

namespaces = pytest.mark.skipif(sandbox_mode() != "namespaces", reason="no PID/mount namespaces here: weak sandbox (see README)")


def alive(marker: str) -> list[str]:
    """Processes whose command line holds `marker`."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def zombies() -> int:
    out = subprocess.run(["ps", "-eo", "stat"], capture_output=True, text=True).stdout
    return sum(line.strip().startswith("Z") for line in out.splitlines())


@pytest.fixture(scope="module")
def problem():
    return human_eval()[0]


def test_canonical_solution_passes(problem):
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")


@pytest.mark.parametrize("completion", [
    "    import sys; sys.exit(0)\n",
    "    import os; os._exit(0)\n",
    "    raise SystemExit(0)\n",
    "    exit()\n",
    "    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n",
])
def test_exiting_early_is_not_a_pass(problem, completion):
    ok, why = humaneval_pass(problem, completion)
    assert not ok, why


def test_exit_at_module_level_is_not_a_pass():
    assert run_untrusted("import sys\nsys.exit(0)\n")[0] is False
    assert run_untrusted("x = 1\n") == (True, "passed")


@namespaces
@pytest.mark.parametrize("how", ["setsid", "double-fork", "popen-new-session"])
def test_nothing_outlives_the_program(how):
    marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**6)}"  # a unique `sleep` argument
    program = {
        "setsid": f"import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\n",
        "double-fork": f"import os\nif os.fork() == 0:\n    if os.fork() == 0:\n        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
                       "    os._exit(0)\nos.wait()\n",
        "popen-new-session": f"import subprocess\nsubprocess.Popen(['/bin/sleep', '{marker}'], start_new_session=True)\n",
    }[how]
    ok, why = run_untrusted(program, timeout_s=5)
    assert ok, why
    time.sleep(0.2)
    assert alive(marker) == []


@namespaces
def test_a_child_holding_stderr_open_cannot_hang_the_run():
    marker = f"{secrets.randbelow(10**6)}.5"
    program = (f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
               "sys.stderr.write('still here')\n")
    ok, why = run_untrusted(program, timeout_s=5)
    assert ok, why  # a run that waited for the child would have ended in "timeout"
    assert alive(marker) == []


@namespaces
def test_a_timeout_kills_everything():
    marker = f"{secrets.randbelow(10**6)}.25"
    program = f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\ntime.sleep(60)\n"
    assert run_untrusted(program, timeout_s=2) == (False, "timeout")
    time.sleep(0.2)
    assert alive(marker) == []


@namespaces
def test_tmp_and_shm_are_private():
    name = f"viasd-escape-{secrets.token_hex(6)}"
    program = "".join(f"open('{d}/{name}', 'w').write('x')\n" for d in ("/tmp", "/dev/shm", "/var/tmp"))
    assert run_untrusted(program) == (True, "passed")
    for d in ("/tmp", "/dev/shm", "/var/tmp"):
        assert not Path(d, name).exists()


@namespaces
def test_fork_bomb_leaves_no_zombies_and_the_next_run_works(problem):
    before = zombies()
    ok, _ = run_untrusted("import os\nwhile True:\n    os.fork()\n", timeout_s=3)
    assert not ok
    time.sleep(0.3)
    assert zombies() <= before
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")


@namespaces
def test_runs_unprivileged_in_its_own_pid_namespace_without_network():
    program = ("import os, socket\n"
               "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
               "assert pids[0] == 1 and len(pids) <= 4, pids\n"
               "assert os.geteuid() != 0 or not os.path.exists('/usr/bin/python3')\n"
               "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    raise SystemExit(3)\nexcept OSError:\n    pass\n")
    assert run_untrusted(program) == (True, "passed")


def test_hostile_programs_are_contained_in_either_mode():
    assert run_untrusted("while True:\n    pass\n", timeout_s=2) == (False, "timeout")
    ok, why = run_untrusted("x = bytearray(8 << 30)\n", timeout_s=3)
    assert not ok and "MemoryError" in why


def test_weak_mode_still_refuses_early_exits(problem, monkeypatch):
    monkeypatch.setenv("VIASD_SANDBOX", "weak")
    assert sandbox_mode() == "weak"
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")
    assert humaneval_pass(problem, "    import os; os._exit(0)\n")[0] is False


# ---------------------------------------------------------- issue 26: attacks on the harness itself

ALWAYS_EQUAL = [
    "    class E:\n        def __eq__(self, other):\n            return True\n        def __ne__(self, other):\n"
    "            return False\n        __hash__ = object.__hash__\n    return E()\n",
    "    class E(int):\n        def __eq__(self, other):\n            return True\n        __hash__ = int.__hash__\n    return E(0)\n",
]


@pytest.mark.parametrize("completion", ALWAYS_EQUAL, ids=["object", "int-subclass"])
def test_an_always_equal_result_does_not_pass(problem, completion):
    ok, why = humaneval_pass(problem, completion)
    assert not ok, why
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")


# Everything a program can reach of its own interpreter: the frames above it, every object the
# collector knows, the descriptors it inherited, its parent's descriptors; each string or bytes of
# a token's shape (32 hex digits) is written to every descriptor, then the program leaves "successfully".
STEAL_THE_TOKEN = """    import gc, os, re, sys
    found, shape = [], re.compile(rb'[0-9a-f]{32}')
    def look(v):
        if isinstance(v, str):
            v = v.encode(errors='replace')
        if isinstance(v, bytes):
            found.extend(t for t in shape.findall(v[:65536]) if t not in found)
    for o in gc.get_objects():
        if isinstance(o, dict):
            for v in list(o.values()):
                look(v)
    for fd in range(3, 64):
        try:
            look(os.pread(fd, 65536, 0))
        except OSError:
            pass
    for pid in (os.getpid(), os.getppid()):
        d = '/proc/%d/fd' % pid
        for name in (os.listdir(d) if os.access(d, os.R_OK) else []):
            try:
                g = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NONBLOCK)
                try:
                    look(os.read(g, 65536))
                finally:
                    os.close(g)
            except OSError:
                pass
    f = sys._getframe()
    frames = []
    while f is not None:
        frames.append(f)
        f = f.f_back
    for f in frames:  # the frames last: what is found there is written last, and wins
        for v in list(f.f_globals.values()) + list(f.f_locals.values()):
            if isinstance(v, (bytes, str)) and shape.fullmatch(v.encode() if isinstance(v, str) else v):
                t = v.encode() if isinstance(v, str) else v
                if t in found:
                    found.remove(t)
                found.append(t)
    for token in found:
        for fd in range(3, 64):
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, token, 0)
            except OSError:
                try:
                    os.write(fd, token)
                except OSError:
                    pass
    os._exit(0)
"""


def test_reading_the_token_from_frames_or_descriptors_does_not_pass(problem):
    ok, why = humaneval_pass(problem, STEAL_THE_TOKEN)
    assert not ok, why
    assert run_untrusted(STEAL_THE_TOKEN.replace("\n    ", "\n").lstrip())[0] is False


def test_the_test_code_is_out_of_the_programs_reach(problem):
    """The program cannot read the test (to look the expected answers up): not in a file beside it,
    nor in its process."""
    program = ("import gc, os\n"
               "hits = [n for n in os.listdir('.') if n not in ('program.py', 'worker.py', 'harness.py')]\n"
               "assert not any('check' in open(n, errors='replace').read() for n in hits if os.path.isfile(n)), hits\n"
               "assert not any(isinstance(o, str) and 'def check(candidate)' in o for o in gc.get_objects())\n")
    assert run_untrusted(program, test="def check(candidate):\n    assert candidate() == 1\n", entry_point="f") != (True, "passed")
    ok, why = run_untrusted(program + "def f():\n    return 1\n", test="def check(candidate):\n    assert candidate() == 1\n",
                            entry_point="f")
    assert ok, why


def test_memory_is_capped_in_total_where_a_cgroup_can_be_made():
    from viasd.quality import memory_cap_mode

    mode = memory_cap_mode()
    assert mode in ("cgroup", "rlimit")
    if mode != "cgroup":
        pytest.skip("no writable cgroup v2 with the memory controller here: RLIMIT_AS per process + RLIMIT_NPROC (see README)")
    # four children of 400 MB each: every one under the 1 GB per-process limit, 1.6 GB together
    program = ("import os\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
               "        x = bytearray(400 << 20)\n        for i in range(0, len(x), 4096):\n            x[i] = 1\n"
               "        import time; time.sleep(3)\n        os._exit(0)\n    pids.append(pid)\n"
               "assert all(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids)\n")
    ok, why = run_untrusted(program, timeout_s=20, memory_mb=1024)
    assert not ok, why


@pytest.mark.parametrize("completion", [ALWAYS_EQUAL[0], STEAL_THE_TOKEN], ids=["always-equal", "steal-the-token"])
def test_the_attacks_fail_in_weak_mode_too(problem, completion, monkeypatch):
    monkeypatch.setenv("VIASD_SANDBOX", "weak")
    assert sandbox_mode() == "weak"
    ok, why = humaneval_pass(problem, completion)
    assert not ok, why
    assert humaneval_pass(problem, problem["canonical_solution"]) == (True, "passed")
