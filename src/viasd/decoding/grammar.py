"""Grammar-constrained decoding: which tokens may come next, and which ones the grammar forces.

A request's `response_format` (OpenAI's `json_object` / `json_schema`, or viasd's `regex` / `grammar`
(Lark)) compiles to an llguidance grammar; a `Constraint` follows the request's committed tokens
through an llguidance `LLMatcher`. The verifier masks the logits of every row it returns with the
grammar's state at that row (`Constraint.mask`), so every loop's acceptance rule runs against the
masked distribution and a lossless strategy's constrained output is constrained `ar`'s.

Tokens the grammar alone determines (`LLMatcher.compute_ff_tokens`: braces, quotes, key names) are
drafted for free by `GrammarDrafter`, in front of the drafter's own proposal, which is cut to its
longest grammar-valid prefix; a tokenization the model would not choose is rejected like any draft.

llguidance over xgrammar: on qwen2.5's 152k vocabulary a mask took 37 us (median) against a JSON
schema, the forced tokens under 1 us, and it is one wheel with no dependencies (xgrammar 0.2.8 pulls
triton and tvm-ffi).

A constraint must allow some finite answer: one with none (an unsatisfiable schema, `false`, a regex
matching nothing, a `$ref` that only recurses) is refused up front (`grammar_of`), found on a byte-level
vocabulary by the matcher's own state and by following the text the grammar forces. Objects that name
their properties and say nothing of others get `additionalProperties: false` (xgrammar's strict mode
does the same): a free extra key is where a model repeats keys (`{"n":1,"":1,"":1`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from viasd.errors import InvalidArgumentError

if TYPE_CHECKING:
    import llguidance

FORCED_MAX = 16  # grammar-forced tokens drafted in one round at most (the caches keep room for them)
GRAMMAR_MAX_CHARS = 1 << 17  # a schema, regex or grammar longer than this is refused before it compiles
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf
_LIMITS_HIT = "Too many items"  # llguidance's parser error once a grammar's state outgrows LLParserLimits


def _limits():
    import llguidance

    # llguidance's own defaults but a smaller grammar: a request's compile must not stall the server
    return llguidance.LLParserLimits(max_grammar_size=200_000)


def grammar_of(response_format: dict | None) -> str | None:
    """The llguidance grammar of a `response_format` (None: unconstrained); InvalidArgumentError with
    the library's own message for a schema, regex or grammar it refuses.

    Shapes (OpenAI's, plus two of viasd's): {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}},
    {"type": "regex", "regex": "..."}, {"type": "grammar", "grammar": "<Lark>"}."""
    import llguidance

    kind, body = check_format(response_format)
    if kind == "text":
        return None
    what = kind.replace("_", " ")
    if kind in ("json_object", "json_schema"):
        if body is False:
            raise InvalidArgumentError("response_format: invalid json schema: the schema is false, which no JSON value "
                                       "satisfies")
        schema = {"type": "object"} if kind == "json_object" else closed_objects({} if body is True else body)
        # compact JSON, as the models print it: no free whitespace between tokens the grammar forces
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(body)
    else:
        grammar = llguidance.LLMatcher.grammar_from_lark(body)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=_limits())
    if error and not error.startswith("WARNING"):
        raise InvalidArgumentError(f"response_format: invalid {what}: {error.strip()}")
    why = _no_answer(grammar)
    if why:
        raise InvalidArgumentError(f"response_format: invalid {what}: {why}")
    return grammar


FORCED_CHECK_BYTES = 1 << 20  # forced text followed up front at most (a{100000} is a valid regex)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # (a list of items: draft 4's tuples)
_SCHEMA_ONES = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "unevaluatedProperties", "propertyNames")
_INTERSECTING = ("allOf", "not", "if", "then", "else", "dependentSchemas")
_NOTES = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default", "examples"}
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _rebuilt(schema: dict, f) -> dict:
    """A copy of `schema` with `f` applied to each of its direct subschemas (never to `const`, `enum`, ...)."""
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: f(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [f(v) for v in value]
        elif key in _SCHEMA_ONES and isinstance(value, dict):
            out[key] = f(value)
    return out


def closed_objects(schema):
    """`schema` with `additionalProperties: false` on every object schema that names properties and says
    nothing of other keys. Not in a schema where subschemas intersect (`allOf`, a `$ref` or `anyOf` beside
    other keywords, ...): a closed part would forbid the keys the other part adds. A copy."""
    intersecting = False

    def scan(s):
        nonlocal intersecting
        if isinstance(s, dict):
            intersecting |= (any(k in s for k in _INTERSECTING) or "$ref" in s and not set(s) <= _NOTES
                             or "properties" in s and ("anyOf" in s or "oneOf" in s))
            _rebuilt(s, scan)
        return s

    def close(s):
        if not isinstance(s, dict):
            return s
        out = _rebuilt(s, close)
        if out.get("properties") and not any(k in out for k in _OPEN):
            out["additionalProperties"] = False
        return out

    scan(schema)
    return schema if intersecting else close(schema)


class _ByteTokens:
    """A vocabulary of the 256 bytes and an end token: a grammar checked on it needs no model."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


