"""The Route value object: a layer mask bound to the model it was made for, with its metrics.

A route is data: the runtime takes its `mask` as an argument of the forward pass and never
changes the model. Saved as JSON (atomically: temporary file + rename).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from viasd.errors import MalformedFileError
from viasd.models.kvcache import LayerMask
from viasd.validation import atomic_write_text, dumps_strict, read_json

FORMAT = "viasd-route/1"


class RouteError(MalformedFileError):
    """A route file that is missing, not JSON, of the wrong shape, or made for another model."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What a route must match: the model's name, architecture, depth and weight hash."""

    source: str
    architecture: str
    n_layers: int
    sha256: str | None = None  # of the source GGUF (zoo / GGUF); None for transformers directories

    @classmethod
    def of(cls, model) -> ModelFingerprint:
        """From a `LoadedModel`."""
        return cls(model.name, model.config.architecture, model.config.n_layers, model.source_sha256)

    def mismatch(self, other: ModelFingerprint) -> str | None:
        """Why `other` is not this model, or None."""
        if self.architecture != other.architecture or self.n_layers != other.n_layers:
            return f"{other.architecture} with {other.n_layers} layers, not {self.architecture} with {self.n_layers}"
        if self.sha256 and other.sha256 and self.sha256 != other.sha256:
            return f"weights sha256 {other.sha256[:12]}…, not {self.sha256[:12]}…"
        if not (self.sha256 and other.sha256) and self.source != other.source:
            return f"model {other.source!r}, not {self.source!r}"
        return None


