"""`viasd serve`: the official `openai` client (and raw httpx for what the client cannot send)
against live servers on loopback.

Most tests share one module-scoped server over smollm2-135m (uvicorn in a thread, a free port);
auth and the queue-full test use the tiny random model; the SIGTERM drain runs `viasd serve` as a
subprocess. No test asserts a duration: waits are bounded only so that a hang fails instead of
blocking the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from viasd import generate  # noqa: E402
from viasd.cli import main  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from conftest import native_q8  # noqa: E402
from viasd.server.engine import StopText, Worker  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL = "smollm2-135m"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy smollm2 keeps counting: long outputs without EOS
# (ends with a newline: without it, greedy smollm2 in its native Q4_1 weights ends at once, a near tie)
HAIKU = "Write a haiku about the sea.\n"


class LiveServer:
    """uvicorn serving `app` in a thread on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.app.state.worker.cancel_all()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, api_key: str = "unused") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=300)

    def metrics(self, headers: dict | None = None) -> dict[tuple, float]:
        """{(sample name, sorted label items): value} from /metrics."""
        text = httpx.get(self.url + "/metrics", headers=headers or {}).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, what: str, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live(smollm2):
    app = create_app(smollm2, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 16}, served_name=MODEL,
                                                     max_queue=32, max_body_bytes=64 * 1024))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def alone(smollm2, prompt, **settings):
    """The same request decoded directly by the engine, alone."""
    return generate(prompt, smollm2, progress=False, **{"strategy": "pld", "max_new_tokens": 16, **settings})


# ---------------------------------------------------------------- stop strings (no model)


@pytest.mark.parametrize("pieces, stops, sent, hit", [
    (["Hello", " wor", "ld. Bye"], ["."], "Hello world", 11),
    (["ab", "cX", "Yd"], ["XY"], "abc", 3),  # a stop split across pieces, held back meanwhile
    (["ab", "cX", "Zd"], ["XY"], "abcXZd", None),  # a false start is released
    (["one two", " three"], [], "one two three", None),
    (["xx<|e", "nd|>yy"], ["<|end|>", "zz"], "xx", 2),
])
def test_stop_text_cuts_at_the_first_stop_and_holds_back_prefixes(pieces, stops, sent, hit):
    s = StopText(stops)
    out = "".join(s.feed(p) for p in pieces)
    assert (out, s.hit) == (sent, hit)


def test_stop_text_never_sends_a_stop_prefix_early():
    s = StopText(["END"])
    assert s.feed("abcE") == "abc"
    assert s.feed("N") == ""
    assert s.feed("x") == "ENx"


@pytest.mark.model
@pytest.mark.parametrize("strategy", ["ar", "pld", "viasd"])
def test_stop_generation_from_on_text_returns_the_committed_prefix(smollm2, strategy):
    """The engine hook the server relies on for stop strings and cancellation."""
    from viasd.api import StopGeneration

    kw = dict(strategy=strategy, max_new_tokens=16, chat=False, progress=False, k=3)
    full = generate(COUNTING, smollm2, **kw)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 2:
            raise StopGeneration()

    part = generate(COUNTING, smollm2, on_text=on_text, **kw)
    assert 1 <= len(part.token_ids) < len(full.token_ids)
    assert part.token_ids == full.token_ids[: len(part.token_ids)]  # exactly what was committed, nothing more
    assert part.stats.new_tokens == len(part.token_ids) and part.stats.wall_s > 0
    assert part.text == "".join(pieces)


# ---------------------------------------------------------------- the API, happy paths


@pytest.mark.model
def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}


@pytest.mark.model
def test_completion_is_the_engines_output_with_usage_and_record(client, smollm2):
    r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12)
    ref = alone(smollm2, COUNTING, chat=False, max_new_tokens=12)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    record = r.model_extra["viasd"]
    assert record["config"]["strategy"] == "pld"
    stats = record["stats"]
    assert stats["new_tokens"] == 12 and stats["calls"]["full"] >= 1
    for key in ("mean_accepted_length", "rejection_rate", "full_rejection_rate", "tokens_per_s", "tiers"):
        assert key in stats


@pytest.mark.model
def test_token_id_prompt(client, smollm2):
    ids = smollm2.encode(COUNTING, chat=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert r.choices[0].text == alone(smollm2, ids, max_new_tokens=6).text


@pytest.mark.model
def test_chat_uses_the_chat_template(client, smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "7"}, {"role": "user", "content": "And a larger one?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == alone(smollm2, messages, max_new_tokens=10).text
    assert r.usage.prompt_tokens == len(smollm2.encode(messages))


@pytest.mark.model
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}], ids=["greedy", "seeded"])
def test_stream_reassembles_to_the_non_streamed_text(client, chat, sampling):
    if chat:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": HAIKU}], max_tokens=20, **sampling)
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole_text = whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model=MODEL, prompt=HAIKU, max_tokens=20, **sampling)
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        whole_text = whole.choices[0].text
    assert len([c for c in chunks if c.choices]) > 2  # really streamed, not one blob
    assert text == whole_text and text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["viasd"]["stats"]["new_tokens"] == whole.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.model