_byte_tokenizer = None


def _no_answer(grammar: str) -> str | None:
    """Why `grammar` allows no finite text (None: it may allow some), on a byte-level vocabulary: the
    matcher stops before any byte (nothing can start), or the text it forces runs into the parser's
    limits (a `$ref` or rule that only recurses, a repeat too large to build). A grammar naming a model's
    special tokens cannot be read on bytes: the model's own vocabulary checks it once loaded."""
    import llguidance

    global _byte_tokenizer
    if _byte_tokenizer is None:
        _byte_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()), slices=[])
    matcher = llguidance.LLMatcher(_byte_tokenizer, grammar, log_level=0, limits=_limits())
    if matcher.is_error():
        return None
    matcher.compute_logit_bias()  # (the first mask: where the matcher finds that nothing can start)
    if matcher.is_stopped() and not matcher.is_accepting():
        return "no text satisfies it (an unsatisfiable schema, a regex that matches nothing, a $ref or rule that only recurses)"
    followed = 0
    while followed < FORCED_CHECK_BYTES and not matcher.is_stopped():
        forced = matcher.compute_ff_bytes()
        if not forced or not matcher.consume_tokens(list(forced)) or matcher.is_error():
            break
        followed += len(forced)
    if matcher.is_error():
        error = matcher.get_error().strip().splitlines()[0].split("; try ")[0]  # (llguidance's tip is for grammar authors)
        return (f"no finite text satisfies it: the text it alone determines runs past the parser's limits ({error}); "
                "a $ref or rule that only recurses, or a repeat too large?")
    return None


