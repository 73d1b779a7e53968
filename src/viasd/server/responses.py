"""One request's answer: its id and shapes (a whole body, a stream's chunks), its accounting in
/metrics (once, whatever ends it) and the answer to a request that ended before any text."""

from __future__ import annotations

import asyncio
import math
import time
import uuid

from fastapi.responses import Response

from viasd.api import TokenText
from viasd.decoding.stats import TokenLogprob
from viasd.errors import VocabularyMismatchError
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
    st = job.decoded.stats
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
            "total_tokens": st.prompt_tokens + st.new_tokens}


def record(job: Job) -> dict:
    """The `viasd` field of an answer: the settings the decode used and its stats."""
    c = job.decoded.config
    return finite({"config": {k: c[k] for k in _RECORDED if k in c}, "stats": job.decoded.stats.to_dict()})


def _scored(t: TokenText) -> TokenLogprob:
    """A token's logprob, which every token carries with the logprobs setting."""
    if t.logprob is None:
        raise RuntimeError("a token without its logprob under the logprobs setting")
    return t.logprob


def token_string(piece: bytes) -> str:
    """A token's text as OpenAI's logprobs name it: its bytes as UTF-8, else as escapes ("bytes:\\xe2")."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class Reply:
    """The answer to one submitted job; `watcher` (the task that notices a client leaving) ends with it.
    `model`: whose tokens' bytes logprobs name; `provenance`: each token's source in the `viasd`
    object (chunks', or the whole answer's)."""

    def __init__(self, job: Job, endpoint: str, chat: bool, served: str, metrics: Metrics, watcher: asyncio.Task,
                 tools=None, model=None, provenance: bool = False):
        self.job, self.endpoint, self.chat, self.served, self.metrics, self.watcher = job, endpoint, chat, served, metrics, watcher
        self.tools = tools  # the ToolPlan of the tool calls the answer may hold (tools.py), or None
        self.model, self.provenance = model, provenance
        self.logprobs = job.settings.get("logprobs")  # None, or the alternatives per token
        self.offset = 0  # characters of the answer's tokens sent so far (completions' text_offset)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def token_logprobs(self, tokens: list[TokenText]) -> dict | None:
        """`tokens`' logprobs in the endpoint's shape (None without the setting)."""
        if self.logprobs is None:
            return None
        piece = self._piece
        name = lambda i: token_string(piece(i))  # noqa: E731
        scored = [_scored(t) for t in tokens]
        if self.chat:
            def entry(i: int, lp: float) -> dict:
                return {"token": name(i), "logprob": lp, "bytes": list(piece(i))}
            return {"content": [{**entry(t.id, s.logprob), "top_logprobs": [entry(i, lp) for i, lp in s.top]}
                                for t, s in zip(tokens, scored)], "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.text)
        return {"tokens": [name(t.id) for t in tokens], "token_logprobs": [s.logprob for s in scored],
                "top_logprobs": [{name(i): lp for i, lp in s.top} for s in scored] if self.logprobs else None,
                "text_offset": offsets}

    def _piece(self, i: int) -> bytes:
        """Token i's bytes (a word-level tokenizer has no byte pieces: its decoded text)."""
        try:
            return self.model.vocabulary.pieces[i]
        except VocabularyMismatchError:
            return self.model.tokenizer.decode([i]).encode()

    def token_sources(self, tokens: list[TokenText]) -> list[dict]:
        return [{"text": t.text, "by": t.source.value} for t in tokens]

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
                text = self.tools.answer_text(job.text, job.decoded.token_ids)
                message, finish = whole_message(text, finish, self.tools.family)
            choice = {"index": 0, "message": message, "logprobs": self.token_logprobs(job.tokens), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": job.text, "logprobs": self.token_logprobs(job.tokens), "finish_reason": job.finish_reason}
        extension = record(job)
        if self.provenance:
            extension["tokens"] = self.token_sources(job.tokens)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.served, "choices": [choice], "usage": usage(job), "viasd": extension}

    def chunk(self, text: str | None, finish_reason: str | None = None, first_chunk: bool = False,
              tokens: list[TokenText] | None = None) -> dict:
        """One streamed chunk: a delta of text (chat) or the text itself (completions), and `tokens`' logprobs
        and sources where asked for."""
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first_chunk else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._with_tokens({**self._chunk_head(), "choices": [choice]}, tokens)

    def delta_chunk(self, delta: dict, tokens: list[TokenText] | None = None) -> dict:
        """One streamed chat chunk of a given delta (a tool call's fragment)."""
        chunk = {**self._chunk_head(), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        return self._with_tokens(chunk, tokens)

    def _with_tokens(self, chunk: dict, tokens: list[TokenText] | None) -> dict:
        if tokens:
            chunk["choices"][0]["logprobs"] = self.token_logprobs(tokens)
            if self.provenance:
                chunk["viasd"] = {"tokens": self.token_sources(tokens)}
        return chunk

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._chunk_head(), "choices": [], "usage": usage(self.job)}

    def _chunk_head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.served}