@dataclass(frozen=True)
class Route:
    model: ModelFingerprint
    attn: tuple[bool, ...]  # [n_layers] attention sub-layer i runs
    mlp: tuple[bool, ...]  # [n_layers] MLP sub-layer i runs
    budget: float | None = None  # the compute budget it was searched under (fraction of sub-layers)
    metrics: dict = field(default_factory=dict)  # e.g. {"kl": .., "top1_agreement": ..}
    search: dict = field(default_factory=dict)  # how it was found: seed, trials, calibration, time_s
    # the reduced LM head's vocabulary: ascending token ids (None: the full head); see routing/vocab.py
    vocab: tuple[int, ...] | None = None

    def __post_init__(self):
        n = self.model.n_layers
        if len(self.attn) == 0 and len(self.mlp) == 0:
            raise RouteError("empty route mask: it must name every layer of the model")
        if len(self.attn) != n or len(self.mlp) != n:
            raise RouteError(f"route mask has {len(self.attn)} attention / {len(self.mlp)} MLP entries, the model has {n} layers")
        if not any(self.attn) and not any(self.mlp):
            raise RouteError("route skips every layer: it must keep at least one")

    @classmethod
    def from_layers(cls, model: ModelFingerprint, kept, **kw) -> Route:
        mask = LayerMask.from_layers(model.n_layers, list(kept))
        return cls(model, mask.attn, mask.mlp, **kw)

    @property
    def mask(self) -> LayerMask:
        return LayerMask(self.attn, self.mlp)

    @property
    def fraction(self) -> float:
        return self.mask.fraction

    @property
    def kept_layers(self) -> list[int]:
        return [i for i, (a, m) in enumerate(zip(self.attn, self.mlp)) if a or m]

    def picture(self) -> str:
        """One character per layer: █ both sub-layers, a attention only, m MLP only, · skipped."""
        return "".join("█" if a and m else "a" if a else "m" if m else "·" for a, m in zip(self.attn, self.mlp))

    def check_model(self, model: ModelFingerprint) -> None:
        why = self.model.mismatch(model)
        if why:
            raise RouteError(f"route was made for {self.model.source} ({self.model.architecture}, {self.model.n_layers} layers) "
                             f"and cannot be used with {model.source}: {why}")

    def to_dict(self) -> dict:
        d = {"format": FORMAT, **asdict(self), "attn": [int(a) for a in self.attn], "mlp": [int(m) for m in self.mlp]}
        if self.vocab is None:
            del d["vocab"]
        else:
            d["vocab"] = list(self.vocab)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Route:
        """Every field checked for shape and type: a mask entry is true/false or 1/0, never a
        string (bool("0") is True)."""
        if not isinstance(d, dict):
            raise RouteError(f"not a viasd route: a JSON object was expected, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise RouteError(f"not a viasd route (format {d.get('format')!r}, expected {FORMAT!r})")
        m = d.get("model")
        if (not isinstance(m, dict) or not {"source", "architecture", "n_layers"} <= set(m)
                or set(m) - {"source", "architecture", "n_layers", "sha256"}):
            raise RouteError("malformed route: 'model' must be an object with source, architecture, n_layers (and sha256)")
        if not isinstance(m["source"], str) or not isinstance(m["architecture"], str):
            raise RouteError("malformed route: model.source and model.architecture must be strings")
        if isinstance(m["n_layers"], bool) or not isinstance(m["n_layers"], int) or not 1 <= m["n_layers"] <= 4096:
            raise RouteError(f"malformed route: model.n_layers must be a positive integer, got {m['n_layers']!r}")
        if m.get("sha256") is not None and not isinstance(m["sha256"], str):
            raise RouteError("malformed route: model.sha256 must be a string or null")
        masks = {}
        for key in ("attn", "mlp"):
            v = d.get(key)
            if not isinstance(v, list):
                raise RouteError(f"malformed route: '{key}' must be a list of true/false (or 1/0), got {type(v).__name__}")
            bad = [x for x in v if not (x is True or x is False or (type(x) is int and x in (0, 1)))]
            if bad:
                raise RouteError(f"malformed route: '{key}' entries must be true/false or 1/0, got {bad[0]!r}")
            masks[key] = tuple(bool(x) for x in v)
        budget = d.get("budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
            raise RouteError(f"malformed route: budget must be a number in (0, 1] or null, got {budget!r}")
        for key in ("metrics", "search"):
            if not isinstance(d.get(key, {}), dict):
                raise RouteError(f"malformed route: '{key}' must be an object")
        vocab = d.get("vocab")
        if vocab is not None:
            if (not isinstance(vocab, list) or not vocab or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in vocab)
                    or any(a >= b for a, b in zip(vocab, vocab[1:]))):
                raise RouteError("malformed route: 'vocab' must be a non-empty list of ascending token ids")
            vocab = tuple(vocab)
        return cls(model=ModelFingerprint(**m), attn=masks["attn"], mlp=masks["mlp"], budget=budget,
                   metrics=dict(d.get("metrics", {})), search=dict(d.get("search", {})), vocab=vocab)

    def save(self, path: str | Path) -> Path:
        d = self.to_dict()
        vocab = d.pop("vocab", None)
        text = dumps_strict(d, indent=1)
        if vocab is not None:  # thousands of ids: on one line
            text = text[: text.rindex("}")].rstrip() + ',\n "vocab": ' + dumps_strict(vocab) + "\n}"
        return atomic_write_text(path, text + "\n")

    @classmethod
    def load(cls, path: str | Path, model: ModelFingerprint | None = None) -> Route:
        path = Path(path)
        data = read_json(path, "route", RouteError)
        try:
            route = cls.from_dict(data)
        except RouteError as e:
            raise RouteError(f"{path}: {e}") from None
        if model is not None:
            route.check_model(model)
        return route


ROLES = ("slim", "draft")


@functools.cache
def _shipped(role: str) -> tuple[tuple[Path, Route], ...]:
    """Every route shipped for `role`, read once per process (package data: they never change)."""
    return tuple((path, Route.from_dict(json.loads(path.read_text())))
                 for path in sorted((Path(__file__).parent / "shipped").glob(f"*.{role}.json")))


def _shipped_match(model: ModelFingerprint, role: str) -> tuple[Path, Route] | None:
    if role not in ROLES:
        raise ValueError(f"unknown route role {role!r}: {', '.join(ROLES)}")
    return next(((path, route) for path, route in _shipped(role) if route.model.mismatch(model) is None), None)


def shipped_route_path(model: ModelFingerprint, role: str) -> Path | None:
    """The searched route shipped with viasd for `model` (matched by weight hash) and `role`
    ("slim": the slim verifier, "draft": a self-drafting route), or None."""
    found = _shipped_match(model, role)
    return found[0] if found else None


def shipped_route(model: ModelFingerprint, role: str) -> Route | None:
    found = _shipped_match(model, role)
    return found[1] if found else None