def test_seeded_sampling_differs_from_greedy(client):
    kw = dict(model=MODEL, prompt=HAIKU, max_tokens=20)
    greedy = client.completions.create(**kw).choices[0].text
    seeds = {client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert seeds - {greedy}  # sampling really happens (and the seed selects it)


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(client, stream):
    full = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=16).choices[0].text
    assert " 11," in full  # greedy smollm2 counts on: " 9, 10, 11, 12, ..."
    kw = dict(model=MODEL, prompt=COUNTING, max_tokens=16, stop=[" 11,", "never there"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, [r.choices[0].finish_reason]
        assert r.usage.completion_tokens < 16  # the decode ended early, not only the text
    assert text == full[: full.index(" 11,")]
    assert reason == ["stop"]


@pytest.mark.model
def test_viasd_extension_selects_the_strategy(client, smollm2):
    kw = dict(model=MODEL, prompt=COUNTING, max_tokens=12)
    ar = client.completions.create(extra_body={"viasd": {"strategy": "ar"}}, **kw)
    # (fixed draft lengths: measured costs may price drafting out on a slow or busy machine, and then no slim pass runs)
    lossless = client.completions.create(extra_body={"viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld", "k": 3,
                                                               "adapt_k": False}}, **kw)
    assert lossless.choices[0].text == ar.choices[0].text  # lossless VIA-SD is exactly the full model's greedy output
    rec = lossless.model_extra["viasd"]
    assert rec["config"]["strategy"] == "viasd" and rec["config"]["mode"] == "lossless" and rec["config"]["k"] == 3
    assert rec["stats"]["calls"].get("slim", 0) > 0  # the slim verifier tier ran
    assert ar.model_extra["viasd"]["stats"]["calls"] == {"full": 12}
    tiered = client.completions.create(extra_body={"viasd": {"strategy": "viasd", "mode": "tiered", "accept": 0.5, "slim": 0.5}}, **kw)
    tiers = tiered.model_extra["viasd"]["stats"]["tiers"]
    assert sum(tiers.values()) == tiered.usage.completion_tokens


def test_a_server_with_a_drafter_model_serves_sd(tiny, tiny_drafter):
    app = create_app(tiny, tiny_drafter, settings=ServeSettings(defaults={"strategy": "sd", "k": 3}, served_name="tiny"))
    with LiveServer(app) as live:
        c = live.client()
        for ext in ({}, {"adapt_k": False}, {"strategy": "viasd", "draft": "model", "slim_layers": [0, 1, 3]},
                    {"strategy": "viasd", "mode": "tiered", "draft": "model", "slim_layers": [0, 1, 3], "resume": False,
                     "reduced_head": False, "draft_confident": 0.9}):
            r = c.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=6, extra_body={"viasd": ext})
            ref = generate("w5 w6 w7", tiny, drafter=tiny_drafter, chat=False, progress=False,
                           **{"strategy": "sd", "k": 3, "max_new_tokens": 6, **{k: tuple(v) if isinstance(v, list) else v for k, v in ext.items()}})
            assert r.choices[0].text == ref.text
            assert r.model_extra["viasd"]["config"]["draft"] == "model"
            config = r.model_extra["viasd"]["config"]
            if not config.get("adaptive_k"):  # adaptive drafting follows measured costs: it may draft nothing in 6 tokens
                assert r.model_extra["viasd"]["stats"]["calls"].get("draft", 0) >= 1 or r.usage.completion_tokens <= 1
            assert config["adapt_k"] is ext.get("adapt_k")  # as asked; None: the default
            # what ran: adaptive drafting for sd and VIA-SD under greedy decoding unless asked not to; the new
            # VIA-SD settings reach the record
            assert config.get("adaptive_k") == ext.get("adapt_k", True)
            for key in ("resume", "reduced_head"):
                if key in ext:
                    assert config[key] == ext[key]
            if "draft_confident" in ext:
                assert config["tier_thresholds"]["draft_confident"] == ext["draft_confident"]
            if ext.get("resume") is False:
                assert config["resume_layer"] is None and "lower" not in r.model_extra["viasd"]["stats"]["calls"]


# ---------------------------------------------------------------- bad input: never a 500, never a traceback

LONG_IDS = [1] * 8190


def _post(live, path, content, headers=None):
    return httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=120)


def _body(**kw):
    return json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}).encode()


