"""`viasd serve`'s continuous batching: requests share passes and each answer equals the request alone."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd import compute, generate  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from support import native_q8  # noqa: E402
from live_server import LiveServer, metric  # noqa: E402
from helpers import GatedWorker, wait_for  # noqa: E402


def test_concurrent_requests_share_passes_and_each_answer_equals_serving_alone(tiny_q8, tiny_drafter):
    """Mixed strategies, prompt lengths and arrival times on one batched server: every greedy answer
    equals the request decoded alone, and passes did carry rows of several requests."""
    app = create_app(tiny_q8, tiny_drafter, settings=ServeSettings(served_name="tiny", max_batch=6,
                                                                defaults={"slim_layers": (0, 1, 3)}))
    asks = [("w1 w2 w3", {"strategy": "ar"}, 40), ("w5 w6 w5 w6 w5", {"strategy": "pld"}, 30),
            (" ".join(f"w{i % 50}" for i in range(90)), {"strategy": "ar"}, 20),  # a prompt longer than a pass
            ("w9 w8 w7", {"strategy": "sd", "k": 3}, 30), ("w2 w4", {"strategy": "viasd", "mode": "lossless"}, 25),
            ("w3 w3 w1", {"strategy": "viasd", "mode": "tiered", "draft": "pld"}, 25), ("w7 w1", {"strategy": "ar"}, 35)]
    alone = [generate(p, tiny_q8, drafter=tiny_drafter if s["strategy"] == "sd" else None, max_new_tokens=n, chat=False,
                      progress=False, slim_layers=(0, 1, 3), **s).text for p, s, n in asks]
    passes = []
    with LiveServer(app) as live, ThreadPoolExecutor(len(asks)) as pool:
        worker = live.app.state.worker
        worker.session.on_pass = lambda r, rows: passes.append(r)
        # the compute thread held until three requests are in, so that some passes are shared however
        # busy the machine (the first request alone finished before the next arrived under `make
        # test`'s other worker); the later ones join running ones
        gate = threading.Event()
        compute.submit(gate.wait, 60)
        def ask(i):
            time.sleep(0.005 * i)  # staggered arrivals
            p, s, n = asks[i]
            r = httpx.post(live.url + "/v1/completions", timeout=300,
                           json={"model": "tiny", "prompt": p, "max_tokens": n, "viasd": s})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        answers = pool.map(ask, range(len(asks)))
        try:
            wait_for(lambda: worker.pending >= 3, "three requests in", limit=60)
        finally:
            gate.set()
        together = list(answers)
    assert together == alone
    assert passes and max(passes) >= 2
    assert app.state.worker.session.members == 0


def test_speculative_members_draft_together_and_verify_together(tiny_q8, tiny_drafter):
    """`batching.lockstep`: while a drafter's calls are parked, the verifier's wait for them, so no
    step runs a drafter pass and a verifier pass at once (run as they came, three `sd` requests
    started apart would each pay both in most steps); each answer equals the request alone."""
    from viasd.execution import batching

    drafter = native_q8(tiny_drafter)  # 2 layers against the verifier's 4: its passes read fewer bytes
    assert drafter.decoder.weight_bytes() < tiny_q8.decoder.weight_bytes()
    session = batching.BatchSession()
    steps: list[list[int | None]] = []
    run = session._run
    session._run = lambda calls: (steps.append([batching._cost(c) for c in calls]), run(calls))
    kw = dict(strategy="sd", drafter=drafter, k=3, adapt_k=False, max_new_tokens=60, progress=False)
    # three prompts that each decode their 60 tokens (no end of text): which do depends on the CPU's
    # kernels (on the AVX2 EPYC [5, 36, 16] ends after 33), so they are chosen here
    candidates = [[5, 36, 16], [8, 7, 5], [11, 28, 44], [9, 14, 30], [12, 6, 40], [20, 33, 7], [15, 3, 27], [25, 10, 41]]
    full = [(p, a) for p in candidates if len(a := generate(p, tiny_q8, **kw).token_ids) == 60][:3]
    prompts, alone = [p for p, _ in full], [a for _, a in full]
    assert len(prompts) == 3

    assert members_decode(session, tiny_q8, prompts, **kw) == alone
    verifier = tiny_q8.decoder.weight_bytes()
    assert all(len(set(costs)) == 1 for costs in steps), [s for s in steps if len(set(s)) > 1][:3]
    assert max(costs.count(verifier) for costs in steps) == 3  # all three verified in one pass


def test_lossless_viasd_members_share_resumed_and_stream_storing_passes(tiny_q8, monkeypatch):
    """Lossless VIA-SD's full passes resume at the slim route's first incomplete layer, and its slim
    and lower passes store the streams entering it: such passes of several requests share a pass
    (each request reading and writing its own cache's streams), and every answer equals the request
    alone. Run one by one, 8 served VIA-SD requests delivered 0.28x `ar`'s tokens/s."""
    from viasd.execution import batching
    from viasd.models.decoder import Decoder

    shared = []  # per shared pass: (resumed, stores streams) of each call
    many = Decoder.forward_many

    def recording(self, calls, rows=None):
        kinds = []
        for args, kw in calls:
            route = kw.get("route")
            kinds.append((kw.get("resume", False), args[2].saves_hidden(None if route is None or route.is_full else route)))
        shared.append(kinds)
        return many(self, calls, rows)

    monkeypatch.setattr(Decoder, "forward_many", recording)
    session = batching.BatchSession()
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 8, 9, 8, 9, 8], [11, 12, 13, 11, 12, 13]]
    kw = dict(strategy="viasd", mode="lossless", draft="pld", slim_layers=(0, 1, 3), k=3, max_new_tokens=40, adapt_k=False,
              progress=False)  # always k: beside others the adaptive policy would draft nothing, and make no slim pass
    alone = [generate(p, tiny_q8, **kw) for p in prompts]
    assert {r.config["resume_layer"] for r in alone} == {2}
    assert all(r.stats.calls["lower"] > 0 for r in alone)  # some rows no slim pass processed went through layers 0-1 alone

    assert members_decode(session, tiny_q8, prompts, **kw) == [r.token_ids for r in alone]
    assert any(len(kinds) >= 2 and all(resumed for resumed, _ in kinds) for kinds in shared), shared
    assert any(len(kinds) >= 2 and all(stores and not resumed for resumed, stores in kinds) for kinds in shared), shared


