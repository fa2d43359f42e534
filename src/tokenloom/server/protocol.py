"""The OpenAI API's request bodies as tokenloom reads them (its responses, stream chunks and error body are
response_models.py's).

The request models are strict: a field gets the JSON type OpenAI documents or a 400 (no "10" for 10, no true for 1), and
numbers stay within OpenAI's documented bounds (finite, so no Infinity).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tokenloom.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams, StructuredOutputsParams
from tokenloom.server.errors import APIError


def _valid_utf8(text: str) -> str:
    # JSON may carry a lone surrogate ("\\ud800"), a str in Python but no text any tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the text is not valid Unicode ({error.reason} at position {error.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_utf8)]
TokenId = Annotated[int, Field(ge=0)]
MAX_CHOICES = 128  # prompts times n in one request, as OpenAI caps n
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI caps logit_bias
# Token id (as a JSON object's key) -> a value added to its logit, in OpenAI's range.
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=MAX_LOGIT_BIAS),
]


class _Strict(BaseModel):
    # Parts of a body (messages, tools) tolerate fields OpenAI's SDKs echo back (an assistant message's "refusal",
    # "audio", "annotations"); a request body itself refuses what it does not know (_Body).
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class _Body(_Strict):
    """A request body: an unknown field is a 400 ("Unrecognized request argument"), as OpenAI answers it."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (a chunk may carry several tokens)


class JSONSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's extra `structured_outputs`: exactly one of these (its other fields are refused, not ignored)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    json_schema: dict[str, Any] | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None


def _structured(param: str, **fields: Any) -> StructuredOutputsParams:
    """A structured-output spec from the request's fields; what it refuses (two kinds at once) is a 400."""
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise APIError(400, str(error).removeprefix("StructuredOutputsParams: "), param, "invalid_value") from None


# Fields of OpenAI's API a request may carry that change nothing here: accepted and ignored (README, "Bad input").
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# Fields of OpenAI's API that tokenloom does not implement: refused by name when set, never silently dropped.
# What beam search would ignore if it took it (structured output and forced tools are refused where they are built).
BEAM_SEARCH_REFUSES = (
    "stream", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
)  # fmt: skip
UNSUPPORTED_FIELDS = ("functions", "function_call", "suffix", "audio", "prediction", "web_search_options")