BAD = {
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ', 400, "invalid_json"),
    "invalid UTF-8": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}', 400, "invalid_encoding"),
    "lone surrogate escape": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "invalid_encoding"),
    "not an object": ("/v1/completions", b'["a"]', 422, "invalid_type"),
    "unknown model": ("/v1/completions", _body(model="gpt-4"), 404, "model_not_found"),
    "missing model": ("/v1/completions", b'{"prompt": "a"}', 422, "missing_required_parameter"),
    "missing prompt": ("/v1/completions", b'{"model": "smollm2-135m"}', 422, "missing_required_parameter"),
    "string for int": ("/v1/completions", _body(max_tokens="3"), 422, "invalid_type"),
    "bool for int": ("/v1/completions", _body(max_tokens=True), 422, "invalid_type"),
    "negative max_tokens": ("/v1/completions", _body(max_tokens=-1), 422, "invalid_value"),
    "absurd max_tokens": ("/v1/completions", _body(max_tokens=10**12), 422, "invalid_value"),
    "max_tokens beyond the context": ("/v1/completions", _body(max_tokens=9000), 400, "context_length_exceeded"),
    "prompt + max_tokens beyond the context": ("/v1/completions", _body(prompt=LONG_IDS, max_tokens=100), 400, "context_length_exceeded"),
    "token id out of range": ("/v1/completions", _body(prompt=[1, 10**9]), 400, "invalid_value"),
    "empty prompt": ("/v1/completions", _body(prompt="  "), 400, "invalid_value"),
    "temperature too high": ("/v1/completions", _body(temperature=7), 422, "invalid_value"),
    "NaN top_p": ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a", "top_p": NaN}', 422, "invalid_value"),
    "negative seed": ("/v1/completions", _body(seed=-5), 422, "invalid_value"),
    "n=2": ("/v1/completions", _body(n=2), 400, "unsupported_parameter"),
    "logprobs": ("/v1/completions", _body(logprobs=3), 400, "unsupported_parameter"),
    "unknown argument": ("/v1/completions", _body(frobnicate=1), 422, "unknown_parameter"),
    "too many stops": ("/v1/completions", _body(stop=list("abcde")), 422, "invalid_value"),
    "two prompts": ("/v1/completions", _body(prompt=["a", "b"]), 422, None),
    "bad strategy": ("/v1/completions", _body(viasd={"strategy": "magic"}), 422, None),
    "bad k": ("/v1/completions", _body(viasd={"k": 1000}), 422, "invalid_value"),
    "adapt_k not a boolean": ("/v1/completions", _body(viasd={"adapt_k": "yes"}), 422, None),
    "unknown viasd field": ("/v1/completions", _body(viasd={"slim_route": "/etc/passwd"}), 422, "unknown_parameter"),
    "model drafting without a drafter": ("/v1/completions", _body(viasd={"strategy": "sd"}), 400, "invalid_value"),
    "slim layer out of range": ("/v1/completions", _body(viasd={"strategy": "viasd", "slim_layers": [0, 99]}), 400, "invalid_value"),
    "inconsistent ngram bounds": ("/v1/completions", _body(viasd={"min_ngram": 5, "max_ngram": 2}), 400, "invalid_value"),
    "empty messages": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": []}', 422, None),
    "bad role": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}', 422, None),
    "message content a number": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": 5}]}', 422, None),
    "last message not the user's": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "assistant", "content": "x"}]}', 400, "invalid_value"),
    "tools": ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400, "unsupported_parameter"),
    "unknown route": ("/v1/embeddings", _body(), 404, "not_found"),
    "body over the limit": ("/v1/completions", _body(prompt="x" * 70_000), 413, "request_too_large"),
}


def check_error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if code is not None:
        assert body["error"]["code"] == code


@pytest.mark.model
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_openai_style_error(live, case):
    path, content, status, code = BAD[case]
    check_error(_post(live, path, content), status, code)


@pytest.mark.model
def test_bad_input_edge_transports(live):
    check_error(httpx.get(live.url + "/v1/completions"), 405, "method_not_allowed")
    # a chunked body (no Content-Length) over the limit is cut while reading
    chunks = (b"x" * 8192 for _ in range(10))
    check_error(httpx.post(live.url + "/v1/completions", content=chunks), 413, "request_too_large")
    # streaming requests get their errors as a status code too, before any event is sent
    check_error(_post(live, "/v1/completions", _body(stream=True, prompt=LONG_IDS, max_tokens=100)), 400, "context_length_exceeded")
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}  # and the server is fine


@pytest.mark.model
def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
    assert e.value.code == "unsupported_parameter"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)


# ---------------------------------------------------------------- auth


@pytest.fixture(scope="module")
def tiny_live_with_key(tiny):
    with LiveServer(create_app(tiny, settings=ServeSettings(served_name="tiny", api_key="s3cret-key"))) as server:
        yield server


def test_api_key_guards_every_route_but_health(tiny_live_with_key):
    live = tiny_live_with_key
    assert httpx.get(live.url + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}, {"Authorization": "Basic s3cret-key"}):
            r = httpx.request(method, live.url + path, headers=headers, content=b"{}")
            check_error(r, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").models.list()
    good = live.client("s3cret-key")
    assert [m.id for m in good.models.list().data] == ["tiny"]
    r = good.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=4)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200


@pytest.mark.model
def test_without_a_key_any_or_no_token_is_accepted(live):
    assert httpx.get(live.url + "/v1/models").status_code == 200
    assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


# ---------------------------------------------------------------- load: concurrency, queue, cancellation


@pytest.mark.model
def test_16_concurrent_clients_each_get_their_own_complete_answer(live):
    requests = []
    for i in range(16):
        prompt = [HAIKU, COUNTING, "The capital of France is", "def fibonacci(n):"][i % 4]
        sampling = {"temperature": 0.8, "seed": 1000 + i} if i % 3 == 0 else {}
        requests.append((i % 2 == 0, dict(model=MODEL, prompt=prompt, max_tokens=10, **sampling)))

    def ask(stream_and_kw):
        stream, kw = stream_and_kw
        c = live.client()
        if stream:
            chunks = list(c.completions.create(stream=True, **kw))
            return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
        r = c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason

    served_alone = [ask(r) for r in requests]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, requests))
    assert together == served_alone
    assert all(reason == "stop" or (reason == "length" and text) for text, reason in together)
    assert sum(reason == "length" for _, reason in together) >= 8


