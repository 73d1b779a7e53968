"""One declaration per setting (viasd/settings.py): the Python API, the CLI's flags, the server's
request schema and the benchmark's method options accept and refuse the same values of every
setting, and start from the same defaults."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

from viasd.bench import parse_methods
from viasd.cli import build_parser
from viasd.errors import UsageError
from viasd.server.errors import APIError
from viasd.server.parsing import config_for
from viasd.server.schemas import CompletionRequest
from viasd.settings import SETTINGS, VIASD, Declared, GenerateConfig, from_args

# what each setting needs of the others to mean anything (e.g. `correct` is for tiered VIA-SD)
CONTEXT = {"correct": {"strategy": "viasd", "mode": "tiered"}, "min_ngram": {"max_ngram": 64}, "max_ngram": {"min_ngram": 1}}


def context(d: Declared) -> dict:
    if d.name in CONTEXT:
        return CONTEXT[d.name]
    if d.name == "strategy" or d.spec.reads == tuple(SETTINGS["strategy"].spec.choices):
        return {}
    if d.name == "draft":
        return {"strategy": "viasd"}
    return {"strategy": d.spec.reads[0], **({"mode": "tiered"} if d.spec.reads == VIASD else {})}


def values(d: Declared) -> list:
    """Values at and beyond the declared range, of the declared kind."""
    s = d.spec
    if d.kind == "int":
        return [int(s.lo), int(s.lo) - 1, int(s.hi), int(s.hi) + 1, (int(s.lo) + int(s.hi)) // 2]
    if d.kind == "float":
        hi = s.hi if s.hi is not None else 1e300
        return [s.lo, s.lo - 0.5, hi, hi + 0.5 if s.hi is not None else 1e301, math.inf, -math.inf, math.nan]
    if d.kind == "bool":
        return [True, False]
    if d.kind == "choice":
        return list(s.choices) + ["no-such-" + d.name]
    if d.kind == "layers":
        return [(0, 1), (-1,), (int(s.hi),), (int(s.hi) + 1,)]
    if d.kind == "format":
        return FORMATS
    if d.kind == "bias":
        return BIASES
    return ["some/file.json"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FORMATS = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}},
           {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
           {"type": "regex", "regex": "[a-z]+"}, {"type": "regex", "regex": "("}, {"type": "grammar", "grammar": 'start: "a" | "b"'},
           {"type": "grammar", "grammar": "start: undefined_rule"}, {"type": "no-such-format"}]


BIASES = [{5: 1.5}, {"7": -100, 3: 100}, {5: 100.5}, {5: -101}, {-1: 1.0}, {"x": 1.0}, {5: math.nan}, {5: math.inf},
          {}, "5=1"]


def format_argv(v: dict, tmp: Path) -> list[str] | None:
    """The CLI's flags for a response_format (its files written to `tmp`); None where no flag spells it."""
    kind = v["type"]
    if kind == "json_object":
        return ["--json-object"]
    if kind == "regex":
        return ["--regex", v["regex"]]
    if kind in ("json_schema", "grammar"):
        path = tmp / ("schema.json" if kind == "json_schema" else "g.lark")
        path.write_text(json.dumps(v["json_schema"]["schema"]) if kind == "json_schema" else v["grammar"])
        return ["--" + kind.replace("_", "-"), str(path)]
    return None


def text(d: Declared, v) -> str | None:
    """The value as a flag or a method option spells it; None where none does."""
    if d.kind == "bias":  # ('/' between pairs: ',' separates a bench's methods)
        return "/".join(f"{k}={b!r}" for k, b in v.items()) if isinstance(v, dict) and v else None
    if d.kind == "layers":
        return "/".join(map(str, v))
    if d.kind == "bool":
        return str(v).lower()
    return repr(v).replace("e+", "e") if d.kind == "float" else str(v)  # ('+' separates a method's options)


def api_accepts(d: Declared, v) -> bool:
    try:
        GenerateConfig.from_settings(**{**context(d), d.name: v}).validate()
    except UsageError:
        return False
    return True


