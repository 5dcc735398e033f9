"""OpenAI's /v1/completions and /v1/chat/completions: request bodies in, SamplingParams out; outputs in,
response and stream-chunk bodies out, in OpenAI's exact shapes. No HTTP here (that is http.py), so every
rule is testable on plain dicts. docs/http.md lists every field taken and every one refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from minisarathi.outputs import CompletionOutput, Logprob
from minisarathi.sampling_params import SamplingParams
from minisarathi.server.protocol import ListBoundError, ServerLimits, check_list_bounds
from minisarathi.server.tool_calls import ToolError, ToolFormat, ToolRequest, parse_tools
from minisarathi.validation import PRIORITY_RANGE

# vLLM's floor for a logprob that is -inf (a masked token): JSON has no infinity.
MIN_LOGPROB = -9999.0


class OpenAIError(Exception):
    """An error answered as OpenAI's error object {"error": {message, type, param, code}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s  # the Retry-After header (429s, the 503 draining)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass
class DoorLimits:
    """The server-wide limits as the HTTP door applies them."""

    max_prompt_tokens: int  # Hub.max_prompt_tokens: min(ServerLimits.max_prompt_tokens, max_model_len)
    max_tokens: int  # the largest max_tokens a request may ask for
    max_n: int  # choices per prompt
    vocab_size: int
    lists: ServerLimits = dataclasses.field(
        default_factory=ServerLimits
    )  # stop, stop_token_ids, logit_bias bounds


@dataclass
class GenerationRequest:
    """What both endpoints turn into: prompts (token ids), one SamplingParams per choice of a prompt."""

    prompts: list[list[int] | None]  # None: a text prompt, until the door tokenizes it (off the event loop)
    prompt_texts: list[str | None]
    params: SamplingParams  # of every prompt; its n choices are choice indexes p * n .. p * n + n - 1
    stream: bool
    include_usage: bool
    logprobs: int | None  # top logprobs wanted per token (None: no logprobs)
    model: str
    priority: int | None = None  # lower runs first (vLLM's extension); None: the server's default
    max_tokens_given: bool = True  # False: a chat request without one (the door fits it to the key)
    messages: list[dict] | None = None  # a chat request's, until the door renders them into prompt_texts[0]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None  # the template's extra variables (enable_thinking, ...)
    tools: ToolRequest | None = None  # a chat request's tools, unless tool_choice is "none"


# vLLM's structured-output fields (SamplingParams.structured): `structured_outputs` is its map, the guided_*
# ones its older names for one key of it. OpenAI's `response_format` is the other way to ask.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_FIELDS = ("structured_outputs", *_GUIDED)
# Extensions vLLM users rely on, taken by both endpoints with SamplingParams' meaning.
_EXTENSIONS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "stop_token_ids",
)
_COMMON = {
    "model",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "max_tokens",
    "priority",
    "response_format",
    *_EXTENSIONS,
    *_STRUCTURED_FIELDS,
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "store",
    "metadata",
    "service_tier",
}
# Fields OpenAI defines that this server refuses unless they hold their no-op value.
REFUSED = {
    "echo": "echo is not supported (the prompt's own logprobs are not computed)",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of is not supported; use n",
    "store": "store: true (stored completions) is not supported",
    "metadata": "metadata must be an object of strings or null",
    "service_tier": 'service_tier other than "auto" or "default" is not supported',
}
# Fields of a message that clients echo back from an earlier answer: taken only with their empty value.
MESSAGE_ECHOES = {
    "refusal": (None,),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
}


def _is_noop(name: str, value, body: dict) -> bool:
    if value is None or value is False:
        return True
    if name == "best_of":
        return value == body.get("n", 1)
    if name == "metadata":  # only labels stored completions, which are never stored here
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    if name == "service_tier":
        return value in ("auto", "default")
    return False


def parse_completion(body, model: str, limits: DoorLimits) -> GenerationRequest:
    """A /v1/completions body. Its text prompts are left for the door to tokenize (with the model's BOS) and
    check with check_prompt_length."""
    body = check_body(body, COMPLETION_FIELDS, model)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "prompt is required")
    texts, prompts = _prompts(body["prompt"], limits)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= 20):
        raise bad("logprobs", f"logprobs must be an integer in [0, 20] or null, got {_show(logprobs)}")
    max_tokens = body.get("max_tokens")
    return _request(
        body, model, limits, texts, prompts, 16 if max_tokens is None else max_tokens, "max_tokens", logprobs
    )


