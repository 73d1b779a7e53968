"""llama.cpp's /infill (as llama.vscode sends it, over HTTP) and `suffix` on /v1/completions (the `openai`
client): the model's FIM tokens in llama.cpp's layout, the text that of the same prompt through
/v1/completions under every strategy, streamed and whole alike, errors in each dialect's shape."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from viasd.server import ServeSettings, create_app  # noqa: E402
from viasd.server.fim import fim_tokens, plain, repository  # noqa: E402
from live_server import LiveServer, metric  # noqa: E402
from helpers import check_error  # noqa: E402

SERVED = "tiny-coder"
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "mul.py", "text": "def mul(a, b):\n    return a * b\n"}]
# the strategies a greedy answer must not depend on: plain decoding, prompt lookup, a drafter model, VIA-SD lossless
STRATEGIES = {"ar": {"strategy": "ar"}, "pld": {"strategy": "pld"}, "sd": {"strategy": "sd", "k": 3},
              "viasd": {"strategy": "viasd", "mode": "lossless", "draft": "pld", "k": 3, "adapt_k": False}}


@pytest.fixture(scope="module")
def live(coder):
    model, drafter = coder
    app = create_app(model, drafter, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 12}, served_name=SERVED))
    with LiveServer(app) as server:
        yield server


def vscode_body(**kw) -> dict:
    """The body llama.vscode posts (its defaults, the fields it asks back)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": " a", "n_predict": 12, "top_k": 40,
            "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, **kw}


def test_the_layout_is_llama_cpps(coder):
    """<|repo_name|>myproject\\n <|file_sep|>{name}\\n{text} ... <|file_sep|>filename\\n <|fim_prefix|>{prefix}{prompt}
    <|fim_suffix|>{suffix}<|fim_middle|>, each text tokenized alone and as text."""
    model = coder[0]
    tok, f = model.tokenizer, fim_tokens(coder[0].tokenizer)
    ids = lambda s: tok(s, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # noqa: E731
    want = [f.rep, *ids("myproject\n"), f.sep, *ids("mul.py\n"), *ids(EXTRA[0]["text"]), f.sep, *ids("filename\n"),
            f.pre, *ids(PREFIX), *ids(" a"), f.suf, *ids(SUFFIX), f.mid]
    assert repository(model, f, PREFIX, SUFFIX, " a", [("mul.py", EXTRA[0]["text"])], 12) == want
    assert plain(model, f, PREFIX, SUFFIX) == [f.pre, *ids(PREFIX), f.suf, *ids(SUFFIX), f.mid]
    typed = plain(model, f, "<|fim_middle|>", "")  # a token's spelling in the code is text, not the token
    assert typed.count(f.mid) == 1 and typed[-1] == f.mid


def test_infill_is_the_completion_of_its_layout_under_every_strategy(live, coder):
    model = coder[0]
    f = fim_tokens(model.tokenizer)
    layout = repository(model, f, PREFIX, SUFFIX, " a", [(e["filename"], e["text"]) for e in EXTRA], 12)
    oc, texts = live.client(), set()
    for name, ext in STRATEGIES.items():
        r = httpx.post(live.url + "/infill", json=vscode_body(viasd=ext), timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        ref = oc.completions.create(model=SERVED, prompt=layout, max_tokens=12, extra_body={"viasd": ext})
        assert body["content"] == ref.choices[0].text, name
        assert body["stop"] is True and body["tokens_predicted"] == ref.usage.completion_tokens
        assert body["tokens_evaluated"] == ref.usage.prompt_tokens == len(layout)
        assert body["stop_type"] == ("limit" if ref.choices[0].finish_reason == "length" else "eos")
        assert body["viasd"]["config"]["strategy"] == ext["strategy"]
        assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"}
        texts.add(body["content"])
    assert len(texts) == 1  # greedy: the same text whatever drafts it


def test_suffix_on_completions_is_the_plain_fim_prompt(live, coder):
    model = coder[0]
    layout = plain(model, fim_tokens(model.tokenizer), PREFIX, SUFFIX)
    oc = live.client()
    for ext in (STRATEGIES["ar"], STRATEGIES["sd"]):
        r = oc.completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=10, extra_body={"viasd": ext})
        ref = oc.completions.create(model=SERVED, prompt=layout, max_tokens=10, extra_body={"viasd": ext})
        assert r.choices[0].text == ref.choices[0].text and r.usage.prompt_tokens == len(layout)
    streamed = "".join(c.choices[0].text for c in oc.completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=10,
                                                                        stream=True))
    assert streamed == oc.completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=10).choices[0].text


