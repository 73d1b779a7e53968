"""Request bodies of the OpenAI-compatible API (pydantic, strict: "10" is not an integer) and the
`viasd` extension object. Response bodies are plain dicts shaped as OpenAI's (see responses.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from viasd.settings import SETTINGS, Declared

# Parameters of the OpenAI API this server understands but does not implement: a clear 400 when
# given a non-default value (the openai client sends none of them unless asked).
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, False, True),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
}
# Accepted and ignored (bookkeeping fields with no effect on decoding).
IGNORED = ("user", "metadata", "store")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def field_of(d: Declared):
    """The pydantic type of a declared setting, as a request may give it (null: the server's default)."""
    sp = d.spec
    if d.kind == "int":
        t = Annotated[int, Field(ge=sp.lo, le=sp.hi)]
    elif d.kind == "float":
        bounds = {"gt" if sp.lo_open else "ge": sp.lo, "le": None if sp.allow_inf else sp.hi}
        t = Annotated[float, Field(**{k: v for k, v in bounds.items() if v is not None}, allow_inf_nan=sp.allow_inf)]
    elif d.kind == "bool":
        t = bool
    elif d.kind == "choice":
        t = Literal[sp.choices]
    elif d.kind == "layers":
        t = Annotated[list[Annotated[int, Field(ge=sp.lo, le=sp.hi)]], Field(min_length=1, max_length=sp.hi + 1)]
    else:
        raise TypeError(f"setting {d.name} ({d.kind}) has no request field")
    return t | None


class _Extension(Strict):
    def settings(self) -> dict:
        out = self.model_dump(exclude_none=True)
        for name, d in SETTINGS.items():
            if d.kind == "layers" and name in out:
                out[name] = tuple(out[name])
        return out


# The `viasd` extension object: decoding settings by their GenerateConfig names, one field per setting
# the server lets a request choose (viasd/settings.py); the server's configured defaults fill what is
# not given. Routes are layer lists; the drafter model, route files and threshold files are the
# server's (`viasd serve --drafter / --slim-route ...`).
ViasdExtension = create_model("ViasdExtension", __base__=_Extension,
                              **{n: (field_of(d), None) for n, d in SETTINGS.items() if d.spec.server == "viasd"})
MaxTokens = field_of(SETTINGS["max_new_tokens"])  # max_tokens, max_completion_tokens
Temperature, TopP, SeedField = (field_of(SETTINGS[n]) for n in ("temperature", "top_p", "seed"))


class StreamOptions(Strict):
    include_usage: bool = False


class _Common(Strict):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    # OpenAI's sampling fields: the settings of the same names (viasd/settings.py)
    temperature: Temperature = None
    top_p: TopP = None
    seed: SeedField = None
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    viasd: ViasdExtension | None = None
    # unsupported (400 when set to anything but their default) and ignored fields
    logprobs: object = None
    top_logprobs: object = None
    echo: object = None
    best_of: object = None
    suffix: object = None
    logit_bias: object = None
    presence_penalty: object = None
    frequency_penalty: object = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    response_format: object = None
    parallel_tool_calls: object = None
    modalities: object = None
    audio: object = None
    prediction: object = None
    reasoning_effort: object = None
    service_tier: object = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> str | None:
        """The first unsupported parameter given a non-default value, if any."""
        for name, defaults in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value not in defaults:
                return name
        if self.n not in (None, 1):
            return "n"
        return None



class CompletionRequest(_Common):
    # a string, or token ids; a list of one string or of one id list is accepted too (batches of
    # more than one prompt are not: n and batching are 1 here)
    prompt: Annotated[str, Field(max_length=1_000_000)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=1)] | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    max_tokens: MaxTokens = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            return v[0]
        return v


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: Annotated[str, Field(max_length=256)] | None = None

    def as_engine(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=10_000)]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
