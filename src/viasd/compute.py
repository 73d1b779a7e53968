"""The one thread that runs viasd's model work in a process, and how many cores it uses.

**Why one thread.** ggml-py's C library and torch share one OpenMP runtime (libgomp: torch ships it,
ggml links it). libgomp gives every thread that opens a parallel region its own team of worker
threads, kept while that thread lives, and as soon as the process holds more such workers than it
has cores, every team stops spin-waiting between regions (`gomp_throttled_spin_count_var`: ~100
spins instead of ~300000) and sleeps in the kernel instead. A forward pass is one or more regions,
the sampler a few more; every one then begins by waking a sleeping worker, and a decode in a second
thread ran markedly slower than on the thread that loaded the model (docs/performance.md). So the
model work of a process runs
on a single thread, `viasd-compute`: `run(fn)` executes `fn` there (directly when already on it) and
`submit(fn)` queues it. `load_model`, `generate`, the route search, calibration, the benchmark and
the server's decode worker all go through it, so a user's own threads, the server and Ray Serve
replicas get the CLI's speed. (Code that calls a `Decoder` directly from other threads still works;
it is only slower.)

**How many cores.** Two threads that meet at a barrier after every op lose a time slice whenever
another process shares one of their cores. `ThreadBudget` follows what the machine gives: every `INTERVAL` seconds (every
`FIRST_INTERVAL` while it runs on fewer threads than cores) it reads how much
CPU time the rest of the machine used (`/proc/stat` minus this process' own), and the graphs and
torch then run on as many threads as there are cores left, at least one. After an idle spell (a server
between requests) the first pass follows the machine's load over the spell's last quarter-second,
which a sampler thread reads while no pass runs. `VIASD_THREADS=N` fixes the count instead.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

THREAD_NAME = "viasd-compute"

_executor: ThreadPoolExecutor | None = None
_ident: int | None = None  # the compute thread's id, once it has started
_lock = threading.Lock()


def _started() -> None:
    global _ident
    _ident = threading.get_ident()
    budget().apply(force=True)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME, initializer=_started)
        return _executor


_members = threading.local()  # threads of a batch session (execution/batching.py): their model work is the compute thread's


def on_compute_thread() -> bool:
    """Whether model work called here runs here: on the compute thread, or in a batch member (whose
    forward passes the compute thread runs)."""
    return getattr(_members, "member", False) or (_ident is not None and threading.get_ident() == _ident)


def enter_member() -> None:
    _members.member = True


def leave_member() -> None:
    _members.member = False


def submit(fn: Callable[..., T], *args, **kwargs) -> Future:
    """Queue `fn(*args, **kwargs)` on the compute thread (in order, one at a time), in a copy of the
    caller's context variables (as asyncio runs its callbacks)."""
    return _pool().submit(contextvars.copy_context().run, fn, *args, **kwargs)


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the compute thread, waiting for it; its exception is raised here.
    Ctrl-C while waiting interrupts `fn` too (KeyboardInterrupt is raised inside it), as it would
    on the calling thread."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    future = submit(fn, *args, **kwargs)
    try:
        return future.result()
    except KeyboardInterrupt:
        if not future.done() and _ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(_ident), ctypes.py_object(KeyboardInterrupt))
            try:
                future.result(timeout=30)
            except BaseException:
                pass
        raise