class GatedWorker(Worker):
    """Decodes only when the test opens the gate: a busy server, deterministically."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.order: list = []

    def _decode(self, job):
        self.gate.wait(120)
        self.order.append(job.prompt)
        super()._decode(job)


def test_requests_are_served_in_arrival_order(tiny):
    worker = GatedWorker(tiny, max_queue=8, max_batch=1)
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_queue=8), worker=worker)
    prompts = ["w1 w2", "w3 w4", "w5 w6", "w7 w8", "w9 w10"]
    with LiveServer(app) as live, ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for i, prompt in enumerate(prompts):
            futures.append(pool.submit(live.client().completions.create, model="tiny", prompt=prompt, max_tokens=2))
            wait_for(lambda: worker.pending == i + 1, f"request {i} to be admitted")
        worker.gate.set()
        assert all(f.result().usage.prompt_tokens >= 2 for f in futures)
    assert worker.order == prompts


def test_queue_full_answers_503_and_waiting_requests_still_complete(tiny):
    worker = GatedWorker(tiny, max_queue=1, max_batch=1)
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_queue=1), worker=worker)
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        c = live.client()
        ask = lambda: c.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=3)  # noqa: E731
        first = pool.submit(ask)
        wait_for(lambda: worker.running == 1, "the first request to run")
        second = pool.submit(ask)
        wait_for(lambda: worker.waiting == 1, "the second request to queue")
        assert metric(live.metrics(), "viasd_queue_depth") == 1
        r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 2})
        check_error(r, 503, "queue_full")
        assert r.headers.get("retry-after") == "1"
        with pytest.raises(openai.InternalServerError):
            ask()
        worker.gate.set()
        assert first.result().choices[0].text == second.result().choices[0].text  # same request, in order, both complete
        m = live.metrics()
        assert metric(m, "viasd_requests_total", endpoint="completions", status="503") == 2
        assert metric(m, "viasd_requests_total", endpoint="completions", status="200") == 2
        assert metric(m, "viasd_queue_depth") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_client_left_while_queued_is_never_decoded(tiny, stream):
    worker = GatedWorker(tiny, max_queue=4, max_batch=1)
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_queue=4), worker=worker)
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 3}
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: worker.running == 1, "the first request to run")
        # the second client sends its request and hangs up before any answer (raw socket: httpx
        # would wait for the response headers, which come with the first text)
        payload = json.dumps({**body, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as leaving:
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            wait_for(lambda: worker.waiting == 1, "the second request to queue")
        worker.gate.set()
        answer = first.result()
        assert answer.status_code == 200
        wait_for(lambda: worker.pending == 0, "the queue to empty")
        wait_for(lambda: metric(live.metrics(), "viasd_requests_total", endpoint="completions", status="499") == 1, "the cancellation")
        m = live.metrics()
        assert metric(m, "viasd_requests_total", endpoint="completions", status="200") == 1
        # only the first request was decoded
        assert metric(m, "viasd_generated_tokens_total", strategy="pld") == answer.json()["usage"]["completion_tokens"]


@pytest.mark.model
def test_a_client_that_disconnects_mid_stream_cancels_its_generation(live):
    before = live.metrics()
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", live.url + "/v1/completions",
                      json={"model": MODEL, "prompt": COUNTING, "max_tokens": 1000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
        # leaving the block closes the connection mid-stream
    wait_for(lambda: metric(live.metrics(), "viasd_requests_total", endpoint="completions", status="499")
             == metric(before, "viasd_requests_total", endpoint="completions", status="499") + 1, "the cancellation")
    after = live.metrics()
    generated = (metric(after, "viasd_generated_tokens_total", strategy="pld")
                 - metric(before, "viasd_generated_tokens_total", strategy="pld"))
    assert 1 <= generated < 1000  # stopped early, its partial decode accounted for
    assert live.app.state.worker.pending == 0  # the slot is free
    r = live.client().completions.create(model=MODEL, prompt=COUNTING, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.model
def test_metrics_counters_move(live, client):
    before = live.metrics()
    r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8)
    httpx.post(live.url + "/v1/completions", content=b"{")
    after = live.metrics()
    d = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert d("viasd_requests_total", endpoint="completions", status="200") == 1
    assert d("viasd_requests_total", endpoint="completions", status="400") == 1
    assert d("viasd_generated_tokens_total", strategy="pld") == r.usage.completion_tokens == 8
    assert d("viasd_prompt_tokens_total") == r.usage.prompt_tokens
    assert d("viasd_forward_calls_total", tier="full") == r.model_extra["viasd"]["stats"]["calls"]["full"]
    assert d("viasd_request_latency_seconds_count", endpoint="completions") == 1
    assert d("viasd_time_to_first_token_seconds_count", endpoint="completions") == 1
    assert d("viasd_accepted_length_count", strategy="pld") == 1
    assert d("viasd_accepted_length_sum", strategy="pld") == pytest.approx(r.model_extra["viasd"]["stats"]["mean_accepted_length"])
    assert metric(after, "viasd_queue_depth") == 0 and metric(after, "viasd_requests_running") == 0


# ---------------------------------------------------------------- the command: flags, SIGTERM drain


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--replicas", "two"], "invalid int value: 'two'"),
    (["--ray-address", "auto"], "--ray-address needs --replicas N"),
    (["--k", "-1"], "k must be >= 0, got -1"),
    (["--strategy", "magic"], "invalid choice: 'magic'"),
    (["--api-key", " "], "--api-key (or VIASD_API_KEY) is empty"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, message):
    try:
        code = main(["serve", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.model
def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(smollm2):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "viasd", "serve", "--model", MODEL, "--port", str(port), "-q",
                             "--strategy", "ar", "--drain-timeout", "120"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        def up():
            assert proc.poll() is None, proc.stderr.read()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, "the server to start")
        with httpx.Client(timeout=300) as c:
            with c.stream("POST", url + "/v1/completions",
                          json={"model": MODEL, "prompt": COUNTING, "max_tokens": 100, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(url + "/health").status_code == 503, "draining to start")
                check_error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}),
                            503, "shutting_down")
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][6:])
        assert final["choices"][0]["finish_reason"] in ("length", "stop")
        assert final["viasd"]["stats"]["new_tokens"] >= 1
        assert proc.wait(120) == 0
        assert "draining 1 request(s)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("where", ["port-in-use", "unknown-host"])
def test_a_bind_failure_is_one_line_and_exit_2_before_any_model_loads(capsys, tmp_path, where):
    """Issue 42: the server binds before it loads the model (whose path here does not exist: a load
    would say so first) and a bind failure is one line, exit 2, not uvicorn's log and exit 3."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        host, port = ("127.0.0.1", busy.getsockname()[1]) if where == "port-in-use" else ("999.1.1.1", 8000)
        code = main(["serve", "--model", str(tmp_path / "no-model"), "--host", host, "--port", str(port), "--strategy", "ar"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"viasd: error: cannot listen on {host}:{port} (--host, --port): "), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_port_0_is_announced_as_the_port_the_server_listens_on(tiny_dir, tmp_path):
    """Issue 42: the banner comes once the socket listens and names the port the system chose."""
    import re

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "viasd", "serve", "--model", str(tiny_dir), "--port", "0", "-q",
                                 "--strategy", "ar"], env=env, stderr=err)
    try:
        def announced():
            assert proc.poll() is None, log.read_text()
            return "/v1 (" in log.read_text()
        wait_for(announced, "the banner")
        port = int(re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", log.read_text()).group(1))
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=120).status_code == 200  # listening already
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- faults: stalled readers, half bodies, drains, config


