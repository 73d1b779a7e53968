"""The public Python API: one call = one request.

    >>> from viasd import generate
    >>> result = generate("Write a haiku about the sea.", strategy="viasd", mode="lossless")
    >>> result.text, result.stats.to_dict()["tokens_per_s"]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from viasd.decoding.acceptance import DEFERRAL_RULES, DeferralRule, SamplingParams
from viasd.decoding.crossvocab import Conversion, CrossVocabDrafter
from viasd.decoding.drafters import Drafter, ModelDrafter, NgramDrafter, SelfDrafter
from viasd.decoding.multitier import resume_layer
from viasd.decoding.registry import DEFAULT_STRATEGY, STRATEGIES, DraftKind, LoopArgs, Mode, Strategy, strategy
from viasd.decoding.stats import DecodeResult, DecodeStats
from viasd.decoding.tiers import TierThresholds, load_thresholds, thresholds_beside
from viasd.decoding.verifier import DecodeRequest
from viasd.execution.passes import Passes
from viasd.errors import InvalidArgumentError, UsageError, VocabularyMismatchError
from viasd import compute
from viasd.models.loading import LoadedModel, load_model, same_vocabulary
from viasd.models.vocabulary import VocabBridge
from viasd.models.zoo import DEFAULT_MODEL
from viasd.routing.resolve import drafter_head, resolve_route, route_head, slim_vocab
from viasd.routing.route import Route
from viasd.validation import check_choice, check_float, check_int, check_layers, check_seed, check_text, check_token_ids

MODES = tuple(m.value for m in Mode)
DRAFT_KINDS = tuple(k.value for k in DraftKind)
CONVERSIONS = tuple(c.value for c in Conversion)


@dataclass(frozen=True)
class DraftOptions:
    """How drafts are made (every strategy with a drafter)."""

    draft: str = DraftKind.AUTO.value  # drafter kind for viasd / cascade: model (--drafter), pld, self; auto picks
    draft_threshold: float | None = None  # adaptive drafting: stop below this top probability
    draft_layers: tuple[int, ...] | None = None  # self drafting: verifier layers the drafter keeps
    draft_route: str | None = None  # self drafting: a route JSON file (instead of draft_layers)
    max_ngram: int = 3  # prompt lookup
    min_ngram: int = 1
    # sd / pld / self-sd / cascade: k is the most; each round drafts what measured costs favour
    # (decoding/draft_length.py). None: on for the lossless ones under greedy decoding (the output is
    # the same at any draft length); off under sampling (a seed then reproduces the output) and for cascade
    adapt_k: bool | None = None
    # a drafter model of another vocabulary (decoding/crossvocab.py): its drafts reach the verifier
    # through text (greedy) or through the tokens both vocabularies share (any sampling);
    # auto: shared tokens where the loop reads draft probabilities (sampling, cascade, tiered), else text
    draft_conversion: str = Conversion.AUTO.value

    def validate(self) -> None:
        if self.draft_conversion not in CONVERSIONS:
            raise UsageError(f"unknown draft conversion {self.draft_conversion!r}: choose from {', '.join(CONVERSIONS)}")
        if self.draft not in DRAFT_KINDS:
            raise UsageError(f"unknown drafter kind {self.draft!r}: choose from {', '.join(DRAFT_KINDS)}")
        if self.draft_threshold is not None and not 0 <= self.draft_threshold <= 1:
            raise UsageError(f"draft_threshold must be in [0, 1], got {self.draft_threshold}")
        if self.draft_layers is not None and self.draft_route is not None:
            raise UsageError("give either draft_layers or draft_route, not both")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


@dataclass(frozen=True)
class ViasdOptions:
    """VIA-SD (`strategy="viasd"`): the slim verifier and the tier rules."""

    mode: str = Mode.LOSSLESS.value
    slim_layers: tuple[int, ...] | None = None  # slim verifier: kept layers (default: shipped route)
    slim_route: str | None = None  # slim verifier: a route JSON file
    full_block: int = 8  # lossless: slim-verified tokens per full-model check
    resume: bool = True  # native weights: full passes start where the slim route's whole lower layers end (same output)
    # slim and drafting routes: the reduced LM head their route file stores, if any; a drafter model:
    # the vocabulary of the verifier's shipped slim route (`routing.resolve.drafter_head`)
    reduced_head: bool = True
    thresholds: str | None = None  # tiered: a JSON file of TierThresholds fields
    # tiered, greedy: each full pass corrects the first token settled without the full model where its
    # greedy choice differs (dropping what follows); such tokens are streamed once checked. Output = ar's
    correct: bool = False
    accept: float | None = None  # tiered threshold overrides (TierThresholds)
    accept_draft: float | None = None
    accept_tv: float | None = None
    slim: float | None = None
    slim_entropy: float | None = None
    draft_confident: float | None = None

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.slim_layers is not None and self.slim_route is not None:
            raise UsageError("give either slim_layers or slim_route, not both")
        if self.full_block < 1:
            raise UsageError(f"full_block must be >= 1, got {self.full_block}")

    def tier_thresholds(self, route_file: Path | None = None) -> TierThresholds:
        """Defaults <- a thresholds file (given, or found beside the slim route: with `correct` its
        correction-mode thresholds first, see `tiers.thresholds_beside`) <- explicit overrides."""
        values = TierThresholds().to_dict()
        if self.thresholds:
            values.update(load_thresholds(self.thresholds))
        elif route_file is not None:
            beside = ([thresholds_beside(route_file, correct=True)] if self.correct else []) + [thresholds_beside(route_file)]
            found = next((p for p in beside if p.exists()), None)
            if found is not None:
                values.update(load_thresholds(found))
        for name in values:
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return TierThresholds(**values)


@dataclass(frozen=True)
class CascadeOptions:
    """Speculative cascades (`strategy="cascade"`)."""

    rule: str = DeferralRule.OPT.value
    alpha: float = 0.1

    def validate(self) -> None:
        if self.rule not in DEFERRAL_RULES:
            raise UsageError(f"unknown deferral rule {self.rule!r}: choose from {', '.join(DEFERRAL_RULES)}")


_GROUPS = {"drafting": DraftOptions, "viasd": ViasdOptions, "cascade": CascadeOptions}
_GROUP_OF = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class GenerateConfig:
    """Every setting of one request: the common ones, and one option group per kind of strategy.

    Settings are set by their flat names, whatever group holds them:
    `GenerateConfig.from_settings(strategy="viasd", mode="tiered", k=4)`; `settings()` gives them back
    flat (as result records and the CLI use them).
    """

    strategy: str = DEFAULT_STRATEGY
    k: int = 4  # draft tokens per verification round (the most, with draft_threshold)
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    chat: bool | None = None  # None: use the chat template when the model has one
    drafting: DraftOptions = field(default_factory=DraftOptions)
    viasd: ViasdOptions = field(default_factory=ViasdOptions)
    cascade: CascadeOptions = field(default_factory=CascadeOptions)

    @classmethod
    def setting_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in _GROUPS] + list(_GROUP_OF)

    @classmethod
    def from_settings(cls, **settings) -> GenerateConfig:
        return cls().replace(**settings)

    def replace(self, **settings) -> GenerateConfig:
        """A copy with settings changed, by their flat names."""
        unknown = sorted(set(settings) - set(self.setting_names()))
        if unknown:
            raise UsageError(f"unknown setting(s): {', '.join(unknown)}")
        common = {k: v for k, v in settings.items() if k not in _GROUP_OF}
        groups = {g: dataclasses.replace(getattr(self, g), **{k: v for k, v in settings.items() if _GROUP_OF.get(k) == g})
                  for g in _GROUPS}
        return dataclasses.replace(self, **common, **groups)

    def settings(self) -> dict:
        """Every setting by its flat name (the record echoed with each result)."""
        return {name: getattr(getattr(self, _GROUP_OF[name]) if name in _GROUP_OF else self, name) for name in self.setting_names()}

    @property
    def spec(self) -> Strategy:
        return strategy(self.strategy)

    def flat(self) -> SimpleNamespace:
        """The settings as attributes, by their flat names."""
        return SimpleNamespace(**self.settings())

    def validate(self) -> None:
        check_generate_config(self.flat())  # types, NaN / inf, seed and value ranges (viasd.validation)
        spec = strategy(self.strategy)
        if self.drafting.draft != DraftKind.AUTO:
            spec.draft_kind(self.drafting.draft, True)  # a kind the strategy cannot draft with, before any model loads
        if not 0 <= self.k <= 64:
            raise UsageError(f"k must be between 0 and 64, got {self.k}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.viasd.correct and not (spec.multitier and self.viasd.mode == Mode.TIERED.value and self.temperature == 0):
            raise UsageError("correct applies to strategy viasd in tiered mode with greedy decoding (temperature 0): "
                             "it replaces tokens by the full model's greedy choice")
        for group in _GROUPS:
            getattr(self, group).validate()


# ------------------------------------------------------------------------------ request settings
# (here, not in viasd.validation: they read the strategy table, routes and thresholds files, which
# lie above the validation helpers)


def check_generate_config(c) -> None:
    """Types and sanity of every `GenerateConfig` field (ranges that need the model come later)."""
    # ranges GenerateConfig.validate checks itself (with its own messages) are only typed here
    check_choice("strategy", c.strategy, STRATEGIES)
    check_int("k", c.k)
    check_int("max_new_tokens", c.max_new_tokens, hi=1 << 20)
    check_float("temperature", c.temperature, 0.0, 100.0)
    check_float("top_p", c.top_p)
    check_seed(c.seed)
    if c.chat is not None and not isinstance(c.chat, bool):
        raise InvalidArgumentError(f"chat must be True, False or None, got {c.chat!r}")
    if c.adapt_k is not None and not isinstance(c.adapt_k, bool):
        raise InvalidArgumentError(f"adapt_k must be True, False or None, got {c.adapt_k!r}")
    if c.draft_threshold is not None:
        check_float("draft_threshold", c.draft_threshold)
    check_choice("drafter kind", c.draft, DRAFT_KINDS)
    check_layers("draft_layers", c.draft_layers)
    check_layers("slim_layers", c.slim_layers)
    for name in ("draft_route", "slim_route", "thresholds"):
        value = getattr(c, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise InvalidArgumentError(f"{name} must be a file path, got {value!r}")
        if isinstance(value, str):
            check_text(name, value)
    check_int("max_ngram", c.max_ngram, hi=64)
    check_int("min_ngram", c.min_ngram)
    check_choice("mode", c.mode, MODES)
    check_int("full_block", c.full_block, hi=1024)
    for name in ("resume", "reduced_head", "correct"):
        if not isinstance(getattr(c, name), bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {getattr(c, name)!r}")
    for name in ("accept", "accept_draft", "accept_tv", "slim", "draft_confident"):
        if getattr(c, name) is not None:
            check_float(name, getattr(c, name), 0.0, 2.0)
    if c.slim_entropy is not None:
        check_float("slim_entropy", c.slim_entropy, 0.0, allow_inf=True)
    check_choice("deferral rule", c.rule, DEFERRAL_RULES)
    check_float("alpha", c.alpha, 0.0, 1.0)


def preflight_files(c) -> None:
    """Read the route and thresholds files a GenerateConfig names, before any model is loaded, so a
    missing or malformed file is reported in a second (the model match is checked after loading)."""
    for name in ("draft_route", "slim_route"):
        if getattr(c, name) is not None:
            Route.load(getattr(c, name))
    if c.thresholds is not None:
        load_thresholds(Path(c.thresholds))


def _as_model(model: str | LoadedModel, progress: bool) -> LoadedModel:
    if not isinstance(model, (str, LoadedModel)) or (isinstance(model, str) and not model):
        raise UsageError(f"model must be a model name or path (str) or a LoadedModel, got {model!r}")
    return model if isinstance(model, LoadedModel) else load_model(model, progress=progress)


class StopGeneration(Exception):
    """Raised by an `on_text` callback to end the decode after the round that produced the text:
    `generate` then returns what was committed so far (the server's `stop` strings and cancellation)."""


class TextStream:
    """Turns token ids into text increments, holding back incomplete UTF-8 sequences.

    With a fast tokenizer that does not clean up spaces, through its own incremental decoder
    (`tokenizers.decoders.DecodeStream`, as text-generation-inference streams): 2 us a token whatever
    the answer's length. Decoding the whole answer again after every round, as before, cost 12 us a
    token over a 64-token answer and 66 over a 512-token one (smollm2; its tokens take 4-5 ms)."""

    def __init__(self, model: LoadedModel, emit: Callable[[str], None]):
        self.model, self.emit = model, emit
        self.ids: list[int] = []
        self.sent = 0
        tok = getattr(model, "tokenizer", None)
        backend = getattr(tok, "backend_tokenizer", None)
        self._backend, self._steps = None, None
        if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._backend, self._steps = backend, DecodeStream(skip_special_tokens=True)

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        if self._steps is not None:
            pieces = [p for p in (self._steps.step(self._backend, i) for i in new_ids) if p]
            if pieces:
                self.emit("".join(pieces))
            return
        text = self.model.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        if len(text) > self.sent:
            self.emit(text[self.sent :])
            self.sent = len(text)


def _make_drafter(kind: DraftKind, verifier: LoadedModel, drafter: str | LoadedModel | None, config: GenerateConfig,
                  params: SamplingParams, generator: torch.Generator, progress: bool) -> Drafter:
    opts, reduced_head = config.drafting, config.viasd.reduced_head
    if kind is DraftKind.MODEL:
        draft_model = _as_model(drafter, progress)
        if same_vocabulary(verifier, draft_model):
            return ModelDrafter(draft_model.decoder, params, generator, opts.draft_threshold,
                                drafter_head(verifier, draft_model) if reduced_head else None)
        return _cross_drafter(verifier, draft_model, config, params, generator)
    if kind is DraftKind.PLD:
        return NgramDrafter(opts.max_ngram, opts.min_ngram)
    route = resolve_route(verifier, "draft", opts.draft_layers, opts.draft_route)
    return SelfDrafter(verifier.decoder, route.mask, params, generator, opts.draft_threshold, route_head(verifier, route) if reduced_head else None)


def draft_conversion(config: GenerateConfig) -> Conversion:
    """The conversion a cross-vocabulary drafter uses for these settings (auto resolved)."""
    chosen = Conversion(config.drafting.draft_conversion)
    needs_probs = config.temperature > 0 or config.spec.needs_draft_probs or (
        config.spec.multitier and Mode(config.viasd.mode) is Mode.TIERED)
    if chosen is Conversion.TEXT and config.temperature > 0:
        raise UsageError("draft_conversion 'text' is greedy only: sampling with a drafter of another vocabulary "
                         "drafts the tokens both vocabularies share (draft_conversion 'intersection' or 'auto')")
    if chosen is Conversion.TEXT and config.spec.needs_draft_probs:
        raise UsageError(f"strategy {config.strategy!r} reads the drafter's probabilities, which drafts converted "
                         "through text do not have: use draft_conversion 'intersection' or 'auto'")
    if chosen is Conversion.AUTO:
        return Conversion.INTERSECTION if needs_probs else Conversion.TEXT
    return chosen


def _cross_drafter(verifier: LoadedModel, draft_model: LoadedModel, config: GenerateConfig, params: SamplingParams,
                   generator: torch.Generator) -> CrossVocabDrafter:
    if verifier.decoder.is_encoder_decoder or draft_model.decoder.is_encoder_decoder:
        raise VocabularyMismatchError(f"drafter {draft_model.name} has another vocabulary than {verifier.name}; drafting "
                                      "across vocabularies needs decoder-only models")
    # built once per pair (a dictionary over the larger vocabulary: a tenth of a second), kept on the drafter
    bridges = draft_model.__dict__.setdefault("_bridges", {})
    bridge = bridges.get(id(verifier.vocabulary)) or bridges.setdefault(id(verifier.vocabulary), VocabBridge(verifier.vocabulary, draft_model.vocabulary))
    if not bridge.shared:
        raise VocabularyMismatchError(f"drafter {draft_model.name} and verifier {verifier.name} share no token")
    conversion = draft_conversion(config)
    head = None
    if conversion is Conversion.INTERSECTION:  # the shared tokens (within the slim route's vocabulary, if any)
        vocab = slim_vocab(verifier) if config.viasd.reduced_head else None
        head = draft_model.decoder.reduced_head(bridge.shared_within(vocab) or bridge.shared)
    return CrossVocabDrafter(draft_model.decoder, bridge, conversion, params, generator, config.drafting.draft_threshold,
                             head, draft_model.eos_token_ids)


def _loop_args(spec: Strategy, config: GenerateConfig, verifier: LoadedModel) -> tuple[LoopArgs, dict]:
    """The loop's arguments, and what they add to the result record."""
    v, extra = config.viasd, {}
    slim = thresholds = head = None
    if spec.multitier:
        resolved = resolve_route(verifier, "slim", v.slim_layers, v.slim_route)
        slim, slim_file = resolved.mask, resolved.path
        extra["slim_fraction"] = round(slim.fraction, 4)
        head = route_head(verifier, resolved) if v.reduced_head else None
        extra["slim_head_vocab"] = len(head) if head is not None else None
        if Mode(v.mode) is Mode.TIERED:
            thresholds = v.tier_thresholds(slim_file)
            extra["tier_thresholds"] = thresholds.to_dict()
    cascade = (DeferralRule(config.cascade.rule), config.cascade.alpha)
    adaptive = config.drafting.adapt_k
    tiered = spec.multitier and Mode(v.mode) is Mode.TIERED
    if adaptive is None:  # greedy: every lossless strategy's output is the same at any draft length
        adaptive = config.temperature == 0 and (spec.is_lossless(v.mode) or tiered)
    if spec.drafter is not None:
        extra["adaptive_k"] = adaptive
    # resumed full passes equal full ones bit for bit only where every product is row-exact (native
    # weights); oneDNN's float products round a row computed alone otherwise, and with bfloat16 weights
    # that changed a token of lossless VIA-SD on the AMD EPYC with AVX-512 (tests/test_native.py)
    resume = v.resume and getattr(verifier.decoder, "native", False)  # (T5: float weights, no resuming)
    if spec.multitier:
        extra["resume_layer"] = resume_layer(slim, resume)
    if tiered:
        extra["correct"] = v.correct
    return LoopArgs(config.k, Mode(v.mode), v.full_block, slim, thresholds, cascade, adaptive, resume, head, v.correct), extra


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


def drafter_kind(config: GenerateConfig, has_drafter: bool) -> DraftKind | None:
    """The drafter a request's strategy uses, checked against whether a drafter model was given."""
    spec = config.spec
    if spec.drafter is None and has_drafter:
        raise UsageError(f"strategy {spec.name!r} uses no drafter")
    kind = spec.draft_kind(config.drafting.draft, has_drafter)
    if kind is DraftKind.MODEL and not has_drafter:
        raise UsageError(f"strategy {spec.name!r} needs a drafter model (--drafter), "
                         "e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")
    if kind not in (None, DraftKind.MODEL) and has_drafter:
        raise UsageError(f"a drafter model is only used with model drafting (--draft model), not {kind.value!r} "
                         f"drafting (strategy {spec.name!r})")
    return kind


def drafts_with_model(config: GenerateConfig) -> bool:
    """Whether a request with these settings drafts with a drafter model when one is at hand (a server
    with a drafter passes it only to those)."""
    try:
        return config.spec.draft_kind(config.drafting.draft, True) is DraftKind.MODEL
    except UsageError:  # `generate` says why
        return True


@compute.owned  # every decode on the process' one compute thread (compute.py says why)
def generate(
    prompt: str | Sequence[int] | list[dict[str, str]],
    model: str | LoadedModel = DEFAULT_MODEL,
    *,
    drafter: str | LoadedModel | None = None,
    config: GenerateConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    progress: bool = True,
    passes: Passes | None = None,
    **settings,
) -> DecodeResult:
    """Generate a continuation of `prompt`: text (one user turn), a conversation as chat messages
    (`[{"role": "user", "content": ...}, {"role": "assistant", ...}, {"role": "user", ...}]`), or
    token ids used as they are.

    Settings are `GenerateConfig` fields, given as `config=` or as keywords (`strategy="viasd"`,
    `mode="tiered"`, `k=4`, `temperature=0.7`, ...). `on_text` receives the text as it is produced.
    `passes`: where the model passes run (a server's batch session and prefix caches); default: here.
    """
    if config is not None and not isinstance(config, GenerateConfig):
        raise UsageError(f"config must be a GenerateConfig, got {type(config).__name__}")
    if config is not None and settings:
        raise UsageError("give settings either as config= or as keywords, not both")
    config = config or GenerateConfig.from_settings(**settings)
    config.validate()
    spec = config.spec
    kind = drafter_kind(config, drafter is not None)
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        check_messages(prompt)
    else:
        check_token_ids(prompt)  # types before the model loads; the vocabulary bound after
    if on_text is not None and not callable(on_text):
        raise UsageError(f"on_text must be callable, got {on_text!r}")
    preflight_files(config.flat())
    verifier = _as_model(model, progress)
    ids = _prompt_ids(prompt, verifier, config.chat)
    v = config.viasd
    if len(ids) + config.max_new_tokens + config.k + v.full_block + 2 > verifier.config.max_positions:
        raise UsageError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's {verifier.config.max_positions} positions"
        )
    generator = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(config.temperature, config.top_p)
    stats = DecodeStats(prompt_tokens=len(ids))
    stream = TextStream(verifier, on_text) if on_text else None
    req = DecodeRequest(ids, config.max_new_tokens, params, verifier.eos_token_ids, stats, generator, stream, passes or Passes())
    args, extra = _loop_args(spec, config, verifier)
    chosen = _make_drafter(kind, verifier, drafter, config, params, generator, progress) if kind else None
    record = {"model": verifier.name, "drafter": getattr(drafter, "name", drafter), **config.settings(),
              "draft": kind.value if kind else None, **extra}
    if isinstance(chosen, CrossVocabDrafter):
        record["draft_conversion"] = chosen.conversion.value
    elif isinstance(chosen, ModelDrafter):
        record["draft_conversion"] = "same-vocabulary"
    if isinstance(chosen, ModelDrafter):
        record["drafter_head_vocab"] = len(chosen.head) if chosen.head is not None else None
    try:
        out = spec.loop(verifier.decoder, chosen, req, args)
    except StopGeneration:  # from on_text: keep the tokens committed so far
        out = list(stream.ids)
    stats.finish()
    return DecodeResult(text=verifier.decode(out), token_ids=out, stats=stats, config=record)


def _prompt_ids(prompt: str | Sequence[int] | list[dict[str, str]], verifier: LoadedModel, chat: bool | None) -> list[int]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        return verifier.encode(prompt, chat)
    if isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        return verifier.encode(check_messages(prompt), chat)
    return check_token_ids(prompt, verifier.config.vocab_size)
