"""Drafters of another vocabulary (decoding/crossvocab.py): greedy output equals `ar`'s through either
conversion, sampled output (intersection, TLI) follows the verifier's distribution, the drafter's
context follows the committed text incrementally, and token bytes are exact on the zoo's tokenizers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support import GREEDY, NO_EOS, bpe_tokenizer, exact_marginals, run_ar, save_tiny
from viasd.api import generate
from viasd.decoding.acceptance import SamplingParams
from viasd.decoding.crossvocab import Conversion, CrossVocabDrafter, DrafterContext, complete_utf8
from viasd.decoding.strategies import speculative_decode
from viasd.decoding.session import DecodeRequest
from viasd.errors import UsageError, VocabularyMismatchError
from viasd.models.loading import load_model
from viasd.models.vocabulary import VocabBridge, Vocabulary, _byte_decoder

CORPUS_A = ["the quick brown fox jumps over the lazy dog", "def f(x):\n    return x + 1\n", "hello world, hello there"] * 20
CORPUS_B = ["lorem ipsum dolor sit amet", "for i in range(10):\n    print(i)\n", "the cat sat on the mat"] * 20


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    """A verifier and a drafter with byte-level BPE tokenizers trained on different text (300 and
    280 tokens: the same bytes, other merges, other ids)."""
    v = save_tiny(tmp_path_factory.mktemp("bpe-v"), seed=3, tokenizer=bpe_tokenizer(300, CORPUS_A))
    d = save_tiny(tmp_path_factory.mktemp("bpe-d"), seed=4, n_layers=2, tokenizer=bpe_tokenizer(280, CORPUS_B))
    return load_model(str(v), progress=False), load_model(str(d), progress=False)


def test_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}


def test_token_bytes_concatenate_to_the_text(bpe_pair):
    for model in bpe_pair:
        vocab = model.vocabulary
        for text in ["the quick fox", "def f(x):\n    return x  # ok", "hello\tworld<eos>"]:
            ids = vocab.encode(text)
            assert vocab.text_bytes(ids) == text.encode()
        assert model.tokenizer.eos_token_id in vocab.special


def test_bridge_shares_tokens_of_equal_bytes(bpe_pair):
    v, d = bpe_pair
    bridge = VocabBridge(v.vocabulary, d.vocabulary)
    assert 98 <= len(bridge.shared) < len(d.vocabulary.pieces)  # every character, some merges, not all
    for j in bridge.shared:
        assert v.vocabulary.pieces[int(bridge.to_verifier[j])] == d.vocabulary.pieces[j]
    eos_d, eos_v = d.tokenizer.eos_token_id, v.tokenizer.eos_token_id
    assert int(bridge.to_verifier[eos_d]) == eos_v


def test_joined_takes_the_longest_verifier_token_of_whole_pieces():
    """Drafted pieces become verifier ids without the verifier's tokenizer: at each piece the longest
    run of whole pieces that is one verifier token (not a special one); None where a piece starts
    none, since a verifier token would split it."""
    pieces = (b"a", b"b", b"ab", b"abc", b"c", b"<s>", b"cd", b"bc")
    v = Vocabulary(pieces, frozenset({5}), lambda text: [], "byte-level")
    bridge = VocabBridge(v, v)
    assert bridge.joined([b"a", b"b", b"c"]) == [3]  # "abc", not "ab" + "c" nor "a" + "bc"
    assert bridge.joined([b"a", b"b", b"c", b"a"]) == [3, 0]
    assert bridge.joined([b"", b"b", b"c"]) == [7]  # (a healed token drafted again adds nothing)
    assert bridge.joined([b"c", b"d"]) == [6]  # "cd", though "d" alone is no token
    assert bridge.joined([b"a", b"d"]) is None  # "d" starts none
    assert bridge.joined([b"<s>"]) is None  # the special token is not drafted text
    assert bridge.joined([b"a", b"bcd"]) is None  # "bcd" would be split
    assert bridge.joined([]) == []


def test_drafter_context_follows_the_text_incrementally(bpe_pair):
    """Committing a sequence token by token (and taking some back, as a correction does) gives the
    drafter ids of the whole text encoded at once, re-encoding only a short tail each time."""
    v, d = bpe_pair
    text = "def f(x):\n    return x + 1\nthe quick brown fox jumps over the lazy dog " * 3
    ids = v.vocabulary.encode(text)
    ctx = DrafterContext(VocabBridge(v.vocabulary, d.vocabulary))
    encoded: list[int] = []
    encode = d.vocabulary.encode
    ctx.bridge.drafter = Vocabulary(d.vocabulary.pieces, d.vocabulary.special, lambda s: encoded.append(len(s)) or encode(s), "byte-level")
    for n in range(1, len(ids) + 1):
        out = ctx.update(ids[:n])
        assert d.vocabulary.text_bytes(out) == v.vocabulary.text_bytes(ids[:n])
        if n == len(ids) // 2:  # taken back
            assert d.vocabulary.text_bytes(ctx.update(ids[: n - 5])) == v.vocabulary.text_bytes(ids[: n - 5])
    assert out == encode(text)
    assert max(encoded[1:]) < 40  # only a tail, never the whole text (len(text) = 240)


def test_a_text_that_repeats_the_draft_keeps_its_ids_without_an_encode(bpe_pair):
    """Where the committed text is the drafter's draft (or part of it) and then nothing or one drafter
    token, the drafter's ids are the draft's and that token's, found without an encode; a token that
    would merge with the one before it (" th" + "e" into " the") is encoded with its neighbours."""
    v, d = bpe_pair
    encoded: list[str] = []
    encode = d.vocabulary.encode
    bridge = VocabBridge(v.vocabulary, d.vocabulary)
    bridge.drafter = Vocabulary(d.vocabulary.pieces, d.vocabulary.special, lambda s: encoded.append(s) or encode(s), "byte-level")
    piece = d.vocabulary.pieces.index
    prefix, cont = "the quick brown", " fox jumps over"
    extra, word = [w for w in (" cat", " sat", " the", " mat") if w.encode() in d.vocabulary.pieces][:2]  # drafter tokens

    ctx = DrafterContext(bridge)
    ids = list(ctx.update(v.vocabulary.encode(prefix)))
    assert ids == encode(prefix)
    ctx.drafted(len(ids), encode(prefix + cont + extra)[len(ids):])  # a word more than the verifier keeps
    before = len(encoded)
    out = ctx.update(v.vocabulary.encode(prefix + cont + word))  # the draft's words, then the verifier's own
    assert out == encode(prefix + cont + word) and len(encoded) == before

    whole = next(b for b in d.vocabulary.pieces if len(b) >= 3 and b[:1] == b" " and b[:-1] in d.vocabulary.pieces
                 and b[-1:] in d.vocabulary.pieces and b.isascii() and b[1:].isalpha())
    ctx = DrafterContext(bridge)
    ids = list(ctx.update(v.vocabulary.encode(prefix)))
    ctx.drafted(len(ids), [piece(whole[:-1])])
    before = len(encoded)
    out = ctx.update(v.vocabulary.encode(prefix + whole.decode()))
    assert out == encode(prefix + whole.decode()) and out[-1] == piece(whole) and len(encoded) == before + 1


def test_incomplete_utf8_is_held_back():
    assert complete_utf8("日本".encode()[:-1]) == "日"
    assert complete_utf8(b"a\xff b") == "a\ufffd b"


@pytest.mark.parametrize("conversion", ["text", "intersection"])
@pytest.mark.parametrize("strategy, window", [("sd", 0), ("sd", 2), ("viasd", 0)])
def test_greedy_output_equals_ar_with_a_drafter_of_another_vocabulary(bpe_pair, conversion, strategy, window):
    v, d = bpe_pair
    prompt = v.vocabulary.encode("the quick brown fox")
    expected = run_ar(v, prompt, 30, v.eos_token_ids)
    extra = {"draft": "model", "slim_layers": (0, 1, 3)} if strategy == "viasd" else {}
    r = generate(prompt, v, drafter=d, strategy=strategy, max_new_tokens=30, adapt_k=False,
                 draft_conversion=conversion, progress=False, drafter_window=window, **extra)
    assert r.token_ids == expected
    assert r.config["draft_conversion"] == conversion
    assert r.stats.drafted > 0 and r.stats.calls["draft"] > 0
    if conversion == "text":
        assert r.stats.converted_bytes > 0 and r.stats.converted_kept <= r.stats.converted_bytes


def test_a_context_ending_in_a_special_token_drafts_without_healing(bpe_pair):
    """A control token heals into nothing: the drafter drafts after it, k tokens of new text at least."""
    from viasd.decoding.session import Session

    v, d = bpe_pair
    prompt = v.vocabulary.encode("the quick brown fox<eos>")
    assert prompt[-1] in v.vocabulary.special
    drafter = CrossVocabDrafter(d.decoder, VocabBridge(v.vocabulary, d.vocabulary), Conversion.TEXT, GREEDY, None, None,
                                eos=d.eos_token_ids)
    drafter.begin(64, Session(v.decoder, DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY, eos=NO_EOS), 64))
    drafted = []
    draft_ids = drafter.draft_ids
    drafter.draft_ids = lambda *a, **kw: (drafted.append(draft_ids(*a, **kw)[0]) or drafted[-1], None)
    draft = drafter.propose(prompt, 3)
    assert len(drafted) == 1 and (len(drafted[0]) > 3 or drafted[0][-1] in d.eos_token_ids)
    assert draft.tokens and len(draft.tokens) <= 3


def test_a_drafter_copying_the_verifier_through_text_is_accepted(tmp_path, bpe_pair):
    """The verifier's own weights behind another tokenizer: its drafts, converted through text, are
    the verifier's tokens wherever the tokenizations agree, so most are accepted."""
    v, _ = bpe_pair
    twin_dir = save_tiny(tmp_path / "twin", seed=3, tokenizer=v.tokenizer)  # same weights and ids ...
    twin = load_model(str(twin_dir), progress=False)
    encoded = []  # the verifier tokenizer's calls: none, every drafted piece is one of its tokens
    counted = dataclasses.replace(v.vocabulary, encode=lambda text: encoded.append(text) or v.vocabulary.encode(text))
    bridge = VocabBridge(counted, twin.vocabulary)
    drafter = CrossVocabDrafter(twin.decoder, bridge, Conversion.TEXT, GREEDY, None, None, eos=twin.eos_token_ids)
    prompt = v.vocabulary.encode("hello world, hello")
    req = DecodeRequest(prompt=prompt, max_new_tokens=40, params=GREEDY, eos=NO_EOS)
    assert speculative_decode(v.decoder, drafter, req, k=4) == run_ar(v, prompt, 40)
    assert req.stats.accepted / req.stats.drafted > 0.5
    assert encoded == []


def test_text_conversion_is_refused_when_sampling_or_for_cascade(bpe_pair):
    v, d = bpe_pair
    with pytest.raises(UsageError, match="greedy only"):
        generate([1, 2], v, drafter=d, strategy="sd", temperature=0.8, draft_conversion="text", max_new_tokens=4, progress=False)
    with pytest.raises(UsageError, match="reads the drafter's probabilities"):
        generate([1, 2], v, drafter=d, strategy="cascade", draft_conversion="text", max_new_tokens=4, progress=False)
    r = generate([1, 2], v, drafter=d, strategy="cascade", max_new_tokens=4, progress=False)
    assert r.config["draft_conversion"] == "intersection"


def test_word_level_tokenizers_cannot_be_bridged(tmp_path, tiny):
    words = [f"v{i}" for i in range(61)] + ["<eos>", "<unk>", "<pad>"]
    other = load_model(str(save_tiny(tmp_path / "other", words=words)), progress=False)
    with pytest.raises(VocabularyMismatchError, match="byte-level or SentencePiece BPE tokenizer, not a WordLevel one"):
        generate([1, 2, 3], tiny, drafter=other, strategy="sd", max_new_tokens=4, progress=False)


def _words(words: list[str]) -> Vocabulary:
    """A word vocabulary as bytes (" w0", " w1", ...), for hand-built pairs; a word it lacks encodes
    as its last token."""
    index = {w: i for i, w in enumerate(words)}
    return Vocabulary(tuple(f" {w}".encode() for w in words), frozenset({words.index("<eos>")}),
                      lambda text: [index.get(w, len(words) - 1) for w in text.split()], "byte-level")