def parse_chat(
    body, model: str, limits: DoorLimits, tool_format: ToolFormat | None = None
) -> GenerationRequest:
    """A /v1/chat/completions body. Its messages are left for the door to render (in the template worker,
    after the quota check), then to tokenize without added special tokens (the template writes its own) and
    check with check_prompt_length. tool_format: the model's tool-call format (None: tools are refused)."""
    body = check_body(body, CHAT_FIELDS, model)
    try:
        tools, tools_constraint = parse_tools(body, tool_format)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    messages = _messages(body.get("messages"))
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise bad("add_generation_prompt", "add_generation_prompt must be a boolean")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", f"logprobs must be a boolean, got {_show(logprobs)}")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise bad("top_logprobs", f"top_logprobs must be an integer in [0, 20] or null, got {_show(top)}")
    if top is not None and not logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    wanted = (top or 0) if logprobs else None
    max_tokens, name = body.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    # Without a limit the answer may run to the end of the context, as in OpenAI, within the server's cap.
    given = max_tokens is not None
    request = _request(
        body,
        model,
        limits,
        [None],
        [None],
        limits.max_tokens if not given else max_tokens,
        name,
        wanted,
        tools_constraint,
        skip_special_tokens=tools is None or tools.format.trigger_token is None,
    )
    request.max_tokens_given, request.tools = given, tools
    request.messages, request.add_generation_prompt = messages, add_generation_prompt
    request.chat_template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    return request


# chat_template_kwargs: what a template reads as variables, within bounds that keep a render's input small
TEMPLATE_KWARGS_MAX_KEYS, TEMPLATE_KWARGS_MAX_CHARS, TEMPLATE_KWARGS_MAX_DEPTH = 16, 4096, 4
# names the renderer sets itself (transformers lets a kwarg replace them; a client has no need to)
TEMPLATE_RESERVED = {"messages", "tools", "documents", "add_generation_prompt"}


def _template_kwargs(kwargs) -> dict | None:
    """chat_template_kwargs: null, or an object of identifier keys and plain JSON values, bounded."""
    if kwargs is None:
        return None
    name = "chat_template_kwargs"
    if not isinstance(kwargs, dict):
        raise bad(name, f"{name} must be an object or null, got {_show(kwargs)}")
    if len(kwargs) > TEMPLATE_KWARGS_MAX_KEYS:
        raise bad(name, f"{name} may hold at most {TEMPLATE_KWARGS_MAX_KEYS} keys, got {len(kwargs)}")
    for key in kwargs:
        if not key.isidentifier() or key in TEMPLATE_RESERVED or key.startswith("_"):
            reserved = ", ".join(sorted(TEMPLATE_RESERVED))
            raise bad(name, f"{name} key {_show(key)} must be a variable name other than {reserved}")

    def plain(value, depth: int) -> bool:
        if isinstance(value, (list, dict)) and depth >= TEMPLATE_KWARGS_MAX_DEPTH:
            return False
        if isinstance(value, list):
            return all(plain(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v, depth + 1) for k, v in value.items())
        return (
            value is None
            or isinstance(value, (bool, int, str))
            or isinstance(value, float)
            and math.isfinite(value)
        )

    if not all(plain(v, 1) for v in kwargs.values()):
        raise bad(name, f"{name} values must be plain JSON nested at most {TEMPLATE_KWARGS_MAX_DEPTH} deep")
    if len(json.dumps(kwargs)) > TEMPLATE_KWARGS_MAX_CHARS:
        raise bad(name, f"{name} must be at most {TEMPLATE_KWARGS_MAX_CHARS} characters of JSON")
    return kwargs


