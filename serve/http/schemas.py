"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema).

Requests are strict (a string where a number belongs is a 400, not silently converted), reject NaN and
infinities, and ignore unknown fields (as vLLM does; lm-evaluation-harness sends a few).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.bundle import EOT
from contract.chat_format import ChatFormatError, normalize_messages
from serve.chat import COMPLETION_ONLY
from serve.errors import shown
from serve.sampling import PENALTY_RANGE, REPETITION_PENALTY_RANGE

MAX_N = 64
MAX_LOGPROBS = 20



def _integral(v: Any) -> Any:
    """JSON Schema counts 10.0 as an integer: accept integral floats as ints (10.5 and "10" stay errors)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


#: every integer of a request lies in this range: a 64-bit signed int (what OpenAI's and vLLM's clients send and
#: rust_runtime takes). Past it a number only reaches a message (max_tokens against the context) or arithmetic,
#: where a 4300-digit one cannot even be formatted; checked before any other rule of the field.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(what: str) -> Any:
    """A before-validator refusing an int outside [:data:`INT64_MIN`, :data:`INT64_MAX`]; ``what`` names the value
    (``{field}`` is replaced by the field's name)."""
    def check(v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
            name = what.format(field=info.field_name)
            raise PydanticCustomError("int64", "{message}", {"message": f"{name} a 64-bit signed integer "
                                                                        f"(-2**63 to 2**63 - 1), got {shown(v)}"})
        return v

    return check


def integer(what: str = "{field} must be", **constraints: int) -> Any:
    """An int field type: a 64-bit signed int (:data:`INT64_MIN` .. :data:`INT64_MAX`; the schema says ``format:
    int64`` rather than a minimum/maximum: a JSON Schema tool that holds numbers as floats misplaces bounds near
    2**63), integral floats taken as ints, then ``constraints`` (before the validators, so the schema shows them as
    minimum/maximum). ``what`` starts the out-of-range message."""
    return Annotated[int, Field(**constraints, json_schema_extra={"format": "int64"}), BeforeValidator(_int64(what)),
                     BeforeValidator(_integral)]


TokenId = integer("each token id in {field} must be", ge=0)
StopString = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Texts = Annotated[list[str], Field(min_length=1)]
TokenIdLists = Annotated[list[TokenIds], Field(min_length=1)]
#: a seed: serve.sampling takes any int mod 2**64, so a wider one would silently share another's stream
Seed = integer()


def _only_with_rules(schema: dict, cls: type) -> None:
    """The JSON Schema of ``cls.ONLY_WITH``: when a field is given and not null, the boolean it needs is true."""
    rules = [{"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
              "then": {"required": [needs], "properties": {needs: {"const": True}}}} for field, needs in cls.ONLY_WITH]
    if rules:
        schema["allOf"] = rules


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", json_schema_extra=_only_with_rules)

    #: (field, the boolean field it needs true): a field allowed only beside another (vLLM's checks); the validator
    #: below and the schema (:func:`_only_with_rules`) both read it
    ONLY_WITH: ClassVar[tuple[tuple[str, str], ...]] = ()

    @model_validator(mode="after")
    def _only_with(self) -> Any:
        for field, needs in self.ONLY_WITH:
            if getattr(self, field) is not None and not getattr(self, needs):
                raise PydanticCustomError("invalid_value", "{message}", {
                    "message": f"{field} is only allowed with {needs}: true", "param": field})
        return self


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` (and no choices) before [DONE].")


class CompletionRequest(_Request):
    """OpenAI's /v1/completions request, plus vLLM's `top_k`, `repetition_penalty` and `ignore_eos`."""

    ONLY_WITH = (("stream_options", "stream"),)

    model: str | None = Field(None, description="Must equal the served model's id when given.")
    prompt: str | Texts | TokenIds | TokenIdLists = Field(
        ..., description=f"Text, texts, token ids, or lists of token ids; `{EOT}` is prepended internally.")
    max_tokens: integer(ge=0) | None = Field(None, description="null/absent: SHALIK_DEFAULT_MAX_TOKENS capped by the "
                                                           "context. 0 with echo: score the prompt only.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, ge=0, le=1, description="Nucleus sampling; 1 = off. Default 1.")
    top_k: integer(ge=-1) | None = Field(None, description="0 or -1 = off. Default off.")
    n: integer(ge=1, le=MAX_N) = Field(1, description="Choices per prompt (prompts × n ≤ 128 per request).")
    stop: StopString | list[StopString] | None = Field(None, description="Output ends before the first occurrence of any of these.")
    seed: Seed | None = Field(
        None, description="Same seed, same backend → same text, whatever runs beside it.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Return log-probs and the top N alternatives.")
    echo: bool = Field(False, description="Return the prompt (and, with logprobs, its tokens' log-probs) too.")
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                             description="Over prompt + generated ids; 1 = off.")
    ignore_eos: bool = Field(False, description=f"Keep generating past `{EOT}` (its text then appears), as vLLM's "
                                                "`ignore_eos`: fixed lengths for benchmarks.")
    user: str | None = Field(None, description="Ignored.")
    # OpenAI parameters this server does not implement: refused (400) rather than silently ignored; the schema
    # says so too (maximum / maxProperties / maxLength apply to the non-null branch)
    best_of: integer() | None = Field(None, description="Only null or 1 (no hidden candidates; use n).",
                                      json_schema_extra={"minimum": 1, "maximum": 1})
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: only null or {}.",
                                                json_schema_extra={"maxProperties": 0})
    suffix: str | None = Field(None, description="Not supported: only null or \"\".", json_schema_extra={"maxLength": 0})

    @field_validator("best_of", "logit_bias", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and (v != 1 if info.field_name == "best_of" else bool(v)):
            why = "only 1: use n for more choices" if info.field_name == "best_of" else "not supported by this server"
            raise PydanticCustomError("unsupported", "{message}", {"message": f"{info.field_name}: {why}"})
        return v


class Logprobs(BaseModel):
    """OpenAI's legacy logprobs object (parallel lists, one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float | None] = Field(..., description="null for the first token of an echoed prompt.")
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int = Field(..., description=f"Incl. the leading {EOT} of each prompt.")
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class TextPart(_Request):
    """A text part of a message's content (the only kind a text model takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] = Field(
        ..., description="A string, or text parts (joined without a separator).")
    name: str | None = Field(None, description="Ignored.")


#: chat fields of features this server does not have → (the values that ask for none of it, why a value is refused)
UNSUPPORTED = {
    "logit_bias": (({},), "not supported by this server (only null or {})"),
    "tools": (([],), "tool calling is not supported by this server (only null or [])"),
    "tool_choice": (("none",), 'tool calling is not supported by this server (only null or "none")'),
    "functions": (([],), "function calling is not supported by this server (only null or [])"),
    "function_call": (("none",), 'function calling is not supported by this server (only null or "none")'),
    "response_format": (({"type": "text"},), 'only {"type": "text"}: this server has no JSON mode or structured '
                                             "output"),
    "modalities": ((["text"],), 'only ["text"]: the model writes text'),
    "audio": ((), "audio output is not supported: the model writes text"),
    "web_search_options": ((), "web search is not supported by this server"),
    "reasoning_effort": ((), "not supported: this is not a reasoning model"),
    **{name: ((False,), f"an option of /v1/completions, not of chat: {why}") for name, why in COMPLETION_ONLY.items()},
}


class ChatCompletionRequest(_Request):
    """OpenAI's /v1/chat/completions request (text only), plus vLLM's `top_k` and `repetition_penalty`. The
    conversation is rendered with the model's chat template (ChatML) on the server."""

    ONLY_WITH = (("stream_options", "stream"), ("top_logprobs", "logprobs"))

    model: str | None = Field(None, description="Must equal the served model's id when given.")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        ..., description="The conversation: system / user / assistant messages.")
    max_completion_tokens: integer(ge=1) | None = Field(
        None, description="Tokens of the reply at most; null/absent: SHALIK_DEFAULT_MAX_TOKENS capped by the context.")
    max_tokens: integer(ge=1) | None = Field(None, description="The older name of max_completion_tokens (which wins).")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, ge=0, le=1, description="Nucleus sampling; 1 = off. Default 1.")
    top_k: integer(ge=-1) | None = Field(None, description="0 or -1 = off. Default off.")
    n: integer(ge=1, le=MAX_N) = Field(1, description="Choices (replies) to generate.")
    stop: StopString | list[StopString] | None = Field(None, description="The reply ends before the first occurrence of any of these.")
    seed: Seed | None = Field(
        None, description="Same seed, same backend → same reply, whatever runs beside it.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = Field(False, description="Return the log-prob of each reply token.")
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="The N most likely alternatives at each position; only with logprobs: true.")
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                             description="Over prompt + generated ids; 1 = off.")
    user: str | None = Field(None, description="Ignored.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted: without tools it has no effect.")
    # OpenAI parameters of features this text-only server does not have: refused (400) when they ask for the
    # feature, accepted when they do not (null, {}, [], "none", {"type": "text"}, ["text"]); see UNSUPPORTED
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: only null or {}.",
                                                json_schema_extra={"maxProperties": 0})
    tools: list[Any] | None = Field(None, description="Not supported (no tool calling): only null or [].",
                                    json_schema_extra={"maxItems": 0})
    tool_choice: Any = Field(None, description='Not supported (no tool calling): only null or "none".',
                             json_schema_extra={"enum": ["none", None]})
    functions: list[Any] | None = Field(None, description="The older tools; not supported: only null or [].",
                                        json_schema_extra={"maxItems": 0})
    function_call: Any = Field(None, description='The older tool_choice; not supported: only null or "none".',
                               json_schema_extra={"enum": ["none", None]})
    response_format: dict[str, Any] | None = Field(
        None, description='Only null or {"type": "text"}: no JSON mode or structured output.',
        json_schema_extra={"anyOf": [{"const": {"type": "text"}}, {"type": "null"}]})
    modalities: list[str] | None = Field(None, description='Only null or ["text"].',
                                         json_schema_extra={"anyOf": [{"const": ["text"]}, {"type": "null"}]})
    audio: Any = Field(None, description="Not supported (a text model): only null.", json_schema_extra={"type": "null"})
    web_search_options: Any = Field(None, description="Not supported: only null.", json_schema_extra={"type": "null"})
    reasoning_effort: Any = Field(None, description="Not supported (not a reasoning model): only null.",
                                  json_schema_extra={"type": "null"})
    echo: bool | None = Field(None, description="A completions option: only null or false.",
                              json_schema_extra={"enum": [False, None]})
    ignore_eos: bool | None = Field(None, description="A completions option: only null or false.",
                                    json_schema_extra={"enum": [False, None]})
    prediction: Any = Field(None, description="Accepted and ignored: a latency hint that does not change the reply.")

    @field_validator("messages", mode="before")
    @classmethod
    def _conversation(cls, v: Any) -> Any:
        """The chat format's own check first (contract.chat_format.normalize_messages), so that a bad conversation
        gets the message the Python API gives (``messages[0].content[1].type: expected 'text' ...``)."""
        try:
            normalize_messages(v)
        except ChatFormatError as e:
            raise PydanticCustomError("invalid_messages", "{message}", {"message": str(e)}) from None
        return v

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        accepts, why = UNSUPPORTED[info.field_name]
        if v is not None and v not in accepts:
            raise PydanticCustomError("unsupported", "{message}", {"message": f"{info.field_name}: {why}"})
        return v



class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(..., description="The token's UTF-8 bytes (a token may hold part of a character).")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ScoreRequest(_Request):
    """Our /v1/score: per-token negative log-likelihood of a text."""

    model: str | None = None
    text: Annotated[str, Field(min_length=1)] | TokenIds = Field(..., description="Text or token ids to score.")


class ScoreResponse(BaseModel):
    object: Literal["score"] = "score"
    model: str
    text: str
    token_ids: list[int]
    tokens: list[str]
    token_nll: list[float] = Field(..., description=f"Nats, one per token; the first predicted from {EOT}.")
    nll_sum: float
    nll_mean: float
    chars: int = Field(..., description="NFC code points.")
    bits_per_char: float


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shalik"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "unavailable"]
    model: str | None = None
    backend: str | None = None
    quantize: str | None = None
    vocab_size: int | None = None
    context_length: int | None = None
    quantized_forms: dict[str, bool | None] | None = Field(
        None, description="The export's quality gate per form (\"rust q4_0\"): true passed, false failed, null "
                          "not measured; a loader serves only the forms that passed, unless SHALIK_ALLOW_UNGATED=1.")
    ungated: bool | None = Field(None, description="The served quantized form did not pass the gate "
                                                   "(loaded with SHALIK_ALLOW_UNGATED=1).")
    detail: str | None = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize (only the completion form)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Accepted and ignored: no special token is added.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info (what lm-evaluation-harness probes)."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str
    bos_token: str | None = None
    pad_token: str | None = None
    model_max_length: int
    vocab_size: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail
