"""Shared by the dialect tests (test_responses.py, test_messages.py): a tiny random model with a byte-level BPE
tokenizer and Qwen2.5's chat template (tool calls in <tool_call> tags), a drafter of the same vocabulary, and
the server over them (`sd` by default, so that every strategy runs on it)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from viasd.models.loading import load_model
from viasd.server import ServeSettings, create_app
from viasd.server.engine import Worker
from live_server import LiveServer
from support import bpe_tokenizer, save_tiny

SERVED = "tiny-qwen"
KEY = "sekrit"
TEMPLATE = (Path(__file__).parent / "qwen_template.jinja").read_text()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                                           "additionalProperties": False}}
FUNCTIONS = [WEATHER, TIME]
CHAT_TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
CORPUS = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
          '{"ok": true, "n": 3}', "yes no maybe hello world"] * 10
# the strategies whose greedy text each dialect must match chat's for (VIA-SD lossless: exactly the full model's)
STRATEGIES = {"ar": {"strategy": "ar"}, "pld": {"strategy": "pld"}, "sd": {"strategy": "sd", "k": 3},
              "viasd-lossless": {"strategy": "viasd", "mode": "lossless", "draft": "pld", "k": 3, "adapt_k": False}}


def tiny_pair(tmp_path_factory):
    """The model and its drafter (their tokenizer trained on the template's tool prompt too: prompts stay short)."""
    tok = bpe_tokenizer(600, CORPUS + [TEMPLATE, json.dumps(CHAT_TOOLS)] * 10)
    tok.chat_template = TEMPLATE
    model = load_model(str(save_tiny(tmp_path_factory.mktemp("tiny-qwen"), seed=5, tokenizer=tok)), progress=False)
    drafter = load_model(str(save_tiny(tmp_path_factory.mktemp("tiny-qwen-drafter"), seed=1, n_layers=2, tokenizer=tok)), progress=False)
    return model, drafter


def serve(model, drafter) -> LiveServer:
    settings = ServeSettings(defaults={"strategy": "sd", "k": 3, "max_new_tokens": 24}, served_name=SERVED, api_key=KEY,
                             max_body_bytes=64 * 1024)
    return LiveServer(create_app(model, drafter, settings=settings))


class PausingWorker(Worker):
    """Sends one piece of text (a chunk the client reads), then waits for the test before decoding."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def _decode(self, job):
        job.post("text", " ", [])
        self.gate.wait(120)
        super()._decode(job)


def drained_stream(model, path: str, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a stream the drain cuts after its first text: what a client reads."""
    import httpx

    worker = PausingWorker(model)
    with LiveServer(create_app(model, settings=ServeSettings(served_name=SERVED), worker=worker)) as live:
        with httpx.Client(timeout=120) as c, c.stream("POST", live.url + path, json=body) as r:
            lines = r.iter_lines()
            seen = []
            for line in lines:
                seen.append(line)
                if line.startswith("data: ") and '"delta"' in line:  # the first text: the drain's time is up
                    worker.cancel_all()
                    worker.gate.set()
                    break
            seen += list(lines)
    blocks = "\n".join(seen).strip().split("\n\n")
    return [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: "))) for b in blocks]
