"""Shared by the server tests: the model and prompts they use, waiting for a condition, the check of an
OpenAI-style error, a worker that decodes only when the test opens its gate."""

from __future__ import annotations

import threading
import time

from viasd.server import ServeSettings, create_app
from viasd.server.engine import Worker

MODEL = "smollm2-135m"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy smollm2 keeps counting: long outputs without EOS
# (ends with a newline: without it, greedy smollm2 in its native Q4_1 weights ends at once, a near tie)
HAIKU = "Write a haiku about the sea.\n"


def wait_for(predicate, what: str, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def check_error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if code is not None:
        assert body["error"]["code"] == code


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


def gated_app(model, max_queue: int):
    """A GatedWorker deciding one request at a time behind a queue of `max_queue`, and the app over it
    (served as "tiny")."""
    worker = GatedWorker(model, max_queue=max_queue, max_batch=1)
    return worker, create_app(model, settings=ServeSettings(served_name="tiny", max_queue=max_queue), worker=worker)


FIM_NAMES = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"]
CODE = ["def add(a, b):\n    return a + b\n", "def mul(a, b):\n    return a * b\n", "print(add(1, 2))\n",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"ok": true, "n": 3}', "yes no maybe hello world"]


def save_coder(path, seed: int, n_layers: int = 4):
    """A tiny random model with FIM tokens (FIM_NAMES, special) and Qwen2.5's chat template, loaded."""
    from pathlib import Path

    from support import bpe_tokenizer, save_tiny
    from viasd.models.loading import load_model

    template = (Path(__file__).parent / "qwen_template.jinja").read_text()
    tok = bpe_tokenizer(600, (CODE + [template]) * 10)
    tok.add_special_tokens({"additional_special_tokens": FIM_NAMES})
    tok.chat_template = template
    return load_model(str(save_tiny(path, seed=seed, n_layers=n_layers, tokenizer=tok)), progress=False)
