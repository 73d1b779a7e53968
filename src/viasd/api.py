"""The public Python API: one call = one request.

    >>> from viasd import generate
    >>> result = generate("Write a haiku about the sea.", strategy="viasd", mode="lossless")
    >>> result.text, result.stats.to_dict()["tokens_per_s"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from viasd.decoding.acceptance import DEFERRAL_RULES, SamplingParams, TierThresholds
from viasd.decoding.multitier import viasd_lossless_decode, viasd_tiered_decode
from viasd.decoding.stats import DecodeResult, DecodeStats
from viasd.decoding.strategies import DecodeRequest, autoregressive_decode, speculative_decode
from viasd.decoding.drafters import Drafter, ModelDrafter, NgramDrafter, SelfDrafter
from viasd.errors import UsageError
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model
from viasd.models.runtime import LayerMask
from viasd.models.zoo import DEFAULT_MODEL
from viasd.validation import (check_generate_config, check_text, check_thresholds, check_token_ids, preflight_files, read_json,
                              require_dict)

STRATEGIES = {
    "ar": "autoregressive decoding (the baseline)",
    "sd": "speculative decoding with a separate drafter model (--drafter)",
    "pld": "speculative decoding with prompt-lookup n-gram drafts (no drafter model)",
    "self-sd": "speculative decoding drafting with a route of the verifier's own layers",
    "cascade": "speculative cascades (Narasimhan et al. 2024): Chow / Diff / OPT deferral, then SD (lossy)",
    "viasd": "VIA-SD: drafter -> slim verifier (a route) -> full verifier; --mode lossless or tiered",
}
DEFAULT_STRATEGY = "pld"
MODES = ("lossless", "tiered")
DRAFT_KINDS = ("auto", "model", "pld", "self")


@dataclass(frozen=True)
class GenerateConfig:
    """Every setting of one request (echoed into the result record)."""

    strategy: str = DEFAULT_STRATEGY
    k: int = 4  # draft tokens per verification round (the most, with draft_threshold)
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    chat: bool | None = None  # None: use the chat template when the model has one
    draft_threshold: float | None = None  # adaptive drafting: stop below this top probability
    draft: str = "auto"  # drafter kind for viasd / cascade: model (--drafter), pld, self; auto picks
    draft_layers: tuple[int, ...] | None = None  # self drafting: verifier layers the drafter keeps
    draft_route: str | None = None  # self drafting: a route JSON file (instead of draft_layers)
    max_ngram: int = 3
    min_ngram: int = 1
    # viasd
    mode: str = "lossless"
    slim_layers: tuple[int, ...] | None = None  # slim verifier: kept layers (default: shipped route)
    slim_route: str | None = None  # slim verifier: a route JSON file
    full_block: int = 8  # lossless: slim-verified tokens per full-model check
    thresholds: str | None = None  # tiered: a JSON file of TierThresholds fields
    accept: float | None = None  # tiered threshold overrides (TierThresholds)
    accept_draft: float | None = None
    accept_tv: float | None = None
    slim: float | None = None
    slim_entropy: float | None = None
    # cascade
    rule: str = "opt"
    alpha: float = 0.1

    def validate(self) -> None:
        check_generate_config(self)  # types, NaN / inf, seed and value ranges (viasd.validation)
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {self.strategy!r}: choose from {', '.join(STRATEGIES)}")
        if not 0 <= self.k <= 64:
            raise UsageError(f"k must be between 0 and 64, got {self.k}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.draft_threshold is not None and not 0 <= self.draft_threshold <= 1:
            raise UsageError(f"draft_threshold must be in [0, 1], got {self.draft_threshold}")
        if self.draft_layers is not None and self.draft_route is not None:
            raise UsageError("give either draft_layers or draft_route, not both")
        if self.slim_layers is not None and self.slim_route is not None:
            raise UsageError("give either slim_layers or slim_route, not both")
        if self.draft not in DRAFT_KINDS:
            raise UsageError(f"unknown drafter kind {self.draft!r}: choose from {', '.join(DRAFT_KINDS)}")
        if self.mode not in MODES:
            raise UsageError(f"unknown mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.rule not in DEFERRAL_RULES:
            raise UsageError(f"unknown deferral rule {self.rule!r}: choose from {', '.join(DEFERRAL_RULES)}")
        if self.full_block < 1:
            raise UsageError(f"full_block must be >= 1, got {self.full_block}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")

    def tier_thresholds(self, beside: Path | None = None) -> TierThresholds:
        """Defaults <- a thresholds file (given, or found beside the slim route) <- explicit overrides."""
        values = TierThresholds().to_dict()
        path = Path(self.thresholds) if self.thresholds else beside
        if path is not None and (self.thresholds or path.exists()):
            values.update(load_thresholds(path))
        for name in values:
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return TierThresholds(**values)


def load_thresholds(path: Path) -> dict:
    data = require_dict(read_json(path, "thresholds"), path, "thresholds")
    data = require_dict(data.get("thresholds", data), path, "thresholds")
    known = TierThresholds().to_dict()
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"{path}: unknown threshold(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return check_thresholds(data, path)


def default_draft_layers(n_layers: int) -> tuple[int, ...]:
    """Drafting route until a searched one is given or shipped: the first half of the layers plus
    the last one (early exit as LayerSkip drafts, with the last layer so the head sees a final state)."""
    return tuple(range(n_layers // 2)) + (n_layers - 1,)


def default_slim_layers(n_layers: int) -> tuple[int, ...]:
    """Slim route until a searched one is given or shipped: every layer but the odd ones of the middle third."""
    return tuple(i for i in range(n_layers) if not (n_layers // 3 <= i < 2 * n_layers // 3 and i % 2))


def resolve_route(model: LoadedModel, role: str, layers: Sequence[int] | None, route_file: str | None) -> tuple[LayerMask, Path | None]:
    """(mask, route file) for role "draft" or "slim": given layers, a route file, else the shipped
    searched route for this model, else the default layers."""
    from viasd.routing import ModelFingerprint, Route
    from viasd.routing.route import shipped_route_path

    n = model.config.n_layers
    fingerprint = ModelFingerprint.of(model)
    if route_file is not None:
        return Route.load(route_file, fingerprint).mask, Path(route_file)
    if layers is None:
        shipped = shipped_route_path(fingerprint, role)
        if shipped is not None:
            return Route.load(shipped).mask, shipped
        layers = default_draft_layers(n) if role == "draft" else default_slim_layers(n)
    layers = tuple(layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise UsageError(f"{role} layers {bad} out of range: {model.name} has layers 0..{n - 1}")
    if not layers:
        raise UsageError(f"a {role} route must keep at least one layer")
    return LayerMask.from_layers(n, layers), None


def draft_route(model: LoadedModel, layers: Sequence[int] | None, route_file: str | None = None) -> LayerMask:
    return resolve_route(model, "draft", layers, route_file)[0]


def _as_model(model: str | LoadedModel, progress: bool) -> LoadedModel:
    if not isinstance(model, (str, LoadedModel)) or (isinstance(model, str) and not model):
        raise UsageError(f"model must be a model name or path (str) or a LoadedModel, got {model!r}")
    return model if isinstance(model, LoadedModel) else load_model(model, progress=progress)


class TextStream:
    """Turns token ids into text increments, holding back incomplete UTF-8 sequences."""

    def __init__(self, model: LoadedModel, emit: Callable[[str], None]):
        self.model, self.emit = model, emit
        self.ids: list[int] = []
        self.sent = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.model.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        if len(text) > self.sent:
            self.emit(text[self.sent :])
            self.sent = len(text)


def _draft_kind(config: GenerateConfig, has_model: bool) -> str:
    fixed = {"sd": "model", "pld": "pld", "self-sd": "self"}
    if config.strategy in fixed:
        if config.draft not in ("auto", fixed[config.strategy]):
            raise UsageError(f"strategy {config.strategy!r} drafts with {fixed[config.strategy]!r}, not {config.draft!r}")
        return fixed[config.strategy]
    if config.draft != "auto":
        return config.draft
    if has_model:
        return "model"
    return "self" if config.strategy == "cascade" else "pld"


def _make_drafter(kind: str, verifier: LoadedModel, drafter: str | LoadedModel | None, config: GenerateConfig,
                  params: SamplingParams, generator: torch.Generator, progress: bool) -> Drafter:
    if kind == "model":
        draft_model = _as_model(drafter, progress)
        check_same_vocabulary(verifier, draft_model)
        return ModelDrafter(draft_model.decoder, params, generator, config.draft_threshold)
    if kind == "pld":
        return NgramDrafter(config.max_ngram, config.min_ngram)
    route = draft_route(verifier, config.draft_layers, config.draft_route)
    return SelfDrafter(verifier.decoder, route, params, generator, config.draft_threshold)


def check_messages(messages: Sequence[dict]) -> list[dict[str, str]]:
    """A conversation as chat messages, checked: roles user/assistant/system, string contents,
    ending with a user turn (the model answers it)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in ("user", "assistant", "system") or not isinstance(m["content"], str):
            raise UsageError(f"message {i}: expected {{'role': 'user'|'assistant'|'system', 'content': str}}, got {m!r}")
        check_text(f"message {i} content", m["content"])
    if messages[-1]["role"] != "user":
        raise UsageError("a conversation must end with a user message for the model to answer")
    return [dict(m) for m in messages]


