"""Constrained decoding: every lossless strategy's output under a grammar is constrained `ar`'s
(greedy: token for token; sampled: the masked distribution), the grammar's forced tokens are drafted
and counted, and bad constraints are refused with the library's message."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from viasd import generate
from viasd.api import constraint_for
from viasd.cli import main
from viasd.decoding.acceptance import SamplingParams, logits_to_probs
from viasd.decoding.drafters import GrammarDrafter, ModelDrafter
from viasd.decoding.grammar import Constraint, closed_objects, grammar_of
from viasd.decoding.strategies import speculative_decode
from viasd.decoding.stats import Source
from viasd.decoding.session import DecodeRequest
from viasd.errors import UsageError
from viasd.models.loading import load_model

from support import bpe_tokenizer, save_tiny

CORPUS = ['{"ok": true, "n": 2, "name": "abc"}', '{"ok":false,"n":3,"name":"cab"}', "abc cab bca aab", "yes no maybe"] * 30
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # every answer infinite
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "name": {"type": "string", "pattern": "^[abc]{1,4}$"}},
          "required": ["ok", "n", "name"], "additionalProperties": False}
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}},
    "regex": {"type": "regex", "regex": "(yes|no)( maybe){0,2}"},
    "lark": {"type": "grammar", "grammar": 'start: "items: [" item ("," item)* "]"\nitem: "abc" | "cab" | NUM\nNUM: /[0-9]/'},
}
STRATEGIES = {  # name -> generate settings (and whether it drafts with the drafter model)
    "ar, no forced drafts": dict(strategy="ar", grammar_drafts=False),
    "ar": dict(strategy="ar"),
    "pld": dict(strategy="pld"),
    "sd": dict(strategy="sd", k=3),
    "self-sd": dict(strategy="self-sd", draft_layers=(0, 2)),
    "viasd lossless": dict(strategy="viasd", slim_layers=(0, 1, 3)),
    "viasd lossless, model drafts": dict(strategy="viasd", slim_layers=(0, 1, 3), draft="model"),
    "viasd tiered, corrected": dict(strategy="viasd", mode="tiered", correct=True, slim_layers=(0, 1, 3)),
}


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    tok = bpe_tokenizer(200, CORPUS)
    v = load_model(str(save_tiny(tmp_path_factory.mktemp("g-v"), seed=11, tokenizer=tok)), progress=False)
    d = load_model(str(save_tiny(tmp_path_factory.mktemp("g-d"), seed=12, n_layers=2, tokenizer=tok)), progress=False)
    return v, d


def satisfies(fmt: str, text: str) -> bool:
    if fmt == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if fmt == "regex":
        return re.fullmatch(FORMATS["regex"]["regex"], text) is not None
    return re.fullmatch(r"items: \[(abc|cab|[0-9])(,(abc|cab|[0-9]))*\]", text) is not None


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_strategy_under_a_grammar_equals_constrained_ar(bpe_pair, fmt):
    verifier, drafter = bpe_pair
    prompt = verifier.encode("abc cab", chat=False)
    results = {}
    for name, settings in STRATEGIES.items():
        uses_model = settings["strategy"] == "sd" or settings.get("draft") == "model"
        results[name] = generate(prompt, verifier, drafter=drafter if uses_model else None, max_new_tokens=40,
                                 response_format=FORMATS[fmt], progress=False, **settings)
    expected = results["ar, no forced drafts"]
    for name, r in results.items():
        assert r.token_ids == expected.token_ids, name
    if expected.token_ids[-1] in verifier.eos_token_ids:  # ended: the text is complete under the grammar
        assert satisfies(fmt, expected.text)
    stats = {name: r.stats.to_dict() for name, r in results.items()}
    assert stats["ar, no forced drafts"]["grammar_drafted"] == 0
    assert stats["ar"]["grammar_drafted"] > 0 and stats["ar"]["grammar_accepted"] > 0
    assert stats["ar"]["rounds"] < stats["ar, no forced drafts"]["rounds"]  # forced tokens verified in passes of their own
    assert all(s["grammar_mask_us"] is not None for s in stats.values())


def test_unconstrained_and_constrained_outputs_differ_where_the_grammar_binds(bpe_pair):
    verifier, _ = bpe_pair
    prompt = verifier.encode("abc cab", chat=False)
    free = generate(prompt, verifier, strategy="ar", max_new_tokens=12, progress=False)
    bound = generate(prompt, verifier, strategy="ar", max_new_tokens=12, response_format=FORMATS["regex"], progress=False)
    assert free.token_ids != bound.token_ids
    assert re.fullmatch(r"(yes|no)( maybe){0,2}", bound.text) or re.fullmatch(r"(yes|no)( maybe){0,2}", bound.text + " maybe")


def test_a_constraint_cut_by_max_new_tokens_is_an_unfinished_prefix(bpe_pair):
    verifier, _ = bpe_pair
    r = generate(verifier.encode("abc", chat=False), verifier, strategy="pld", max_new_tokens=3,
                 response_format=FORMATS["json_schema"], progress=False)
    assert len(r.token_ids) == 3 and r.token_ids[-1] not in verifier.eos_token_ids
    assert r.text.startswith('{"ok":')
    with pytest.raises(ValueError):
        json.loads(r.text)


@pytest.mark.model
def test_lossless_strategies_under_a_json_schema_equal_constrained_ar_on_smollm2(smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    prompt = "Extract the person as JSON with name, age and city: Maria Lopez is 34 and lives in Madrid."
    runs = {name: generate(prompt, smollm2, max_new_tokens=48, response_format=fmt, progress=False, **s)
            for name, s in [("ar-plain", dict(strategy="ar", grammar_drafts=False)), ("ar", dict(strategy="ar")),
                            ("pld", dict(strategy="pld")), ("self-sd", dict(strategy="self-sd")),
                            ("viasd", dict(strategy="viasd")), ("viasd-self", dict(strategy="viasd", draft="self"))]}
    runs["sd same-model"] = generate(prompt, smollm2, drafter=smollm2, strategy="sd", max_new_tokens=48,
                                     response_format=fmt, progress=False)
    expected = runs["ar-plain"]
    jsonschema.validate(json.loads(expected.text), schema)
    for name, r in runs.items():
        assert r.token_ids == expected.token_ids, name
    assert runs["ar"].stats.to_dict()["grammar_accepted"] >= 5  # keys, quotes and braces


def _constrained_marginals(model, constraint, prompt: list[int], params: SamplingParams, n: int) -> list[torch.Tensor]:
    """P(i-th new token) of the masked verifier distribution, by enumerating every continuation."""
    marginals: list = [0] * n

    def walk(ids: list[int], weight: float, depth: int) -> None:
        cache = model.decoder.new_cache(len(ids))
        logits = model.decoder.forward(torch.tensor(ids), 0, cache, last_only=True)[0]
        p = logits_to_probs(logits.masked_fill(~constraint.allowed(), float("-inf")), params)
        marginals[depth] = marginals[depth] + weight * p
        if depth + 1 < n:
            for t in torch.nonzero(p > 0).flatten().tolist():
                constraint.commit([t])
                walk(ids + [t], weight * float(p[t]), depth + 1)
                constraint.retract(1)

    walk(list(prompt), 1.0, 0)
    return marginals


def test_sampled_speculative_decoding_under_a_grammar_follows_the_masked_distribution(bpe_pair):
    """N = 1000 sampled decodes of 3 tokens (the first from the prefill, two from a verification of
    k = 2 drafts) under a regex: each position's empirical distribution is within TV 0.08 of the exact
    marginal of the masked verifier distribution (sampling noise: ~0.04; a token the grammar forbids,
    or an unmasked distribution, is far beyond it)."""
    verifier, drafter = bpe_pair
    fmt = {"type": "regex", "regex": "[abc]{2,8}"}
    params = SamplingParams(temperature=1.0)
    prompt = verifier.encode("abc cab", chat=False)
    marginals = _constrained_marginals(verifier, constraint_for(verifier, fmt), prompt, params, 3)
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(3, marginals[0].shape[0])
    n, drafted, accepted = 1000, 0, 0
    for _ in range(n):
        constraint = constraint_for(verifier, fmt)
        req = DecodeRequest(prompt=prompt, max_new_tokens=3, params=params, eos=frozenset(), generator=g, constraint=constraint)
        out = speculative_decode(verifier.decoder, GrammarDrafter(ModelDrafter(drafter.decoder, params, g, None), constraint), req, 2)
        for i, t in enumerate(out):
            counts[i, t] += 1
        drafted, accepted = drafted + req.stats.drafted, accepted + req.stats.accepted
    assert 0 < accepted < drafted
    for i, p in enumerate(marginals):
        assert 0.5 * (counts[i] / n - p).abs().sum() < 0.08, i


def test_masks_of_pending_rows_are_the_grammars_states_before_each_token(bpe_pair):
    verifier, _ = bpe_pair
    fmt = FORMATS["json_schema"]
    text_ids = verifier.tokenizer('{"ok":true,"n":2,"name":"ab"}', add_special_tokens=False)["input_ids"]
    one_by_one, c = [], constraint_for(verifier, fmt)
    for t in text_ids:
        one_by_one.append(c.allowed())
        c.commit([t])
    c = constraint_for(verifier, fmt)
    c.commit(text_ids[:6])
    rows = c.mask(torch.zeros(len(text_ids) - 3 + 1, verifier.config.vocab_size), text_ids[6:])  # 3 pending rows back
    for j, row in enumerate(rows[:-1]):
        assert torch.equal(row == 0, one_by_one[3 + j]), j
    assert c.committed == text_ids[:6] and c.valid(text_ids[6:]) == len(text_ids) - 6  # the state is unchanged
    assert c.valid([verifier.eos_token_ids.__iter__().__next__()]) == 0  # not complete yet
    c.commit(text_ids[6:])
    eos = min(verifier.eos_token_ids)
    assert c.allowed().nonzero().flatten().tolist() == sorted(verifier.eos_token_ids)  # complete: only the end
    c.commit([eos])  # the matcher stops; the end token is still taken and given back
    c.retract(1)
    assert c.forced() == [] and c.valid([eos]) == 1


@pytest.mark.parametrize("fmt, message", [
    ({"type": "regex", "regex": "("}, "response_format: invalid regex"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "response_format: invalid json schema"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "response_format: invalid grammar"),
    ({"type": "xml"}, "response_format type must be one of text, json_object, json_schema, regex, grammar"),
    ({"type": "regex"}, "response_format type 'regex' needs a non-empty string 'regex'"),
    ({"type": "regex", "regex": "a" * 200_000}, "more than the 131072 accepted"),
])
def test_bad_constraints_are_refused_before_any_model_loads(fmt, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        generate("hi", "no-such-model", response_format=fmt)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}, "response_format: invalid json schema: no text satisfies it"),
    ({"type": "regex", "regex": r"[^\s\S]"}, "response_format: invalid regex: no text satisfies it"),
    ({"type": "json_schema", "json_schema": {"schema": False}}, "invalid json schema: the schema is false, which no JSON value"),
    ({"type": "json_schema", "json_schema": {"schema": RECURSIVE}}, "invalid json schema: no finite text satisfies it"),
    ({"type": "grammar", "grammar": 'start: x\nx: "c" x'}, "invalid grammar: no finite text satisfies it"),
    ({"type": "regex", "regex": "a{1000000}"}, "invalid regex: no finite text satisfies it"),
    ({"type": "json_schema", "json_schema": {"schema": 42}}, "json_schema's schema must be a JSON object or a boolean, got 42"),
])
def test_constraints_with_no_finite_answer_are_refused_in_one_line_naming_why(fmt, message):
    """Not answered with empty text (a `$ref` to itself, a regex matching nothing), a crash (`false`) or a
    parser error once the model has loaded (the forced text of a `$ref` that only recurses)."""
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        generate("hi", "no-such-model", response_format=fmt)
    assert "\n" not in str(e.value) and "special token" not in str(e.value)


def test_a_true_schema_is_any_json_value():
    assert grammar_of({"type": "json_schema", "json_schema": {"schema": True}}) == \
        grammar_of({"type": "json_schema", "json_schema": {"schema": {}}})


def test_objects_naming_their_properties_take_no_other_keys(bpe_pair):
    """A non-strict schema's object closes after its properties: no free key for a model to repeat."""
    verifier, _ = bpe_pair
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = constraint_for(verifier, {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    ids = verifier.tokenizer('{"n":1', add_special_tokens=False)["input_ids"]
    c.commit(ids)
    nexts = {verifier.tokenizer.decode([t])[:1] for t in c.allowed().nonzero().flatten().tolist()}
    assert "}" in nexts and "," not in nexts and '"' not in nexts


def test_closed_objects_closes_only_objects_that_name_their_keys():
    inner = {"type": "object", "properties": {"b": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"a": inner, "c": {"const": {"properties": {"x": 1}}}},
              "$defs": {"d": inner}, "items": [inner]}
    closed = {**inner, "additionalProperties": False}
    assert closed_objects(schema) == {**schema, "properties": {"a": closed, "c": schema["properties"]["c"]},
                                      "$defs": {"d": closed}, "items": [closed], "additionalProperties": False}
    described = {"properties": {"a": {"$ref": "#/$defs/d", "description": "an A"}}, "$defs": {"d": inner}}
    assert closed_objects(described)["$defs"]["d"] == closed
    kept = [{"type": "object"}, {"properties": {"a": {}}, "additionalProperties": True},
            {"properties": {"a": {}}, "patternProperties": {"^x": {}}},
            # where schemas intersect, a closed one would forbid the other's keys: the whole schema stays open
            {"properties": {"a": {}}, "$ref": "#/$defs/d", "$defs": {"d": inner}},
            {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "required": ["a", "b"]},
            {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}, {"required": ["a"]}]},
            {"properties": {"x": inner, "y": {"allOf": [inner]}}}]
    for s in kept:
        assert closed_objects(s) == s, s
    assert closed_objects(schema) is not schema and "additionalProperties" not in inner  # a copy


