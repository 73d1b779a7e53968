"""`viasd serve`'s faults: stalled readers, half bodies, drains, serving configuration."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd.cli import main  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from viasd.server.engine import Worker  # noqa: E402
from live_server import LiveServer, metric  # noqa: E402
from helpers import check_error, gated_app, wait_for  # noqa: E402


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
    """Sends one piece of text (a chunk the client reads), then waits for the test before decoding."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def _decode(self, job):
        job.post("text", " ", [])
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
    """A request still queued when the drain's time is up gets a 503 saying it never
    started; the running one's says its generation stopped before its end."""
    worker, app = gated_app(tiny, 4)
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
            leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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