def test_a_request_answered_at_once_wakes_its_reader_only_at_the_end():
    """A non-streamed request's tokens are not events: the reader (the event loop) is woken once,
    when the answer is complete, not for each token while the decode runs beside it."""
    import asyncio

    from viasd.server.engine import Job

    loop = asyncio.new_event_loop()
    try:
        job = Job("x", {}, [], loop, stream=False, max_unread=3)
        for _ in range(10):  # more than max_unread: never "stalled", there is nothing to read yet
            job.post("text", "a")
        job.post("done")
        loop.run_until_complete(asyncio.sleep(0))
        assert job.events.qsize() == 1 and loop.run_until_complete(job.next_event()) == ("done",)
        assert not job.cancel.is_set()
    finally:
        loop.close()


def test_an_unread_stream_stops_its_own_decode_and_its_memory_stays_bounded():
    import asyncio

    from viasd.server.engine import Job

    loop = asyncio.new_event_loop()
    try:
        job = Job("x", {}, [], loop, max_unread=3)
        for _ in range(3):
            job.post("text", "a")
        assert not job.cancel.is_set()
        job.post("text", "a")  # a 4th unread event: the reader is not keeping up
        assert job.cancel.is_set() and job.cancel_reason == "stalled"
        # a reader that takes events is never stopped, however many it takes
        reading = Job("x", {}, [], loop, max_unread=3)
        for _ in range(10):
            reading.post("text", "a")
            loop.run_until_complete(asyncio.sleep(0))
            assert loop.run_until_complete(reading.next_event()) == ("text", "a")
        assert not reading.cancel.is_set()
        # nor one that is merely slow; one that took nothing for the stall timeout is
        slow = Job("x", {}, [], loop, max_unread=100, stall_timeout=5.0)
        slow.post("text", "a")
        slow.post("text", "a")
        assert not slow.cancel.is_set()
        slow.last_taken -= 6.0
        slow.post("text", "a")
        assert slow.cancel_reason == "stalled"
        slow.stop("client")  # the first reason stays
        assert slow.cancel_reason == "stalled"
    finally:
        loop.close()


