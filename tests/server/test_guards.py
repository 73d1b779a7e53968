"""Issue 62: what `viasd serve` refuses before a request reaches the model. Another site's page (a Host the
server does not answer to: DNS rebinding; another Origin; a body not sent as JSON), requests OpenAI
refuses (tool messages out of place, stream_options without stream), and request heads over the HTTP
limits (too large, too slow, an absurd Content-Length) on a real `viasd serve` process."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from viasd.cli import main  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from viasd.server.run import allowed_hosts, allowed_origins  # noqa: E402
from live_server import LiveServer  # noqa: E402
from helpers import check_error, wait_for  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
PAGE = "http://localhost:3000"  # another site's page the tests' servers allow
COMPLETION = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny_live(tiny):
    """A server as `viasd serve` on loopback makes it (no --allowed-hosts), allowing one other origin."""
    with LiveServer(create_app(tiny, settings=ServeSettings(served_name="tiny", allowed_origins=(PAGE,)))) as server:
        yield server


# ------------------------------------------------------------------ class 4: Host, Origin, Content-Type

def test_a_host_that_is_no_name_of_a_loopback_server_is_refused(tiny_live):
    """A DNS-rebinding page's requests carry its own domain as Host: 403 on every route, the page's too."""
    live, port = tiny_live, tiny_live.port
    for host in ("evil.example", f"evil.example:{port}", "rebind.attacker.net.", "localhost.evil.example"):
        for method, path in (("GET", "/v1/models"), ("GET", "/"), ("GET", "/health"), ("POST", "/v1/completions")):
            r = httpx.request(method, live.url + path, headers={"Host": host}, json=COMPLETION)
            check_error(r, 403, "host_not_allowed")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "127.0.0.2", f"app.localhost:{port}",
                 "192.168.1.7:8000"):  # loopback names and IP literals (no rebinding page has one)
        assert httpx.get(live.url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_add_names_or_any(tiny):
    narrowed = create_app(tiny, settings=ServeSettings(served_name="tiny", allowed_hosts=("my.box",)))
    with LiveServer(narrowed) as live:
        assert httpx.get(live.url + "/v1/models", headers={"Host": f"MY.BOX:{live.port}"}).status_code == 200
        check_error(httpx.get(live.url + "/v1/models", headers={"Host": "other.box"}), 403, "host_not_allowed")
    with LiveServer(create_app(tiny, settings=ServeSettings(served_name="tiny", allowed_hosts=None))) as live:
        assert httpx.get(live.url + "/v1/models", headers={"Host": "any.name.example"}).status_code == 200


def test_the_hosts_viasd_serve_allows_follow_its_bind_address():
    assert allowed_hosts("127.0.0.1", None) == () and allowed_hosts("localhost", None) == () and allowed_hosts("::1", None) == ()
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("192.168.1.7", None) is None  # any Host
    assert allowed_hosts("0.0.0.0", "Box.lan, api.example.") == ("box.lan", "api.example")  # narrowed
    assert allowed_hosts("127.0.0.1", "*") is None
    assert allowed_origins(" http://localhost:3000/ ,HTTPS://App.example") == ("http://localhost:3000", "https://app.example")


@pytest.mark.parametrize("argv, message", [
    (["--allowed-hosts", "box.lan:8000"], "--allowed-hosts takes host names (no scheme, port or path), got 'box.lan:8000'"),
    (["--allowed-origins", "app.example"], "--allowed-origins takes origins as scheme://host[:port] (or '*'), got 'app.example'"),
    (["--allowed-origins", "http://app.example/chat"], "got 'http://app.example/chat'"),
    (["--header-timeout", "0"], "--header-timeout must be > 0"),
])
def test_bad_guard_flags_exit_2_with_one_line(capsys, argv, message):
    try:
        code = main(["serve", "--strategy", "ar", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_another_sites_page_is_refused_unless_allowed(tiny_live):
    live = tiny_live
    for origin in ("http://evil.example", f"http://evil.example:{live.port}", "null", f"http://localhost:{live.port + 1}"):
        check_error(httpx.get(live.url + "/v1/models", headers={"Origin": origin}), 403, "origin_not_allowed")
        check_error(httpx.post(live.url + "/v1/completions", headers={"Origin": origin}, json=COMPLETION), 403, "origin_not_allowed")
        r = httpx.options(live.url + "/v1/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        check_error(r, 403, "origin_not_allowed")  # (the CORS preflight too)
    # the server's own page (its fetches send its origin: the Host's), and a request from no page at all
    for origin in (live.url, None):
        r = httpx.post(live.url + "/v1/completions", headers={"Origin": origin} if origin else {}, json=COMPLETION)
        assert r.status_code == 200, (origin, r.text)
        assert "access-control-allow-origin" not in r.headers
    # the origin allowed: its preflight answered, its requests readable by its page
    r = httpx.options(live.url + "/v1/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    r = httpx.post(live.url + "/v1/completions", headers={"Origin": PAGE}, json=COMPLETION)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE


def test_a_json_route_takes_only_a_json_body(tiny_live):
    """A cross-site form or text/plain POST (no CORS preflight) never starts a generation: 415."""
    live, body = tiny_live, b'{"model": "tiny", "prompt": "w1 w2", "max_tokens": 2}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx", None):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r = httpx.post(live.url + path, content=body, headers={"Content-Type": kind} if kind else {})
            check_error(r, 415, "unsupported_media_type")
    for kind in ("application/json", "Application/JSON; charset=utf-8"):
        assert httpx.post(live.url + "/v1/completions", content=body, headers={"Content-Type": kind}).status_code == 200


# ------------------------------------------------------------------ class 8: requests OpenAI refuses

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
USER = {"role": "user", "content": "hi"}
OPENAI_400 = {  # messages -> (param, code, message)
    "tool message without tool_call_id": (
        [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "1"}],
        "messages.[2].tool_call_id", "missing_required_parameter", "messages with role 'tool' must have a 'tool_call_id'"),
    "conversation starting with a tool message": (
        [{"role": "tool", "tool_call_id": "call_1", "content": "1"}, USER],
        "messages.[0].role", "invalid_value", "must be a response to a preceding message with 'tool_calls'"),
    "tool message after a user message": (
        [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, USER,
         {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
        "messages.[3].role", "invalid_value", "must be a response to a preceding message with 'tool_calls'"),
    "tool message answering another call": (
        [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_9", "content": "1"}],
        "messages.[2].tool_call_id", "invalid_value", "'tool_call_id' of 'call_9' not found"),
}


@pytest.mark.parametrize("case", list(OPENAI_400))
def test_tool_messages_out_of_place_get_openais_400(tiny_live, case):
    messages, param, code, message = OPENAI_400[case]
    r = httpx.post(tiny_live.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
    check_error(r, 400, code)
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], r.text


def test_tool_results_in_place_pass_the_checks(tiny_live):
    """Two calls answered in turn (the tiny model then has no chat template: the check after these)."""
    calls = [CALL, {**CALL, "id": "call_2"}]
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}, {"role": "tool", "tool_call_id": "call_2", "content": "2"}]
    check_error(httpx.post(tiny_live.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages}), 400, "no_chat_template")


def test_stream_options_need_stream(tiny_live):
    for path, extra in (("/v1/completions", {"prompt": "w1"}), ("/v1/chat/completions", {"messages": [USER]})):
        for stream in ({}, {"stream": False}):
            r = httpx.post(tiny_live.url + path, json={"model": "tiny", **extra, **stream, "stream_options": {"include_usage": True}})
            check_error(r, 400, "invalid_value")
            assert r.json()["error"]["param"] == "stream_options" and "only allowed when 'stream' is enabled" in r.text
    r = httpx.post(tiny_live.url + "/v1/completions", json={**COMPLETION, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert httpx.post(tiny_live.url + "/v1/completions", json={**COMPLETION, "stream_options": None}).status_code == 200


# ------------------------------------------------------------------ class 9: the request head's limits

@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """`viasd serve` over the tiny model on loopback, heads timed out after 1 s, one extra Host name."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path_factory.mktemp("serve") / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "viasd", "serve", "--model", str(tiny_dir), "--port", "0", "-q",
                                 "--strategy", "ar", "--header-timeout", "1", "--allowed-hosts", "my.box"], env=env, stderr=err)
    try:
        def announced():
            assert proc.poll() is None, log.read_text()
            return "/v1 (" in log.read_text()
        wait_for(announced, "the banner")
        port = int(re.search(r" on http://127\.0\.0\.1:(\d+)/v1 ", log.read_text()).group(1))
        yield port
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exchange(port: int, data: bytes, push: bool = False) -> bytes:
    """What the server answers to `data` on a new connection, read to its close (`push`: sent by another
    thread, for a request larger than the socket buffers that the server refuses before its end)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        def send():
            try:
                c.sendall(data)
            except OSError:  # (refused and closed before its end)
                pass
        sender = threading.Thread(target=send)
        sender.start()
        if not push:
            sender.join()
        out = bytearray()
        while chunk := c.recv(65536):
            out += chunk
        sender.join()
    return bytes(out)


def _status_and_code(answer: bytes) -> tuple[int, str]:
    import json

    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), answer[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return int(head.split()[1]), error["code"]


def test_viasd_serve_checks_the_host(served):
    url = f"http://127.0.0.1:{served}"
    check_error(httpx.get(url + "/v1/models", headers={"Host": "evil.example"}), 403, "host_not_allowed")
    assert httpx.get(url + "/v1/models", headers={"Host": f"my.box:{served}"}).status_code == 200  # --allowed-hosts


def test_a_request_head_over_64_kib_gets_431(served):
    for size in (70_000, 8_000_000):  # (the 8 MB one is refused while it is still being sent)
        answer = _exchange(served, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * size + b"\r\n\r\n", push=True)
        assert _status_and_code(answer) == (431, "request_header_too_large")
    assert httpx.get(f"http://127.0.0.1:{served}/health").status_code == 200


def test_slow_request_heads_are_closed(served):
    """Slowloris: 40 connections that never finish their headers get 408 and are closed; one that sends
    nothing is closed; a kept-alive connection whose next head stalls too; the server answers meanwhile."""
    partial = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    conns = [socket.create_connection(("127.0.0.1", served), timeout=60) for _ in range(41)]
    try:
        for c in conns[:40]:
            c.sendall(partial)
        assert httpx.get(f"http://127.0.0.1:{served}/health").status_code == 200
        for c in conns[:40]:
            answer = bytearray()
            while chunk := c.recv(65536):
                answer += chunk
            assert _status_and_code(bytes(answer)) == (408, "request_timeout")
        assert conns[40].recv(1) == b""  # closed without a word
    finally:
        for c in conns:
            c.close()
    with socket.create_connection(("127.0.0.1", served), timeout=60) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = c.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        c.sendall(partial)
        answer = bytearray()
        while chunk := c.recv(65536):
            answer += chunk
        assert _status_and_code(bytes(answer)) == (408, "request_timeout")


@pytest.mark.parametrize("length, status, code", [
    ("9" * 30, 413, "request_too_large"),  # more digits than h11 reads
    (str(10 ** 19), 413, "request_too_large"),  # read, over --max-body-kb
    ("-5", 400, "invalid_request"),
    ("12, 13", 400, "invalid_request"),
])
def test_a_bad_content_length_gets_an_openai_error(served, length, status, code):
    answer = _exchange(served, f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {length}\r\nConnection: close\r\n\r\n{{}}".encode())
    assert _status_and_code(answer) == (status, code)
