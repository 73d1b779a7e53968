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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from viasd.errors import InvalidArgumentError

FORCED_MAX = 16  # grammar-forced tokens drafted in one round at most (the caches keep room for them)
GRAMMAR_MAX_CHARS = 1 << 17  # a schema, regex or grammar longer than this is refused before it compiles
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf


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
    if kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if kind == "json_object" else body
        # compact JSON, as the models print it: no free whitespace between tokens the grammar forces
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(body)
    else:
        grammar = llguidance.LLMatcher.grammar_from_lark(body)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=_limits())
    if error and not error.startswith("WARNING"):
        raise InvalidArgumentError(f"response_format: invalid {kind.replace('_', ' ')}: {error.strip()}")
    return grammar


def check_format(response_format: dict | None) -> tuple[str, object]:
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
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InvalidArgumentError("response_format json_schema must be {'name': ..., 'schema': {...}, 'strict': bool}")
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

    matcher: object  # llguidance.LLMatcher, at the state after the committed tokens
    vocab_size: int  # V, the logits' width (may exceed the tokenizer's)
    tokenizer: object = None  # llguidance.LLTokenizer (tokenizes the forced bytes)
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

    def valid(self, tokens: list[int], ahead: list[int] = ()) -> int:
        """How many of `tokens` (after the committed tokens and `ahead`) the grammar accepts in a row."""
        self._consume(list(ahead))
        if self._after_stop or self.matcher.is_stopped():  # only end tokens may follow
            n = next((i for i, t in enumerate(tokens) if not self.allowed()[t]), len(tokens))
        else:
            n = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        self._rollback(len(ahead))
        return n

    def forced(self, ahead: list[int] = (), tail: bool = True) -> list[int]:
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

    def commit(self, tokens: list[int]) -> None:
        self._consume(list(tokens))
        self.committed += tokens

    def retract(self, n: int) -> None:
        self._rollback(n)
        del self.committed[len(self.committed) - n :]