def owned(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator: the function always runs on the compute thread."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return run(fn, *args, **kwargs)

    return wrapper


# ------------------------------------------------------------------------------------ thread count


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (every state but idle and iowait) since boot."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


class ThreadBudget:
    """How many threads the compute thread's graphs and torch use: the cores other processes left
    free over the last `INTERVAL` seconds (rounded, at least 1), or `fixed`; over the last
    `FIRST_INTERVAL` while that is fewer than the cores (a neighbour that ended gives them back soon).

    After an idle spell (no pass for `STALE` s), the next pass follows what the rest of the machine
    did over the spell's last `RECENT`-`2 * RECENT` s, sampled by a daemon thread while no pass runs
    (`sample`), not over the whole spell, which may hold a neighbour's decode that has ended (load.py's
    solo phase: a served request right after a `viasd generate` process ran at one thread) and not on
    every core, which beside a busy neighbour runs the request's first `FIRST_INTERVAL` at a fraction
    of one thread's speed."""

    INTERVAL = 0.5
    FIRST_INTERVAL = 0.1  # the first window, the first after an idle spell, and those on fewer threads than cores
    STALE = 2.0
    RECENT = 0.25

    def __init__(self, cores: int | None = None, fixed: int | None = None, sampler: bool = True):
        self.cores = cores or _cores()
        self.fixed = fixed
        self.threads = fixed or self.cores
        self.others = 0.0  # cores the rest of the machine used in the last window
        self._applied: int | None = None
        self._first = True
        self._mark = (time.monotonic(), _machine_busy_s(), _own_s())
        self._last_update = self._mark[0]
        self._idle: deque[tuple[float, float, float]] = deque(maxlen=4)  # (time, machine busy s, own s) while idle
        if sampler and fixed is None:
            threading.Thread(target=self._sampling, name="viasd-load", daemon=True).start()

    def _sampling(self) -> None:
        while True:
            time.sleep(self.RECENT)
            self.sample()

    def sample(self, now: float | None = None) -> None:
        """Note the machine's load counters, if no pass has run for `RECENT` s (cheap: one read of
        /proc/stat)."""
        now = time.monotonic() if now is None else now
        if now - self._last_update >= self.RECENT and (busy := _machine_busy_s()) is not None:
            self._idle.append((now, busy, _own_s()))

    def update(self, now: float | None = None) -> int:
        """The thread count, re-measured when a window has passed (cheap otherwise: one clock read)."""
        now = time.monotonic() if now is None else now
        last, self._last_update = self._last_update, now
        t0, busy0, own0 = self._mark
        if now - t0 > self.STALE and self.fixed is None:  # no pass for a while: judge by the spell's end
            busy, own = _machine_busy_s(), _own_s()
            self._mark, self._first, self.threads = (now, busy, own), True, self.cores
            recent = [m for m in self._idle if last < m[0] <= now - self.RECENT]
            if recent and busy is not None:
                t1, busy1, own1 = recent[-1]
                self.others = max(0.0, (busy - busy1) - (own - own1)) / (now - t1)
                self.threads = choose_threads(self.cores, self.others)
            return self.threads
        # (the first window is short: it runs from the library's load, so the first pass already follows the
        # machine; so are those on fewer threads than cores, so that a neighbour that has ended gives its cores
        # back within a tenth of a second: smollm2 decodes right after a llama-bench call ran at half speed
        # through all of their 0.45 s, one half-second window, in benchmarks/decode_peer.py)
        short = self._first or self.threads < self.cores
        if self.fixed is not None or now - t0 < (self.FIRST_INTERVAL if short else self.INTERVAL) or busy0 is None:
            return self.threads
        self._first = False
        busy, own = _machine_busy_s(), _own_s()
        self._mark = (now, busy, own)
        if busy is None:
            return self.threads
        self.others = max(0.0, (busy - busy0) - (own - own0)) / (now - t0)
        self.threads = choose_threads(self.cores, self.others)
        return self.threads

    def apply(self, force: bool = False) -> int:
        """Update, and set torch's thread count on this thread when it changed."""
        n = self.update()
        if force or n != self._applied:
            import torch

            torch.set_num_threads(n)
            self._applied = n
        return n


def choose_threads(cores: int, others: float) -> int:
    """As many threads as cores the other processes leave free: `cores - others`, rounded, in [1, cores]."""
    return max(1, min(cores, int(cores - others + 0.5)))


def _fixed_from_env() -> int | None:
    value = os.environ.get("VIASD_THREADS", "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        import sys

        print(f"viasd: VIASD_THREADS must be a positive integer, got {value!r}; following the machine instead", file=sys.stderr)
        return None
    return n


_budget: ThreadBudget | None = None


def budget() -> ThreadBudget:
    global _budget
    if _budget is not None:  # every pass asks: no lock once it exists
        return _budget
    with _lock:
        if _budget is None:
            _budget = ThreadBudget(fixed=_fixed_from_env())
        return _budget
