"""Prometheus metrics of one server process (its own registry, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROW_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTED_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16, 32, 64)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("viasd_requests", "HTTP requests by endpoint and status (499: the client "
                                "disconnected and its generation was cancelled)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("viasd_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.generated_tokens = Counter("viasd_generated_tokens", "tokens generated (committed), by strategy",
                                        ["strategy"], registry=r)
        self.forward_calls = Counter("viasd_forward_calls", "model forward calls by tier: full (verifier), slim "
                                     "(verifier along the slim route), draft (drafter)", ["tier"], registry=r)
        self.tier_tokens = Counter("viasd_tier_tokens", "tokens committed by VIA-SD tier (accept, slim, full)",
                                   ["tier"], registry=r)
        self.accepted_length = Histogram("viasd_accepted_length", "mean accepted length (tokens per verification "
                                         "round) of each request", ["strategy"], buckets=ACCEPTED_BUCKETS, registry=r)
        self.latency = Histogram("viasd_request_latency_seconds", "arrival to last token, queueing included",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("viasd_time_to_first_token_seconds", "arrival to first text, queueing included",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("viasd_queue_depth", "requests waiting for the decode worker", registry=r)
        self.running = Gauge("viasd_requests_running", "requests being decoded at once (at most --max-batch)", registry=r)
        self.queue_wait = Histogram("viasd_queue_wait_seconds", "arrival to the start of decoding", ["endpoint"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_requests = Histogram("viasd_batch_requests", "requests whose rows shared a forward pass",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.batch_rows = Histogram("viasd_batch_rows", "rows of a forward pass shared by several requests",
                                    buckets=ROW_BUCKETS, registry=r)
        self.kv_used = Gauge("viasd_kv_cache_bytes", "KV-cache bytes reserved by the running requests", registry=r)
        self.kv_budget = Gauge("viasd_kv_cache_budget_bytes", "KV-cache bytes the running requests may reserve (--kv-budget-mb)",
                               registry=r)
        self.prefix_bytes = Gauge("viasd_prefix_cache_bytes", "bytes of prompts' K/V kept for reuse (--prefix-cache-mb)", registry=r)
        self.prefix_reused = Gauge("viasd_prefix_cache_reused_tokens", "prompt tokens whose K/V came from the prefix cache "
                                   "since start (verifier model)", registry=r)

    def watch(self, worker) -> None:
        """Follow `worker`'s KV reservations and its batched passes."""
        self.kv_used.set_function(lambda: worker.kv_used)
        self.kv_budget.set(worker.kv_budget)
        caches = [c for _, c in worker.prefix_caches]
        self.prefix_bytes.set_function(lambda: sum(c.nbytes for c in caches))
        self.prefix_reused.set_function(lambda: caches[0].reused_positions if caches else 0)
        worker.session.on_pass = self.observe_pass

    def observe_pass(self, requests: int, rows: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_rows.observe(rows)

    def depth(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def observe_decode(self, endpoint: str, job) -> None:
        """A finished or cancelled generation (job.result may be partial or None)."""
        if job.first_text is not None:
            self.ttft.labels(endpoint).observe(job.first_text - job.arrived)
        if job.started is not None:
            self.queue_wait.labels(endpoint).observe(job.started - job.arrived)
        result = job.result
        if result is None:
            return
        s = result.stats.to_dict()
        strategy = result.config.get("strategy", "?")
        self.prompt_tokens.inc(s["prompt_tokens"])
        self.generated_tokens.labels(strategy).inc(s["new_tokens"])
        for tier, n in s["calls"].items():
            self.forward_calls.labels(tier).inc(n)
        for tier, n in s["tiers"].items():
            if n:
                self.tier_tokens.labels(tier).inc(n)
        if s["rounds"]:
            self.accepted_length.labels(strategy).observe(s["mean_accepted_length"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
