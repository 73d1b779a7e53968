"""Continuous batching: several requests' decoding loops at once, their forward passes stacked into
shared passes on the compute thread.

Each request runs its own, unchanged decoding loop (any strategy: `ar`, `pld`, `sd`, VIA-SD) in a
thread of its own that is a *member* of a `BatchSession`. A member's passes (`execution.passes.Passes`
with the session) do not compute: they park in the session. The compute thread (`step`) waits until every member is parked
(or `MAX_WAIT_S` has passed with some parked), then runs all parked calls at once: calls of one
decoder along one route with one head become one pass (`Decoder.forward_many`: every product over
all their rows, each request's rows attending its own cache), the rest run one by one. Members do
only their loops' light work (acceptance, sampling, text) between passes, on one torch thread each,
so that the OpenMP teams stay with the compute thread (`compute.py` says why).

Speculative members run in lockstep (`lockstep`): while a cheaper model's calls are parked (a
drafter's, a slim route's), the dearer ones wait for them, so that every member drafts in the same
cheap passes and verifies in the same full one. Run as they came, a step held one member's draft
and another's verification, and cost a drafter pass plus a verifier pass for one row of each.

Rows are computed independently (row-exact products; attention of each row over its own keys), so a
request's tokens are the same served alone or beside any others: batch invariance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from viasd import compute
from viasd.models.kvcache import ROW_ATTENTION_MAX

if TYPE_CHECKING:
    from viasd.models.decoder import Decoder

MAX_WAIT_S = 0.005  # a pass waits at most this long for members still busy elsewhere (longer: fewer, fuller
# passes but a slower first token; shorter: passes that leave members behind)

MAX_DEFER = 16  # steps a call waits at most for cheaper models' calls (`lockstep`): four times the
# default draft length (`--k` 4), so that a member drafting long rounds cannot hold the others for good

T = TypeVar("T")


class _Call:
    __slots__ = ("decoder", "args", "kwargs", "result", "error", "done", "deferred")

    def __init__(self, decoder, args, kwargs):
        self.decoder, self.args, self.kwargs = decoder, args, kwargs
        self.result = self.error = None
        self.done = False
        self.deferred = 0  # steps it waited for cheaper calls (`lockstep`)


class BatchSession:
    """Members' forward calls, gathered into passes by `step` on the compute thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._parked: list[_Call] = []
        self.members = 0
        # requests its owner has taken in and not yet finished, members or not (a server's: waiting,
        # starting, tokenizing, finishing): more than one, and a member's passes are not its own
        # even while it is the only member (`alone`)
        self.admitted = 0
        self.last_batch: tuple[int, int] = (0, 0)  # (requests, rows) of the last pass of many
        self.on_pass: Callable[[int, int], None] | None = None  # (requests, rows) of each pass
        self._inline: int | None = None  # the thread of the member run on the compute thread (`run_inline`)
        self._woken = False

    # ------------------------------------------------------------------ members
    def member(self, fn: Callable, *args, **kwargs):
        """Run `fn` in the calling thread as a member (its passes parked here: `Passes(session=self)`)."""
        import torch

        torch.set_num_threads(1)  # a member's own torch work is small: no OpenMP team of its own
        with self._cv:
            self.members += 1
            self._cv.notify_all()
        compute.enter_member()
        try:
            return fn(*args, **kwargs)
        finally:
            compute.leave_member()
            with self._cv:
                self.members -= 1
                self._cv.notify_all()

    def run_inline(self, fn: Callable, *args, **kwargs):
        """Run `fn` on the compute thread itself as a member: its forward calls run at once, with
        whatever other members have parked (it steps the session), and its loop's own work runs where
        `viasd generate`'s does (a request served alone decodes at the CLI's speed; as a member in a
        thread of its own it ran at 0.92-0.96x). Other members are served while it waits in a pass."""
        with self._cv:
            self.members += 1
        self._inline = threading.get_ident()
        try:
            return fn(*args, **kwargs)
        finally:
            self._inline = None
            with self._cv:
                self.members -= 1
                self._cv.notify_all()

    def alone(self) -> bool:
        """Whether the calling member is the only request, in the session and admitted by its owner:
        its passes' times are then its own."""
        return max(self.members, self.admitted) <= 1

    def exclusive(self, fn: Callable[[], T]) -> T:
        """`fn()` on the compute thread in a step of its own: no member's pass runs beside it or
        between its passes, which call the decoders' `forward` themselves. For measuring pass times
        from a member: through the shared steps, the first request of a burst timed its passes with
        the others' prompts run in the same steps, and kept those inflated times for the process."""
        if self._inline == threading.get_ident():  # the compute thread itself: the others wait meanwhile
            return fn()
        return self._park(_Call(None, (fn,), {}))

    def wake(self) -> None:
        """End a `step` waiting for calls now (the compute thread has other work: `run_inline`)."""
        with self._cv:
            self._woken = True
            self._cv.notify_all()

    def forward(self, decoder: Decoder, *args, **kwargs):
        """A member's `decoder.forward(*args, **kwargs)`: parked until the compute thread runs it (run
        at once, with the others' parked calls, for the member on the compute thread)."""
        call = _Call(decoder, args, kwargs)
        if self._inline == threading.get_ident():
            with self._cv:
                alone = self.members == 1 and not self._parked
                if not alone:
                    self._parked.append(call)
            if alone:  # nobody to share the pass with: run it as `viasd generate` does, without a step
                _run_one(call)
                call.done = True
            while not call.done:
                self.step(idle_timeout=0.0)
            if call.error is not None:
                raise call.error
            return call.result
        return self._park(call)

    def _park(self, call: _Call):
        """Park `call` for the compute thread and wait until it ran; its result (or its error, raised)."""
        with self._cv:
            self._parked.append(call)
            self._cv.notify_all()
            while not call.done:
                self._cv.wait()
        if call.error is not None:
            raise call.error
        return call.result

    # ------------------------------------------------------------------ the compute thread
    def step(self, idle_timeout: float = 0.1) -> int:
        """Wait for the members' calls and run them; returns how many ran (0 after `idle_timeout`
        seconds with nothing parked)."""
        with self._cv:
            deadline = time.monotonic() + idle_timeout
            while not self._parked:
                left = deadline - time.monotonic()
                if left <= 0 or self._woken:
                    self._woken = False
                    return 0
                self._cv.wait(left)
            first = time.monotonic()
            while len(self._parked) < self.members:  # members still busy: wait for them, briefly
                left = first + MAX_WAIT_S - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            alone = next((c for c in self._parked if c.decoder is None), None)  # `exclusive`
            if alone is not None:
                calls = [alone]
                self._parked.remove(alone)
            else:
                calls, self._parked = lockstep(self._parked)
        try:
            self._run(calls)
        finally:
            with self._cv:
                for call in calls:
                    call.done = True
                self._cv.notify_all()
        return len(calls)

    def _run(self, calls: list[_Call]) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for call in calls:
            groups.setdefault(_group_key(call), []).append(call)
        for key, group in groups.items():
            if key[0] is None or len(group) == 1:
                for call in group:
                    _run_one(call)
                continue
            decoder = group[0].decoder
            outs = decoder.forward_many([(c.args, c.kwargs) for c in group], rows=key[-1])
            rows = sum(len(c.args[0]) for c in group)
            self.last_batch = (len(group), rows)
            if self.on_pass is not None:
                self.on_pass(len(group), rows)
            for call, out in zip(group, outs):
                if isinstance(out, BaseException):
                    call.error = out
                else:
                    call.result = out


