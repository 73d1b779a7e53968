"""Drafting with a model of another vocabulary: a drafter reads and writes text, not ids.

Two conversions, as in transformers' universal assisted generation and its lossless variant
(Timor et al., ICML 2025, "Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies"):

- **text** (greedy; UAG): the drafter drafts in its own vocabulary; the drafted bytes are encoded with
  the verifier's tokenizer, the verifier's last committed tokens before them (so a token spanning the
  junction is seen), and the last converted token is dropped (the text after it may still extend it).
  The verifier judges its own tokens, so greedy output is `ar`'s whatever the drafts. Drafts carry no
  probabilities (q = None), like prompt lookup's.
- **intersection** (any sampling; TLI, "token-level intersection"): the drafter drafts only tokens whose
  bytes are also one verifier token (its reduced LM head over the shared tokens), each mapped 1:1, and
  its distribution over them is q over the verifier's vocabulary (0 elsewhere). Standard speculative
  sampling against p is then lossless, as for any proposal distribution.

Either way the drafter's context follows the committed text incrementally (`DrafterContext`): only
the new text and a few tokens before it are re-encoded each round, and the drafter's KV cache is
rolled back to the longest common prefix of its old and new ids.
"""

from __future__ import annotations

import bisect
from enum import StrEnum

import torch

from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.drafters import NO_DRAFT, Draft, ModelDrafter, common_prefix
from viasd.decoding.session import CallKind, Session, pass_bytes
from viasd.models.decoder import Decoder
from viasd.models.layers import ReducedHead
from viasd.models.vocabulary import VocabBridge

LOOKBEHIND = 3  # drafter tokens before the new text that are re-encoded with it (a merge across the junction)
JUNCTION = 3  # committed verifier tokens encoded with drafted text (a token spanning the junction)


class Conversion(StrEnum):
    AUTO = "auto"  # intersection when the loop needs draft probabilities (sampling, cascade, tiered), else text
    TEXT = "text"
    INTERSECTION = "intersection"


def complete_utf8(data: bytes) -> str:
    """`data` as text, less a trailing incomplete UTF-8 sequence (its bytes come with the next token);
    invalid bytes elsewhere become U+FFFD."""
    for back in range(1, min(4, len(data)) + 1):  # the last lead byte within the final 4
        b = data[-back]
        if b & 0xC0 != 0x80:  # not a continuation byte
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            if need > back:
                data = data[:-back]
            break
    return data.decode("utf-8", errors="replace")


class DrafterContext:
    """The drafter's ids for the text of the committed verifier ids, updated incrementally.

    Invariant: `text` = the bytes of `v_ids`; `d_ids` encode `text` (but a trailing incomplete UTF-8
    character); `v_ends[i]` / `d_ends[i]` = the byte where token i ends.

    Where the committed text repeats the drafter's last draft (`drafted`), the drafted ids are kept as
    they were drafted, and what follows them, if one drafter token, is looked up: no encode. Right
    after a verifier pass, with the caches cold, an encode costs ~0.2 ms (a tenth of a smollm2 pass)."""

    def __init__(self, bridge: VocabBridge):
        self.bridge = bridge
        self.v_ids: list[int] = []
        self.v_ends: list[int] = []
        self.text = bytearray()
        self.d_ids: list[int] = []
        self.d_ends: list[int] = []
        self.draft: tuple[int, list[int]] | None = None  # (n, ids): the last draft, following d_ids[:n]

    def drafted(self, n: int, tokens: list[int]) -> None:
        """The drafter drafted `tokens` after its first `n` ids of the context."""
        self.draft = (n, tokens)

    def update(self, context: list[int]) -> list[int]:
        """The drafter's ids for `context` (verifier ids, prompt included)."""
        pieces = self.bridge.verifier.pieces
        c = common_prefix(self.v_ids, context)
        kept = self.v_ends[c - 1] if c else 0
        del self.v_ids[c:], self.v_ends[c:], self.text[kept:]
        for t in context[c:]:
            self.text += pieces[t]
            self.v_ids.append(t)
            self.v_ends.append(len(self.text))
        draft, self.draft = self.draft, None
        if c == len(context) and len(self.d_ends) and self.d_ends[-1] == len(self.text):
            return self.d_ids
        if draft is not None and self._follow(*draft, kept):
            return self.d_ids
        s = max(0, bisect.bisect_right(self.d_ends, kept) - LOOKBEHIND)  # drafter tokens kept as they are
        begin = self.d_ends[s - 1] if s else 0
        new = self.bridge.drafter.encode(complete_utf8(bytes(self.text[begin:])))
        d_pieces = self.bridge.drafter.pieces
        ends, end = [], begin
        for t in new:
            end += len(d_pieces[t])
            ends.append(end)
        self.d_ids[s:], self.d_ends[s:] = new, ends
        return self.d_ids

    def _follow(self, n: int, tokens: list[int], kept: int) -> bool:
        """Whether the text past byte `kept` (what changed) is the draft's tokens after d_ids[:n], as
        many as the text repeats, then nothing or one drafter token that does not merge with the one
        before it (" fresh" + "ly" is " freshly"; a drafter read worse after the split); if so they
        become d_ids."""
        d = self.bridge.drafter
        end = self.d_ends[n - 1] if n else 0
        if end > kept:
            return False
        ids: list[int] = []
        ends: list[int] = []
        for t in tokens:
            piece = d.pieces[t]
            if t in d.special or self.text[end : end + len(piece)] != piece:
                break
            end += len(piece)
            ids.append(t)
            ends.append(end)
        if end < len(self.text):  # (the verifier's token after the draft: kept where it starts a drafter token)
            rest = bytes(self.text[end:])
            before = d.pieces[ids[-1]] if ids else d.pieces[self.d_ids[n - 1]] if n else b""
            last = self.bridge.piece_id(rest)
            if last is None or self.bridge.piece_id(before + rest) is not None:
                return False
            ids.append(last)
            ends.append(len(self.text))
        self.d_ids[n:], self.d_ends[n:] = ids, ends
        return True


