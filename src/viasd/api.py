"""The public Python API: one call = one request.

    >>> from viasd import generate
    >>> result = generate("Write a haiku about the sea.", strategy="pld")
    >>> result.text, result.stats.to_dict()["tokens_per_s"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.stats import DecodeResult, DecodeStats
from viasd.decoding.strategies import DecodeRequest, autoregressive_decode, speculative_decode
from viasd.drafters import ModelDrafter, NgramDrafter, SelfDrafter
from viasd.errors import UsageError
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model
from viasd.models.runtime import LayerMask
from viasd.models.zoo import DEFAULT_MODEL

STRATEGIES = {
    "ar": "autoregressive decoding (the baseline)",
    "sd": "speculative decoding with a separate drafter model (--drafter)",
    "pld": "speculative decoding with prompt-lookup n-gram drafts (no drafter model)",
    "self-sd": "speculative decoding drafting with a route of the verifier's own layers",
}
DEFAULT_STRATEGY = "pld"


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
    draft_layers: tuple[int, ...] | None = None  # self-sd: verifier layers the drafter keeps
    draft_route: str | None = None  # self-sd: a route JSON file (instead of draft_layers)
    max_ngram: int = 3
    min_ngram: int = 1

    def validate(self) -> None:
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
        if (self.draft_layers is not None or self.draft_route is not None) and self.strategy != "self-sd":
            raise UsageError(f"a drafting route is only used by strategy 'self-sd', not {self.strategy!r}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


def default_draft_layers(n_layers: int) -> tuple[int, ...]:
    """Drafting route until searched routes ship: the first half of the layers plus the last one
    (early exit, as LayerSkip drafts, with the last layer kept so the LM head sees a final-layer state)."""
    return tuple(range(n_layers // 2)) + (n_layers - 1,)


def draft_route(model: LoadedModel, layers: Sequence[int] | None, route_file: str | None = None) -> LayerMask:
    if route_file is not None:
        from viasd.routing import ModelFingerprint, Route

        return Route.load(route_file, ModelFingerprint.of(model)).mask
    n = model.config.n_layers
    layers = default_draft_layers(n) if layers is None else tuple(layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise UsageError(f"draft layers {bad} out of range: {model.name} has layers 0..{n - 1}")
    if not layers:
        raise UsageError("a drafting route must keep at least one layer")
    return LayerMask.from_layers(n, layers)


def _as_model(model: str | LoadedModel, progress: bool) -> LoadedModel:
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


def generate(
    prompt: str | Sequence[int],
    model: str | LoadedModel = DEFAULT_MODEL,
    *,
    drafter: str | LoadedModel | None = None,
    config: GenerateConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    progress: bool = True,
    **settings,
) -> DecodeResult:
    """Generate a continuation of `prompt` (text, or token ids used as they are).

    Settings are `GenerateConfig` fields, given as `config=` or as keywords (`strategy="sd"`, `k=4`,
    `temperature=0.7`, ...). `on_text` receives the text as it is produced.
    """
    config = config or GenerateConfig(**settings)
    config.validate()
    if config.strategy == "sd" and drafter is None:
        raise UsageError("strategy 'sd' needs a drafter model (--drafter), e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    if config.strategy != "sd" and drafter is not None:
        raise UsageError(f"a drafter model is only used by strategy 'sd', not {config.strategy!r}")
    verifier = _as_model(model, progress)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        ids = verifier.encode(prompt, config.chat)
    else:
        ids = [int(t) for t in prompt]
        if not ids:
            raise UsageError("the prompt is empty")
    if len(ids) + config.max_new_tokens + config.k + 1 > verifier.config.max_positions:
        raise UsageError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's {verifier.config.max_positions} positions"
        )
    generator = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(config.temperature, config.top_p)
    stats = DecodeStats(prompt_tokens=len(ids))
    stream = TextStream(verifier, on_text) if on_text else None
    req = DecodeRequest(ids, config.max_new_tokens, params, verifier.eos_token_ids, stats, generator, stream)
    if config.strategy == "ar":
        out = autoregressive_decode(verifier.decoder, req)
    else:
        if config.strategy == "sd":
            draft_model = _as_model(drafter, progress)
            check_same_vocabulary(verifier, draft_model)
            chosen = ModelDrafter(draft_model.decoder, params, generator, config.draft_threshold)
        elif config.strategy == "pld":
            chosen = NgramDrafter(config.max_ngram, config.min_ngram)
        else:  # self-sd
            route = draft_route(verifier, config.draft_layers, config.draft_route)
            chosen = SelfDrafter(verifier.decoder, route, params, generator, config.draft_threshold)
        out = speculative_decode(verifier.decoder, chosen, req, config.k)
    stats.finish()
    record = {"model": verifier.name, "drafter": getattr(drafter, "name", drafter), **asdict(config)}
    return DecodeResult(text=verifier.decode(out), token_ids=out, stats=stats, config=record)
