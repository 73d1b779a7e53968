"""Fixtures of the server tests: one module-scoped server over smollm2-135m, and its `openai` client.

(Imports inside the fixtures: without the server's optional packages the test modules skip themselves.)
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def live(smollm2):
    from helpers import MODEL
    from live_server import LiveServer
    from viasd.server import ServeSettings, create_app

    app = create_app(smollm2, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 16}, served_name=MODEL,
                                                     max_queue=32, max_body_bytes=64 * 1024))
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="session")
def coder(tmp_path_factory):
    """A tiny random model whose byte-level BPE tokenizer has Qwen2.5-Coder's FIM and repository tokens
    and Qwen2.5's chat template (tools in <tool_call> tags), and a drafter over the same vocabulary."""
    from helpers import save_coder

    return save_coder(tmp_path_factory.mktemp("coder"), seed=5), save_coder(tmp_path_factory.mktemp("coder-drafter"), seed=6, n_layers=2)