def test_streamed_infill_adds_up_to_the_whole_answer_and_ends_with_its_record(live):
    whole = httpx.post(live.url + "/infill", json=vscode_body(), timeout=120).json()
    with httpx.stream("POST", live.url + "/infill", json=vscode_body(stream=True, n_probs=2), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        records = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(records) > 2 and all(not x["stop"] for x in records[:-1])
    assert "".join(x["content"] for x in records) == whole["content"]
    assert sum(len(x["completion_probabilities"]) for x in records[:-1]) == whole["tokens_predicted"]
    last = records[-1]
    assert last["stop"] is True and last["content"] == "" and last["tokens_predicted"] == whole["tokens_predicted"]


def test_response_fields_pick_what_llama_vscode_reads(live):
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]
    body = httpx.post(live.url + "/infill", json=vscode_body(response_fields=fields), timeout=120).json()
    assert set(body) == set(fields) and body["truncated"] is False and isinstance(body["timings/prompt_n"], int)


def test_consecutive_completions_of_a_file_reuse_its_cached_prefix(live, coder):
    """The other files and the code before the cursor lead the prompt: the next completion further down the
    same file takes their K/V from the prefix cache."""
    model = coder[0]
    f = fim_tokens(model.tokenizer)
    extra = [(e["filename"], e["text"]) for e in EXTRA]
    first = vscode_body(input_prefix=PREFIX + " a + b\n\n\ndef sub(a, b):\n", prompt="")
    second = vscode_body(input_prefix=PREFIX + " a + b\n\n\ndef sub(a, b):\n    return", prompt=" a")
    a, b = (repository(model, f, x["input_prefix"], SUFFIX, x["prompt"], extra, 12) for x in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared > len(a) // 2
    httpx.post(live.url + "/infill", json=first, timeout=120).raise_for_status()
    before = metric(live.metrics(), "viasd_prefix_cache_reused_tokens")
    httpx.post(live.url + "/infill", json=second, timeout=120).raise_for_status()
    assert metric(live.metrics(), "viasd_prefix_cache_reused_tokens") - before >= shared - 1


def llama_error(r, status: int):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type"} and body["error"]["code"] == status
    assert body["error"]["message"] and "Traceback" not in r.text
    return body["error"]["message"]


@pytest.mark.parametrize("body, needle", [
    ({"input_extra": [{"filename": 3}]}, "input_extra"),
    ({"input_extra": "x"}, "input_extra"),
    ({"n_predict": "8"}, "n_predict"),
    ({"temperature": 9.0}, "temperature"),
    ({"input_prefix": ["a", 1]}, "input_prefix"),
    ({"viasd": {"strategy": "nope"}}, "strategy"),
])
def test_bad_infill_requests_get_llama_cpps_error(live, body, needle):
    assert needle in llama_error(httpx.post(live.url + "/infill", json=vscode_body(**body), timeout=60), 400)


def test_malformed_bodies_get_llama_cpps_error(live):
    llama_error(httpx.post(live.url + "/infill", content=b"{", headers={"content-type": "application/json"}), 400)
    llama_error(httpx.post(live.url + "/infill", json=[1]), 400)


def test_a_model_without_fim_tokens_says_so_in_each_dialect(tiny):
    app = create_app(tiny, settings=ServeSettings(served_name="tiny"))
    with LiveServer(app) as server:
        message = llama_error(httpx.post(server.url + "/infill", json=vscode_body(), timeout=60), 400)
        assert "fill-in-the-middle" in message
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w1", "suffix": "w2"}, timeout=60)
        check_error(r, 400, "no_fim_tokens")
        r = httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": "w1", "suffix": "w2"}, timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"error"} and "fill-in-the-middle" in r.json()["error"]
