"""Every setting of a request, declared once: its name, type, default, range, help text, command-line
flag, and which strategies read it.

`GenerateConfig` is the declaration: one dataclass field per setting (grouped by the kind of strategy
that reads it), each carrying a `Setting` as metadata. What accepts settings is derived from it:
- the Python API's checks: `check_settings` (types and ranges) inside `GenerateConfig.validate`;
- the CLI's flags of `viasd generate`, `serve`, `bench` and `calibrate` (`add_arguments`, `from_args`);
- the server's request schema: the `viasd` extension object and OpenAI's sampling fields
  (`server.schemas`);
- the benchmark's method options (`METHOD+name=value`, `bench.parse_methods`).
So a limit cannot differ between them (tests/test_settings.py walks every setting through all four).
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from viasd.decoding.acceptance import DEFERRAL_RULES, DeferralRule
from viasd.decoding.crossvocab import Conversion
from viasd.decoding.grammar import grammar_of
from viasd.decoding.registry import DEFAULT_STRATEGY, STRATEGIES, DraftKind, Mode, Strategy, strategy
from viasd.decoding.tiers import TierThresholds, load_thresholds, thresholds_beside
from viasd.errors import InvalidArgumentError, UsageError
from viasd.routing.route import Route
from viasd.validation import SEED_MAX, check_choice, check_float, check_int, check_layers, check_text

MODES = tuple(m.value for m in Mode)
DRAFT_KINDS = tuple(k.value for k in DraftKind)
CONVERSIONS = tuple(c.value for c in Conversion)
MAX_NEW_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20
MAX_LAYER = 4096  # a layer index (and the most entries a layer list holds); the model's own bound is checked when it loads

# which strategies read a setting, from the strategy table
ALL = tuple(STRATEGIES)
DRAFTING = tuple(n for n, s in STRATEGIES.items() if s.drafter is not None)
CHOOSING_DRAFTER = tuple(n for n, s in STRATEGIES.items() if s.drafter is DraftKind.AUTO)  # --draft chooses
MODEL_DRAFTING = tuple(n for n, s in STRATEGIES.items() if s.drafter in (DraftKind.MODEL, DraftKind.AUTO))
PLD_DRAFTING = tuple(n for n, s in STRATEGIES.items() if s.drafter in (DraftKind.PLD, DraftKind.AUTO))
SELF_DRAFTING = tuple(n for n, s in STRATEGIES.items() if s.drafter in (DraftKind.SELF, DraftKind.AUTO))
VIASD = tuple(n for n, s in STRATEGIES.items() if s.multitier)
CASCADE = tuple(n for n, s in STRATEGIES.items() if s.needs_draft_probs and not s.multitier)


@dataclass(frozen=True)
class Setting:
    """What a `GenerateConfig` field accepts and how the front ends offer it.

    lo / hi: the range (numbers; `lo_open`: lo itself refused; `allow_inf`: +inf accepted); choices:
    the accepted strings; flags: the command line's names (default --name-with-dashes); server: where
    a request to the server sets it: "viasd" (the `viasd` extension object), "openai" (a top-level field of
    the same name: OpenAI's own, as temperature, top_p, seed, max_tokens, logit_bias, or vLLM's and
    llama-server's extras, as top_k, min_p, repetition_penalty) or None (the server's, given at start: files, and the
    chat template, which the endpoint decides); group: the CLI help group; reads: the strategies that
    read it."""

    help: str
    reads: tuple[str, ...] = ALL
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    allow_inf: bool = False
    choices: tuple[str, ...] | None = None
    label: str | None = None  # the name in a refusal of a choice ("unknown drafter kind 'x'")
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    server: str | None = "viasd"
    group: str | None = None


def setting(default, help: str, **meta):
    """A `GenerateConfig` field with its `Setting`."""
    return field(default=default, metadata={"setting": Setting(help, **meta)})


@dataclass(frozen=True)
class DraftOptions:
    """How drafts are made (every strategy with a drafter)."""

    draft: str = setting(DraftKind.AUTO.value, "drafter for viasd / cascade: model (--drafter), pld, self (a route); auto = "
                         "model if --drafter is given, else pld for viasd and self for cascade", reads=CHOOSING_DRAFTER,
                         choices=DRAFT_KINDS, label="drafter kind")
    draft_threshold: float | None = setting(None, "adaptive drafting: stop when the drafter's top probability falls below this",
                                            reads=DRAFTING, lo=0.0, hi=1.0)
    drafter_window: int = setting(256, "a drafter model reads only the prompt's last N tokens (0 = all of them): its prefill "
                                  "is time to the first token, and its drafts are verified all the same",
                                  reads=MODEL_DRAFTING, lo=0, hi=1 << 20)
    draft_layers: tuple[int, ...] | None = setting(None, "self drafting: verifier layers the drafting route keeps",
                                                   reads=SELF_DRAFTING, lo=0, hi=MAX_LAYER, metavar="L")
    draft_route: str | None = setting(None, "self drafting: a route file instead of --draft-layers (see `viasd routes show`)",
                                      reads=SELF_DRAFTING, metavar="ROUTE.json", server=None)
    max_ngram: int = setting(3, "prompt lookup: the longest n-gram matched (sd's --lookup: the one matched)",
                             reads=PLD_DRAFTING + ("sd",), lo=1, hi=64)
    min_ngram: int = setting(1, "prompt lookup: the shortest n-gram matched", reads=PLD_DRAFTING, lo=1, hi=64)
    lookup: bool = setting(True, "sd: where the text's last --max-ngram tokens occurred before, verify the tokens that "
                           "followed them (prompt lookup) instead of drafting with the model: free drafts, the same output",
                           reads=("sd",))
    adapt_k: bool | None = setting(
        None, "--k is the most; each round verifies the number of drafts that commits the most tokens per measured "
        "second, down to none (default: on for sd, pld, self-sd and viasd under greedy decoding, where a lossless "
        "strategy's output is the same at any draft length; off when sampling, so that --seed reproduces the output, "
        "and for cascade)", reads=DRAFTING)
    draft_conversion: str = setting(
        Conversion.AUTO.value, "a --drafter with another vocabulary: text (greedy: drafted text re-encoded by the "
        "verifier's tokenizer) or intersection (drafts only tokens both vocabularies have, mapped one to one: lossless "
        "under sampling too); auto = intersection when sampling, for cascade and tiered viasd (they read the drafter's "
        "probabilities), else text", reads=MODEL_DRAFTING, choices=CONVERSIONS, label="draft conversion")

    def validate(self) -> None:
        if self.draft_layers is not None and self.draft_route is not None:
            raise UsageError("give either draft_layers or draft_route, not both")
        if self.min_ngram > self.max_ngram:
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")


@dataclass(frozen=True)
class ViasdOptions:
    """VIA-SD (`strategy="viasd"`): the slim verifier and the tier rules."""

    mode: str = setting(Mode.LOSSLESS.value, "lossless: exactly the full model's output; tiered: tiers 1-2 skip the full model",
                        reads=VIASD, choices=MODES, group="viasd")
    slim_layers: tuple[int, ...] | None = setting(None, "slim verifier's kept layers (default: the shipped route)",
                                                  reads=VIASD, lo=0, hi=MAX_LAYER, metavar="L", group="viasd")
    slim_route: str | None = setting(None, "slim verifier's route file (thresholds beside it are used in tiered mode)",
                                     reads=VIASD, metavar="ROUTE.json", server=None, group="viasd")
    full_block: int = setting(8, "lossless: slim-verified tokens per full check", reads=VIASD, lo=1, hi=1024, group="viasd")
    resume: bool = setting(True, "full passes start at the first layer the slim route does not keep whole, from the "
                           "states its passes stored; the output is the same either way", reads=VIASD, group="viasd")
    reduced_head: bool = setting(True, "slim and drafting routes score only the vocabulary their route file stores, if "
                                 "it stores one (a draft outside it goes to the full model), and a drafter model the "
                                 "vocabulary of the verifier's shipped slim route", reads=DRAFTING, group="viasd")
    thresholds: str | None = setting(None, "tiered: thresholds file (as written by `viasd calibrate`)", reads=VIASD,
                                     metavar="FILE.json", server=None, group="viasd")
    correct: bool = setting(False, "tiered, greedy: each full pass corrects the first token settled without the full "
                            "model where its choice differs, dropping what follows; tokens are printed once checked, "
                            "and the output equals --strategy ar's", reads=VIASD, group="viasd")
    # tiered mode's threshold overrides (`TierThresholds`; above 1 switches a tier off)
    accept: float | None = setting(None, "tiered: tier 1 when the slim prob of the draft is >= this", reads=VIASD,
                                   lo=0.0, hi=2.0, group="viasd")
    accept_draft: float | None = setting(None, "tiered: ... and the drafter's prob of its token is >= this", reads=VIASD,
                                         lo=0.0, hi=2.0, group="viasd")
    accept_tv: float | None = setting(None, "tiered: ... and TV(drafter, slim) is <= this", reads=VIASD, lo=0.0, hi=2.0,
                                      group="viasd")
    slim: float | None = setting(None, "tiered: tier 2 when the slim top prob is >= this, else tier 3 (full)", reads=VIASD,
                                 lo=0.0, hi=2.0, group="viasd")
    slim_entropy: float | None = setting(None, "tiered: ... and the slim entropy is <= this", reads=VIASD, lo=0.0,
                                         allow_inf=True, group="viasd")
    draft_confident: float | None = setting(None, "tiered: a round whose drafts all have drafter prob >= this is tier 1 "
                                            "with no slim pass (model or self drafters; default 2 = off)", reads=VIASD,
                                            lo=0.0, hi=2.0, group="viasd")

    def validate(self) -> None:
        if self.slim_layers is not None and self.slim_route is not None:
            raise UsageError("give either slim_layers or slim_route, not both")

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

    rule: str = setting(DeferralRule.OPT.value, "deferral rule", reads=CASCADE, choices=tuple(str(r) for r in DEFERRAL_RULES),
                        label="deferral rule", group="cascade")
    alpha: float = setting(0.1, "deferral rule parameter", reads=CASCADE, lo=0.0, hi=1.0, group="cascade")

    def validate(self) -> None:
        pass


_GROUPS = {"drafting": DraftOptions, "viasd": ViasdOptions, "cascade": CascadeOptions}
_GROUP_OF = {f.name: group for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class GenerateConfig:
    """Every setting of one request: the common ones, and one option group per kind of strategy.

    Settings are set by their flat names, whatever group holds them:
    `GenerateConfig.from_settings(strategy="viasd", mode="tiered", k=4)`; `settings()` gives them back
    flat (as result records and the CLI use them).
    """

    strategy: str = setting(DEFAULT_STRATEGY, "; ".join(f"{k}: {v.help}" for k, v in STRATEGIES.items()),
                            choices=tuple(STRATEGIES), flags=("--strategy", "-s"))
    k: int = setting(4, "draft tokens per verification round (the most, with --draft-threshold or --adapt-k)",
                     reads=DRAFTING, lo=0, hi=64, flags=("--k", "-k"))
    max_new_tokens: int = setting(128, "new tokens at most", lo=1, hi=MAX_NEW_TOKENS, flags=("--max-new-tokens", "-n"),
                                  server="openai")
    temperature: float = setting(0.0, "0 = greedy", lo=0.0, hi=2.0, flags=("--temperature", "-t"), server="openai")
    top_p: float = setting(1.0, "nucleus sampling mass", lo=0.0, lo_open=True, hi=1.0, server="openai")
    seed: int = setting(0, "the sampler's seed", lo=0, hi=SEED_MAX, server="openai")
    # samplers of the verifier's distribution (every strategy; lossless ones stay lossless: decoding/processors.py)
    top_k: int = setting(0, "sample from the k most likely tokens only (0 = all)", lo=0, hi=MAX_TOP_K, server="openai")
    min_p: float = setting(0.0, "sample only tokens of at least min_p times the most likely one's probability (after "
                           "temperature; 0 = off)", lo=0.0, hi=1.0, server="openai")
    presence_penalty: float = setting(0.0, "subtracted from the logit of every token the output already holds",
                                      lo=-2.0, hi=2.0, server="openai")
    frequency_penalty: float = setting(0.0, "times a token's count in the output so far, subtracted from its logit",
                                       lo=-2.0, hi=2.0, server="openai")
    repetition_penalty: float = setting(1.0, "a token of the prompt or the output so far: its logit divided by this if "
                                        "positive, else multiplied (1 = off)", lo=0.0, lo_open=True, hi=10.0, server="openai")
    logit_bias: dict[int, float] | None = setting(
        None, "added to a token's logit (OpenAI's); ID=BIAS, repeated or comma-separated", lo=-100.0, hi=100.0,
        metavar="ID=BIAS", server="openai")
    chat: bool | None = setting(None, "wrap the prompt in the model's chat template (default: when the model has one)",
                                server=None)
    response_format: dict | None = setting(
        None, "constrain the output (every strategy; lossless ones stay lossless): OpenAI's {'type': 'json_object'} or "
        "{'type': 'json_schema', 'json_schema': {'schema': {...}}}, or {'type': 'regex', 'regex': R} or {'type': "
        "'grammar', 'grammar': LARK}", flags=("--json-schema", "--json-object", "--regex", "--grammar"), server="openai")
    grammar_drafts: bool = setting(True, "under a constraint, the tokens the grammar alone determines are drafted for "
                                   "free in front of the drafter's (and by ar) and verified in the same pass")
    logprobs: int | None = setting(
        None, "record each new token's log-probability under the full model and this many alternatives' (after "
        "logit_bias, penalties and the grammar's mask; before temperature and top-k/top-p/min-p); not with tiered "
        "viasd, which settles tokens without the full model (in --json output)", lo=0, hi=20, server="openai")
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
        """Every setting's type and range (`check_settings`), then what settings require of each other."""
        check_settings(self.settings())
        spec = strategy(self.strategy)
        if self.drafting.draft != DraftKind.AUTO:
            spec.draft_kind(self.drafting.draft, True)  # a kind the strategy cannot draft with, before any model loads
        if self.viasd.correct and not (spec.multitier and self.viasd.mode == Mode.TIERED.value and self.temperature == 0):
            raise UsageError("correct applies to strategy viasd in tiered mode with greedy decoding (temperature 0): "
                             "it replaces tokens by the full model's greedy choice")
        if self.logprobs is not None and spec.multitier and self.viasd.mode == Mode.TIERED.value:
            raise UsageError("logprobs need the full model's distribution at every token, and tiered viasd settles "
                             "tokens without it: use mode lossless (or another strategy)")
        for group in _GROUPS:
            getattr(self, group).validate()


