"""`viasd serve --replicas N`: the same app as N Ray Serve replicas, each loading its own model,
behind Ray Serve's HTTP proxy (no home-made load balancer). `pip install 'viasd[ray]'`.

Each replica keeps the single-process behaviour (one decode at a time, its own bounded queue,
OpenAI-style errors, /metrics of that replica); Ray routes each request to a replica with room.
"""

from __future__ import annotations

import signal
import sys
import threading

from viasd.errors import UsageError

APP_NAME = "viasd"


def _require_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("--replicas needs Ray Serve: pip install 'viasd[ray]'") from None
    return ray, serve


def build_replica_app(model_name: str, drafter_name: str | None, settings, weights: str = "native", device: str = "cpu",
                      drafter_weights: str | None = None):
    """Runs on each replica when it starts: load the model, build the app."""
    from viasd.server.app import build_app

    return build_app(model_name, drafter_name, settings, weights=weights, device=device, progress=False,
                     drafter_weights=drafter_weights)


def deploy(model_name: str, drafter_name: str | None, settings, replicas: int, host: str = "127.0.0.1", port: int = 8000,
           weights: str = "native", device: str = "cpu", drain_timeout: float = 30.0, cpus_per_replica: float = 1.0,
           blocking_timeout_s: float = 600.0, drafter_weights: str | None = None) -> str:
    """Deploy on the Ray cluster this process is connected to (ray.init done); returns the base URL
    once every replica has loaded its model."""
    _, serve = _require_ray()
    serve.start(http_options={"host": host, "port": port})
    def builder():  # a plain function: Ray Serve calls it on each replica (a partial would be taken for an ASGI app)
        return build_replica_app(model_name, drafter_name, settings, weights, device, drafter_weights)

    deployment = serve.deployment(
        serve.ingress(builder)(),
        name="viasd",
        num_replicas=replicas,
        # one decode at a time per replica; the queue lives in the replica's app, which admits
        # max_queue + 1 requests: Ray may send one more, so that a full replica answers the
        # OpenAI-style 503 itself instead of Ray queueing without bound in its proxy
        max_ongoing_requests=settings.max_queue + 2,
        graceful_shutdown_timeout_s=drain_timeout,
        ray_actor_options={"num_cpus": cpus_per_replica},
    )
    serve.run(deployment.bind(), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def serve_replicas(args, settings) -> int:
    """The command: join (--ray-address) or start a local Ray head, deploy, serve until SIGTERM/SIGINT."""
    ray, serve = _require_ray()
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:  # a local head, reachable on loopback only
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        url = deploy(args.model, args.drafter, settings, args.replicas, args.host, args.port, args.weights, args.device,
                     args.drain_timeout, drafter_weights=args.drafter_weights)
        print(f"viasd serve: {args.replicas} Ray Serve replica(s) of {args.model} on {url}/v1 (SIGTERM drains)", file=sys.stderr)
        stop.wait()
        print("viasd serve: shutting down the replicas (in-flight requests finish first)", file=sys.stderr)
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()
        for sig, handler in previous.items():  # the caller's handlers back (a test, an embedding program)
            signal.signal(sig, handler)
    return 0
