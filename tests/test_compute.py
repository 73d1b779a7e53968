"""The process' one compute thread (viasd.compute) and its thread budget."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from viasd.api import generate
from viasd import compute
from viasd.compute import ThreadBudget, choose_threads


def test_generate_from_any_thread_runs_on_the_compute_thread_with_the_same_tokens(tiny):
    seen: list[str] = []

    def call():
        return generate("w1 w2 w3", tiny, strategy="ar", max_new_tokens=12, chat=False, progress=False,
                        on_text=lambda _: seen.append(threading.current_thread().name))

    here = call()
    box = {}
    user = threading.Thread(target=lambda: box.setdefault("r", call()))
    user.start()
    user.join()
    assert box["r"].token_ids == here.token_ids
    assert seen and all(name.startswith(compute.THREAD_NAME) for name in seen)
    assert len(set(seen)) == 1  # one thread, whichever thread called


def test_a_call_on_the_compute_thread_runs_directly():
    inner = compute.run(lambda: compute.run(threading.get_ident))  # nested: no deadlock
    assert inner == compute.run(threading.get_ident) != threading.get_ident()


def test_errors_reach_the_caller():
    def fail():
        raise ValueError("from the compute thread")

    with pytest.raises(ValueError, match="from the compute thread"):
        compute.run(fail)


def test_ctrl_c_while_waiting_interrupts_the_work_and_the_thread_stays_usable():
    state = {"interrupted": False}

    def spin():
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20:
                pass
        except KeyboardInterrupt:
            state["interrupted"] = True
            raise

    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            compute.run(spin)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert state["interrupted"]
    assert compute.run(lambda: 41 + 1) == 42


@pytest.mark.parametrize("cores,others,expected", [(2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 3.5, 1),
                                                   (8, 2.2, 6), (1, 0.0, 1)])
def test_threads_are_the_cores_other_processes_leave(cores, others, expected):
    assert choose_threads(cores, others) == expected


@pytest.fixture
def clock(monkeypatch) -> dict:
    """The machine's busy CPU seconds and this process' own, as the test sets them."""
    clock = {"busy": 100.0, "own": 10.0}
    monkeypatch.setattr(compute, "_machine_busy_s", lambda: clock["busy"])
    monkeypatch.setattr(compute, "_own_s", lambda: clock["own"])
    return clock


def test_budget_follows_the_machine(clock):
    b = ThreadBudget(cores=2, sampler=False)
    t0 = b._mark[0]
    assert b.threads == 2
    # a window in which this process used 1.9 core-seconds a second and nothing else ran: two threads
    clock["busy"] += 0.95
    clock["own"] += 0.95
    assert b.update(t0 + 0.5) == 2
    # another process kept a core busy: one thread
    clock["busy"] += 1.0 + 0.5
    clock["own"] += 0.5
    assert b.update(t0 + 1.0) == 1 and b.others == pytest.approx(2.0)
    assert b.update(t0 + 1.05) == 1  # no new window yet: not re-measured
    # it stopped: two again a tenth of a second on (on fewer threads than cores the windows are short)
    clock["busy"] += 0.1
    clock["own"] += 0.1
    assert b.update(t0 + 1.11) == 2
    # on every core, half-second windows again: a neighbour's tenth of a second is not yet measured
    clock["busy"] += 0.1 + 0.1
    clock["own"] += 0.1
    assert b.update(t0 + 1.2) == 2


def test_a_window_spanning_an_idle_spell_is_measured_afresh(clock):
    b = ThreadBudget(cores=2, sampler=False)
    t0 = b._mark[0]
    clock["busy"] += 10.0  # another process ran for a long while, then this process' next pass comes
    assert b.update(t0 + 5.0) == 2  # not judged on that: a fresh, short window starts
    clock["busy"] += 0.05  # in which only this process runs
    clock["own"] += 0.05
    assert b.update(t0 + 5.15) == 2 and b.others == pytest.approx(0.0)
    clock["busy"] += 0.15 + 0.05  # a neighbour busy now: one thread
    clock["own"] += 0.05
    assert b.update(t0 + 5.3) == 2  # (the window is 0.5 s after the first)
    clock["busy"] += 0.5
    assert b.update(t0 + 5.8) == 1


def test_after_an_idle_spell_the_first_pass_follows_the_spells_last_quarter_second(clock):
    # a neighbour keeps one core busy all through this process' idle spell (a server between requests)
    b = ThreadBudget(cores=2, sampler=False)
    t0 = b._mark[0]
    for i in range(1, 12):
        clock["busy"] += 0.25
        b.sample(t0 + 0.25 * i)
    clock["busy"] += 0.25
    assert b.update(t0 + 3.0) == 1 and b.others == pytest.approx(1.0)  # not every core for the first window
    # a neighbour that decoded on both cores early in the spell and then stopped (a CLI process)
    b = ThreadBudget(cores=2, sampler=False)
    t0 = b._mark[0]
    clock["busy"] += 3.0
    b.sample(t0 + 2.0)
    assert b.update(t0 + 2.5) == 2 and b.others == pytest.approx(0.0)  # its end says idle: both cores


def test_only_samples_of_the_spell_itself_count(clock):
    b = ThreadBudget(cores=2, sampler=False)
    t0 = b._mark[0]
    b.sample(t0 + 0.1)
    assert not b._idle  # a pass ran 0.1 s ago: not idle, nothing noted
    b.sample(t0 + 0.5)
    assert b.update(t0 + 0.6) == 2  # a pass: the spell before it ends
    clock["busy"] += 3.0  # a neighbour busy on every core since; no sample after that pass
    assert b.update(t0 + 4.0) == 2  # nothing known of the spell's end: every core, as before the sampler


def test_a_fixed_count_is_kept(monkeypatch):
    monkeypatch.setattr(compute, "_machine_busy_s", lambda: 1e9)
    b = ThreadBudget(cores=2, fixed=1)
    assert b.update(b._mark[0] + 10) == 1


@pytest.mark.parametrize("value,expected", [("3", 3), ("", None), ("zero", None), ("0", None), ("-2", None)])
def test_viasd_threads_env(monkeypatch, capsys, value, expected):
    monkeypatch.setenv("VIASD_THREADS", value)
    assert compute._fixed_from_env() == expected
    if value and expected is None:
        assert "VIASD_THREADS must be a positive integer" in capsys.readouterr().err