class CrossVocabDrafter(ModelDrafter):
    """A drafter model with another tokenizer (`VocabBridge`), by either `Conversion`.

    `head` (intersection): the drafter's reduced LM head over the shared tokens (or a subset of them).
    `max_len` of the drafter's cache: `ratio` drafter tokens per verifier position (a drafter with
    shorter tokens needs more); past it, no drafts (the verifier decodes alone)."""

    def __init__(self, decoder: Decoder, bridge: VocabBridge, conversion: Conversion, params: SamplingParams,
                 generator: torch.Generator | None, threshold: float | None, head: ReducedHead | None = None,
                 eos: frozenset[int] = frozenset(), ratio: float = 3.0, probs: bool = True, window: int = 0):
        if conversion is Conversion.AUTO:
            raise ValueError("choose the conversion (api.draft_conversion resolves auto)")
        if conversion is Conversion.TEXT and not params.greedy:
            raise ValueError("text conversion is greedy only: sampling needs the intersection (TLI)")
        if conversion is Conversion.INTERSECTION and head is None:
            raise ValueError("intersection drafting needs the drafter's head over the shared tokens")
        super().__init__(decoder, params, generator, threshold, head, probs, window)
        self.bridge, self.conversion, self.eos, self.ratio = bridge, conversion, eos, ratio
        self.context = DrafterContext(bridge)
        self._shared = torch.tensor(bridge.shared, dtype=torch.long)  # [n_shared]
        bridge.piece_id(b"")  # (the drafter's tokens by their bytes: indexed here, not in a drafting round)

    def begin(self, max_len: int, session: Session) -> None:
        self.stats, self.passes = session.stats, session.passes
        if getattr(session, "source", None) is not None:
            raise ValueError("cross-vocabulary drafting needs a decoder-only session")
        self.context = DrafterContext(self.bridge)
        prompt = self.context.update(list(session.tokens))
        self.capacity = int(len(prompt) + self.ratio * (max_len - len(session.tokens))) + 8
        self.cache = self.decoder.new_cache(self.capacity)
        self.cached_ids = []
        self._window(prompt)
        prompt = prompt[self.offset :]
        if len(prompt) > 1:  # the prompt but its last token, as ModelDrafter does (prefill work)
            self.passes.forward(self.decoder, torch.tensor(prompt[:-1]), 0, self.cache, logits=False)
            self.stats.observe_call(CallKind.DRAFT, bytes_read=pass_bytes(self.decoder, None, head=False))
            self.cached_ids = list(prompt[:-1])

    def propose(self, context: list[int], k: int) -> Draft:
        ids = self.context.update(context)
        if not ids or k <= 0 or len(ids) + 2 * k + 2 > self.capacity:
            return NO_DRAFT
        if self.conversion is Conversion.INTERSECTION:
            return self._mapped(ids, k)
        return self._through_text(context, ids, k)

    def _mapped(self, ids: list[int], k: int) -> Draft:
        tokens, probs = self.draft_ids(ids, k)
        self.context.drafted(len(ids), tokens)
        if not tokens:
            return NO_DRAFT
        if probs is None:  # (a drafter that keeps no q: greedy, for a loop that reads none)
            return Draft(self.bridge.to_verifier[torch.tensor(tokens)].tolist(), None)
        shared = self._shared
        # [k', V_verifier]: q moved to the verifier's ids of the shared tokens (0 elsewhere; every
        # drafted id is shared: the head scores no others)
        q = torch.zeros(len(tokens), len(self.bridge.verifier.pieces), dtype=probs.dtype)
        q[:, self.bridge.to_verifier[shared]] = probs[:, shared]
        return Draft(self.bridge.to_verifier[torch.tensor(tokens)].tolist(), q)

    def _through_text(self, context: list[int], ids: list[int], k: int) -> Draft:
        """Token healing (as guidance does it): the committed text's last
        drafter token is drafted again, as any token that starts with its bytes. A text that ends in
        "\n" ends in the drafter token "\n", which training text shows only before a non-space: an
        indented line then drafts as "\n    ", which this lets the drafter choose. Where the drafter
        draws that token itself again, which is most often, healing costs no pass (`draft_ids`' guess)."""
        v, d = self.bridge.verifier, self.bridge.drafter
        base = v.text_bytes(context[-JUNCTION:])
        healed = d.pieces[ids[-1]] if len(ids) > 1 and ids[-1] not in d.special else b""
        converted: list[int] = []

        def text_of(tokens: list[int]) -> list[bytes]:  # the drafted pieces, less the healed bytes
            pieces = [d.pieces[t] for t in tokens if t not in self.eos]
            if pieces and healed:
                pieces[0] = pieces[0][len(healed):]  # (a healed draft starts with them: `extensions`)
            return pieces

        def enough(tokens: list[int]) -> bool:  # k + 1 verifier tokens (the last may be incomplete), or an end
            nonlocal converted
            # (k + 1 tokens of new text before the first try: fewer made k + 1 verifier tokens in 6 of
            # 267 tries, smollm2 drafting for the 1.5B, and each try is an encode)
            if tokens[-1] not in self.eos and len(tokens) - (1 if healed and d.pieces[tokens[0]] == healed else 0) <= k:
                return False
            converted = self._convert(base, text_of(tokens), tokens[-1])
            return tokens[-1] in self.eos or len(converted) > k

        if healed:  # (its own token, most often drawn again: read in the first pass with the context)
            tokens, _ = self.draft_ids(ids[:-1], 2 * k + 2, enough, self.bridge.extensions(healed), guess=ids[-1])
        else:
            tokens, _ = self.draft_ids(ids, 2 * k + 2, enough)
        self.context.drafted(len(ids) - bool(healed), tokens)
        ended = bool(tokens) and tokens[-1] in self.eos
        pieces = text_of(tokens)
        if tokens and not converted:
            converted = self._convert(base, pieces, tokens[-1])
        kept = converted[:k] if ended else converted[: min(k, len(converted) - 1)]
        drafted, got = b"".join(pieces), v.text_bytes([t for t in kept if t not in v.special])
        self.stats.observe_conversion(len(drafted), common_prefix(list(drafted), list(got)))  # (bytes as they came)
        return Draft(kept, None) if kept else NO_DRAFT

    def _convert(self, base: bytes, pieces: list[bytes], last: int) -> list[int]:
        """Verifier ids of the drafted `pieces`' bytes following the committed `base` bytes: the
        longest verifier tokens of whole pieces (`VocabBridge.joined`), else the verifier's
        tokenization that starts exactly at the junction (of the drafted text alone where the
        verifier's spans it); the drafter's end token `last` becomes the verifier's own where they
        share it."""
        end_id = int(self.bridge.to_verifier[last]) if last in self.eos else None
        out = self.bridge.joined(pieces)
        if out is None:
            out = self._encoded(base, b"".join(pieces))
        return out + [end_id] if end_id is not None and end_id >= 0 else out

    def _encoded(self, base: bytes, drafted: bytes) -> list[int]:
        v = self.bridge.verifier
        ids, end, out = v.encode(complete_utf8(base + drafted)), 0, None
        for i, t in enumerate(ids):
            if end == len(base):
                out = ids[i:]
                break
            end += len(v.pieces[t])
            if end > len(base):
                break
        if out is None and end != len(base):
            self.stats.observe_conversion(0, 0, junction=True)
            out = v.encode(complete_utf8(drafted))
        return out or []
