"""The decode worker: one model in memory; up to `max_batch` requests decoding at once, each in a
thread of its own running `viasd.generate`, their forward passes stacked into shared passes on the
process' compute thread (`viasd.execution.batching`); a bounded FIFO of admitted requests behind them.

The HTTP side (routes_completions.py) runs on the asyncio loop; a request becomes a `Job` whose events (text pieces,
then done / cancelled / error) the worker posts back to the loop. Stop strings and cancellation go
through the engine's own hook: the `on_text` callback (called after each committed round that
produces text) raises `StopGeneration`, and `generate` returns what was committed so far.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from viasd.api import GenerateConfig, StopGeneration, TokenText, drafts_with_model, generate
from viasd.decoding.stats import DecodeResult
from viasd.errors import ViasdError
from viasd import compute
from viasd.execution.batching import BatchSession
from viasd.execution.passes import Passes
from viasd.execution.prefix import PrefixCache


class StopText:
    """Text pieces in, the pieces that may be sent out: cut at the first stop string, holding back
    a tail that could still become one. Streaming and non-streaming responses share it, so the
    chunks of a stream always reassemble to the non-streamed text."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything received
        self.sent = 0  # characters of self.text handed out
        self.hit: int | None = None  # index of the first stop string in self.text

    def feed(self, piece: str) -> str:
        self.text += piece
        cut = first_stop(self.text, self.stops)
        if cut is not None:
            self.hit = cut
            return self._take(cut)
        hold = max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])), default=0)
        return self._take(len(self.text) - hold)

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out


class TokenLog:
    """The committed tokens against the text a `StopText` lets out: each token is handed out once, in the
    batch where the text sent covers all of it (cut where a stop string cuts the answer), so that the
    tokens handed out carry, in order, exactly the text sent."""

    def __init__(self) -> None:
        self.tokens: list[TokenText] = []  # every committed token
        self.ends: list[int] = []  # [len(tokens)] where each token's text ends in the whole text
        self.out = 0  # tokens handed out

    def add(self, tokens: list[TokenText]) -> None:
        end = self.ends[-1] if self.ends else 0
        for t in tokens:
            end += len(t.text)
            self.tokens.append(t)
            self.ends.append(end)

    def take(self, sent: int, final: bool = False) -> list[TokenText]:
        """The tokens not handed out yet whose text ends within the first `sent` characters (`final`:
        also the one that `sent` cuts, its text cut there; the rest are dropped)."""
        taken = []
        while self.out < len(self.tokens) and (self.ends[self.out] <= sent or final):
            t, start = self.tokens[self.out], self.ends[self.out] - len(self.tokens[self.out].text)
            if start > sent or (start == sent and t.text):
                break
            taken.append(t if self.ends[self.out] <= sent else dataclasses.replace(t, text=t.text[: sent - start]))
            self.out += 1
        return taken


def first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


# A stream whose reader stops reading: the worker stops its decode when this many text events wait
# unread, or when events have waited this long (seconds) without the reader taking one. Either way
# only that stream ends; its memory stays bounded and the other requests go on.
MAX_UNREAD_EVENTS = 1024
STALL_TIMEOUT_S = 30.0