def test_a_member_measures_pass_times_in_a_step_of_its_own(tiny_q8, monkeypatch):
    """`pass_times` from a member (a served request starting beside others) runs its passes in one
    step of the session's, with no other member's pass between them: through the shared steps, the
    first request of a burst timed its passes with the others' prompts run in the same steps, and
    kept 34-114 ms for smollm2's 1-5 rows (4.5-13 alone) for every later request of the process.
    Its tokens are unchanged: the measurement uses a scratch cache."""
    from viasd.execution.timing import pass_times
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    decoder = tiny_q8.decoder
    order: list[int] = []  # the cache of each pass, in the order the compute thread ran them
    own = decoder.forward
    monkeypatch.setitem(decoder.__dict__, "forward",
                        lambda tokens, start, cache, *a, **kw: (order.append(id(cache)), own(tokens, start, cache, *a, **kw))[1])
    many = decoder.forward_many
    monkeypatch.setattr(decoder, "forward_many",
                        lambda calls, rows=None: ([order.append(id(args[2])) for args, _ in calls], many(calls, rows))[1])
    monkeypatch.setattr(decoder, "pass_times", {})
    session = batching.BatchSession()
    measuring = threading.Event()
    kw = dict(strategy="ar", max_new_tokens=40, progress=False)
    alone = generate([5, 6, 7], tiny_q8, **kw).token_ids

    def decoding():  # a member decoding all along, its passes parked in the session
        def run():
            measuring.wait(30)
            return generate([5, 6, 7], tiny_q8, passes=Passes(session), **kw).token_ids
        return session.member(run)

    def measuring_member():
        def run():
            measuring.set()
            deadline = time.monotonic() + 30
            while not order and time.monotonic() < deadline:  # the other member's decode under way
                time.sleep(0.001)
            return pass_times(decoder, 3, passes=Passes(session))
        return session.member(run)

    def compute_thread():
        while not all(f.done() for f in futures):
            session.step(idle_timeout=0.05)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(decoding), pool.submit(measuring_member)]
        compute.run(compute_thread)
        tokens, times = futures[0].result(timeout=60), futures[1].result(timeout=60)
    assert tokens == alone and len(times) == 3 and decoder.pass_times[3, False] == times
    caches = list(dict.fromkeys(order))
    scratch = [c for c in caches if order.count(c) == 4 * 3]  # 4 rounds of 1-3 rows
    assert len(scratch) == 1, (len(caches), [order.count(c) for c in caches])
    first = order.index(scratch[0])
    assert order[first : first + 12] == [scratch[0]] * 12  # no other pass among them
    assert len(order) > 12 + 1 and first > 0  # the decode ran before it (and after it: 40 tokens)