def check_body(body, fields: set[str], model: str) -> dict:
    """body as a JSON object of known `fields` for the served `model`; OpenAIError naming what is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for key in body:
        if key not in fields:
            raise bad(key, f"unknown field {_show(key)}")
    for name, message in REFUSED.items():
        if name in body and not _is_noop(name, body[name], body):
            raise bad(name, message)
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise bad("model", "model must be a string")
    if requested is not None and requested != model:
        raise OpenAIError(
            404,
            f"the model {_show(requested)} does not exist; this server serves {model!r}",
            param="model",
            code="model_not_found",
        )
    return body


def _request(
    body: dict,
    model: str,
    limits: DoorLimits,
    texts,
    prompts,
    max_tokens,
    max_tokens_name: str,
    logprobs: int | None,
    tools_constraint: dict | None = None,
    skip_special_tokens: bool = True,
) -> GenerationRequest:
    """tools_constraint: the calls' grammar of a chat request's tools; skip_special_tokens False keeps a
    special-token trigger in the text, for the tool-call parser."""
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= limits.max_n:
        raise bad("n", f"n must be an integer in [1, {limits.max_n}], got {_show(n)}")
    stream = body.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise bad("stream", f"stream must be a boolean, got {_show(stream)}")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", 'stream_options must be {"include_usage": bool}')
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad("stream_options.include_usage", "stream_options.include_usage must be a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "user must be a string")
    priority = body.get("priority")
    if priority is not None and (
        not _is_int(priority) or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
    ):
        raise bad("priority", f"priority must be a 32-bit integer or null, got {_show(priority)}")
    if _is_int(max_tokens) and max_tokens > limits.max_tokens:
        raise bad(max_tokens_name, f"{max_tokens_name} must be <= {limits.max_tokens}, got {max_tokens}")
    sampling = {
        name: body[name]
        for name in (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "stop",
            "logit_bias",
            *_EXTENSIONS,
        )
        if body.get(name) is not None
    }
    stop = sampling.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad("stop", "stop must be a string or an array of strings")
    try:
        check_list_bounds(sampling, limits.lists)
    except ListBoundError as e:
        raise bad(e.field, str(e)) from None
    structured, structured_name = _structured(body)
    if tools_constraint is not None:
        if structured is not None:
            raise bad(structured_name, f"{structured_name} cannot be combined with tools")
        structured, structured_name = tools_constraint, "tools"
    if not skip_special_tokens:
        sampling["skip_special_tokens"] = False
    try:  # the engine gives choice i the seed seed + i
        params = SamplingParams(
            **sampling, n=n, max_tokens=max_tokens, logprobs=logprobs, structured=structured
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        if message.startswith("structured"):  # named as this request named it
            raise bad(structured_name, structured_name + " " + message.split(" ", 1)[1]) from None
        raise _sampling_error(message, max_tokens_name) from None
    return GenerationRequest(prompts, texts, params, stream, include_usage, logprobs, model, priority)


def _structured(body: dict) -> tuple[dict | None, str | None]:
    """SamplingParams.structured from response_format, structured_outputs or a guided_* field (at most one),
    and the name of the field it came from; (None, None) without one."""
    given = [name for name in ("response_format", *_STRUCTURED_FIELDS) if body.get(name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"{given[1]} cannot be combined with {given[0]}: give one constraint")
    if not given:
        return None, None
    name = given[0]
    value = body[name]
    if name in _GUIDED:
        return {_GUIDED[name]: value}, name
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise bad(name, f"{name} must be an object, got {_show(value)}")
        return value, name
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and len(value) == 1:
        return None, None
    if kind == "json_object" and len(value) == 1:
        return {"json_object": True}, name
    if kind != "json_schema" or set(value) != {"type", "json_schema"}:
        raise bad(
            name,
            f'{name} must be {{"type": "text"}}, {{"type": "json_object"}} or '
            f'{{"type": "json_schema", "json_schema": {{...}}}}, got {_show(value)}',
        )
    spec, where = value["json_schema"], f"{name}.json_schema"
    if not isinstance(spec, dict) or not set(spec) <= {"name", "schema", "strict", "description"}:
        raise bad(where, f"{where} must be an object of name, schema, strict and description")
    if not isinstance(spec.get("name", ""), str) or not isinstance(
        spec.get("strict", False), (bool, type(None))
    ):
        raise bad(where, f"{where}.name must be a string and {where}.strict a boolean")
    if not isinstance(spec.get("schema"), dict):
        raise bad(f"{where}.schema", f"{where}.schema must be a JSON schema object")
    return {"json": spec["schema"]}, f"{where}.schema"


def _sampling_error(message: str, max_tokens_name: str) -> OpenAIError:
    # SamplingParams' messages start with the field they are about.
    field = message.split(" ", 1)[0]
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    if field == "max_tokens":
        return bad(max_tokens_name, message.replace("max_tokens", max_tokens_name, 1))
    return bad(field if field in names else None, message)


def _prompts(prompt, limits: DoorLimits) -> tuple[list[str | None], list[list[int] | None]]:
    usage = (
        "prompt must be a string, an array of strings, an array of token ids, or an array of token-id arrays"
    )
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        texts, prompt = [None], [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        texts = [None] * len(prompt)
    else:
        raise bad("prompt", usage)
    if len(texts) > limits.lists.max_prompts:
        raise bad("prompt", f"prompt holds {len(texts)} prompts; the limit is {limits.lists.max_prompts}")
    if texts[0] is not None:
        return texts, [None] * len(texts)
    if not all(0 <= t < limits.vocab_size for ids in prompt for t in ids):
        raise bad("prompt", f"prompt token ids must be in [0, {limits.vocab_size})")
    for ids in prompt:
        check_prompt_length(ids, limits, "prompt")
    return texts, prompt


def check_prompt_length(ids: list[int], limits: DoorLimits, param: str) -> None:
    if not ids:
        raise bad(param, f"{param} is empty")
    if len(ids) > limits.max_prompt_tokens:
        raise bad(param, f"{param} has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}")


def _messages(messages) -> list[dict]:
    """Validated messages as the template sees them: text-part arrays joined into one string (as vLLM does
    for string-content templates), null fields dropped (as transformers does)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty array")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role", f"{where}.role must be a non-empty string")
        for key in message:
            if key in MESSAGE_ECHOES:
                if message[key] not in MESSAGE_ECHOES[key]:
                    raise bad(
                        f"{where}.{key}",
                        f"{where}.{key} is not supported (only null"
                        + (" or []" if [] in MESSAGE_ECHOES[key] else "")
                        + ")",
                    )
            elif key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise bad(f"{where}.{key}", f"{where}.{key} is not supported")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad(
                        f"{where}.content[{j}]",
                        f'{where}.content[{j}] must be {{"type": "text", '
                        '"text": string}: only text content is supported',
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content must be a string or an array of text parts")
        if content is None and role != "assistant":
            raise bad(f"{where}.content", f"{where}.content is required")
        name, call_id = message.get("name"), message.get("tool_call_id")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name", f"{where}.name must be a string")
        if call_id is not None and (role != "tool" or not isinstance(call_id, str)):
            raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string, on a tool message")
        fields = {"role": role, "content": content, "name": name, "tool_call_id": call_id}
        fields["tool_calls"] = _tool_calls(message.get("tool_calls"), role, f"{where}.tool_calls")
        result.append({k: v for k, v in fields.items() if v is not None})
    return result


def _tool_calls(calls, role: str, where: str) -> list[dict] | None:
    """An assistant message's tool_calls as templates read them (transformers' convention): each call's
    arguments a JSON object, not OpenAI's JSON text."""
    if calls is None or calls == []:
        return None
    if role != "assistant" or not isinstance(calls, list):
        raise bad(where, f"{where} must be an array, on an assistant message")
    result = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not set(call) <= {"id", "type", "function"}
            or not isinstance(call.get("id", ""), str)
            or set(function) != {"name", "arguments"}
            or not isinstance(function["name"], str)
            or not isinstance(function["arguments"], str)
        ):
            raise bad(
                f"{where}[{i}]",
                f'{where}[{i}] must be {{"id": string, "type": "function", "function": '
                '{"name": string, "arguments": JSON text}}',
            )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise bad(
                f"{where}[{i}].function.arguments", f"{where}[{i}].function.arguments must be a JSON object"
            )
        result.append(
            {**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return result


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


# ---------------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf (and NaN) become the floor


def completion_logprobs(
    token_ids: list[int], positions: list[dict[int, Logprob]], top: int, text_offset: int
) -> dict:
    """OpenAI's legacy completions logprobs for these tokens: the sampled token's text and logprob, and per
    position a map of the top `top` tokens (plus the sampled one, as vLLM does) to their logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions):
        sampled = position[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(_logprob(sampled.logprob))
        top_logprobs.append(
            {
                lp.decoded_token: _logprob(lp.logprob)
                for t, lp in position.items()
                if lp.rank <= top or t == token_id
            }
        )
        offsets.append(text_offset)
        text_offset += len(sampled.decoded_token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Logprob]],
    top: int,
    token_bytes: Callable[[int, str], bytes],
) -> dict:
    """Chat logprobs: per token its text, logprob, bytes (a byte-fallback token's own byte, else its text's
    UTF-8: `token_bytes`), and the top `top` alternatives by rank."""

    def entry(token_id: int, lp: Logprob) -> dict:
        return {
            "token": lp.decoded_token,
            "logprob": _logprob(lp.logprob),
            "bytes": list(token_bytes(token_id, lp.decoded_token)),
        }

    content = []
    for token_id, position in zip(token_ids, positions):
        alternatives = sorted(
            ((t, lp) for t, lp in position.items() if lp.rank <= top), key=lambda a: a[1].rank
        )
        content.append(
            {**entry(token_id, position[token_id]), "top_logprobs": [entry(t, lp) for t, lp in alternatives]}
        )
    return {"content": content, "refusal": None}


def finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason if completion.finish_reason in ("stop", "length") else None