@dataclass(eq=False)  # hashed by identity (the worker keeps a set of live jobs)
class Job:
    prompt: object  # str | list[dict] | list[int], as `generate` takes it
    settings: dict  # GenerateConfig fields
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_text: float | None = None
    finished: bool = False
    stream: bool = True  # the reader takes the text as it comes; else only the end (no wake-up per token)
    max_unread: int = field(default_factory=lambda: MAX_UNREAD_EVENTS)
    stall_timeout: float = field(default_factory=lambda: STALL_TIMEOUT_S)
    # filled by the worker
    result: DecodeResult | None = None
    text: str = ""
    tokens: list[TokenText] = field(default_factory=list)  # the answer's tokens, their texts making `text`
    finish_reason: str | None = None
    cancel_reason: str | None = None  # "client" (it left), "stalled" (it stopped reading), "shutdown"
    posted: int = 0  # text events posted / taken by the reader (the unread ones are the difference)
    taken: int = 0
    last_taken: float = field(default_factory=time.monotonic)

    @property
    def decoded(self) -> DecodeResult:
        """`result`, read once the decode is done (the answer's body, its record)."""
        if self.result is None:
            raise RuntimeError("the request's decode has no result yet")
        return self.result

    def stop(self, reason: str) -> None:
        """End the decode after its current round, for `reason` (the first reason given wins)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancel.set()

    def post(self, *event) -> None:
        """An event for the reader: ("text", piece, tokens), ("done",), ("cancelled",), ("error", e)."""
        if event[0] == "text":
            if not self.stream:  # read at the end (`text`): waking the event loop for each token took
                return  # the cores from the decode (a request served alone at 0.90-0.95x `generate`)
            self.posted += 1
            unread = self.posted - self.taken
            if unread > self.max_unread or (unread > 1 and time.monotonic() - self.last_taken > self.stall_timeout):
                self.stop("stalled")
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def next_event(self) -> tuple:
        """The next event, for the reader (marks the reader alive)."""
        event = await self.events.get()
        if event[0] == "text":
            self.taken += 1
        self.last_taken = time.monotonic()
        return event


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


def default_kv_budget() -> int:
    """A quarter of the memory the machine has available now (bytes), for the requests' KV caches."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        return int(info.get("MemAvailable", info.get("MemTotal", 8 << 30)) * 0.25)
    except (OSError, ValueError):
        return 2 << 30


def kv_bytes(model, positions: int) -> int:
    """The bytes of one request's float32 KV cache over `positions` positions (K and V, every layer)."""
    c = model.config
    return positions * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4


