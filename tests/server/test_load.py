"""`viasd serve` under load: concurrency, the queue, cancellation. No test asserts a duration: waits
are bounded only so that a hang fails instead of blocking the suite."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from live_server import LiveServer, metric  # noqa: E402
from helpers import COUNTING, HAIKU, MODEL, check_error, gated_app, wait_for  # noqa: E402


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


def test_requests_are_served_in_arrival_order(tiny):
    worker, app = gated_app(tiny, 8)
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
    worker, app = gated_app(tiny, 1)
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
    worker, app = gated_app(tiny, 4)
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 3}
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, live.url + "/v1/completions", json=body, timeout=120)
        wait_for(lambda: worker.running == 1, "the first request to run")
        # the second client sends its request and hangs up before any answer (raw socket: httpx
        # would wait for the response headers, which come with the first text)
        payload = json.dumps({**body, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as leaving:
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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
    httpx.post(live.url + "/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
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