def test_intersection_sampling_follows_the_verifier_distribution(small_vocab_pair):
    """TLI: the drafter drafts only the 5 of its 8 tokens the verifier also has (its ids in another
    order), and its q moves to the verifier's ids. N = 2000 sampled decodes of 4 tokens with k = 2:
    each position's empirical distribution within TV 0.05 of the exact marginal (noise alone ~0.02)."""
    verifier, drafter_model = small_vocab_pair
    v_words = [f"w{i}" for i in range(6)] + ["<eos>", "<unk>"]
    d_words = ["w3", "x1", "w0", "x2", "w5", "<eos>", "w1", "x3"]  # shared: w3 w0 w5 <eos> w1
    bridge = VocabBridge(_words(v_words), _words(d_words))
    assert bridge.shared == (0, 2, 4, 5, 6) and bridge.to_verifier[bridge.shared, ].tolist() == [3, 0, 5, 6, 1]
    params = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = [4, 0]
    marginals = exact_marginals(verifier, prompt, params, n=4)
    g = torch.Generator().manual_seed(11)
    head = drafter_model.decoder.reduced_head(bridge.shared)
    counts, n, drafted, accepted, seen = torch.zeros(4, marginals[0].shape[0]), 2000, 0, 0, set()
    for _ in range(n):
        drafter = CrossVocabDrafter(drafter_model.decoder, bridge, Conversion.INTERSECTION, params, g, None, head)
        req = DecodeRequest(prompt=prompt, max_new_tokens=4, params=params, eos=NO_EOS, generator=g)
        out = speculative_decode(verifier.decoder, drafter, req, k=2)
        for i, t in enumerate(out):
            counts[i, t] += 1
        drafted, accepted = drafted + req.stats.drafted, accepted + req.stats.accepted
        seen.update(drafter.propose(req.prompt, 2).tokens if len(seen) < 5 else [])
    assert 0 < accepted < drafted
    assert seen <= {3, 0, 5, 6, 1}  # w2, w4: the drafter has neither
    for i, p in enumerate(marginals):
        assert 0.5 * (counts[i] / n - p).abs().sum() < 0.05, i