def generate(
    prompt: str | Sequence[int] | list[dict[str, str]],
    model: str | LoadedModel = DEFAULT_MODEL,
    *,
    drafter: str | LoadedModel | None = None,
    config: GenerateConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    progress: bool = True,
    **settings,
) -> DecodeResult:
    """Generate a continuation of `prompt`: text (one user turn), a conversation as chat messages
    (`[{"role": "user", "content": ...}, {"role": "assistant", ...}, {"role": "user", ...}]`), or
    token ids used as they are.

    Settings are `GenerateConfig` fields, given as `config=` or as keywords (`strategy="viasd"`,
    `mode="tiered"`, `k=4`, `temperature=0.7`, ...). `on_text` receives the text as it is produced.
    """
    unknown = set(settings) - {f.name for f in fields(GenerateConfig)}
    if unknown:
        raise UsageError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    if config is not None and not isinstance(config, GenerateConfig):
        raise UsageError(f"config must be a GenerateConfig, got {type(config).__name__}")
    if config is not None and settings:
        raise UsageError("give settings either as config= or as keywords, not both")
    config = config or GenerateConfig(**settings)
    config.validate()
    if config.strategy == "ar" and drafter is not None:
        raise UsageError("strategy 'ar' uses no drafter")
    kind = _draft_kind(config, drafter is not None) if config.strategy != "ar" else None
    if kind == "model" and drafter is None:
        raise UsageError(f"strategy {config.strategy!r} needs a drafter model (--drafter), "
                         "e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    if kind not in (None, "model") and drafter is not None:
        raise UsageError(f"a drafter model is only used with model drafting (--draft model), not {kind!r} "
                         f"drafting (strategy {config.strategy!r})")
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        check_messages(prompt)
    else:
        check_token_ids(prompt)  # types before the model loads; the vocabulary bound after
    if on_text is not None and not callable(on_text):
        raise UsageError(f"on_text must be callable, got {on_text!r}")
    preflight_files(config)
    verifier = _as_model(model, progress)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        ids = verifier.encode(prompt, config.chat)
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        ids = verifier.encode(check_messages(prompt), config.chat)
    else:
        ids = check_token_ids(prompt, verifier.config.vocab_size)
    if len(ids) + config.max_new_tokens + config.k + config.full_block + 2 > verifier.config.max_positions:
        raise UsageError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's {verifier.config.max_positions} positions"
        )
    generator = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(config.temperature, config.top_p)
    stats = DecodeStats(prompt_tokens=len(ids))
    stream = TextStream(verifier, on_text) if on_text else None
    req = DecodeRequest(ids, config.max_new_tokens, params, verifier.eos_token_ids, stats, generator, stream)
    record = {"model": verifier.name, "drafter": getattr(drafter, "name", drafter), **asdict(config), "draft": kind}
    if config.strategy == "ar":
        out = autoregressive_decode(verifier.decoder, req)
    else:
        chosen = _make_drafter(kind, verifier, drafter, config, params, generator, progress)
        if config.strategy == "viasd":
            slim, slim_file = resolve_route(verifier, "slim", config.slim_layers, config.slim_route)
            record["slim_fraction"] = round(slim.fraction, 4)
            if config.mode == "lossless":
                out = viasd_lossless_decode(verifier.decoder, chosen, slim, req, config.k, config.full_block)
            else:
                beside = slim_file.with_suffix(".thresholds.json") if slim_file else None
                thresholds = config.tier_thresholds(beside)
                record["tier_thresholds"] = thresholds.to_dict()
                out = viasd_tiered_decode(verifier.decoder, chosen, slim, req, config.k, thresholds)
        else:
            cascade = (config.rule, config.alpha) if config.strategy == "cascade" else None
            out = speculative_decode(verifier.decoder, chosen, req, config.k, cascade)
    stats.finish()
    return DecodeResult(text=verifier.decode(out), token_ids=out, stats=stats, config=record)
