"""Request bodies of the OpenAI-compatible API (pydantic, strict: "10" is not an integer) and the
`viasd` extension object. Response bodies are plain dicts shaped as OpenAI's (see responses.py)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from viasd.settings import SETTINGS, Declared

# Parameters of the OpenAI API this server understands but does not implement: a clear 400 when
# given a non-default value (the openai client sends none of them unless asked).
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),  # (chat: supported, see ChatCompletionRequest)
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
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


def field_of(d: Declared) -> Any:
    """The pydantic type of a declared setting, as a request may give it (null: the server's default)."""
    sp = d.spec
    t: Any
    if d.kind == "int":
        t = Annotated[int, Field(ge=sp.lo, le=sp.hi)]
    elif d.kind == "float":
        bounds: dict[str, Any] = {"gt" if sp.lo_open else "ge": sp.lo, "le": None if sp.allow_inf else sp.hi}
        t = Annotated[float, Field(**{k: v for k, v in bounds.items() if v is not None}, allow_inf_nan=sp.allow_inf)]
    elif d.kind == "bool":
        t = bool
    elif d.kind == "choice":
        t = Literal[sp.choices]
    elif d.kind == "layers":
        assert sp.hi is not None  # (declared with the setting)
        t = Annotated[list[Annotated[int, Field(ge=sp.lo, le=sp.hi)]], Field(min_length=1, max_length=int(sp.hi) + 1)]
    elif d.kind == "bias":  # OpenAI's shape: {"50256": -100} (JSON keys are text); the vocabulary bound: parsing.config_for
        t = dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=sp.lo, le=sp.hi, allow_inf_nan=False)]]
    else:
        raise TypeError(f"setting {d.name} ({d.kind}) has no request field")
    return t | None


class _Extension(Strict):
    def settings(self) -> dict:
        """The decode settings it sets (its regex / grammar: parsing.response_format_of)."""
        out = self.model_dump(exclude_none=True, exclude={"regex", "grammar", "provenance"})
        for name, d in SETTINGS.items():
            if d.kind == "layers" and name in out:
                out[name] = tuple(out[name])
        return out