@pytest.mark.model
def test_zoo_tokenizers_bytes_are_exact(smollm2, gemma3):
    """SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece with byte fallback): the bytes of the ids
    are the text, control tokens included, and the ids are the tokenizer's."""
    text = "<|im_start|>user\ndef f(n):\n    \"\"\"Doc.\"\"\"\n\treturn n  # ok\n\nprint('héllo 日本語 😀')<|im_end|>"
    for model in (smollm2, gemma3):
        vocab = model.vocabulary
        assert vocab.text_bytes(vocab.encode(text)) == text.encode(), model.name
        assert vocab.encode(text) == model.tokenizer.encode(text, add_special_tokens=False), model.name  # (the backend's)
    assert VocabBridge(gemma3.vocabulary, smollm2.vocabulary).shared


@pytest.mark.model
def test_gemma3_drafts_for_smollm2_and_the_output_is_ar(smollm2, gemma3):
    ids = smollm2.encode("Write a haiku about the sea.")
    expected = run_ar(smollm2, ids, 24, smollm2.eos_token_ids)
    for conversion in ("text", "intersection"):
        r = generate(ids, smollm2, drafter=gemma3, strategy="sd", max_new_tokens=24, adapt_k=False,
                     draft_conversion=conversion, progress=False)
        assert r.token_ids == expected, conversion
        assert r.stats.accepted > 0, conversion


