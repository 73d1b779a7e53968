"""A tokenizer as cross-vocabulary drafting sees it: the bytes every token id stands for, and text -> ids.

Decoding a sequence of ids is then the concatenation of their bytes, exactly, for the two kinds of
tokenizer the zoo's families use: byte-level BPE (GPT-2's byte-to-unicode alphabet: SmolLM2, Qwen)
and SentencePiece-style BPE with byte fallback (Gemma: U+2581 for a space, `<0xNN>` for a byte).
Added tokens (`<|im_end|>`, `<end_of_turn>`) stand for their own text and are marked special when
the tokenizer says so. Ids the tokenizer does not define (an LM head padded past the vocabulary)
stand for nothing (b"").
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from viasd.errors import VocabularyMismatchError

SPACE_MARK = "\u2581"  # SentencePiece's visible space
JOIN_BYTES = 32  # the longest run of drafted bytes `VocabBridge.joined` tries as one verifier token


@dataclass(frozen=True, eq=False)
class Vocabulary:
    pieces: tuple[bytes, ...]  # [n_ids] the bytes of each id (b"": none)
    special: frozenset[int]  # ids of special (control) tokens
    encode: Callable[[str], list[int]]  # text -> ids, no special tokens added (those in the text are parsed)
    kind: str  # "byte-level" or "sentencepiece"

    def text_bytes(self, ids: list[int]) -> bytes:
        return b"".join(self.pieces[i] for i in ids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def vocabulary_of(tokenizer, n_ids: int, name: str = "model") -> Vocabulary:
    """The `Vocabulary` of a transformers fast tokenizer, over ids 0 .. n_ids-1 (the LM head's width)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise VocabularyMismatchError(f"{name}: cross-vocabulary drafting needs a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    model, decoder = spec.get("model", {}), json.dumps(spec.get("decoder"))
    vocab: dict[str, int] = model.get("vocab") if isinstance(model.get("vocab"), dict) else {}
    if model.get("type") == "BPE" and '"ByteLevel"' in decoder:
        kind, table = "byte-level", _byte_decoder()
        piece = lambda s: bytes(table[c] for c in s) if all(c in table for c in s) else s.encode()  # noqa: E731
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        kind = "sentencepiece"

        def piece(s: str) -> bytes:
            if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
                return bytes([int(s[3:5], 16)])
            return s.replace(SPACE_MARK, " ").encode()
    else:
        raise VocabularyMismatchError(f"{name}: cross-vocabulary drafting needs a byte-level or SentencePiece BPE tokenizer, "
                         f"not a {model.get('type')} one")
    pieces = [b""] * n_ids
    for token, i in vocab.items():
        if 0 <= i < n_ids:
            pieces[i] = piece(token)
    special = set()
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if 0 <= i < n_ids:
            pieces[i] = added["content"].encode()
            if added.get("special"):
                special.add(i)
    # (the tokenizers backend itself: transformers' wrapper doubled a call's time, run each drafting round)
    return Vocabulary(tuple(pieces), frozenset(special), lambda text: backend.encode(text, add_special_tokens=False).ids, kind)


class VocabBridge:
    """A verifier's and a drafter's vocabularies, and the tokens they share: same bytes, both special
    or both not."""

    def __init__(self, verifier: Vocabulary, drafter: Vocabulary):
        self.verifier, self.drafter = verifier, drafter
        # (bytes, special) -> the verifier's id: what a drafter token maps to, and what drafted text joins into
        index = self._verifier_index = {(b, i in verifier.special): i for i, b in enumerate(verifier.pieces) if b}
        to_v = [index.get((b, j in drafter.special), -1) if b else -1 for j, b in enumerate(drafter.pieces)]
        self.to_verifier = torch.tensor(to_v, dtype=torch.long)  # [V_drafter] verifier id, -1: none
        self.shared = tuple(j for j, i in enumerate(to_v) if i >= 0)  # drafter ids, ascending

    @functools.cached_property
    def by_bytes(self) -> tuple[list[int], list[bytes]]:
        """The drafter's non-special ids sorted by their bytes, and those bytes: the ids whose bytes
        start with a prefix are one range of them."""
        d = self.drafter
        ranked = sorted((b, j) for j, b in enumerate(d.pieces) if b and j not in d.special)
        return [j for _, j in ranked], [b for b, _ in ranked]

    @functools.cached_property
    def _by_piece(self) -> dict[bytes, int]:
        order, keys = self.by_bytes  # (ids of equal bytes ascend: reversed, the lowest is written last)
        return dict(zip(reversed(keys), reversed(order)))

    def joined(self, segments: Sequence[bytes]) -> list[int] | None:
        """Verifier ids for the bytes of `segments` (drafted drafter pieces), each the longest
        verifier token made of whole segments from where the one before ended; None where some
        segment's bytes start no such token (a verifier token would split it). A dictionary walk in
        place of the verifier's tokenizer, which costs 0.2-0.35 ms right after a pass: on smollm2's
        tokens of the 1.5B's text it gave the tokenizer's ids in 593 of 623 six-token windows, None in
        26 (the tokenizer's turn) and other ids in 4 (drafts the verifier judges like any other)."""
        index, out, i = self._verifier_index, [], 0
        while i < len(segments):
            if not segments[i]:  # (a healed token drafted again: nothing new)
                i += 1
                continue
            best, run = None, b""
            for j in range(i, len(segments)):
                run += segments[j]
                if len(run) > JOIN_BYTES:
                    break
                if (t := index.get((run, False))) is not None:
                    best = (t, j + 1)
            if best is None:
                return None
            out.append(best[0])
            i = best[1]
        return out

    def piece_id(self, piece: bytes) -> int | None:
        """The drafter's (lowest, not special) id whose bytes are `piece`, or None."""
        return self._by_piece.get(piece)

    def extensions(self, piece: bytes) -> tuple[int, ...]:
        """The drafter ids whose bytes start with `piece` (not special), in the order of their bytes: a
        range of `by_bytes` (Python ints: a drafting round asks, right after a pass)."""
        order, keys = self.by_bytes
        lo = bisect.bisect_left(keys, piece)
        return tuple(order[lo : bisect.bisect_left(keys, piece + b"\xff" * 64, lo)])  # (no piece is 64 bytes of 0xff)

    def shared_within(self, verifier_ids: tuple[int, ...] | None) -> tuple[int, ...]:
        """The shared drafter ids whose verifier tokens are in `verifier_ids` (None: all shared)."""
        if verifier_ids is None:
            return self.shared
        keep = set(verifier_ids)
        return tuple(j for j in self.shared if int(self.to_verifier[j]) in keep)


def same_vocabulary(verifier, drafter) -> bool:
    """Whether a drafter speaks the verifier's token ids (two `LoadedModel`s; else its drafts go through
    text: `decoding.crossvocab`). Vocabularies of different sizes differ without reading them."""
    a, b = verifier.tokenizer, drafter.tokenizer
    return a is b or len(a) == len(b) and _vocabulary_digest(a) == _vocabulary_digest(b)


_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocabulary_digest(tokenizer) -> str:
    """sha256 of a tokenizer's tokens in id order (and their count), once per tokenizer (compared in
    this process only): every request with a drafter asks. Reading a 151k vocabulary takes 0.15 s
    this way; sorted by token, 0.33 s (the first `sd` call of a process paid 0.67 s for its two models)."""
    if (digest := _digests.get(tokenizer)) is None:
        vocab = tokenizer.get_vocab()  # token -> id
        by_id: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            by_id[i] = token
        digest = _digests[tokenizer] = hashlib.sha256(json.dumps([len(vocab), by_id]).encode()).hexdigest()
    return digest
