"""Route value object: JSON round trip, bad inputs, and use as a drafting route."""

from __future__ import annotations

import json

import pytest

from viasd import generate
from viasd.cli import main
from viasd.routing import ModelFingerprint, Route, RouteError

SMOL = ModelFingerprint("smollm2-135m", "llama", 30, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")


def test_json_round_trip(tmp_path):
    route = Route(SMOL, attn=(True,) * 10 + (False,) * 20, mlp=(True,) * 5 + (False,) * 25, budget=0.25,
                  metrics={"kl": 0.5, "top1_agreement": 0.8}, search={"seed": 1, "trials": 100})
    path = route.save(tmp_path / "r.json")
    assert Route.load(path, SMOL) == route
    assert json.loads(path.read_text())["format"] == "viasd-route/1"
    assert route.picture() == "█" * 5 + "a" * 5 + "·" * 20
    assert route.kept_layers == list(range(10)) and route.fraction == pytest.approx(15 / 60)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    "attn, mlp, message",
    [
        ((), (), "empty route mask"),
        ((True,) * 29, (True,) * 29, "route mask has 29 attention / 29 MLP entries, the model has 30 layers"),
        ((False,) * 30, (False,) * 30, "route skips every layer"),
    ],
)
def test_bad_masks(attn, mlp, message):
    with pytest.raises(RouteError, match=message):
        Route(SMOL, attn, mlp)


def test_route_for_another_model(tmp_path):
    path = Route.from_layers(SMOL, range(15)).save(tmp_path / "r.json")
    qwen = ModelFingerprint("qwen2.5-coder-1.5b", "qwen2", 28, "cc324af0" + "0" * 56)
    with pytest.raises(RouteError, match="route was made for smollm2-135m .* cannot be used with qwen2.5-coder-1.5b"):
        Route.load(path, qwen)
    other_weights = ModelFingerprint("my.gguf", "llama", 30, "0" * 64)
    with pytest.raises(RouteError, match="weights sha256"):
        Route.load(path, other_weights)


def test_unreadable_files(tmp_path):
    with pytest.raises(RouteError, match="no such route file"):
        Route.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RouteError, match="not a readable route JSON"):
        Route.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(RouteError, match="not a viasd route"):
        Route.load(tmp_path / "other.json")


def test_routes_show(tmp_path, capsys):
    path = Route.from_layers(SMOL, [0, 1, 2, 29], budget=0.15, metrics={"kl": 0.25}).save(tmp_path / "r.json")
    assert main(["routes", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "███" + "·" * 26 + "█" in out and "4/30 layers" in out and "kl              0.25" in out
    assert main(["routes", "show", str(tmp_path / "nope.json")]) == 2
    assert "no such route file" in capsys.readouterr().err


def test_route_file_drives_self_sd(tiny, tmp_path):
    fp = ModelFingerprint.of(tiny)
    path = Route.from_layers(fp, [0, 3]).save(tmp_path / "tiny.json")
    # (a fixed k: adaptive draft lengths follow measured times, so their call counts may differ run to run)
    by_file = generate([1, 2, 3], tiny, strategy="self-sd", draft_route=str(path), max_new_tokens=12, adapt_k=False)
    by_layers = generate([1, 2, 3], tiny, strategy="self-sd", draft_layers=(0, 3), max_new_tokens=12, adapt_k=False)
    assert by_file.token_ids == by_layers.token_ids
    assert by_file.stats.to_dict()["verifier_layer_passes_per_token"] == by_layers.stats.to_dict()["verifier_layer_passes_per_token"]
    wrong = Route.from_layers(SMOL, [0]).save(tmp_path / "smol.json")
    with pytest.raises(RouteError, match="cannot be used with"):
        generate([1, 2, 3], tiny, strategy="self-sd", draft_route=str(wrong), max_new_tokens=4)


def test_shipped_routes_belong_to_zoo_models():
    from pathlib import Path

    import viasd.routing
    from viasd.models.zoo import ZOO

    shipped = sorted((Path(viasd.routing.__file__).parent / "shipped").glob("*.json"))
    assert {p.name for p in shipped} >= {"smollm2-135m.slim.json", "smollm2-135m.draft.json"}
    for path in shipped:
        if path.name.endswith(".thresholds.json"):
            continue
        route = Route.load(path)
        entry = ZOO[route.model.source]
        # (the zoo names the GGUF's architecture; a route, the converted config's: gemma3 -> gemma3_text)
        gguf_to_hf = {"gemma3": "gemma3_text"}
        assert route.model.sha256 == entry.sha256
        assert route.model.architecture == gguf_to_hf.get(entry.architecture, entry.architecture)
        assert route.search["trials"] >= 20 and "kl" in route.metrics


@pytest.mark.model
def test_shipped_routes_are_the_defaults(smollm2):
    from viasd.routing.resolve import draft_route
    from viasd.routing import shipped_route

    fp = ModelFingerprint.of(smollm2)
    slim, draft = shipped_route(fp, "slim"), shipped_route(fp, "draft")
    assert draft_route(smollm2, None) == draft.mask  # self-sd drafts with the shipped route
    r = generate("Name a colour.", smollm2, strategy="viasd", max_new_tokens=4)
    assert r.config["slim_fraction"] == round(slim.fraction, 4)
