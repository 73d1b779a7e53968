"""Which route a request runs: given layers, a route file, the shipped searched route, or a default."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from viasd.errors import UsageError
from viasd.models.kvcache import LayerMask
from viasd.routing.route import ModelFingerprint, Route, RouteError, shipped_route, shipped_route_path

if TYPE_CHECKING:
    from viasd.models.loading import LoadedModel
    from viasd.models.layers import ReducedHead


def default_draft_layers(n_layers: int) -> tuple[int, ...]:
    """Drafting route until a searched one is given or shipped: the first half of the layers plus
    the last one (early exit as LayerSkip drafts, with the last layer so the head sees a final state)."""
    return tuple(range(n_layers // 2)) + (n_layers - 1,)


def default_slim_layers(n_layers: int) -> tuple[int, ...]:
    """Slim route until a searched one is given or shipped: every layer but the odd ones of the middle third."""
    return tuple(i for i in range(n_layers) if not (n_layers // 3 <= i < 2 * n_layers // 3 and i % 2))


class Resolved(NamedTuple):
    mask: LayerMask
    path: Path | None  # the route file (None: given layers or the default)
    vocab: tuple[int, ...] | None  # the reduced head's vocabulary the file stores


def resolve_route(model: LoadedModel, role: str, layers: Sequence[int] | None, route_file: str | None) -> Resolved:
    """(mask, route file, its head's vocabulary) for role "draft" or "slim": given layers, a route
    file, else the shipped searched route for this model, else the default layers. Each file is read
    once (the shipped ones once per process)."""
    n = model.config.n_layers
    fingerprint = ModelFingerprint.of(model)
    if route_file is not None:
        route = Route.load(route_file, fingerprint)
        return Resolved(route.mask, Path(route_file), route.vocab)
    if layers is None:
        shipped = shipped_route_path(fingerprint, role)
        if shipped is not None:
            found = shipped_route(fingerprint, role)
            assert found is not None  # (its file was found just now)
            return Resolved(found.mask, shipped, found.vocab)
        layers = default_draft_layers(n) if role == "draft" else default_slim_layers(n)
    layers = tuple(layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise UsageError(f"{role} layers {bad} out of range: {model.name} has layers 0..{n - 1}")
    if not layers:
        raise UsageError(f"a {role} route must keep at least one layer")
    return Resolved(LayerMask.from_layers(n, layers), None, None)


def draft_route(model: LoadedModel, layers: Sequence[int] | None, route_file: str | None = None) -> LayerMask:
    return resolve_route(model, "draft", layers, route_file).mask


def route_head(model: LoadedModel, resolved: Resolved) -> ReducedHead | None:
    """The reduced LM head of the vocabulary a resolved route stores, on `model`'s decoder (None: it
    stores none, or the decoder has no reduced heads: T5)."""
    vocab = resolved.vocab
    if vocab is None or not hasattr(model.decoder, "reduced_head"):
        return None
    if vocab[-1] >= model.decoder.lm_head.out_features:
        raise RouteError(f"{resolved.path}: vocabulary ids reach {vocab[-1]}, past {model.name}'s {model.decoder.lm_head.out_features}")
    return model.decoder.reduced_head(vocab)


def slim_vocab(verifier: LoadedModel) -> tuple[int, ...] | None:
    """The vocabulary of the verifier's shipped slim route (None: no such route, or it stores none)."""
    route = shipped_route(ModelFingerprint.of(verifier), "slim")
    return route.vocab if route is not None else None


def drafter_head(verifier: LoadedModel, drafter: LoadedModel) -> ReducedHead | None:
    """A drafter model's reduced LM head(for drafting passes): the vocabulary of
    the verifier's shipped slim route, the calibration corpus' most frequent tokens, which a drafter
    with the same tokenizer shares (None: no shipped route with a vocabulary, or a drafter without
    reduced heads). A small drafter spends a larger share of its pass on the head than its verifier
    does (qwen2.5-coder-0.5b: 136M of its 494M parameters)."""
    vocab = slim_vocab(verifier)
    if vocab is None or not hasattr(drafter.decoder, "reduced_head") or vocab[-1] >= drafter.decoder.lm_head.out_features:
        return None
    return drafter.decoder.reduced_head(vocab)