def test_a_right_guess_of_the_healed_token_saves_its_pass_and_a_wrong_one_changes_nothing(tiny, tiny_drafter):
    """Token healing drafts the context's last token again (`draft_ids(first=...)`); read in the
    first pass with the context (`guess`), a token drawn again costs no pass of its own, and a guess
    the drafter does not draw leaves drafts and cache as without it."""
    from viasd.decoding.drafters import ModelDrafter
    from viasd.decoding.session import Session

    prompt = [1, 5, 6, 7, 5, 6, 7, 5]
    every = list(range(tiny_drafter.config.vocab_size))

    def drafted(guess_of):
        drafter = ModelDrafter(tiny_drafter.decoder, GREEDY, None, None)
        drafter.begin(64, Session(tiny.decoder, DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY, eos=NO_EOS), 64))
        out = []
        for context in (prompt, prompt + [6, 7], prompt + [6, 7, 9, 9]):  # later rounds: what was committed
            calls = drafter.stats.calls["draft"]
            tokens, _ = drafter.draft_ids(context[:-1], 5, first=every, guess=guess_of(context))
            out.append((tokens, drafter.stats.calls["draft"] - calls, drafter.cache.k[:, :, : len(context) + 3].clone()))
        return out

    plain = drafted(lambda context: None)
    first_of = {len(context): tokens[0] for context, (tokens, _, _) in zip((prompt, prompt + [6, 7], prompt + [6, 7, 9, 9]), plain)}
    right = drafted(lambda context: first_of[len(context)])
    wrong = drafted(lambda context: (first_of[len(context)] + 1) % 50)
    for (tokens, passes, k), (r_tokens, r_passes, r_k), (w_tokens, w_passes, w_k) in zip(plain, right, wrong):
        assert r_tokens == w_tokens == tokens and len(tokens) == 5
        assert r_passes == passes - 1 and w_passes == passes
        assert torch.equal(r_k, k) and torch.equal(w_k, k)  # the same K/V for the context and the drafts


def test_same_vocabulary_compares_every_token_and_id():
    """A drafter shares the verifier's ids only with the same token at every id; vocabularies of
    different sizes differ without being read."""
    from types import SimpleNamespace

    from viasd.models.vocabulary import same_vocabulary

    class Tok:
        def __init__(self, vocab):
            self.vocab, self.reads = vocab, 0

        def get_vocab(self):
            self.reads += 1
            return dict(self.vocab)

        def __len__(self):
            return len(self.vocab)

    def model(vocab):
        return SimpleNamespace(tokenizer=Tok(vocab))

    a = {"a": 0, "b": 1, "c": 2}
    assert same_vocabulary(model(a), model(dict(a)))
    assert not same_vocabulary(model(a), model({"a": 0, "b": 2, "c": 1}))  # the same tokens at other ids
    assert not same_vocabulary(model(a), model({"a": 0, "b": 1, "d": 2}))
    assert not same_vocabulary(model(a), model({"a": 0, "b": 1, "c": 3}))  # a gap
    small, big = model({"a": 0}), model(a)
    assert not same_vocabulary(big, small) and small.tokenizer.reads == big.tokenizer.reads == 0


def test_healing_greedy_draws_the_masked_rows_first_maximum(tiny, tiny_drafter):
    """A greedy drafter that keeps no q picks the healed token from the allowed ids' logits alone
    (`first_among`); it drafts what the masked row gives (a drafter keeping q masks the row)."""
    from viasd.decoding.drafters import ModelDrafter
    from viasd.decoding.session import Session

    prompt = [1, 5, 6, 7, 5, 6, 7, 5]
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        first = torch.randperm(tiny_drafter.config.vocab_size, generator=g)[: 1 + 8 * trial].tolist()
        drafts = []
        for probs in (False, True):
            drafter = ModelDrafter(tiny_drafter.decoder, GREEDY, None, None, probs=probs)
            drafter.begin(64, Session(tiny.decoder, DecodeRequest(prompt=prompt, max_new_tokens=20, params=GREEDY, eos=NO_EOS), 64))
            drafts.append(drafter.draft_ids(prompt, 3, first=first)[0])
        assert drafts[0] == drafts[1] and drafts[0][0] in first, trial