# ------------------------------------------------------------------------------ the declarations, read


@dataclass(frozen=True)
class Declared:
    """One setting as the front ends read it: `kind` is "int", "float", "bool", "choice", "layers", "file",
    "format" (response_format) or "bias" (logit_bias: token id -> number); `optional`: None is accepted (and means the default
    behaviour)."""

    name: str
    kind: str
    default: object
    optional: bool
    spec: Setting

    @property
    def flags(self) -> tuple[str, ...]:
        return self.spec.flags or ("--" + self.name.replace("_", "-"),)


def _kind(hint) -> tuple[str, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    base = args[0] if optional else hint
    if typing.get_origin(base) is tuple:
        return "layers", optional
    if typing.get_origin(base) is dict:
        return "bias", optional
    if base is dict:
        return "format", optional
    return {int: "int", float: "float", bool: "bool", str: "str"}[base], optional


def _declared() -> dict[str, Declared]:
    out = {}
    for cls in (GenerateConfig, *_GROUPS.values()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "setting" not in f.metadata:
                continue
            kind, optional = _kind(hints[f.name])
            spec = f.metadata["setting"]
            if kind == "str":
                kind = "choice" if spec.choices is not None else "file"
            out[f.name] = Declared(f.name, kind, f.default, optional, spec)
    return out


SETTINGS: dict[str, Declared] = _declared()  # by name, in declaration order (common, drafting, viasd, cascade)


def check_setting(d: Declared, value) -> object:
    """`value` checked against `d`'s declaration: its type and range (UsageError with a one-line message)."""
    name, s = d.name, d.spec
    if value is None and d.optional:
        return None
    if d.kind == "int":
        return check_int(name, value, None if s.lo is None else int(s.lo), None if s.hi is None else int(s.hi))
    if d.kind == "float":
        return check_float(name, value, s.lo, s.hi, lo_open=s.lo_open, allow_inf=s.allow_inf)
    if d.kind == "bool":
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True{', False or None' if d.optional else ' or False'}, got {value!r}")
        return value
    if d.kind == "choice":
        assert s.choices is not None  # (declared with the setting)
        return check_choice(s.label or name, value, s.choices)
    if d.kind == "format":
        grammar_of(value)  # the shape, then the library's own verdict on the schema, regex or grammar
        return value
    if d.kind == "bias":
        assert s.lo is not None and s.hi is not None  # (declared with the setting)
        return bias_of(value, s.lo, s.hi)
    if d.kind == "layers":
        assert s.lo is not None and s.hi is not None  # (declared with the setting)
        layers = check_layers(name, value)
        if layers is None:  # (None is accepted above where the setting is optional)
            raise InvalidArgumentError(f"{name} must be a list of layer indices, got None")
        if len(layers) > s.hi + 1:
            raise InvalidArgumentError(f"{name} lists {len(layers)} layers, more than {int(s.hi) + 1}")
        return tuple(check_int(f"{name} entry", x, int(s.lo), int(s.hi)) for x in layers)
    if not isinstance(value, (str, os.PathLike)):  # a file
        raise InvalidArgumentError(f"{name} must be a file path, got {value!r}")
    return check_text(name, value) if isinstance(value, str) else value


def bias_of(value, lo: float = -100.0, hi: float = 100.0) -> dict[int, float]:
    """A logit_bias as {token id: bias}: a mapping whose keys are ids (ints, or their decimal text as JSON
    gives them) and whose values are numbers in [lo, hi]. The ids' vocabulary bound: `check_bias_ids`."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"logit_bias must map token ids to biases, got {value!r}"[:200])
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            tid = key
        else:
            raise InvalidArgumentError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}"[:200])
        if tid in out:
            raise InvalidArgumentError(f"logit_bias gives token id {tid} twice")
        out[tid] = check_float(f"logit_bias[{tid}]", bias, lo, hi)
    return out


def check_bias_ids(value, vocab_size: int) -> None:
    """A logit_bias' token ids within a model's vocabulary (checked once the model is loaded)."""
    bad = sorted(t for t in bias_of(value or {}) if t >= vocab_size)
    if bad:
        raise InvalidArgumentError(f"logit_bias names token id {bad[0]}, outside the vocabulary: ids must be in [0, {vocab_size})")


def check_settings(settings: dict) -> None:
    """Every setting of `settings` (flat names) against its declaration."""
    for name, value in settings.items():
        check_setting(SETTINGS[name], value)


def range_text(d: Declared) -> str:
    """The declared range, as help text shows it ("[0, 64]", "(0, 1]", "[0, inf)")."""
    s = d.spec
    if s.lo is None and s.hi is None:
        return ""
    num = (lambda x: str(int(x))) if d.kind in ("int", "layers") else (lambda x: f"{x:g}")  # noqa: E731
    lo = "" if s.lo is None else num(s.lo)
    hi = "inf" if s.allow_inf or s.hi is None else num(s.hi)
    return f"{'(' if s.lo_open else '['}{lo}, {hi}{')' if hi == 'inf' else ']'}"


def preflight_files(c) -> None:
    """Read the route and thresholds files a GenerateConfig names, before any model is loaded, so a
    missing or malformed file is reported in a second (the model match is checked after loading)."""
    for name in ("draft_route", "slim_route"):
        if getattr(c, name) is not None:
            Route.load(getattr(c, name))
    if c.thresholds is not None:
        load_thresholds(Path(c.thresholds))


def parse_value(d: Declared, text: str) -> object:
    """A setting's value from text (a command-line or method option), by its declared kind."""
    if d.kind == "bool":
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise InvalidArgumentError(f"{d.name} must be true or false, got {text!r}")
    if d.optional and text.lower() == "none":
        return None
    if d.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise InvalidArgumentError(f"{d.name} must be an integer, got {text!r}") from None
    if d.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise InvalidArgumentError(f"{d.name} must be a number, got {text!r}") from None
    if d.kind == "bias":
        return parse_bias(text)
    if d.kind == "layers":
        try:
            return tuple(int(x) for x in text.replace(",", " ").replace("/", " ").split())  # (bench methods: 0/1/5)
        except ValueError:
            raise InvalidArgumentError(f"{d.name} must be layer indices, got {text!r}") from None
    return text


def parse_bias(text: str) -> dict[int, float]:
    """A logit_bias from text: ID=BIAS pairs separated by commas, spaces or '/' (a bench method's option:
    commas separate methods there); the range is checked with the other settings."""
    out: dict[int, float] = {}
    for item in text.replace(",", " ").replace("/", " ").split():
        tid, eq, bias = item.partition("=")
        try:
            if not eq or not re.fullmatch(r"-?[0-9]+", tid.strip()):  # (a negative id: bias_of's range error)
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise InvalidArgumentError(f"logit_bias must be ID=BIAS pairs (a token id, a number), got {item!r}") from None
    return out


# ------------------------------------------------------------------------------ command-line flags

_CLI_GROUPS = {"viasd": "viasd (--strategy viasd)", "cascade": "cascade (--strategy cascade)"}


def add_arguments(parser, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None, defaults: dict | None = None) -> None:
    """One flag per setting (less `skip`, or `only` those) on an argparse parser: type, choices, default
    (or `defaults`' for this command) and help from the declaration; the ranges are checked by
    `GenerateConfig.validate`, with the API's messages."""
    import argparse

    groups, defaults = {}, defaults or {}
    for d in SETTINGS.values():
        if d.name in skip or (only is not None and d.name not in only):
            continue
        if d.kind == "format":
            _add_format(parser)
            continue
        d = dataclasses.replace(d, default=defaults.get(d.name, d.default))
        s = d.spec
        if s.group and s.group not in groups:
            groups[s.group] = parser.add_argument_group(_CLI_GROUPS[s.group])
        where = groups[s.group] if s.group else parser
        extra = range_text(d)
        help_ = s.help + (f" {extra}" if extra else "") + ("" if d.default is None else " (default: %(default)s)")
        kw: dict = {"dest": d.name, "default": d.default, "help": help_}
        if d.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif d.kind == "layers":
            kw.update(type=int, nargs="+", metavar=s.metavar or "L")
        elif d.kind == "choice":
            kw["choices"] = s.choices
        elif d.kind == "file":
            kw["metavar"] = s.metavar
        elif d.kind == "bias":
            kw.update(action="append", metavar=s.metavar)  # (parsed by from_args: a bad pair is a one-line UsageError)
            # "-1=5" is this flag's value (and gets the range error), not an unknown option: argparse >= 3.13's reading
            parser._negative_number_matcher = re.compile(r"-\.?[0-9]")
        else:
            kw["type"] = int if d.kind == "int" else float
        where.add_argument(*d.flags, **kw)


def _add_format(parser) -> None:
    """`response_format`'s flags: one of a JSON schema file, any JSON object, a regex, a Lark grammar file."""
    group = parser.add_argument_group("structured output (every strategy; lossless ones stay lossless)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE.json", dest="fmt_json_schema",
                     help="the output is JSON valid under this JSON schema (strict)")
    one.add_argument("--json-object", action="store_true", dest="fmt_json", help="the output is a JSON object")
    one.add_argument("--regex", metavar="R", dest="fmt_regex", help="the output matches this regular expression")
    one.add_argument("--grammar", metavar="FILE.lark", dest="fmt_grammar",
                     help="the output follows this Lark grammar (llguidance's syntax; %%json {schema} embeds a JSON schema)")


def format_from_args(args) -> dict | None:
    """The `response_format` the structured-output flags give (their files read), or None."""
    from viasd.validation import read_capped, read_json, require_schema

    if getattr(args, "fmt_json_schema", None):
        schema = require_schema(read_json(Path(args.fmt_json_schema), "JSON schema"), args.fmt_json_schema)
        return {"type": "json_schema", "json_schema": {"name": Path(args.fmt_json_schema).stem, "schema": schema, "strict": True}}
    if getattr(args, "fmt_json", False):
        return {"type": "json_object"}
    if getattr(args, "fmt_regex", None) is not None:
        return {"type": "regex", "regex": args.fmt_regex}
    if getattr(args, "fmt_grammar", None):
        return {"type": "grammar", "grammar": read_capped(Path(args.fmt_grammar), "grammar").decode("utf-8", "replace")}
    return None


def from_args(args) -> dict:
    """The settings an argparse namespace holds (flags added by `add_arguments`), by their names
    (UsageError: a --logit-bias that is no ID=BIAS pair)."""
    out = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    if hasattr(args, "fmt_json"):
        out["response_format"] = format_from_args(args)
    for name, d in SETTINGS.items():
        if d.kind == "layers" and out.get(name) is not None:
            out[name] = tuple(out[name])
        if d.kind == "bias" and isinstance(out.get(name), list):  # (--logit-bias given more than once: merged)
            out[name] = {k: v for part in out[name] for k, v in parse_bias(part).items()}
    return out
