"""`viasd serve --replicas N`: two Ray Serve replicas of smollm2-135m behind Ray Serve's proxy, on a
local Ray head started on loopback inside the test. Skipped, with the reason, where Ray is not
installed (the `ray` extra) or cannot start."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from viasd import generate  # noqa: E402
from viasd.server import ServeSettings  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas():
    ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'viasd[ray]'")
    serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'viasd[ray]'")
    from viasd.server.ray_serve import deploy

    try:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    except Exception as e:  # no shared memory, no free ports, a sandbox...
        pytest.skip(f"a local Ray head cannot start here: {type(e).__name__}: {e}")
    try:
        url = deploy(MODEL, None, ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 16}, served_name=MODEL),
                     replicas=2, port=_free_port(), drain_timeout=10)
        yield url, serve
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.mark.model
def test_two_replicas_serve_the_engines_answers(replicas, smollm2):
    url, serve = replicas
    states = serve.status().applications["viasd"].deployments["viasd"].replica_states
    assert states == {"RUNNING": 2}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL]
    requests = [(PROMPTS[i % 4], i % 2 == 0) for i in range(8)]

    def ask(req):
        prompt, stream = req
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True))
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, requests))
    expected = [generate(p, smollm2, chat=False, strategy="pld", max_new_tokens=8, progress=False).text for p, _ in requests]
    assert answers == expected
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=8)
    assert chat.choices[0].message.content == generate(PROMPTS[3], smollm2, strategy="pld", max_new_tokens=8, progress=False).text


@pytest.mark.model
def test_replicas_keep_the_error_contract(replicas):
    url, _ = replicas
    r = httpx.post(url + "/v1/completions", content=b'{"model": "smollm2-135m", "prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json" and "Traceback" not in r.text
    r = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    metrics = httpx.get(url + "/metrics").text  # one replica's metrics
    assert "viasd_requests_total" in metrics and "viasd_queue_depth" in metrics
    assert json.loads(httpx.get(url + "/health").text) == {"status": "ok"}
