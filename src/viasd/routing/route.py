"""The Route value object: a layer mask bound to the model it was made for, with its metrics.

A route is data: the runtime takes its `mask` as an argument of the forward pass and never
changes the model. Saved as JSON (atomically: temporary file + rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from viasd.errors import UsageError
from viasd.models.runtime import LayerMask

FORMAT = "viasd-route/1"


class RouteError(UsageError):
    pass


@dataclass(frozen=True)
class ModelFingerprint:
    """What a route must match: the model's name, architecture, depth and weight hash."""

    source: str
    architecture: str
    n_layers: int
    sha256: str | None = None  # of the source GGUF (zoo / GGUF); None for transformers directories

    @classmethod
    def of(cls, model) -> "ModelFingerprint":
        """From a `LoadedModel`."""
        return cls(model.name, model.config.architecture, model.config.n_layers, model.source_sha256)

    def mismatch(self, other: "ModelFingerprint") -> str | None:
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

    def __post_init__(self):
        n = self.model.n_layers
        if len(self.attn) == 0 and len(self.mlp) == 0:
            raise RouteError("empty route mask: it must name every layer of the model")
        if len(self.attn) != n or len(self.mlp) != n:
            raise RouteError(f"route mask has {len(self.attn)} attention / {len(self.mlp)} MLP entries, the model has {n} layers")
        if not any(self.attn) and not any(self.mlp):
            raise RouteError("route skips every layer: it must keep at least one")

    @classmethod
    def from_layers(cls, model: ModelFingerprint, kept, **kw) -> "Route":
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
        return {"format": FORMAT, **asdict(self), "attn": [int(a) for a in self.attn], "mlp": [int(m) for m in self.mlp]}

    @classmethod
    def from_dict(cls, d: dict) -> "Route":
        if d.get("format") != FORMAT:
            raise RouteError(f"not a viasd route (format {d.get('format')!r}, expected {FORMAT!r})")
        try:
            return cls(
                model=ModelFingerprint(**d["model"]),
                attn=tuple(bool(x) for x in d["attn"]),
                mlp=tuple(bool(x) for x in d["mlp"]),
                budget=d.get("budget"),
                metrics=d.get("metrics", {}),
                search=d.get("search", {}),
            )
        except (KeyError, TypeError) as e:
            raise RouteError(f"malformed route: {type(e).__name__}: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path, model: ModelFingerprint | None = None) -> "Route":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RouteError(f"{path}: no such route file") from None
        except (OSError, ValueError) as e:
            raise RouteError(f"{path}: not a readable route JSON ({e})") from None
        route = cls.from_dict(data)
        if model is not None:
            route.check_model(model)
        return route


ROLES = ("slim", "draft")


def shipped_route_path(model: ModelFingerprint, role: str) -> Path | None:
    """The searched route shipped with viasd for `model` (matched by weight hash) and `role`
    ("slim": the slim verifier, "draft": a self-drafting route), or None."""
    if role not in ROLES:
        raise ValueError(f"unknown route role {role!r}: {', '.join(ROLES)}")
    for path in sorted((Path(__file__).parent / "shipped").glob(f"*.{role}.json")):
        if Route.from_dict(json.loads(path.read_text())).model.mismatch(model) is None:
            return path
    return None


def shipped_route(model: ModelFingerprint, role: str) -> Route | None:
    path = shipped_route_path(model, role)
    return Route.load(path) if path else None
