"""The public Python API: one call = one request.

    >>> from viasd import generate
    >>> result = generate("Write a haiku about the sea.", strategy="viasd", mode="lossless")
    >>> result.text, result.stats.to_dict()["tokens_per_s"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from viasd.decoding.acceptance import DeferralRule, SamplingParams
from viasd.decoding.crossvocab import Conversion, CrossVocabDrafter
from viasd.decoding.drafters import Drafter, GrammarDrafter, LookupDrafter, ModelDrafter, NgramDrafter, SelfDrafter
from viasd.decoding.grammar import Constraint, check_format, grammar_of
from viasd.decoding.multitier import resume_layer
from viasd.decoding.processors import LogitProcessors
from viasd.decoding.registry import DraftKind, LoopArgs, Mode, Strategy
from viasd.decoding.stats import DecodeResult, DecodeStats, Source, TokenLogprob
from viasd.decoding.session import DecodeRequest
from viasd.execution.passes import Passes
from viasd.errors import UsageError, VocabularyMismatchError
from viasd import compute
from viasd.models.loading import LoadedModel, load_drafter, load_model, same_vocabulary
from viasd.models.vocabulary import VocabBridge
from viasd.models.zoo import DEFAULT_MODEL
from viasd.routing.resolve import drafter_head, resolve_route, route_head, slim_vocab
from viasd.settings import (CONVERSIONS, DRAFT_KINDS, MODES, CascadeOptions, DraftOptions,  # noqa: F401 (the API's names)
                            GenerateConfig, ViasdOptions, bias_of, check_bias_ids, preflight_files)
from viasd.validation import check_text, check_token_ids

def _as_model(model: str | LoadedModel | None, progress: bool, drafter: bool = False) -> LoadedModel:
    if not isinstance(model, (str, LoadedModel)) or (isinstance(model, str) and not model):
        raise UsageError(f"model must be a model name or path (str) or a LoadedModel, got {model!r}")
    if isinstance(model, LoadedModel):
        return model
    return load_drafter(model, progress=progress) if drafter else load_model(model, progress=progress)


class StopGeneration(Exception):
    """Raised by an `on_text` or `on_tokens` callback to end the decode after the round that produced the text:
    `generate` then returns what was committed so far (the server's `stop` strings and cancellation)."""


@dataclass(frozen=True)
class TokenText:
    """A committed token as `generate` streams it to `on_tokens`: its id, the text it adds to the answer
    ("" for a special token, or for the first bytes of a character the next token completes), who
    settled it, and its log-probabilities (with the `logprobs` setting)."""

    id: int
    text: str
    source: Source
    logprob: TokenLogprob | None = None


class TextStream:
    """Every committed token, as the decode streams them (`DecodeRequest.on_tokens`), with the text each
    adds, holding back incomplete UTF-8 sequences; `emit` gets each batch (None: only collected).

    With a fast tokenizer that does not clean up spaces, through its own incremental decoder
    (`tokenizers.decoders.DecodeStream`, as text-generation-inference streams): a constant cost a
    token, where decoding the whole answer again after every token grows with the answer."""

    def __init__(self, model: LoadedModel, emit: Callable[[list[TokenText]], None] | None):
        self.model, self.emit = model, emit
        self.ids: list[int] = []
        self.sources: list[Source] = []
        self.logprobs: list[TokenLogprob] = []
        self.sent = 0
        tok = getattr(model, "tokenizer", None)
        backend = getattr(tok, "backend_tokenizer", None)
        self._backend: Any = None  # the fast tokenizer's `tokenizers.Tokenizer`
        self._steps = None
        if backend is not None and not getattr(tok, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._backend, self._steps = backend, DecodeStream(skip_special_tokens=True)

    def __call__(self, new_ids: list[int], sources: list[Source], logprobs: list[TokenLogprob] | None) -> None:
        self.ids.extend(new_ids)
        self.sources.extend(sources)
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        if self.emit is None:
            return
        pieces = [self._piece(len(self.ids) - len(new_ids) + j) for j in range(len(new_ids))]
        unscored: list[TokenLogprob | None] = [None] * len(new_ids)
        self.emit([TokenText(i, p, s, None if logprobs is None else lp)
                   for i, p, s, lp in zip(new_ids, pieces, sources, logprobs or unscored)])

    def _piece(self, j: int) -> str:
        """The text token `j` (of self.ids) adds."""
        if self._steps is not None:
            return self._steps.step(self._backend, self.ids[j]) or ""
        text = self.model.decode(self.ids[: j + 1])
        if text.endswith("\ufffd") or len(text) <= self.sent:
            return ""
        piece, self.sent = text[self.sent :], len(text)
        return piece


def _make_drafter(kind: DraftKind, verifier: LoadedModel, drafter: str | LoadedModel | None, config: GenerateConfig,
                  params: SamplingParams, generator: torch.Generator, progress: bool) -> Drafter:
    opts, reduced_head, probs, spec = config.drafting, config.viasd.reduced_head, draft_probs_read(config), config.spec
    if kind is DraftKind.MODEL:
        draft_model = _as_model(drafter, progress, drafter=True)
        if same_vocabulary(verifier, draft_model):
            chosen = ModelDrafter(draft_model.decoder, params, generator, opts.draft_threshold,
                                  drafter_head(verifier, draft_model) if reduced_head else None, probs, opts.drafter_window)
        else:
            chosen = _cross_drafter(verifier, draft_model, config, params, generator)
        # sd (a model's drafts, checked one by one, q unread; the other model-drafting loops read q or
        # verify through a slim pass), not under a grammar (its drafter proposes only what the grammar allows)
        sd = spec.drafter is DraftKind.MODEL and not spec.needs_draft_probs
        if opts.lookup and sd and check_format(config.response_format)[0] == "text":
            return LookupDrafter(chosen, opts.max_ngram)
        return chosen
    if kind is DraftKind.PLD:
        return NgramDrafter(opts.max_ngram, opts.min_ngram)
    route = resolve_route(verifier, "draft", opts.draft_layers, opts.draft_route)
    return SelfDrafter(verifier.decoder, route.mask, params, generator, opts.draft_threshold,
                       route_head(verifier, route) if reduced_head else None, probs)


def draft_probs_read(config: GenerateConfig) -> bool:
    """Whether decoding with these settings reads the drafter's probabilities q: sampling (the
    acceptance rule), cascades (the deferral rule), tiered VIA-SD (its confidence tiers)."""
    return config.temperature > 0 or config.spec.needs_draft_probs or (
        config.spec.multitier and Mode(config.viasd.mode) is Mode.TIERED)


def draft_conversion(config: GenerateConfig) -> Conversion:
    """The conversion a cross-vocabulary drafter uses for these settings (auto resolved)."""
    chosen = Conversion(config.drafting.draft_conversion)
    needs_probs = draft_probs_read(config)
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
    bridges = draft_model.bridges
    bridge = bridges.get(id(verifier.vocabulary)) or bridges.setdefault(
        id(verifier.vocabulary), VocabBridge(verifier.vocabulary, draft_model.vocabulary))
    if not bridge.shared:
        raise VocabularyMismatchError(f"drafter {draft_model.name} and verifier {verifier.name} share no token")
    conversion = draft_conversion(config)
    head = None
    if conversion is Conversion.INTERSECTION:  # the shared tokens (within the slim route's vocabulary, if any)
        vocab = slim_vocab(verifier) if config.viasd.reduced_head else None
        head = draft_model.decoder.reduced_head(bridge.shared_within(vocab) or bridge.shared)
    return CrossVocabDrafter(draft_model.decoder, bridge, conversion, params, generator, config.drafting.draft_threshold,
                             head, draft_model.eos_token_ids, probs=draft_probs_read(config), window=config.drafting.drafter_window)


def _loop_args(spec: Strategy, config: GenerateConfig, verifier: LoadedModel) -> tuple[LoopArgs, dict]:
    """The loop's arguments, and what they add to the result record."""
    v = config.viasd
    extra: dict[str, Any] = {}
    slim = thresholds = head = None
    if spec.multitier:
        resolved = resolve_route(verifier, "slim", v.slim_layers, v.slim_route)
        slim, slim_file = resolved.mask, resolved.path
        extra["slim_fraction"] = round(slim.fraction, 4)
        # (not under a grammar: a reduced head may score no token the grammar allows)
        constrained = check_format(config.response_format)[0] != "text"
        head = route_head(verifier, resolved) if v.reduced_head and not constrained else None
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
    # that changed a token of lossless VIA-SD on the AMD EPYC with AVX-512 (tests/models/test_native.py)
    resume = v.resume and getattr(verifier.decoder, "native", False)  # (T5: float weights, no resuming)
    if spec.multitier and slim is not None:
        extra["resume_layer"] = resume_layer(slim, resume)
    if tiered:
        extra["correct"] = v.correct
    return LoopArgs(k=config.k, mode=Mode(v.mode), full_block=v.full_block, slim=slim, thresholds=thresholds, cascade=cascade,
                    adaptive=adaptive, resume=resume, slim_head=head, correct=v.correct), extra


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """A conversation as chat messages, checked: roles user/assistant/system with string contents,
    assistant turns that call tools (`tool_calls`, content may be None) and `tool` results (`tool_call_id`,
    content), ending with a user turn or a tool result (the model answers it)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not _message_ok(m):
            raise UsageError(f"message {i}: expected {{'role': 'user'|'assistant'|'system', 'content': str}} (or an "
                             f"assistant's 'tool_calls', a 'tool' result with its 'tool_call_id'), got {m!r:.300}")
        if m["content"] is not None:
            check_text(f"message {i} content", m["content"])
    if messages[-1]["role"] not in ("user", "tool"):
        raise UsageError("a conversation must end with a user message (or a tool's result) for the model to answer")
    return [dict(m) for m in messages]


def _message_ok(m: dict) -> bool:
    role, content = m.get("role"), m.get("content", 0)
    if role == "tool":
        return set(m) <= {"role", "content", "tool_call_id", "name"} and isinstance(content, str)
    if role == "assistant" and "tool_calls" in m:
        calls = m["tool_calls"]
        return set(m) <= {"role", "content", "tool_calls"} and (content is None or isinstance(content, str)) and \
            isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    return set(m) == {"role", "content"} and role in ("user", "assistant", "system") and isinstance(content, str)


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
    on_tokens: Callable[[list[TokenText]], None] | None = None,
    progress: bool = True,
    passes: Passes | None = None,
    **settings,
) -> DecodeResult:
    """Generate a continuation of `prompt`: text (one user turn), a conversation as chat messages
    (`[{"role": "user", "content": ...}, {"role": "assistant", ...}, {"role": "user", ...}]`), or
    token ids used as they are.

    Settings are `GenerateConfig` fields, given as `config=` or as keywords (`strategy="viasd"`,
    `mode="tiered"`, `k=4`, `temperature=0.7`, ...). `on_text` receives the text as it is produced;
    `on_tokens` the committed tokens (`TokenText`: each one's text, who settled it, its logprobs).
    Both run on the thread that decodes, between its passes: the compute thread (`compute.owned`), or
    a server's batch member, whose passes the others' wait for. So they must return quickly (hand the
    text to a queue, not to a socket); raising `StopGeneration` in one ends the decode.
    `passes`: where the model passes run (a server's batch session and prefix caches); default: here.
    """
    config = _checked_request(prompt, config, settings, on_text, on_tokens)
    spec = config.spec
    kind = drafter_kind(config, drafter is not None)
    verifier = _as_model(model, progress)
    ids = _prompt_ids(prompt, verifier, config.chat)
    _check_length(ids, config, verifier)
    generator = torch.Generator().manual_seed(config.seed)
    params = SamplingParams(config.temperature, config.top_p, config.top_k, config.min_p)
    stats = DecodeStats(prompt_tokens=len(ids))
    stream = TextStream(verifier, _emitter(on_text, on_tokens))
    constraint = constraint_for(verifier, config.response_format)
    req = DecodeRequest(prompt=ids, max_new_tokens=config.max_new_tokens, params=params, eos=verifier.eos_token_ids, stats=stats,
                        generator=generator, on_tokens=stream, passes=passes or Passes(), constraint=constraint,
                        logprobs=config.logprobs, processors=_processors(config, verifier))
    args, extra = _loop_args(spec, config, verifier)
    chosen = _make_drafter(kind, verifier, drafter, config, params, generator, progress) if kind else None
    if constraint is not None and (chosen is not None or config.grammar_drafts):
        chosen = GrammarDrafter(chosen, constraint, force=config.grammar_drafts)
    record = {"model": verifier.name, "drafter": getattr(drafter, "name", drafter), **config.settings(),
              "draft": kind.value if kind else None, **extra}
    record.update(_drafter_record(chosen))
    finish = "stop"
    try:
        out = spec.loop(verifier.decoder, chosen, req, args)
        ended = bool(out) and out[-1] in verifier.eos_token_ids
        complete = constraint is not None and constraint.complete(verifier.eos_token_ids)
        if len(out) >= config.max_new_tokens and not ended and not complete:
            finish = "length"
    except StopGeneration:  # from on_text / on_tokens: keep the tokens committed so far
        out = list(stream.ids)
    stats.finish()
    if stream.ids != out:  # every committed token is streamed (correction mode's once checked)
        raise RuntimeError(f"{spec.name}: {len(stream.ids)} tokens streamed, {len(out)} returned")
    return DecodeResult(text=verifier.decode(out), token_ids=out, stats=stats, config=record, sources=stream.sources,
                        logprobs=stream.logprobs if config.logprobs is not None else None, finish_reason=finish)


def _check_length(ids: list[int], config: GenerateConfig, verifier: LoadedModel) -> None:
    """The prompt, the budget and a round's drafts and block must fit the model's positions."""
    if len(ids) + config.max_new_tokens + config.k + config.viasd.full_block + 2 > verifier.config.max_positions:
        raise UsageError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's {verifier.config.max_positions} positions"
        )


def _processors(config: GenerateConfig, verifier: LoadedModel) -> LogitProcessors | None:
    """The request's logit bias and penalties (None at their neutral values)."""
    check_bias_ids(config.logit_bias, verifier.config.vocab_size)
    processors = LogitProcessors(bias_of(config.logit_bias or {}), config.presence_penalty, config.frequency_penalty,
                                 config.repetition_penalty)
    return processors if processors.active else None


def _emitter(on_text: Callable[[str], None] | None,
             on_tokens: Callable[[list[TokenText]], None] | None) -> Callable[[list[TokenText]], None] | None:
    """The callback of a decode's `TextStream`: each batch of tokens to `on_tokens`, their text to `on_text`."""
    if on_text is None and on_tokens is None:
        return None

    def emit(tokens: list[TokenText]) -> None:
        if on_tokens is not None:
            on_tokens(tokens)
        text = "".join(t.text for t in tokens) if on_text is not None else ""
        if text and on_text is not None:
            on_text(text)

    return emit


def constraint_for(model: LoadedModel, response_format: dict | None) -> Constraint | None:
    """The request's grammar on `model`'s vocabulary (None: unconstrained). The grammar tokenizer is built
    once per model (a second for a 150k vocabulary)."""
    grammar = grammar_of(response_format)
    if grammar is None:
        return None
    tokenizer = model.grammar_tokenizer
    if tokenizer is None:
        import llguidance.hf

        try:
            tokenizer = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.config.vocab_size,
                                                     eos_token=sorted(model.eos_token_ids) or None)
        except Exception as e:  # a slow or unusual tokenizer llguidance cannot read
            raise UsageError(f"{model.name}: its tokenizer cannot be used for constrained decoding ({e})") from None
        model.grammar_tokenizer = tokenizer
    return Constraint.compile(grammar, tokenizer, model.config.vocab_size)


def _checked_request(prompt, config: GenerateConfig | None, settings: dict, on_text, on_tokens) -> GenerateConfig:
    """`generate`'s arguments checked before any model loads; the request's settings, validated."""
    if config is not None and not isinstance(config, GenerateConfig):
        raise UsageError(f"config must be a GenerateConfig, got {type(config).__name__}")
    if config is not None and settings:
        raise UsageError("give settings either as config= or as keywords, not both")
    config = config or GenerateConfig.from_settings(**settings)
    config.validate()
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
    elif isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        check_messages(prompt)
    else:
        check_token_ids(prompt)  # types before the model loads; the vocabulary bound after
    for name, f in (("on_text", on_text), ("on_tokens", on_tokens)):
        if f is not None and not callable(f):
            raise UsageError(f"{name} must be callable, got {f!r}")
    preflight_files(config.flat())
    return config


def _drafter_record(chosen: Drafter | None) -> dict:
    """What the result record says of a drafter model: how its drafts reach the verifier, its head."""
    if isinstance(chosen, LookupDrafter):
        chosen = chosen.inner
    if not isinstance(chosen, ModelDrafter):
        return {}
    conversion = chosen.conversion.value if isinstance(chosen, CrossVocabDrafter) else "same-vocabulary"
    return {"draft_conversion": conversion, "drafter_head_vocab": len(chosen.head) if chosen.head is not None else None}


def _prompt_ids(prompt: str | Sequence[int] | list[dict[str, str]], verifier: LoadedModel, chat: bool | None) -> list[int]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        return verifier.encode(prompt, chat)
    if isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt):
        return verifier.encode(check_messages(prompt), chat)
    return check_token_ids(prompt, verifier.config.vocab_size)