def check_format(response_format: dict | None) -> tuple[str, Any]:  # (the body's type follows the kind's)
    """`response_format`'s shape checked: (its type, the schema / regex / grammar text it carries)."""
    if response_format is None:
        return "text", None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidArgumentError(f"response_format must be an object with a 'type', got {response_format!r:.200}")
    kind = response_format["type"]
    if kind not in FORMAT_TYPES:
        raise InvalidArgumentError(f"response_format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
    if kind in ("text", "json_object"):
        return kind, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgumentError("response_format json_schema must be {'name': ..., 'schema': {...}, 'strict': bool}")
        if not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidArgumentError(f"response_format json_schema's schema must be a JSON object or a boolean, "
                                       f"got {spec['schema']!r:.100}")
        body = spec.get("schema", {})
        text = json.dumps(body)
    else:
        body = response_format.get(kind)
        if not isinstance(body, str) or not body:
            raise InvalidArgumentError(f"response_format type {kind!r} needs a non-empty string {kind!r}")
        text = body
    if len(text) > GRAMMAR_MAX_CHARS:
        raise InvalidArgumentError(f"response_format: the {kind.replace('_', ' ')} is {len(text)} characters, more than "
                                   f"the {GRAMMAR_MAX_CHARS} accepted")
    return kind, body


@dataclass
class Constraint:
    """A request's grammar, following its committed tokens (the generated ones, not the prompt).

    `mask` needs the tokens past the committed ones to be grammar-valid: drafts are cut first (`valid`)
    and tokens a masked distribution chose always are."""

    matcher: llguidance.LLMatcher  # at the state after the committed tokens
    vocab_size: int  # V, the logits' width (may exceed the tokenizer's)
    tokenizer: llguidance.LLTokenizer | None = None  # (tokenizes the forced bytes)
    committed: list[int] = field(default_factory=list)  # the tokens the matcher consumed

    def __post_init__(self) -> None:
        self._bits = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)
        # tokens consumed after the grammar stopped (end tokens: all its mask then allows), which the
        # matcher itself refuses; always the last ones, so rolling back takes them first
        self._after_stop = 0

    def _consume(self, tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            if self._after_stop or self.matcher.is_stopped():
                self._after_stop += len(tokens) - i
                return
            self._check(self.matcher.consume_token(t))

    def _rollback(self, n: int) -> None:
        virtual = min(n, self._after_stop)
        self._after_stop -= virtual
        if n > virtual:
            self._check(self.matcher.rollback(n - virtual))

    @classmethod
    def compile(cls, grammar: str, tokenizer, vocab_size: int) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise InvalidArgumentError(f"response_format: {matcher.get_error().strip()}")
        return cls(matcher, vocab_size, tokenizer)

    def _check(self, ok: bool) -> None:
        # llguidance's masks can allow a special token whose text a grammar spells (<tool_call>) that its
        # matcher then refuses: the request's grammar is at fault, so a usage error, not a crash
        if not ok or self.matcher.is_error():
            error = (self.matcher.get_error() or "the matcher refused a token its mask allowed").splitlines()[0]
            if _LIMITS_HIT in error or "too many" in error:  # the grammar outgrew the parser, whatever the tokens
                raise InvalidArgumentError(f"response_format: the grammar cannot follow the model's tokens: "
                                           f"{error.split('; try ')[0]}: its answers nest or repeat past the parser's "
                                           "limits (a $ref or rule that only recurses?)")
            raise InvalidArgumentError(f"response_format: the grammar cannot follow the model's tokens: {error} "
                                       "(a special token's text in a grammar? name the token instead)")

    def _compute(self, invert: bool = False) -> np.ndarray:
        """[V] uint8, 1 where the grammar allows the token next (`invert`: where it forbids it)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        words = self._bits.numpy()
        return np.unpackbits((np.invert(words) if invert else words).view(np.uint8), bitorder="little")[: self.vocab_size]

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        return torch.from_numpy(self._compute().view(bool))  # (0 or 1 bytes: a valid bool view, no copy)

    def _bias_into(self, row: np.ndarray) -> None:
        """row [V] float32 (seen as uint32) <- 0 where the grammar allows the token next, -inf elsewhere:
        an integer product of the forbidden bits with -inf's bit pattern, branch-free (torch.where on a
        152k-token row cost 3-10x more)."""
        np.multiply(self._compute(invert=True)[: row.shape[0]], _NEG_INF_BITS, out=row, dtype=np.uint32)

    def allowed_after(self, tokens: list[int]) -> torch.Tensor:
        """[V] bool: the tokens allowed after the committed ones and `tokens` (grammar-valid)."""
        self._consume(tokens)
        try:
            return self.allowed()
        finally:
            self._rollback(len(tokens))

    def mask(self, logits: torch.Tensor, ahead: list[int]) -> torch.Tensor:
        """logits [n_rows, V] of the last n_rows positions of (committed + ahead) -> a copy with each
        row's disallowed tokens at -inf. Rows before the last committed token (tiered VIA-SD's pending
        ones) take the grammar back over the committed tokens they predict, and forward again."""
        n_rows = logits.shape[0]
        back = max(0, n_rows - len(ahead) - 1)
        replay = self.committed[len(self.committed) - back :] if back else []
        self._rollback(back)
        seq = replay + ahead  # the tokens the rows predict, all but the last row's
        first = len(seq) + 1 - n_rows  # seq[:first] consumed before the first row's state
        self._consume(seq[:first])
        out = torch.empty(n_rows, logits.shape[-1], dtype=torch.float32)  # [n_rows, V]: 0 or -inf, then + logits
        bias = out.numpy().view(np.uint32)
        for i in range(n_rows):
            self._bias_into(bias[i])
            if i < n_rows - 1:
                self._consume([seq[first + i]])
        self._rollback(len(ahead))
        return out.add_(logits)  # (a new tensor: a pass' logits may be its buffer)

    def valid(self, tokens: list[int], ahead: Sequence[int] = ()) -> int:
        """How many of `tokens` (after the committed tokens and `ahead`) the grammar accepts in a row."""
        self._consume(list(ahead))
        if self._after_stop or self.matcher.is_stopped():  # only end tokens may follow
            n = next((i for i, t in enumerate(tokens) if not self.allowed()[t]), len(tokens))
        else:
            n = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        self._rollback(len(ahead))
        return n

    def forced(self, ahead: Sequence[int] = (), tail: bool = True) -> list[int]:
        """The tokens of what the grammar alone determines after the committed tokens and `ahead`.
        llguidance's own forced tokens (`compute_ff_tokens`) stop before the last token that could
        still merge with free text (`":"` after a key); with `tail`, the tokenizer's tokens of all the
        forced bytes instead, that one included: a guess the verifier may reject, which costs a row,
        where leaving it out costs a pass whenever it was right (a drafter model guesses it better)."""
        self._consume(list(ahead))
        try:
            if self._after_stop or self.matcher.is_stopped():
                return []
            forced_bytes = self.matcher.compute_ff_bytes()
            if not tail or not forced_bytes or self.tokenizer is None:
                return list(self.matcher.compute_ff_tokens())
            tokens = self.tokenizer.tokenize_bytes(forced_bytes)
            return tokens[: self.matcher.validate_tokens(tokens)]
        finally:
            self._rollback(len(ahead))

    def complete(self, end_ids) -> bool:
        """Whether the grammar allows nothing but an end token after the committed tokens (an answer
        that reached its budget there is whole, not cut)."""
        if self._after_stop or self.matcher.is_stopped():
            return True
        allowed = self.allowed().nonzero().flatten().tolist()
        return bool(allowed) and set(allowed) <= set(end_ids)

    def commit(self, tokens: list[int]) -> None:
        self._consume(list(tokens))
        self.committed += tokens

    def retract(self, n: int) -> None:
        self._rollback(n)
        del self.committed[len(self.committed) - n :]
