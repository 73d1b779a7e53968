"""`viasd serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `viasd.generate`.

    from viasd import load_model
    from viasd.server import create_app, ServeSettings
    app = create_app(load_model("smollm2-135m"), settings=ServeSettings(defaults={"strategy": "pld"}))

One model (and drafter) per process; up to `--max-batch` requests decoding at once, their passes
batched on the compute thread, a bounded FIFO queue behind them; more processes through Ray Serve
(`viasd serve --replicas N`, server/ray_serve.py).
"""

from viasd.server.app import APIError, ServeSettings, create_app

__all__ = ["APIError", "ServeSettings", "create_app"]
