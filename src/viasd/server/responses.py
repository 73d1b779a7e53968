"""One request's answer: its id and shapes (a whole body, a stream's chunks), its accounting in
/metrics (once, whatever ends it) and the answer to a request that ended before any text."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

from fastapi.responses import Response

from viasd.server.engine import Job
from viasd.server.errors import ended_by_server, engine_error
from viasd.server.metrics import Metrics
from viasd.server.tools import whole_message

_RECORDED = ("strategy", "draft", "drafter", "mode", "k", "adapt_k", "adaptive_k", "slim_fraction", "tier_thresholds",
             "resume", "resume_layer", "reduced_head", "slim_head_vocab", "drafter_head_vocab", "correct", "temperature",
             "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


def finite(x):
    """JSON has no inf / NaN: a threshold of inf (no limit) is sent as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def usage(job: Job) -> dict:
    st = job.result.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens}


def record(job: Job) -> dict:
    """The `viasd` field of an answer: the settings the decode used and its stats."""
    c = job.result.config
    return finite({"config": {k: c[k] for k in _RECORDED if k in c}, "stats": job.result.stats.to_dict()})


class Reply:
    """The answer to one submitted job; `watcher` (the task that notices a client leaving) ends with it."""

    def __init__(self, job: Job, endpoint: str, chat: bool, served: str, metrics: Metrics, watcher: asyncio.Task,
                 tools=None):
        self.job, self.endpoint, self.chat, self.served, self.metrics, self.watcher = job, endpoint, chat, served, metrics, watcher
        self.tools = tools  # the ToolPlan of the tool calls the answer may hold (tools.py), or None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def count(self, status: int) -> None:
        self.metrics.requests.labels(self.endpoint, str(status)).inc()

    def finish(self, status: int) -> None:
        """Account for the request once; error statuses are counted where they are answered."""
        job = self.job
        if job.finished:
            return
        job.finished = True
        self.watcher.cancel()
        if status in (200, 499):
            self.count(status)
        self.metrics.observe_decode(self.endpoint, job)
        if status == 200:
            self.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - job.arrived)

    def abandon(self) -> None:
        """The client is gone (or the handler was cancelled): stop the decode, account for it once it ends."""
        self.job.stop("client")
        if not self.job.finished:
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """Wait for the worker's last event of an abandoned job, then count it as a 499."""
        while True:
            kind, *_ = await self.job.next_event()
            if kind in ("done", "cancelled", "error"):
                self.finish(499)
                return

    def ended_early(self, event: tuple) -> Response | None:
        """The answer to a request whose first event ends it (raised when an error), else None."""
        kind = event[0]
        if kind == "error":
            e = engine_error(event[1])
            self.finish(e.status)
            raise e
        if kind == "cancelled":
            if self.job.cancel_reason == "shutdown":
                self.finish(503)
                raise ended_by_server(self.job)
            self.finish(499)
            return Response(status_code=499)
        return None

    def body(self) -> dict:
        """The whole (non-streamed) answer."""
        job = self.job
        if self.chat:
            message, finish = {"role": "assistant", "content": job.text}, job.finish_reason
            if self.tools is not None:
                text = self.tools.answer_text(job.text, job.result.token_ids)
                message, finish = whole_message(text, finish, self.tools.family)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": job.text, "logprobs": None, "finish_reason": job.finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.served, "choices": [choice], "usage": usage(job), "viasd": record(job)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first_chunk: bool = False) -> dict:
        """One streamed chunk: a delta of text (chat) or the text itself (completions)."""
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first_chunk else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._chunk_head(), "choices": [choice]}

    def delta_chunk(self, delta: dict) -> dict:
        """One streamed chat chunk of a given delta (a tool call's fragment)."""
        return {**self._chunk_head(), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._chunk_head(), "choices": [], "usage": usage(self.job)}

    def _chunk_head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.served}
