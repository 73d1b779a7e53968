"""`viasd serve`, the API's happy paths: the official `openai` client against live servers on loopback
(most tests share one module-scoped server over smollm2-135m, uvicorn in a thread, a free port)."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd import generate  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from live_server import LiveServer  # noqa: E402
from helpers import COUNTING, HAIKU, MODEL  # noqa: E402


def alone(smollm2, prompt, **settings):
    """The same request decoded directly by the engine, alone."""
    return generate(prompt, smollm2, progress=False, **{"strategy": "pld", "max_new_tokens": 16, **settings})


@pytest.mark.model
def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}


@pytest.mark.model
def test_completion_is_the_engines_output_with_usage_and_record(client, smollm2):
    r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12)
    ref = alone(smollm2, COUNTING, chat=False, max_new_tokens=12)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    record = r.model_extra["viasd"]
    assert record["config"]["strategy"] == "pld"
    stats = record["stats"]
    assert stats["new_tokens"] == 12 and stats["calls"]["full"] >= 1
    for key in ("mean_accepted_length", "rejection_rate", "full_rejection_rate", "tokens_per_s", "tiers"):
        assert key in stats


@pytest.mark.model
def test_token_id_prompt(client, smollm2):
    ids = smollm2.encode(COUNTING, chat=False)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert r.choices[0].text == alone(smollm2, ids, max_new_tokens=6).text


@pytest.mark.model
def test_chat_uses_the_chat_template(client, smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "7"}, {"role": "user", "content": "And a larger one?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == alone(smollm2, messages, max_new_tokens=10).text
    assert r.usage.prompt_tokens == len(smollm2.encode(messages))


@pytest.mark.model
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}], ids=["greedy", "seeded"])
def test_stream_reassembles_to_the_non_streamed_text(client, chat, sampling):
    if chat:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": HAIKU}], max_tokens=20, **sampling)
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole_text = whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model=MODEL, prompt=HAIKU, max_tokens=20, **sampling)
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        whole_text = whole.choices[0].text
    assert len([c for c in chunks if c.choices]) > 2  # really streamed, not one blob
    assert text == whole_text and text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["viasd"]["stats"]["new_tokens"] == whole.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.model
def test_seeded_sampling_differs_from_greedy(client):
    kw = dict(model=MODEL, prompt=HAIKU, max_tokens=20)
    greedy = client.completions.create(**kw).choices[0].text
    seeds = {client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert seeds - {greedy}  # sampling really happens (and the seed selects it)


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(client, stream):
    full = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=16).choices[0].text
    assert " 11," in full  # greedy smollm2 counts on: " 9, 10, 11, 12, ..."
    kw = dict(model=MODEL, prompt=COUNTING, max_tokens=16, stop=[" 11,", "never there"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, [r.choices[0].finish_reason]
        assert r.usage.completion_tokens < 16  # the decode ended early, not only the text
    assert text == full[: full.index(" 11,")]
    assert reason == ["stop"]


@pytest.mark.model
def test_viasd_extension_selects_the_strategy(client, smollm2):
    kw = dict(model=MODEL, prompt=COUNTING, max_tokens=12)
    ar = client.completions.create(extra_body={"viasd": {"strategy": "ar"}}, **kw)
    # (fixed draft lengths: measured costs may price drafting out on a slow or busy machine, and then no slim pass runs)
    lossless = client.completions.create(extra_body={"viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld", "k": 3,
                                                               "adapt_k": False}}, **kw)
    assert lossless.choices[0].text == ar.choices[0].text  # lossless VIA-SD is exactly the full model's greedy output
    rec = lossless.model_extra["viasd"]
    assert rec["config"]["strategy"] == "viasd" and rec["config"]["mode"] == "lossless" and rec["config"]["k"] == 3
    assert rec["stats"]["calls"].get("slim", 0) > 0  # the slim verifier tier ran
    assert ar.model_extra["viasd"]["stats"]["calls"] == {"full": 12}
    tiered = client.completions.create(extra_body={"viasd": {"strategy": "viasd", "mode": "tiered", "accept": 0.5, "slim": 0.5}}, **kw)
    tiers = tiered.model_extra["viasd"]["stats"]["tiers"]
    assert sum(tiers.values()) == tiered.usage.completion_tokens


def test_a_server_with_a_drafter_model_serves_sd(tiny, tiny_drafter):
    app = create_app(tiny, tiny_drafter, settings=ServeSettings(defaults={"strategy": "sd", "k": 3}, served_name="tiny"))
    with LiveServer(app) as live:
        c = live.client()
        for ext in ({}, {"adapt_k": False}, {"strategy": "viasd", "draft": "model", "slim_layers": [0, 1, 3]},
                    {"strategy": "viasd", "mode": "tiered", "draft": "model", "slim_layers": [0, 1, 3], "resume": False,
                     "reduced_head": False, "draft_confident": 0.9}):
            r = c.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=6, extra_body={"viasd": ext})
            ref = generate("w5 w6 w7", tiny, drafter=tiny_drafter, chat=False, progress=False,
                           **{"strategy": "sd", "k": 3, "max_new_tokens": 6,
                              **{k: tuple(v) if isinstance(v, list) else v for k, v in ext.items()}})
            assert r.choices[0].text == ref.text
            assert r.model_extra["viasd"]["config"]["draft"] == "model"
            config = r.model_extra["viasd"]["config"]
            if not config.get("adaptive_k"):  # adaptive drafting follows measured costs: it may draft nothing in 6 tokens
                assert r.model_extra["viasd"]["stats"]["calls"].get("draft", 0) >= 1 or r.usage.completion_tokens <= 1
            assert config["adapt_k"] is ext.get("adapt_k")  # as asked; None: the default
            # what ran: adaptive drafting for sd and VIA-SD under greedy decoding unless asked not to; the new
            # VIA-SD settings reach the record
            assert config.get("adaptive_k") == ext.get("adapt_k", True)
            for key in ("resume", "reduced_head"):
                if key in ext:
                    assert config[key] == ext[key]
            if "draft_confident" in ext:
                assert config["tier_thresholds"]["draft_confident"] == ext["draft_confident"]
            if ext.get("resume") is False:
                assert config["resume_layer"] is None and "lower" not in r.model_extra["viasd"]["stats"]["calls"]


def test_samplers_through_the_openai_client(tiny):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias as its client sends them, and top_k,
    min_p, repetition_penalty as top-level extras (extra_body, as vLLM and llama-server take them): the
    engine's output with the same settings; a +100 bias forces its token."""
    app = create_app(tiny, settings=ServeSettings(defaults={"strategy": "pld"}, served_name="tiny"))
    with LiveServer(app) as live:
        c = live.client()
        extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}
        kw = dict(presence_penalty=0.5, frequency_penalty=0.8, logit_bias={"3": 2.5, "61": -100})
        for temperature in (0.0, 0.9):
            r = c.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=temperature, seed=3,
                                     extra_body=extras, **kw)
            ref = generate("w5 w6 w7", tiny, chat=False, progress=False, strategy="pld", max_new_tokens=8, temperature=temperature,
                           seed=3, **extras, **kw)
            assert r.choices[0].text == ref.text
            config = r.model_extra["viasd"]["config"]
            assert {k: config[k] for k in extras} == extras and config["presence_penalty"] == 0.5
        forced = c.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4, logit_bias={"17": 100})
        assert forced.choices[0].text.split() == ["w17"] * 4
        with pytest.raises(openai.BadRequestError) as e:  # an id the vocabulary lacks, once the model is known
            c.completions.create(model="tiny", prompt="w5", max_tokens=2, logit_bias={"64": 1})
        assert e.value.code == "invalid_value" and e.value.param == "logit_bias"
        with pytest.raises(openai.UnprocessableEntityError) as e:
            c.completions.create(model="tiny", prompt="w5", max_tokens=2, extra_body={"top_k": -1})
        assert e.value.param == "top_k"
