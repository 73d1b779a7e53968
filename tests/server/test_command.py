"""The `viasd serve` command: its flags, the SIGTERM drain (`viasd serve` as a subprocess), binding
its port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd.cli import main  # noqa: E402
from helpers import COUNTING, MODEL, check_error, wait_for  # noqa: E402


SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--replicas", "two"], "invalid int value: 'two'"),
    (["--ray-address", "auto"], "--ray-address needs --replicas N"),
    (["--k", "-1"], "k must be >= 0, got -1"),
    (["--logit-bias", "-1=5"], "logit_bias keys must be token ids (integers >= 0), got -1"),
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
    """The server binds before it loads the model (whose path here does not exist: a load
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
    """The banner comes once the socket listens and names the port the system chose."""
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