def lockstep(calls: list[_Call]) -> tuple[list[_Call], list[_Call]]:
    """(run now, keep parked): while calls of a cheaper pass are parked (a drafter model's, a slim
    route's: fewer weight bytes read), the dearer ones wait (each at most MAX_DEFER steps), so that
    speculative members draft together in cheap passes and verify together in one full pass, as
    vLLM's steps run every request's drafts and then one verification. Calls of one cost all run."""
    costs = [_cost(c) for c in calls]
    known = [c for c in costs if c is not None]
    if len(set(known)) < 2:
        return calls, []
    cheapest = min(known)
    now, later = [], []
    for call, cost in zip(calls, costs):
        if cost is not None and cost > cheapest and call.deferred < MAX_DEFER:
            call.deferred += 1
            later.append(call)
        else:
            now.append(call)
    return now, later


def _cost(call: _Call) -> int | None:
    """Weight bytes the call's pass reads (None where its decoder does not say)."""
    weight_bytes = getattr(call.decoder, "weight_bytes", None)
    if weight_bytes is None:
        return None
    kw = call.kwargs
    head = kw.get("head") if kw.get("head") is not None else kw.get("logits", True) is not False  # (False: no head)
    return weight_bytes(kw.get("route"), 0, head) or None


def _run_one(call: _Call) -> None:
    try:
        if call.decoder is None:  # `exclusive`
            call.result = call.args[0]()
            return
        call.result = call.decoder.forward(*call.args, **call.kwargs)
    except BaseException as e:  # handed to the member, raised there
        call.error = e


def _group_key(call: _Call) -> tuple:
    """Calls that can share a pass have equal keys; a key starting with None runs alone. A full pass
    resumed at a layer (VIA-SD's) shares with those resumed at the same layer, and a pass storing the
    streams entering a layer with those storing at the same one (each request reads and writes its
    own cache's): run alone, lossless VIA-SD served 8 requests at 0.28x `ar`'s tokens/s."""
    dec, args, kw = call.decoder, call.args, call.kwargs
    if dec is None:  # `exclusive`
        return (None, id(call))
    route, head, resume = kw.get("route"), kw.get("head"), kw.get("resume", False)
    tokens, start, cache = args
    if getattr(dec, "_graph", None) is None or len(tokens) > ROW_ATTENTION_MAX:
        return (None, id(call))
    first = cache.resume_layer if resume else 0
    save = cache.resume_layer if not resume and cache.saves_hidden(None if route is None or route.is_full else route) else None
    return (id(dec), route, id(head), first, save, padded_rows(len(tokens), start, cache.k.shape[2]))


def padded_rows(n: int, start: int, max_len: int) -> int:
    """The rows a call of `n` rows takes in a shared pass: the next power of two up to 8, else the
    next multiple of 8 (at most ROW_ATTENTION_MAX), where its cache has room for them, else `n`.
    Calls of equal padded rows share passes, so a few graphs serve every mix of draft lengths (one
    graph per composition of exact row counts would be built anew at most steps of speculative
    strategies: 10-20 ms each); the padding rows' outputs are dropped and their K/V lie past the
    request's positions, never read. Prompts pad to a multiple of 8, not to a power of two: each
    padding row costs what a real one does (a 40-token prompt padded to 64 cost 1.6x its rows)."""
    b = 1 << max(0, n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
    return b if b <= ROW_ATTENTION_MAX and start + b <= max_len else n