def cli_accepts(d: Declared, v) -> bool | None:
    argv = ["generate", "hi"]
    for name, value in {**context(d), d.name: v}.items():
        dd = SETTINGS[name]
        if dd.kind == "format":
            flags = format_argv(value, Path(tempfile.mkdtemp()))
            if flags is None:
                return None
            argv += flags
        elif dd.kind == "bool":
            argv.append(dd.flags[0] if value else "--no-" + dd.flags[0][2:])
        elif dd.kind == "layers":
            argv += [dd.flags[0], *map(str, value)]
        elif dd.kind == "bias":  # one flag per pair (the flag repeats)
            if text(dd, value) is None:
                return None
            for pair in text(dd, value).split("/"):
                argv += [dd.flags[0], pair]
        else:
            argv += [dd.flags[0], text(dd, value)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # argparse's own refusal (a choice, a type)
        return False
    try:
        settings = from_args(args)
    except UsageError:  # a flag's text that is no value of its kind (--logit-bias x)
        return False
    return api_accepts_settings(settings)


def api_accepts_settings(settings: dict) -> bool:
    try:
        GenerateConfig.from_settings(**settings).validate()
    except UsageError:
        return False
    return True


def server_accepts(d: Declared, v) -> bool | None:
    """None where a request cannot set it (the server's own: files, the chat template)."""
    if d.spec.server is None:
        return None
    body = {"model": "m", "prompt": "hi", "viasd": dict(context(d))}
    value = list(v) if isinstance(v, tuple) else v
    if d.kind == "bias" and isinstance(v, dict):  # as JSON carries it: the keys as text
        value = {str(k): b for k, b in v.items()}
    if d.kind == "format" and value["type"] in ("regex", "grammar"):  # viasd's own: in the extension object
        body["viasd"][value["type"]] = value[value["type"]]
    elif d.spec.server == "openai":
        body["max_tokens" if d.name == "max_new_tokens" else d.name] = value
    else:
        body["viasd"][d.name] = value
    try:
        req = CompletionRequest.model_validate(body)
        config_for(req, req.max_tokens, {}, max_positions=1 << 40)
    except (APIError, ValueError):  # pydantic's ValidationError is a ValueError
        return False
    return True


def bench_accepts(d: Declared, v) -> bool | None:
    """None for the strategy itself, which a method's name gives, and for an output format (no option sets it)."""
    if d.name == "strategy" or d.kind == "format" or (d.kind == "bias" and text(d, v) is None):
        return None
    given = context(d)  # the method's name gives the strategy and mode; the setting itself is an option
    options = {n: x for n, x in given.items() if n not in ("strategy", "mode")} | {d.name: v}
    method = "+".join([_method(given) if given.get("strategy") else "ar"] + [f"{n}={text(SETTINGS[n], x)}" for n, x in options.items()])
    try:
        (_, settings), = parse_methods(method)
        GenerateConfig.from_settings(**settings).validate()
    except UsageError:
        return False
    return True


def _method(c: dict) -> str:
    return c["strategy"] + (f"-{c['mode']}" if "mode" in c else "-lossless" if c["strategy"] in VIASD else "")


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_front_end_accepts_and_refuses_the_same_values(name):
    d = SETTINGS[name]
    for v in values(d):
        api = api_accepts(d, v)
        seen = {"cli": cli_accepts(d, v), "server": server_accepts(d, v), "bench": bench_accepts(d, v)}
        differ = {k: a for k, a in seen.items() if a is not None and a != api}
        assert not differ, f"{name}={v!r}: the API {'accepts' if api else 'refuses'} it, {differ} do not"
    # the range is real: something at its edge is accepted and something past it refused
    if d.kind in ("int", "float", "choice", "layers", "bias"):
        outcomes = {api_accepts(d, v) for v in values(d)}
        assert outcomes == {True, False}, name


def test_every_front_end_starts_from_the_declared_defaults():
    declared = {n: d.default for n, d in SETTINGS.items()}
    assert GenerateConfig().settings() == declared
    generate = from_args(build_parser().parse_args(["generate"]))
    assert generate == declared
    serve = from_args(build_parser().parse_args(["serve"]))
    assert serve == {n: v for n, v in declared.items() if n != "chat"}
    bench = from_args(build_parser().parse_args(["bench"]))
    assert bench and all(declared[n] == v for n, v in bench.items())
    # a request that sets nothing decodes with the server's defaults: the declared ones for a plain `viasd serve`
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    assert config_for(req, None, serve, max_positions=1 << 20) == serve


def test_the_strategy_names_are_the_registrys():
    from viasd.decoding.registry import STRATEGIES
    from viasd.server.schemas import ViasdExtension

    assert SETTINGS["strategy"].spec.choices == tuple(STRATEGIES)
    assert set(ViasdExtension.model_fields["strategy"].annotation.__args__[0].__args__) == set(STRATEGIES)
