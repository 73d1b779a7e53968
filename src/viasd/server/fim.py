"""Fill-in-the-middle prompts: the model's own FIM tokens (found in its vocabulary) around a prefix and
a suffix, in the plain layout (`suffix` of /v1/completions and Ollama's /api/generate) or in
llama.cpp's repository layout (`/infill`, its `format_infill`):

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text} ... <|file_sep|>filename\\n
    <|fim_prefix|>{prefix}{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

The texts are tokenized as text (a "<|fim_prefix|>" typed in a file is not the token), each alone,
and the ids joined: the prompt is token ids, which the engine decodes as any other prompt (prompt
lookup reads the suffix and the other files too; the prefix cache shares the files and the prefix
between consecutive completions of one file)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from viasd.server.errors import APIError

# (prefix, suffix, middle, repository name, file separator) as each model family spells them
SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),  # StarCoder, StarCoder2
)
REPO = "myproject"  # llama.cpp's project name (it takes none from the request)
BATCH = 2048  # llama-server's default batch: the prefix keeps 3/4 of it, the suffix and prompt the rest


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None  # the repository layout's tokens, where the vocabulary has them
    sep: int | None
    names: tuple[str, ...]


def fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM tokens of `tokenizer`'s vocabulary (None: it has none); the app finds them once
    (`app.state.fim`)."""
    vocab = tokenizer.get_vocab()
    for names in SPELLINGS:
        if all(n in vocab for n in names[:3]):
            pre, suf, mid = (vocab[n] for n in names[:3])
            rep, sep = (vocab.get(n) for n in names[3:])
            return FimTokens(pre, suf, mid, rep, sep, names=names)
    return None


def require_fim(state, param: str) -> FimTokens:
    """The served model's FIM tokens (`app.state.fim`), or the 400 saying it has none (raised as an
    APIError for each dialect to shape)."""
    fim, served = state.fim, state.served
    if fim is None:
        raise APIError(400, f"{served} has no fill-in-the-middle tokens ({', '.join(SPELLINGS[0][:3])} or "
                            f"{', '.join(SPELLINGS[1][:3])}): it cannot complete between a prefix and a suffix; use a "
                            "code model trained for it (Qwen2.5-Coder, StarCoder2)", param=param, code="no_fim_tokens")
    return fim


def text_ids(tokenizer, text: str) -> list[int]:
    """`text`'s ids with its special tokens' spellings read as plain text (llama.cpp's parse_special=false)."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def bos(tokenizer) -> list[int]:
    """The BOS the tokenizer puts before a text, if it puts one."""
    head = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return head[:1] if head and head[0] == tokenizer.bos_token_id else []


def plain(model, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """`<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>` (Qwen2.5-Coder's own FIM form)."""
    tok = model.tokenizer
    return bos(tok) + [fim.pre, *text_ids(tok, prefix), fim.suf, *text_ids(tok, suffix), fim.mid]


def repository(model, fim: FimTokens, prefix: str, suffix: str, prompt: str = "", extra: Sequence[tuple[str, str]] = (),
               n_predict: int = 0) -> list[int]:
    """llama.cpp's `format_infill`: the other files (filename, text) first, then the prefix with the text
    typed at the cursor (`prompt`), the suffix, the middle token. As there, the prefix keeps its last
    3/4 of a batch, the suffix its first quarter less the prompt, and the files the tail that the
    context has room for besides them and `n_predict` tokens."""
    tok, n_ctx = model.tokenizer, model.config.max_positions
    batch = min(BATCH, n_ctx)
    head: list[int] = []
    if fim.rep is not None:
        head += [fim.rep, *text_ids(tok, REPO + "\n")]
    for filename, text in extra:
        head += [fim.sep, *text_ids(tok, filename + "\n")] if fim.sep is not None else text_ids(tok, "\n\n--- snippet ---\n\n")
        head += text_ids(tok, text)
    if fim.sep is not None:
        head += [fim.sep, *text_ids(tok, "filename\n")]
    before, after, typed = text_ids(tok, prefix), text_ids(tok, suffix), text_ids(tok, prompt)
    before = before[len(before) - min(len(before), 3 * (batch // 4)):]
    after = after[: max(0, batch // 4 - (2 + len(typed)))]
    middle = bos(tok) + [fim.pre, *before, *typed, fim.suf, *after, fim.mid]
    room = max(0, n_ctx - len(middle) - n_predict)
    return head[len(head) - min(room, len(head)):] + middle
