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