class PausingWorker(Worker):
    """Sends one piece of text, then waits for the test before decoding."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def _decode(self, job):
        job.post("text", "")
        self.gate.wait(120)
        super()._decode(job)


def test_a_drain_that_times_out_ends_the_stream_with_an_error_and_done(tiny):
    worker = PausingWorker(tiny)
    app = create_app(tiny, settings=ServeSettings(served_name="tiny"), worker=worker)
    with LiveServer(app) as live, httpx.Client(timeout=120) as c:
        with c.stream("POST", live.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 50, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines)
            worker.cancel_all()  # what the drain does when its time is up
            worker.gate.set()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
        wait_for(lambda: worker.pending == 0, "the decode to end")
        assert metric(live.metrics(), "viasd_requests_total", endpoint="completions", status="503") == 1


def test_a_drain_that_cuts_queued_requests_says_they_never_started(tiny):
    """Issue 42: a request still queued when the drain's time is up gets a 503 saying it never
    started; the running one's says its generation stopped before its end."""
    worker = GatedWorker(tiny, max_queue=4, max_batch=1)
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_queue=4), worker=worker)
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 3}
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: worker.running == 1, "the first request to run")
        queued = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: worker.waiting == 1, "the second request to queue")
        worker.cancel_all()  # what the drain does when its time is up
        worker.gate.set()
        r = queued.result()
        check_error(r, 503, "shutting_down")
        assert r.json()["error"]["message"] == "the server is shutting down: the request was cancelled before it started"
        r = running.result()
        check_error(r, 503, "shutting_down")
        assert r.json()["error"]["message"] == "the server is shutting down: generation stopped before its end"


def test_a_client_that_sends_half_a_body_and_leaves_is_a_499_not_a_500(tiny, capfd):
    app = create_app(tiny, settings=ServeSettings(served_name="tiny"))
    with LiveServer(app) as live:
        with socket.create_connection(("127.0.0.1", live.port)) as leaving:
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", ")
            time.sleep(0.2)
        wait_for(lambda: metric(live.metrics(), "viasd_requests_total", endpoint="completions", status="499") == 1,
                 "the half request to be counted")
        assert metric(live.metrics(), "viasd_requests_total", endpoint="completions", status="500") == 0
        r = live.client().completions.create(model="tiny", prompt="w1 w2", max_tokens=2)  # still serving
        assert r.usage.completion_tokens == 2
    assert "ClientDisconnect" not in capfd.readouterr().err


@pytest.mark.parametrize("defaults, message", [
    ({"strategy": "viasd", "slim_layers": (0, 1, 99)}, "99"),
    ({"strategy": "sd"}, "needs a drafter model"),
])
def test_a_server_whose_own_settings_cannot_serve_refuses_to_start(tiny, defaults, message):
    from viasd.errors import UsageError

    with pytest.raises(UsageError, match=message):
        create_app(tiny, settings=ServeSettings(served_name="tiny", defaults=defaults))