def test_a_parser_limit_hit_while_decoding_is_named_as_such():
    """The parser outgrowing its limits mid-decode (a recursion the up-front check cannot follow) says so,
    not that the grammar spells a special token."""

    class Stuck:
        def get_error(self):
            return "parser error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes"

        def is_error(self):
            return True

    with pytest.raises(UsageError, match="past the parser's limits") as e:
        Constraint(Stuck(), 8)._check(True)
    assert "special token" not in str(e.value) and "try avoiding" not in str(e.value)


def test_cli_structured_output_flags(bpe_pair, tmp_path, capsys):
    verifier, _ = bpe_pair
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code = main(["generate", "abc cab", "--model", str(verifier.path), "--no-chat", "-n", "40", "--json-schema", str(schema),
                 "--strategy", "pld", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["config"]["response_format"]["json_schema"]["schema"] == SCHEMA
    if out["token_ids"][-1] in verifier.eos_token_ids:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    for argv, message in [(["--regex", "("], "response_format: invalid regex"),
                          (["--json-schema", str(tmp_path / "missing.json")], "no such JSON schema file"),
                          (["--regex", "a", "--json-object"], "not allowed with argument")]:
        try:
            code = main(["generate", "hi", "--model", str(verifier.path), *argv])
        except SystemExit as e:
            code = e.code
        assert code == 2 and message in capsys.readouterr().err, argv


def test_cli_refuses_a_constraint_with_no_answer_before_the_model_loads(tmp_path, capsys):
    files = {"false.json": "false", "ref.json": '{"$ref": "#"}', "n.json": "42"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    absent = str(tmp_path / "no-model")  # loading it would fail: the constraint must be refused first
    for argv, message in [(["--json-schema", str(tmp_path / "false.json")], "the schema is false"),
                          (["--json-schema", str(tmp_path / "ref.json")], "invalid json schema: no text satisfies it"),
                          (["--regex", r"[^\s\S]"], "invalid regex: no text satisfies it"),
                          (["--regex", "a{1000000}"], "invalid regex: no finite text satisfies it"),
                          (["--json-schema", str(tmp_path / "n.json")],
                           f"{tmp_path / 'n.json'}: a JSON schema is an object or a boolean, not a number")]:
        code = main(["generate", "hi", "--model", absent, *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)


GENERATE = ["generate", "abc cab", "--no-chat", "--strategy", "ar", "--json"]


def test_cli_takes_a_true_schema_as_any_json(bpe_pair, tmp_path, capsys):
    verifier, _ = bpe_pair
    (tmp_path / "true.json").write_text("true")
    assert main([*GENERATE, "--model", str(verifier.path), "--json-schema", str(tmp_path / "true.json"), "-n", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["response_format"]["json_schema"]["schema"] is True


def test_cli_record_says_whether_max_new_tokens_cut_a_constrained_answer(bpe_pair, capsys):
    verifier, _ = bpe_pair
    base = [*GENERATE, "--model", str(verifier.path)]

    def run(n: int) -> dict:
        assert main([*base, "--regex", "yes no maybe", "-n", str(n)]) == 0
        return json.loads(capsys.readouterr().out)

    whole = run(30)
    assert whole["text"] == "yes no maybe" and whole["finish_reason"] == "stop"
    n = len(whole["token_ids"]) - (whole["token_ids"][-1] in verifier.eos_token_ids)
    assert n > 1
    at_budget = run(n)  # complete at exactly the budget: the grammar allows only the end there
    assert at_budget["text"] == "yes no maybe" and at_budget["finish_reason"] == "stop"
    cut = run(n - 1)
    assert cut["finish_reason"] == "length" and "yes no maybe".startswith(cut["text"]) and cut["text"] != "yes no maybe"


def test_a_grammar_spelling_a_special_tokens_text_is_a_usage_error_not_a_crash(bpe_pair):
    """llguidance's mask allows the special token <eos> where the grammar spells "<eos>", and its matcher
    then refuses it: a usage error naming the cause (the server answers it as one)."""
    verifier, _ = bpe_pair
    fmt = {"type": "grammar", "grammar": 'start: "<eos>" "x"'}
    with pytest.raises(UsageError, match="response_format: the grammar cannot follow the model's tokens"):
        generate(verifier.encode("abc", chat=False), verifier, strategy="ar", max_new_tokens=4, response_format=fmt,
                 progress=False)


def test_grammar_forced_tokens_are_their_own_source_and_logprobs_see_the_mask(bpe_pair):
    verifier, _ = bpe_pair
    prompt = verifier.encode("abc cab", chat=False)
    r = generate(prompt, verifier, strategy="ar", response_format=FORMATS["lark"], max_new_tokens=30, logprobs=3, progress=False)
    assert r.stats.sources[Source.GRAMMAR] > 0 and set(r.sources) == {Source.GRAMMAR, Source.FULL}
    assert sum(r.stats.sources.values()) == len(r.token_ids)
    # the distribution after the grammar's mask: at a forced token nothing else is possible
    for source, lp in zip(r.sources, r.logprobs):
        assert all(math.isfinite(v) for _, v in lp.top)
        if source is Source.GRAMMAR and len(lp.top) == 1:
            assert lp.logprob == pytest.approx(0.0, abs=1e-6)
    assert any(s is Source.GRAMMAR and len(lp.top) == 1 for s, lp in zip(r.sources, r.logprobs))
