"""`viasd serve`: flags (generate's decoding flags plus the server's), one process under uvicorn with
a draining shutdown, or N Ray Serve replicas (ray_serve.py)."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import re
import signal
import sys
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from viasd.errors import UsageError


def add_arguments(p: argparse.ArgumentParser, add_model_flags) -> None:
    """`viasd serve`'s flags: `add_model_flags(p)` (the CLI's --model, --drafter, ...), one flag per
    request setting (their defaults for the requests: viasd/settings.py), and the server's own."""
    from viasd.settings import add_arguments as add_setting_flags

    add_model_flags(p)
    add_setting_flags(p, skip=("chat",))  # a chat request uses the template; a completion does not

    def one_line_error(message: str):  # argparse's default prints the whole usage block first
        print(f"viasd serve: error: {message} (see viasd serve --help)", file=sys.stderr)
        sys.exit(2)

    p.error = one_line_error  # type: ignore[method-assign]  # (this parser's own errors, one line each)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    s.add_argument("--api-key", default=os.environ.get("VIASD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $VIASD_API_KEY, else none)")
    s.add_argument("--allowed-hosts", metavar="NAMES",
                   help="comma-separated Host names the server answers to besides IP addresses and localhost; other Hosts "
                        "get 403 (a DNS-rebinding page's). Default: none on a loopback --host, any Host on another address "
                        "(this flag narrows it); '*': any")
    s.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="comma-separated origins (scheme://host[:port]) of other sites whose pages may call the API "
                        "(CORS); a request with another site's Origin gets 403 (default: none, only the server's own "
                        "pages); '*': any")
    s.add_argument("--served-model-name", help="the model id clients send (default: the --model value)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait behind the running ones; more are answered 503 (default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded at once, their forward passes shared (continuous batching; default: %(default)s)")
    s.add_argument("--kv-budget-mb", type=int, default=None,
                   help="MiB of KV cache the running requests may reserve; a request waits while it does not fit "
                        "(default: a quarter of the memory available at start)")
    s.add_argument("--prefix-cache-mb", type=int, default=128,
                   help="MiB of recent prompts' KV cache kept per model for reuse by prompts that share a prefix "
                        "(a chat template's system prompt, earlier turns); results unchanged; 0: off (default: %(default)s)")
    s.add_argument("--max-body-kb", type=int, default=1024, help="request body limit in KiB; larger bodies get 413 (default: %(default)s)")
    s.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a request's headers may take to arrive (after the connection opens or its last answer "
                        "ends); slower ones get 408 and are closed, against clients holding connections open "
                        "(default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are cancelled (default: %(default)s)")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: %(default)s)")
    r = p.add_argument_group("scale-out (Ray Serve; pip install 'viasd[ray]')")
    r.add_argument("--replicas", type=int, default=0,
                   help="serve through Ray Serve with N replicas, each holding its own model (default: 0 = one process, no Ray)")
    r.add_argument("--ray-address", help="join this Ray cluster (e.g. ray://host:10001 or auto) instead of starting a local head")


def check_args(args: argparse.Namespace) -> dict:
    """Every flag checked before a model is fetched; UsageError (exit 2) otherwise."""
    from viasd.api import GenerateConfig, drafter_kind, preflight_files
    from viasd.settings import from_args
    from viasd.validation import check_float, check_int

    defaults = from_args(args)
    config = GenerateConfig.from_settings(**defaults)
    config.validate()
    preflight_files(config.flat())  # route and thresholds files readable and well-formed
    if args.drafter is None:  # a drafter model where the default strategy needs one (with one, requests may choose)
        drafter_kind(config, False)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    check_int("--max-queue", args.max_queue, 0)
    check_int("--max-batch", args.max_batch, 1, 256)
    if args.kv_budget_mb is not None:
        check_int("--kv-budget-mb", args.kv_budget_mb, 1)
    check_int("--prefix-cache-mb", args.prefix_cache_mb, 0)
    check_int("--max-body-kb", args.max_body_kb, 1)
    check_float("--drain-timeout", args.drain_timeout, 0, allow_inf=True)
    check_float("--header-timeout", args.header_timeout, 0, lo_open=True)
    check_int("--replicas", args.replicas, 0)
    if args.ray_address and not args.replicas:
        raise UsageError("--ray-address needs --replicas N")
    args.allowed_hosts = allowed_hosts(args.host, args.allowed_hosts)
    args.allowed_origins = allowed_origins(args.allowed_origins)
    if args.api_key is not None:
        key = args.api_key.strip()
        if not key:
            raise UsageError("--api-key (or VIASD_API_KEY) is empty")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise UsageError("--api-key (or VIASD_API_KEY) contains whitespace or control characters: "
                             "no Authorization header could carry it")
        if key != args.api_key:  # a newline from a file: no header carries it, so nobody could ever authenticate
            print("viasd serve: note: removed whitespace around the API key", file=sys.stderr)
            args.api_key = key
    return defaults


def loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, flag: str | None) -> tuple[str, ...] | None:
    """ServeSettings.allowed_hosts for --host `bind` and --allowed-hosts `flag`: the flag's names; without it,
    none on a loopback address (only IP literals and localhost: no rebinding page gets in) and any Host
    (None) on another."""
    names = tuple(n.strip().lower().rstrip(".") for n in (flag or "").split(",") if n.strip())
    if "*" in names or (not names and not loopback(bind)):
        return None
    bad = next((n for n in names if not re.fullmatch(r"[a-z0-9_.-]+", n)), None)
    if bad is not None:
        raise UsageError(f"--allowed-hosts takes host names (no scheme, port or path), got {bad!r}")
    return names


def allowed_origins(flag: str | None) -> tuple[str, ...]:
    """ServeSettings.allowed_origins for --allowed-origins `flag`: each scheme://host[:port], lower case."""
    origins = tuple(o.strip().lower().rstrip("/") for o in (flag or "").split(",") if o.strip())
    for o in origins:
        try:
            parts = urlsplit(o)
            parts.port  # noqa: B018 (a port out of range raises)
        except ValueError:
            parts = None
        if o != "*" and (parts is None or not parts.scheme or not parts.netloc or parts.path or parts.query or parts.fragment):
            raise UsageError(f"--allowed-origins takes origins as scheme://host[:port] (or '*'), got {o!r}")
    return origins


def serve_command(args: argparse.Namespace) -> int:
    from viasd.server.app import ServeSettings, build_app

    defaults = check_args(args)
    settings = ServeSettings(defaults=defaults, served_name=args.served_model_name or args.model, max_queue=args.max_queue,
                             max_body_bytes=args.max_body_kb * 1024, api_key=args.api_key, max_batch=args.max_batch,
                             kv_budget=None if args.kv_budget_mb is None else args.kv_budget_mb << 20,
                             prefix_cache=args.prefix_cache_mb << 20, allowed_hosts=args.allowed_hosts,
                             allowed_origins=args.allowed_origins)
    if args.replicas:
        from viasd.server.ray_serve import serve_replicas

        return serve_replicas(args, settings)
    sock = listen_socket(args.host, args.port)  # before the model loads: a bind failure is one line, not minutes later
    try:
        app = build_app(args.model, args.drafter, settings, weights=args.weights, device=args.device, progress=not args.quiet,
                        drafter_weights=args.drafter_weights)
        run_uvicorn(app, args.host, args.port, args.drain_timeout, args.log_level, sock=sock, header_timeout=args.header_timeout)
    finally:
        sock.close()
    return 0


def listen_socket(host: str, port: int, backlog: int = 2048):
    """A TCP socket bound to (host, port) and listening, made as uvicorn makes its own (SO_REUSEADDR;
    IPv6 for a host with a ':'; uvicorn's backlog). An address in use, a host this machine does not
    have or cannot resolve: a UsageError (one line, exit 2)."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except (OSError, OverflowError, UnicodeError) as e:
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"cannot listen on {_address(host, port)} (--host, --port): {reason}") from None
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run_uvicorn(app, host: str, port: int, drain_timeout: float = 30.0, log_level: str = "warning", sock=None,
                header_timeout: float = 20.0) -> None:
    """Serve `app` on `sock` (else a socket bound here to host:port), saying where once it listens; each
    connection limited as protocol.py says (heads of at most 64 KiB, arrived within `header_timeout` s)."""
    import uvicorn

    from viasd.server.protocol import protocol

    if sock is None:
        sock = listen_socket(host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
                            http=protocol(header_timeout), timeout_keep_alive=5)
    server = DrainingServer(config, app.state.worker, drain_timeout)
    bound_host, bound_port = sock.getsockname()[:2]  # the port the system chose for --port 0
    print(f"viasd serve: {app.state.model.name} on http://{_address(bound_host, bound_port)}/v1 (Ctrl-C or SIGTERM drains)",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])


if TYPE_CHECKING:
    from uvicorn import Server as _Server
else:
    try:
        import uvicorn as _uvicorn

        _Server = _uvicorn.Server
    except ImportError:  # pragma: no cover
        _Server = object


class DrainingServer(_Server):
    """uvicorn's server, but the first SIGTERM / SIGINT drains: new requests get 503 while the
    in-flight ones finish (for at most `drain_timeout` s, then they are cancelled); a second signal
    exits at once."""

    def __init__(self, config, worker, drain_timeout: float):
        super().__init__(config)
        self.worker, self.drain_timeout = worker, drain_timeout
        self._loop = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self.worker.draining or self._loop is None:
            self.worker.cancel_all()
            return super().handle_exit(sig, frame)
        self.worker.draining = True
        name = signal.Signals(sig).name if sig else "signal"
        print(f"viasd serve: {name}: draining {self.worker.pending} request(s), new ones get 503", file=sys.stderr)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

    async def _drain(self):
        deadline = time.monotonic() + self.drain_timeout
        while self.worker.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.worker.pending:
            print(f"viasd serve: drain timeout: cancelling {self.worker.pending} request(s)", file=sys.stderr)
            self.worker.cancel_all()
            while self.worker.pending:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last responses flush
        self.should_exit = True
