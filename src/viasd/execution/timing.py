"""What a model's passes cost, measured: `pass_times` (passes of 1..n rows after a short context,
kept per model in the process and, for the next processes of this boot of the machine, in
`pass_times.json` in the cache directory) and `PassTimer` (seconds of model work less the forward
graphs built meanwhile). The draft-length policy (`decoding.draft_length`) prices rounds with them.

A CLI call would otherwise measure before each first token (1.3 s of qwen 1.5B's 2.0 s to `pld`'s).
What a pass costs depends on the model's shapes and weight formats, the kernels, the cores and the
machine, so a measurement is kept under exactly those (the machine's boot id, so never for another
machine or boot), for `STORE_MAX_AGE_S`, and only one taken on every core the process may use.
`VIASD_NO_TIMING_CACHE=1` measures afresh.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from viasd import compute
from viasd.execution.passes import Passes
from viasd.models.decoder import Decoder

if TYPE_CHECKING:
    from viasd.models.layers import ReducedHead

_CONTEXT = 64  # positions already in the cache when the pass costs are measured


def pass_times(decoder: Decoder, rows: int, reps: int = 3, last_only: bool = False, keep: bool = True,
               passes: Passes | None = None, head: ReducedHead | None = None) -> list[float]:
    """Seconds of a forward pass of 1..rows tokens after a `_CONTEXT`-position prompt (medians, on a
    scratch cache), measured once per decoder, row count and kind of pass (`last_only`: the last row's
    logits only, as drafting passes ask; else every row's, as verification passes) and kept on it, where
    the draft-length policy then writes what requests learn (`DraftLength(learnt=)`); the first round
    builds each shape's graph. Non-decreasing: a pass of more rows never counts as cheaper. `keep=False`:
    measured now and not kept, whatever is (the benchmark's recorded costs: its own `reps`, never a
    policy's learnt times). Kept measurements also go to the cache directory for the next processes of
    this boot of the machine (`stored`). `passes`: the measuring request's, where it runs beside others.
    `head`: last-row passes over that reduced LM head (a drafter's: qwen2.5-coder-0.5b's drafting
    pass over 32768 tokens took 0.80x the time of one over its whole head)."""
    cached = decoder.pass_times
    if head is not None and not last_only:
        raise ValueError("a reduced head's passes are last-row (drafting) passes")
    shape = (rows, last_only) + ((len(head), head.digest) if head is not None else ())
    if keep and shape in cached:
        return cached[shape]
    key = _store_key(decoder, shape) if keep else None
    if key is not None and (times := stored(key, rows)) is not None:
        cached[shape] = times
        return times
    # a request served beside others measures in a step of its own (`exclusive`), not in passes shared
    # with the others' (a burst's prompts inflated the first request's measurement 4-9x, for good)
    whole = _every_core()  # (kept only if measured on every core, from start to end)
    times = (passes or Passes()).exclusive(lambda: _measure(decoder, rows, reps, last_only, head))
    if keep:
        cached[shape] = times
        if key is not None and whole and _every_core():
            store(key, times)
    return times


# ---------------------------------------------------------------- pass times kept across processes
STORE_NAME = "pass_times.json"
STORE_MAX_AGE_S = 24 * 3600.0


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _every_core() -> bool:
    """Whether passes run on every core the process may use now (the machine otherwise idle)."""
    budget = compute.budget()
    return budget.threads >= (budget.fixed or budget.cores)


def _kernels_digest() -> str:
    from viasd.models import rowexact

    try:
        return rowexact.source_digest()[:16]
    except OSError:
        return "?"


def _store_key(decoder: Decoder, shape: tuple) -> str | None:
    """What a measurement of `decoder`'s pass times stands for, as one string; None where it is not
    kept (`VIASD_NO_TIMING_CACHE`, no boot id, a decoder without a native graph)."""
    import hashlib

    from viasd.version import __version__

    graph = getattr(decoder, "_graph", None)
    boot = _boot_id()
    if os.environ.get("VIASD_NO_TIMING_CACHE", "").strip() not in ("", "0") or boot is None or graph is None:
        return None
    budget = compute.budget()
    what = (boot, __version__, _kernels_digest(), type(decoder).__name__, repr(decoder.config),
            decoder.weight_bytes(), sorted(graph.packed.items()), graph.attention, str(decoder.dtype),
            budget.fixed or budget.cores, *shape)
    return hashlib.sha256(repr(what).encode()).hexdigest()


def _store_path() -> Path:
    from viasd.models.loading import cache_dir

    return cache_dir() / STORE_NAME


def _read_store() -> dict:
    """The kept measurements ({key: entry}); {} when there are none or the file is damaged in any way
    (not a regular file, over `STORE_MAX_BYTES`, not JSON, nested too deeply: said once on stderr; the
    next `store` writes a whole file in its place)."""
    from viasd.validation import read_json_bounded

    path = _store_path()
    try:
        data = read_json_bounded(path, STORE_MAX_BYTES)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        global _store_warned
        if not _store_warned:
            _store_warned = True
            why = str(e).removeprefix(f"{path}: ")
            print(f"viasd: the kept pass times {path} are unreadable ({why}); measuring them again", file=sys.stderr, flush=True)
        return {}
    return data


_store_warned = False  # the damaged store has been named on stderr (once a process)
STORE_MAX_BYTES = 4 << 20  # a day of one boot's measurements is a few KiB


def _entry_times(entry, rows: int | None = None) -> list[float] | None:
    """An entry's times if it is whole (a list of plausible seconds, `rows` of them), else None."""
    times = entry.get("times") if isinstance(entry, dict) else None
    if isinstance(times, list) and (rows is None or len(times) == rows) and times and \
            all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 3600 for t in times):
        return [float(t) for t in times]
    return None


def _recent(entry, boot: str | None, now: float) -> bool:
    """Whether a kept entry was measured on this boot, less than `STORE_MAX_AGE_S` ago."""
    try:
        return entry["boot"] == boot and type(entry["at"]) in (int, float) and 0 <= now - float(entry["at"]) < STORE_MAX_AGE_S
    except (TypeError, KeyError, OverflowError):
        return False


def stored(key: str, rows: int) -> list[float] | None:
    """The kept measurement of `rows` row counts under `key`, if any and recent (None otherwise)."""
    entry = _read_store().get(key)
    times = _entry_times(entry, rows)
    return times if times is not None and _recent(entry, _boot_id(), time.time()) else None


def store(key: str, times: list[float]) -> None:
    """Keep a measurement under `key` (entries of other boots, stale and malformed ones dropped); never
    fails: an unwritable cache directory only means the next process measures again. The file is
    replaced whole (a damaged one, a FIFO or a link to a device included)."""
    from viasd.validation import atomic_write_text

    boot, now = _boot_id(), time.time()
    data = {k: {"times": t, "at": float(e["at"]), "boot": boot} for k, e in _read_store().items()
            if _recent(e, boot, now) and (t := _entry_times(e)) is not None}
    data[key] = {"times": times, "at": now, "boot": boot}
    try:
        atomic_write_text(_store_path(), json.dumps(data))
    except (OSError, ValueError):
        pass


def _measure(decoder: Decoder, rows: int, reps: int, last_only: bool, head: ReducedHead | None = None) -> list[float]:
    """`pass_times`' passes, run here (never parked in a batch session, never through the prefix
    cache: the scratch prompt is nobody's)."""
    direct = isinstance(decoder, Decoder)
    n = max(1, min(_CONTEXT, decoder.config.max_positions - rows - 1))
    ids = torch.arange(rows + n) % min(1000, decoder.config.vocab_size)  # any tokens: the cost is the same
    cache = decoder.new_cache(n + rows)
    over: dict[str, Any] = {} if head is None else {"head": head, "expand": False}  # (drafting passes: the last row only)

    def run(tokens: torch.Tensor, start: int, last: bool) -> None:
        decoder.forward(tokens, start, cache, last_only=last, **(over if last else {}))

    if not direct:
        run(ids[:n], 0, False)
    else:  # the context's positions as they are (zeros): a pass costs the same whatever its keys hold,
        cache._commit(None, 0, n)  # and computing them took qwen 1.5B 0.9 s of its 2.2 s before a first token
    samples: list[list[float]] = [[] for _ in range(rows)]
    for i in range(reps + 1):  # row counts interleaved: drift hits all of them alike
        for r in range(1, rows + 1):
            t0 = time.perf_counter()
            run(ids[n : n + r], n, last_only)
            if i:  # the first round builds the graphs
                samples[r - 1].append(time.perf_counter() - t0)
            cache.rollback(n)
    times: list[float] = []
    for r in range(rows):
        times.append(max(statistics.median(samples[r]), times[-1] if times else 0.0))
    return times


class PassTimer:
    """Seconds of model work on `decoder` (None: time alone) less the forward graphs it built
    meanwhile: a graph is built once per shape and cache length (each request's caches have their
    own), so a round that built some would otherwise price every later round as dear, and the policy
    would stop drafting.

        with PassTimer(decoder) as t:
            ...
        t.seconds
    """

    def __init__(self, decoder=None):
        self.decoder = decoder
        self.seconds = 0.0

    def _built(self) -> float:  # (a plain attribute read: twice a round, right after a pass)
        return getattr(self.decoder, "graph_build_s", 0.0)

    def __enter__(self) -> PassTimer:
        self._t0, self._b0 = time.perf_counter(), self._built()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = max(0.0, time.perf_counter() - self._t0 - (self._built() - self._b0))