class _Common(_Body):
    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=64)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False  # vLLM's
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: keep the last k (-1: max_model_len)
    skip_special_tokens: bool = True  # vLLM's
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name their tokens "token_id:N" (None: the flag)
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None  # vLLM's: names the response
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids beside the text
    # Lower runs first. A request may lower its own priority below its tenant's, never raise it above.
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    # vLLM's: cached prefix blocks are shared only among requests of the same salt, so no one can tell from a faster
    # first token that someone else sent a prompt (a tenant may be salted by the server: tenants.py).
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: the fewest tokens a chunk after the first carries; raises the server's --stream-interval, never lowers it.
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    best_of: Annotated[int, Field(ge=1)] | None = None
    use_beam_search: bool = False  # vLLM's: the n choices are the n best beams of one search (beam_search.py)
    length_penalty: Annotated[float, Field(ge=-10.0, le=10.0)] = 1.0  # vLLM's: beams scored by sum / length ** it
    logit_bias: LogitBias | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # vLLM's
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: each prompt token's, in the response
    bad_words: Annotated[list[Text], Field(max_length=64)] | None = None  # vLLM's: words the output never completes
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older spellings of structured_outputs, still sent by many clients.
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None
    # Accepted and ignored (IGNORED_FIELDS).
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # Refused when set (UNSUPPORTED_FIELDS); declared so that the refusal names them.
    functions: list[Any] | None = None
    function_call: Any = None
    suffix: Text | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # As vLLM and OpenAI: options of a stream that was not asked for are a mistake, not something to ignore.
            raise APIError(400, "stream_options is only for stream: true", "stream_options", "invalid_value")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs are not streamed (as vLLM's)", "prompt_logprobs", "unsupported")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", "best_of", "unsupported")
        if self.use_beam_search:
            self._refuse_what_beam_search_ignores()
        for name in UNSUPPORTED_FIELDS:
            value = getattr(self, name, None)
            if value not in (None, False, "", [], "none"):
                raise APIError(400, f"{name} is not supported by tokenloom", name, "unsupported")

    def _refuse_what_beam_search_ignores(self) -> None:
        """Beam search ranks beams by the raw model's logprobs (as vLLM's): what would change them, or cut a beam
        short, is refused rather than ignored; the sampling settings (temperature, top_p, seed) do not apply."""
        for name in BEAM_SEARCH_REFUSES:
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value not in (default, None, []):
                raise APIError(400, f"{name} is not supported with use_beam_search", name, "unsupported")

    def structured_output(self) -> StructuredOutputsParams | None:
        """The grammar the output must follow, from whichever one of the ways to ask for it the request used."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format json_schema needs a json_schema", "response_format")
            asked.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.json_schema)))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            asked.append(("structured_outputs", _structured("structured_outputs", **fields)))
        for field, value in (("json", self.guided_json), ("regex", self.guided_regex),
                             ("choice", self.guided_choice), ("grammar", self.guided_grammar)):  # fmt: skip
            if value is not None:
                asked.append((f"guided_{field}", _structured(f"guided_{field}", **{field: value})))
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise APIError(400, f"ask for one structured output, not several ({names})", asked[1][0], "invalid_value")
        return asked[0][1] if asked else None

    def requested_max_tokens(self) -> int | None:
        """The output length the client asked for, if it asked."""
        return self.max_tokens

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        """How many alternatives to return per prompt token, if the prompt's logprobs are wanted."""
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict[str, float] | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's sampling settings; a setting it leaves out takes the server's default, if there is one."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=defaults.get("temperature", self.temperature),
                top_p=defaults.get("top_p", self.top_p),
                top_k=int(defaults.get("top_k", self.top_k)),
                min_p=defaults.get("min_p", self.min_p),
                seed=self.seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=defaults.get("repetition_penalty", self.repetition_penalty),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
                allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
                bad_words=list(self.bad_words or []),
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs_wanted(logprobs),
                structured_outputs=structured,
                # each output only what its step added: the server joins them (O(1) a step, not O(length))
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as error:
            raise APIError(400, str(error).removeprefix("SamplingParams: "), None, "invalid_value") from error


class CompletionRequest(_Common):
    prompt: Text | list[TokenId] | Annotated[list[Text], Field(min_length=1)] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole vocabulary (vLLM's)
    echo: bool = False  # the prompt before the completion, with its tokens' logprobs when logprobs are asked for

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        # vLLM's order: its own field first; echo shows the prompt's logprobs with as many alternatives as logprobs
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt, or the list of prompts (text, or token ids), each answered with n choices."""
        prompt = self.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            prompts = [cast(str | list[int], prompt)]
        else:
            prompts = list(cast(list[str | list[int]], prompt))
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices (prompts times n) per request", "n", "invalid_value")
        return prompts


class ContentPart(_Strict):
    type: Text
    text: Text | None = None


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # the call a tool message answers

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it; tool fields only where present (templates test for them)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                raise APIError(400, "only text content parts are supported", "messages", "unsupported")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateOptions(BaseModel):
    """vLLM's fields for how a conversation goes through the chat template (chat completions and /tokenize)."""

    add_generation_prompt: bool = True  # the assistant's turn opened after the messages
    continue_final_message: bool = False  # the last message left open: the reply continues it
    chat_template_kwargs: dict[str, Any] | None = None  # variables the template reads (Qwen3's enable_thinking, ...)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # OpenAI's: the template's variable

    def check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt false", "continue_final_message")


class ChatCompletionRequest(_Common, ChatTemplateOptions):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None  # text is what a language model gives
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the thought (--reasoning-parser) out of the reply

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the current name; max_tokens is deprecated but still sent by most clients.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Body, ChatTemplateOptions):
    """vLLM's /tokenize: a prompt (completions form) or messages (chat form, through the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]