@pytest.mark.parametrize("make_argv, message", [
    (lambda d: ["--slim-route", str(d / "missing.json")], "missing.json"),
    (lambda d: ["-s", "sd"], "needs a drafter model"),
    (lambda d: ["-s", "viasd", "--mode", "tiered", "--thresholds",
                str((d / "t.json").write_text('{"accept": NaN}') and d / "t.json")], "t.json"),
    (lambda d: ["--api-key", "two words"], "contains whitespace"),
])
def test_bad_serving_configuration_exits_2_before_any_model_loads(capsys, tmp_path, make_argv, message):
    code = main(["serve", "--model", "no-such-model-is-loaded", *make_argv(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_api_key_with_a_trailing_newline_still_authenticates(capsys):
    from viasd.cli import build_parser
    from viasd.server.run import check_args

    args = build_parser().parse_args(["serve", "--api-key", "s3cret\n"])
    check_args(args)
    assert args.api_key == "s3cret"
    assert "removed whitespace around the API key" in capsys.readouterr().err


# ---------------------------------------------------------------- continuous batching


def test_concurrent_requests_share_passes_and_each_answer_equals_serving_alone(tiny_q8, tiny_drafter):
    """Mixed strategies, prompt lengths and arrival times on one batched server: every greedy answer
    equals the request decoded alone, and passes did carry rows of several requests."""
    from viasd.execution import batching

    app = create_app(tiny_q8, tiny_drafter, settings=ServeSettings(served_name="tiny", max_batch=6,
                                                                defaults={"slim_layers": (0, 1, 3)}))
    asks = [("w1 w2 w3", {"strategy": "ar"}, 40), ("w5 w6 w5 w6 w5", {"strategy": "pld"}, 30),
            (" ".join(f"w{i % 50}" for i in range(90)), {"strategy": "ar"}, 20),  # a prompt longer than a pass
            ("w9 w8 w7", {"strategy": "sd", "k": 3}, 30), ("w2 w4", {"strategy": "viasd", "mode": "lossless"}, 25),
            ("w3 w3 w1", {"strategy": "viasd", "mode": "tiered", "draft": "pld"}, 25), ("w7 w1", {"strategy": "ar"}, 35)]
    alone = [generate(p, tiny_q8, drafter=tiny_drafter if s["strategy"] == "sd" else None, max_new_tokens=n, chat=False,
                      progress=False, slim_layers=(0, 1, 3), **s).text for p, s, n in asks]
    passes = []
    with LiveServer(app) as live, ThreadPoolExecutor(len(asks)) as pool:
        live.app.state.worker.session.on_pass = lambda r, rows: passes.append(r)
        def ask(i):
            time.sleep(0.005 * i)  # staggered arrivals: requests join running ones (close enough to overlap)
            p, s, n = asks[i]
            r = httpx.post(live.url + "/v1/completions", timeout=300,
                           json={"model": "tiny", "prompt": p, "max_tokens": n, "viasd": s})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        together = list(pool.map(ask, range(len(asks))))
    assert together == alone
    assert passes and max(passes) >= 2
    assert app.state.worker.session.members == 0


def test_speculative_members_draft_together_and_verify_together(tiny_q8, tiny_drafter):
    """`batching.lockstep`: while a drafter's calls are parked, the verifier's wait for them, so no
    step runs a drafter pass and a verifier pass at once (run as they came, three `sd` requests
    started apart would each pay both in most steps); each answer equals the request alone."""
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    drafter = native_q8(tiny_drafter)  # 2 layers against the verifier's 4: its passes read fewer bytes
    assert drafter.decoder.weight_bytes() < tiny_q8.decoder.weight_bytes()
    session = batching.BatchSession()
    steps: list[list[int | None]] = []
    run = session._run
    session._run = lambda calls: (steps.append([batching._cost(c) for c in calls]), run(calls))
    kw = dict(strategy="sd", drafter=drafter, k=3, adapt_k=False, max_new_tokens=60, progress=False)
    # three prompts that each decode their 60 tokens (no end of text): which do depends on the CPU's
    # kernels (on the AVX2 EPYC [5, 36, 16] ends after 33), so they are chosen here
    candidates = [[5, 36, 16], [8, 7, 5], [11, 28, 44], [9, 14, 30], [12, 6, 40], [20, 33, 7], [15, 3, 27], [25, 10, 41]]
    full = [(p, a) for p in candidates if len(a := generate(p, tiny_q8, **kw).token_ids) == 60][:3]
    prompts, alone = [p for p, _ in full], [a for _, a in full]
    assert len(prompts) == 3

    def member(i):
        time.sleep(0.01 * i)  # started apart: not in step by chance
        return session.member(generate, prompts[i], tiny_q8, passes=Passes(session), **kw).token_ids

    def compute_thread():
        while not all(f.done() for f in futures):
            session.step(idle_timeout=0.05)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(member, i) for i in range(3)]
        compute.run(compute_thread)
        assert [f.result(timeout=60) for f in futures] == alone
    verifier = tiny_q8.decoder.weight_bytes()
    assert all(len(set(costs)) == 1 for costs in steps), [s for s in steps if len(set(s)) > 1][:3]
    assert max(costs.count(verifier) for costs in steps) == 3  # all three verified in one pass


def test_lossless_viasd_members_share_resumed_and_stream_storing_passes(tiny_q8, monkeypatch):
    """Lossless VIA-SD's full passes resume at the slim route's first incomplete layer, and its slim
    and lower passes store the streams entering it: such passes of several requests share a pass
    (each request reading and writing its own cache's streams), and every answer equals the request
    alone. Run one by one, 8 served VIA-SD requests delivered 0.28x `ar`'s tokens/s."""
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes
    from viasd.models.decoder import Decoder

    shared = []  # per shared pass: (resumed, stores streams) of each call
    many = Decoder.forward_many

    def recording(self, calls, rows=None):
        kinds = []
        for args, kw in calls:
            route = kw.get("route")
            kinds.append((kw.get("resume", False), args[2].saves_hidden(None if route is None or route.is_full else route)))
        shared.append(kinds)
        return many(self, calls, rows)

    monkeypatch.setattr(Decoder, "forward_many", recording)
    session = batching.BatchSession()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 8, 9, 8, 9, 8], [11, 12, 13, 11, 12, 13]]
    kw = dict(strategy="viasd", mode="lossless", draft="pld", slim_layers=(0, 1, 3), k=3, max_new_tokens=40, adapt_k=False,
              progress=False)  # always k: beside others the adaptive policy would draft nothing, and make no slim pass
    alone = [generate(p, tiny_q8, **kw) for p in prompts]
    assert {r.config["resume_layer"] for r in alone} == {2}
    assert all(r.stats.calls["lower"] > 0 for r in alone)  # some rows no slim pass processed went through layers 0-1 alone

    def member(i):
        time.sleep(0.01 * i)
        return session.member(generate, prompts[i], tiny_q8, passes=Passes(session), **kw).token_ids

    def compute_thread():
        while not all(f.done() for f in futures):
            session.step(idle_timeout=0.05)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(member, i) for i in range(3)]
        compute.run(compute_thread)
        assert [f.result(timeout=60) for f in futures] == [r.token_ids for r in alone]
    assert any(len(kinds) >= 2 and all(resumed for resumed, _ in kinds) for kinds in shared)
    assert any(len(kinds) >= 2 and all(stores and not resumed for resumed, stores in kinds) for kinds in shared)