class _Format(Strict):
    def as_setting(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextFormat(_Format):
    type: Literal["text"]


class JSONObjectFormat(_Format):
    type: Literal["json_object"]


class JSONSchemaSpec(Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict | bool = Field(default_factory=dict, alias="schema")  # (`schema` is a BaseModel method)
    strict: bool | None = None


class JSONSchemaFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


# OpenAI's `response_format` (viasd's regex and grammar come in the `viasd` object)
ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]
GRAMMAR_TEXT = Annotated[str, Field(min_length=1, max_length=1 << 17)]

# The `viasd` extension object: decoding settings by their GenerateConfig names, one field per setting
# the server lets a request choose (viasd/settings.py); the server's configured defaults fill what is
# not given. Routes are layer lists; the drafter model, route files and threshold files are the
# server's (`viasd serve --drafter / --slim-route ...`).
# `provenance`: each token's source in the answer's `viasd` object (a response option, not a decode setting).
_EXTENSION_FIELDS: dict[str, Any] = {
    "regex": (GRAMMAR_TEXT | None, None), "grammar": (GRAMMAR_TEXT | None, None), "provenance": (bool | None, None),
    **{n: (field_of(d), None) for n, d in SETTINGS.items() if d.spec.server == "viasd"}}
# the settings a request sets by a top-level field of the same name: OpenAI's sampling fields (temperature,
# top_p, seed, presence_penalty, frequency_penalty, logit_bias) and vLLM's / llama-server's extras (top_k,
# min_p, repetition_penalty); max_new_tokens is max_tokens, response_format a typed object (below), logprobs
# each endpoint's own fields (`logprobs_setting`)
OPENAI_FIELDS = tuple(n for n, d in SETTINGS.items() if d.spec.server == "openai" and n not in ("max_new_tokens", "response_format",
                                                                                               "logprobs"))
_SAMPLING_FIELDS: dict[str, Any] = {n: (field_of(SETTINGS[n]), None) for n in OPENAI_FIELDS}
if TYPE_CHECKING:  # what mypy checks the models built from the settings (below) as
    ViasdExtension = _Extension

    class _Sampling(Strict):
        def __getattr__(self, name: str) -> Any: ...  # its fields: one per OPENAI_FIELDS setting
    MaxTokens = int | None
    Logprobs = int | None
else:
    ViasdExtension = create_model("ViasdExtension", __base__=_Extension, **_EXTENSION_FIELDS)
    _Sampling = create_model("_Sampling", __base__=Strict, **_SAMPLING_FIELDS)
    MaxTokens = field_of(SETTINGS["max_new_tokens"])  # max_tokens, max_completion_tokens
    Logprobs = field_of(SETTINGS["logprobs"])


class StreamOptions(Strict):
    include_usage: bool = False


class _Common(_Sampling):  # (its sampling fields: _Sampling's, one per setting)
    model: Annotated[str, Field(min_length=1, max_length=512)]
    stop: Annotated[str, Field(min_length=1, max_length=256)] | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    viasd: ViasdExtension | None = None
    _SUPPORTED: ClassVar[tuple[str, ...]] = ()  # UNSUPPORTED's parameters this endpoint does support
    # unsupported (400 when set to anything but their default) and ignored fields
    echo: object = None
    best_of: object = None
    suffix: object = None
    tools: object = None
    tool_choice: object = None
    functions: object = None
    function_call: object = None
    response_format: ResponseFormat | None = None
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
            if name in self._SUPPORTED:
                continue
            value = getattr(self, name, None)
            if value is not None and value not in defaults:
                return name
        if self.n not in (None, 1):
            return "n"
        return None

    def contradiction(self) -> tuple[str, str, str] | None:
        """OpenAI's 400 for fields valid alone but not together: (param, code, message), or None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "invalid_value", "the 'stream_options' parameter is only allowed when 'stream' is enabled"
        return None


class CompletionRequest(_Common):
    # a string, or token ids; a list of one string or of one id list is accepted too (batches of
    # more than one prompt are not: n and batching are 1 here)
    prompt: Annotated[str, Field(max_length=1_000_000)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    max_tokens: MaxTokens = None
    logprobs: Logprobs = None  # the chosen token's and this many alternatives' (OpenAI: at most 5; here 20)
    suffix: Annotated[str, Field(max_length=1_000_000)] | None = None  # the text after the gap (fim.py); the prompt is before it

    _SUPPORTED: ClassVar[tuple[str, ...]] = ("suffix",)

    def logprobs_setting(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            return v[0]
        return v


class TextPart(Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class CalledFunction(Strict):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=1_000_000)]  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None  # (an assistant's)
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # (a tool's answer)

    def as_engine(self) -> dict:
        """The message as the chat template takes it (a tool call's arguments: an object, as
        transformers' templates expect them)."""
        text = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:  # not JSON: given to the template as the text it is
        return text


class FunctionDef(Strict):
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: dict | None = None  # a JSON schema (none: no arguments)
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=10_000)]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs = None  # alternatives per token, with logprobs

    _SUPPORTED: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "parallel_tool_calls")

    def logprobs_setting(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def contradiction(self) -> tuple[str, str, str] | None:
        """Also OpenAI's conversation rules: a tool message carries a tool_call_id, which names a call of the
        assistant message before it (or before the tool messages that answer its other calls)."""
        calls = None  # the ids of the calls the next tool message may answer (None: no assistant message called tools)
        for i, m in enumerate(self.messages):
            if m.role != "tool":
                calls = {c.id for c in m.tool_calls} if m.role == "assistant" and m.tool_calls else None
            elif m.tool_call_id is None:
                return (f"messages.[{i}].tool_call_id", "missing_required_parameter",
                        "missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'")
            elif calls is None:
                return (f"messages.[{i}].role", "invalid_value",
                        "messages with role 'tool' must be a response to a preceding message with 'tool_calls'")
            elif m.tool_call_id not in calls:
                return (f"messages.[{i}].tool_call_id", "invalid_value",
                        f"'tool_call_id' of {m.tool_call_id!r} not found in 'tool_calls' of the previous assistant message")
        return super().contradiction()