class Worker:
    """Runs up to `max_batch` requests at once, their forward passes batched on the compute thread
    (`execution.batching`), and admits up to `max_queue` more waiting in order behind them; a request
    waits too while the KV caches of the running ones leave less than it needs of `kv_budget`."""

    def __init__(self, model, drafter=None, max_queue: int = 64, on_depth=None, max_batch: int = 8,
                 kv_budget: int | None = None, prefix_cache: int = 0):
        self.model, self.drafter, self.max_queue, self.max_batch = model, drafter, max_queue, max_batch
        # prompts' K/V reused across requests (a chat template's system prompt: 24 of qwen's ~40
        # prompt tokens here), `prefix_cache` bytes for each model; results unchanged (execution/prefix.py)
        self.prefix_caches = [(m.decoder, PrefixCache(prefix_cache)) for m in (model, drafter) if m is not None and prefix_cache]
        self.kv_budget = default_kv_budget() if kv_budget is None else kv_budget
        self.kv_used = 0
        self.session = BatchSession()
        self.threads = ThreadPoolExecutor(max_workers=max_batch, thread_name_prefix="viasd-request")
        self.on_depth = on_depth or (lambda waiting, running: None)
        self.lock = threading.Condition()
        self.waiting = 0
        self.running = 0
        self.live: set[Job] = set()
        self.draining = False
        self._scheduling = False
        self._inline: list[tuple[Job, threading.Event, list]] = []  # requests to run on the compute thread

    @property
    def pending(self) -> int:
        with self.lock:
            return self.waiting + self.running

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.draining:
                raise Draining()
            if self.waiting + self.running >= self.max_queue + self.max_batch:
                raise QueueFull()
            self.waiting += 1
            self.session.admitted += 1  # (until it ends, no other request's pass times are its own: `BatchSession.alone`)
            self.live.add(job)
            self._depth()
            start = not self._scheduling
            self._scheduling = True
        if start:
            compute.submit(self._schedule)
        self.threads.submit(self._run, job)

    def cancel_all(self, reason: str = "shutdown") -> None:
        with self.lock:
            for job in self.live:
                job.stop(reason)

    def _depth(self) -> None:
        self.on_depth(self.waiting, self.running)

    def _schedule(self) -> None:
        """On the compute thread while requests are live: run their passes, and run a request that
        started alone on this thread itself (`BatchSession.run_inline`; others that arrive meanwhile
        share its passes)."""
        while True:
            with self.lock:
                inline = self._inline.pop(0) if self._inline else None
            if inline is not None:
                job, done, error = inline
                try:
                    self.session.run_inline(self._decode, job)
                except BaseException as e:  # raised in the request's thread
                    error.append(e)
                finally:
                    done.set()
                continue
            if not self.session.step(idle_timeout=0.05):
                with self.lock:
                    if not self.live and not self._inline:
                        self._scheduling = False
                        return

    def _kv_need(self, job: Job) -> int:
        prompt = job.prompt
        size = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
            len(str(prompt))  # characters: at least the tokens
        positions = min(self.model.config.max_positions, size + job.settings.get("max_new_tokens", 0) + 80)
        return kv_bytes(self.model, positions) + (kv_bytes(self.drafter, positions) if self.drafter is not None else 0)

    def _run(self, job: Job) -> None:
        need = min(self._kv_need(job), self.kv_budget)  # one request alone always fits
        with self.lock:
            while self.kv_used + need > self.kv_budget and not job.cancel.is_set():
                self.lock.wait(0.1)
            self.kv_used += need
            self.waiting -= 1
            self.running += 1
            alone = self.running == 1 and self.waiting == 0
            self._depth()
        try:
            if job.cancel.is_set():  # the client left while the request waited
                job.post("cancelled")
                return
            job.started = time.perf_counter()
            if alone:  # on the compute thread, as `viasd generate` decodes
                done = threading.Event()
                error: list[BaseException] = []
                with self.lock:
                    self._inline.append((job, done, error))
                self.session.wake()
                done.wait()
                if error:
                    raise error[0]
            else:
                self.session.member(self._decode, job)
        except ViasdError as e:
            job.post("error", e)
        except Exception as e:  # a bug, not the client's fault: log it, answer 500 without a traceback
            print(f"viasd serve: internal error: {e!r}\n{traceback.format_exc()}", file=sys.stderr)
            job.post("error", e)
        finally:
            with self.lock:
                self.kv_used -= need
                self.running -= 1
                self.session.admitted -= 1
                self.live.discard(job)
                self._depth()
                self.lock.notify_all()

    def _decode(self, job: Job) -> None:
        stop, log = StopText(job.stops), TokenLog()
        cancelled = False

        def on_tokens(tokens: list[TokenText]) -> None:
            nonlocal cancelled
            if job.cancel.is_set():
                cancelled = True
                raise StopGeneration()
            log.add(tokens)
            out = stop.feed("".join(t.text for t in tokens))
            if out:
                if job.first_text is None:
                    job.first_text = time.perf_counter()
                job.post("text", out, log.take(stop.sent))
            if stop.hit is not None:
                raise StopGeneration()

        drafter = self.drafter if self.drafter is not None and drafts_with_model(GenerateConfig.from_settings(**job.settings)) else None
        passes = Passes(self.session, self.prefix_caches)  # its passes batched with the others', through the prefix caches
        result = generate(job.prompt, self.model, drafter=drafter, on_tokens=on_tokens, progress=False, passes=passes, **job.settings)
        job.result = result
        if cancelled:
            job.post("cancelled")
            return
        cut = first_stop(result.text, stop.stops)
        text = result.text if cut is None else result.text[:cut]
        sent = stop.text[: stop.sent]
        if text.startswith(sent):
            rest = text[len(sent) :]
        else:  # cannot happen while decoding a prefix gives a prefix of the text; keep the stream's
            print("viasd serve: streamed text is not a prefix of the final text; answering the streamed text", file=sys.stderr)
            text, rest = sent, ""
        last = log.take(len(text), final=True)
        if rest or last:
            if job.first_text is None:
                job.first_text = time.perf_counter()
            job.post("text", rest, last)
        job.text, job.tokens = text, log.tokens[: log.out]
        # OpenAI's finish_reason: "length" when the token budget cut the answer (not where its grammar
        # was complete), else "stop" (a stop string, an end token, a complete grammar)
        stopped = cut is not None or stop.hit is not None
        job.finish_reason = "stop" if stopped else result.finish_reason
        job.post("done")

    def shutdown(self) -> None:
        self.cancel_all()
        self.threads.shutdown(wait=False, cancel_futures=False)