def test_a_member_measures_pass_times_in_a_step_of_its_own(tiny_q8, monkeypatch):
    """`pass_times` from a member (a served request starting beside others) runs its passes in one
    step of the session's, with no other member's pass between them: through the shared steps, the
    first request of a burst timed its passes with the others' prompts run in the same steps, and
    kept 34-114 ms for smollm2's 1-5 rows (4.5-13 alone) for every later request of the process.
    Its tokens are unchanged: the measurement uses a scratch cache."""
    from viasd.execution.timing import pass_times
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    decoder = tiny_q8.decoder
    order: list[int] = []  # the cache of each pass, in the order the compute thread ran them
    own = decoder.forward
    monkeypatch.setitem(decoder.__dict__, "forward", lambda tokens, start, cache, *a, **kw: (order.append(id(cache)), own(tokens, start, cache, *a, **kw))[1])
    many = decoder.forward_many
    monkeypatch.setattr(decoder, "forward_many", lambda calls, rows=None: ([order.append(id(args[2])) for args, _ in calls], many(calls, rows))[1])
    monkeypatch.setattr(decoder, "_pass_times", {}, raising=False)
    session = batching.BatchSession()
    measuring = threading.Event()
    kw = dict(strategy="ar", max_new_tokens=40, progress=False)
    alone = generate([5, 6, 7], tiny_q8, **kw).token_ids

    def decoding():  # a member decoding all along, its passes parked in the session
        def run():
            measuring.wait(30)
            return generate([5, 6, 7], tiny_q8, passes=Passes(session), **kw).token_ids
        return session.member(run)

    def measuring_member():
        def run():
            measuring.set()
            deadline = time.monotonic() + 30
            while not order and time.monotonic() < deadline:  # the other member's decode under way
                time.sleep(0.001)
            return pass_times(decoder, 3, passes=Passes(session))
        return session.member(run)

    def compute_thread():
        while not all(f.done() for f in futures):
            session.step(idle_timeout=0.05)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(decoding), pool.submit(measuring_member)]
        compute.run(compute_thread)
        tokens, times = futures[0].result(timeout=60), futures[1].result(timeout=60)
    assert tokens == alone and len(times) == 3 and decoder._pass_times[3, False] == times
    caches = list(dict.fromkeys(order))
    scratch = [c for c in caches if order.count(c) == 4 * 3]  # 4 rounds of 1-3 rows
    assert len(scratch) == 1, (len(caches), [order.count(c) for c in caches])
    first = order.index(scratch[0])
    assert order[first : first + 12] == [scratch[0]] * 12  # no other pass among them
    assert len(order) > 12 + 1 and first > 0  # the decode ran before it (and after it: 40 tokens)


def test_a_call_waits_for_cheaper_ones_at_most_max_defer_steps():
    from viasd.execution import batching

    class Model:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def weight_bytes(self, route=None, from_layer=0, head=True):
            return self.nbytes

    def call(model):
        return batching._Call(model, (), {})

    big, small, unknown = Model(100), Model(10), Model(0)  # 0: the model does not say
    dear, cheap, other = call(big), call(small), call(unknown)
    now, later = batching.lockstep([dear, cheap, other])
    assert now == [cheap, other] and later == [dear]
    assert batching.lockstep([dear, call(big)])[1] == []  # one cost: all run
    for _ in range(batching.MAX_DEFER - 1):
        assert batching.lockstep([dear, call(small)])[1] == [dear]
    assert batching.lockstep([dear, call(small)])[1] == []  # waited MAX_DEFER steps: runs


def test_the_kv_budget_holds_requests_back_until_running_ones_free_it(tiny):
    from viasd.server.engine import kv_bytes

    one = kv_bytes(tiny, 2 + 8 + 80)
    worker = GatedWorker(tiny, max_batch=4, kv_budget=int(one * 1.5))  # room for one request at a time
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_batch=4), worker=worker)
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        ask = lambda: live.client().completions.create(model="tiny", prompt="w1", max_tokens=8)  # noqa: E731
        first, second = pool.submit(ask), pool.submit(ask)
        wait_for(lambda: worker.running == 1 and worker.waiting == 1, "one request to run, one to wait for memory")
        assert metric(live.metrics(), "viasd_kv_cache_bytes") == one
        assert worker.session.admitted == 2 and worker.session.members <= 1  # the running one is not alone
        worker.gate.set()
        assert first.result().choices[0].text == second.result().choices[0].text
        wait_for(lambda: worker.pending == 0, "both to finish")
        assert metric(live.metrics(), "viasd_kv_cache_bytes") == 0 and worker.session.admitted == 0


def test_a_member_run_on_the_compute_thread_serves_the_members_that_join_it(tiny_q8):
    """`BatchSession.run_inline`: a request decoding on the compute thread itself runs its passes at
    once and, while it runs, the passes of members that join share them; every answer equals the
    request decoded alone."""
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    session = batching.BatchSession()
    passes = []
    session.on_pass = lambda requests, rows: passes.append(requests)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    alone = [generate(p, tiny_q8, strategy="ar", max_new_tokens=30, progress=False).token_ids for p in prompts]
    joined, shared = threading.Event(), []

    def first():
        out = []

        def on_text(_):
            if not out:  # the others join after its first round
                out.append(1)
                joined.set()
                time.sleep(0.05)

        return generate(prompts[0], tiny_q8, strategy="ar", max_new_tokens=30, progress=False, on_text=on_text,
                        passes=Passes(session)).token_ids

    def member(p):
        joined.wait(30)
        return session.member(generate, p, tiny_q8, strategy="ar", max_new_tokens=30, progress=False, passes=Passes(session)).token_ids

    def compute_thread():  # as the server's scheduler: the inline request, then steps while members remain
        out = session.run_inline(first)
        shared.append(sum(r >= 2 for r in passes))  # passes of several requests while it ran
        while not all(f.done() for f in others):
            session.step(idle_timeout=0.05)
        return out

    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(member, p) for p in prompts[1:]]
        inline = compute.run(compute_thread)
        results = [inline] + [f.result(timeout=60) for f in others]
    assert results == alone
    assert shared[0] > 0  # the joined members' rows were computed in the inline request's steps
    assert session.members == 0