def test_a_call_waits_for_cheaper_ones_at_most_max_defer_steps():
    from viasd.execution import batching

    class Model:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def weight_bytes(self, route=None, from_layer=0, head=True):
            return self.nbytes

    def call(model):
        return batching._Call(model, (), {})

    big, small, unknown = Model(100), Model(10), Model(0)  # 0: the model does not say
    dear, cheap, other = call(big), call(small), call(unknown)
    now, later = batching.lockstep([dear, cheap, other])
    assert now == [cheap, other] and later == [dear]
    assert batching.lockstep([dear, call(big)])[1] == []  # one cost: all run
    for _ in range(batching.MAX_DEFER - 1):
        assert batching.lockstep([dear, call(small)])[1] == [dear]
    assert batching.lockstep([dear, call(small)])[1] == []  # waited MAX_DEFER steps: runs


def test_the_kv_budget_holds_requests_back_until_running_ones_free_it(tiny):
    from viasd.server.engine import kv_bytes

    one = kv_bytes(tiny, 2 + 8 + 80)
    worker = GatedWorker(tiny, max_batch=4, kv_budget=int(one * 1.5))  # room for one request at a time
    app = create_app(tiny, settings=ServeSettings(served_name="tiny", max_batch=4), worker=worker)
    with LiveServer(app) as live, ThreadPoolExecutor(2) as pool:
        ask = lambda: live.client().completions.create(model="tiny", prompt="w1", max_tokens=8)  # noqa: E731
        first, second = pool.submit(ask), pool.submit(ask)
        wait_for(lambda: worker.running == 1 and worker.waiting == 1, "one request to run, one to wait for memory")
        assert metric(live.metrics(), "viasd_kv_cache_bytes") == one
        assert worker.session.admitted == 2 and worker.session.members <= 1  # the running one is not alone
        worker.gate.set()
        assert first.result().choices[0].text == second.result().choices[0].text
        wait_for(lambda: worker.pending == 0, "both to finish")
        assert metric(live.metrics(), "viasd_kv_cache_bytes") == 0 and worker.session.admitted == 0


def test_a_member_run_on_the_compute_thread_serves_the_members_that_join_it(tiny_q8):
    """`BatchSession.run_inline`: a request decoding on the compute thread itself runs its passes at
    once and, while it runs, the passes of members that join share them; every answer equals the
    request decoded alone."""
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    session = batching.BatchSession()
    passes = []
    session.on_pass = lambda requests, rows: passes.append(requests)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    alone = [generate(p, tiny_q8, strategy="ar", max_new_tokens=30, progress=False).token_ids for p in prompts]
    joined, shared = threading.Event(), []

    def first():
        out = []

        def on_text(_):
            if not out:  # the others join after its first round
                out.append(1)
                joined.set()
                time.sleep(0.05)

        return generate(prompts[0], tiny_q8, strategy="ar", max_new_tokens=30, progress=False, on_text=on_text,
                        passes=Passes(session)).token_ids

    def member(p):
        joined.wait(30)
        return session.member(generate, p, tiny_q8, strategy="ar", max_new_tokens=30, progress=False, passes=Passes(session)).token_ids

    def compute_thread():  # as the server's scheduler: the inline request, then steps while members remain
        out = session.run_inline(first)
        shared.append(sum(r >= 2 for r in passes))  # passes of several requests while it ran
        while not all(f.done() for f in others):
            session.step(idle_timeout=0.05)
        return out

    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(member, p) for p in prompts[1:]]
        inline = compute.run(compute_thread)
        results = [inline] + [f.result(timeout=60) for f in others]
    assert results == alone
    assert shared[0] > 0  # the joined members' rows were computed in the inline request's steps
    assert session.members == 0


def members_decode(session, model, prompts, **kw) -> list[list[int]]:
    """Each prompt decoded by a member of `session` in a thread of its own (started 10 ms apart), the
    compute thread stepping the session once all have joined and until all end, each step waiting for
    every member to park a call: which calls share a pass is the session's doing, not the machine's
    speed (with the default 5-ms wait, a member slowed by another test worker ran its passes alone, and
    the first ran steps alone until the others joined); their token ids."""
    from viasd import compute
    from viasd.execution import batching
    from viasd.execution.passes import Passes

    def member(i):
        time.sleep(0.01 * i)
        return session.member(generate, prompts[i], model, passes=Passes(session), **kw).token_ids

    def compute_thread():
        deadline = time.monotonic() + 60
        while session.members < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.001)
        while not all(f.done() for f in futures):
            session.step(idle_timeout=0.05)

    wait, batching.MAX_WAIT_S = batching.MAX_WAIT_S, 1.0
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(member, i) for i in range(len(prompts))]
            compute.run(compute_thread)
            return [f.result(timeout=60) for f in futures]
    finally:
        batching.MAX_WAIT_S = wait
