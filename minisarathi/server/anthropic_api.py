"""Anthropic's Messages API (/v1/messages) as a thin adapter over the chat door: a Messages body becomes a
chat body for openai_api.parse_chat (the same checks, template, tools and call grammar), and the chat
path's outputs become Anthropic's message, stream events and errors. http.py routes to it; docs/http.md
lists what is taken and what is refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from minisarathi.outputs import CompletionOutput
from minisarathi.server.openai_api import DoorLimits, GenerationRequest, OpenAIError, bad, parse_chat
from minisarathi.server.protocol import short
from minisarathi.server.tool_calls import ToolFormat, ToolStream, tool_message

FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",  # only labels the request for Anthropic's abuse checks: ignored
}
# keys a block may carry besides its own: prompt caching is automatic here (the prefix cache)
_BLOCK_EXTRAS = {"cache_control"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# parse_chat's names for the fields this adapter renamed, and Anthropic's
_RENAMES = [
    (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
    (re.compile(r"tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^stop\b"), "stop_sequences"),
]


def parse_messages(body, model: str, limits: DoorLimits, tool_format: ToolFormat | None) -> GenerationRequest:
    """A /v1/messages body, as parse_chat's GenerationRequest (errors name Anthropic's fields)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for key in body:
        if key not in FIELDS:
            raise bad(key, f"unknown field {short(repr(key), 100)}")
    for name in ("model", "max_tokens"):  # both required, as Anthropic requires them
        if body.get(name) is None:
            raise bad(name, f"{name} is required")
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad("stop_sequences", "stop_sequences must be an array of strings")
    tools = body.get("tools")
    chat = {
        "model": body["model"],
        "messages": _system(body.get("system")) + _messages(body.get("messages")),
        "max_tokens": body["max_tokens"],
        "stop": stop,
        "stream": body.get("stream"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "tools": None if tools is None else _tools(tools),
        **_tool_choice(body.get("tool_choice")),
    }
    try:
        return parse_chat({k: v for k, v in chat.items() if v is not None}, model, limits, tool_format)
    except OpenAIError as e:
        if e.param is not None:
            for pattern, name in _RENAMES:
                e.param, e.message = pattern.sub(name, e.param), pattern.sub(name, e.message)
        raise


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = _text_blocks(system, "system")
    if not isinstance(system, str):
        raise bad("system", "system must be a string or an array of text blocks")
    return [{"role": "system", "content": system}]


def _text_blocks(blocks: list, where: str) -> str:
    """An array of text blocks, joined as the chat door joins text parts."""
    return "\n".join(_text(block, f"{where}[{j}]") for j, block in enumerate(blocks))


def _text(block, at: str) -> str:
    if (
        not isinstance(block, dict)
        or block.get("type") != "text"
        or not isinstance(block.get("text"), str)
        or not set(block) <= {"type", "text", "citations"} | _BLOCK_EXTRAS
        or block.get("citations") not in (None, [])
    ):
        raise bad(at, f'{at} must be {{"type": "text", "text": string}}')
    return block["text"]


def _messages(messages) -> list[dict]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks become tool messages (in their
    place among its text), an assistant turn's tool_use blocks its tool_calls (arguments as JSON text, as
    the chat door takes them)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty array")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise bad(where, f"{where} must be an object of role and content")
        role, content = message["role"], message["content"]
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f'{where}.role must be "user" or "assistant"')
        if isinstance(content, str):
            result.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", f"{where}.content must be a string or an array of blocks")
        texts, calls, results = [], [], 0
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and role == "user":
                if texts:  # text before a result is a turn of its own, in order
                    result.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result.append(_tool_result(block, at))
                results += 1
            else:
                raise bad(
                    at,
                    f"{at}: only text blocks, tool_use (assistant) and tool_result (user) blocks are "
                    f"supported, got type {short(repr(kind), 100)}",
                )
        if role == "assistant":
            turn = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
            result.append({**turn, "tool_calls": calls} if calls else turn)
        elif texts or not results:
            result.append({"role": role, "content": "\n".join(texts)})
    if messages[-1]["role"] != "user":
        raise bad(
            f"messages[{len(messages) - 1}].role",
            "the last message must be a user turn: an assistant prefill is not supported",
        )
    return result


def _tool_use(block: dict, at: str) -> dict:
    if (
        not set(block) <= {"type", "id", "name", "input"} | _BLOCK_EXTRAS
        or not isinstance(block.get("id"), str)
        or not isinstance(block.get("name"), str)
        or not isinstance(block.get("input"), dict)
    ):
        raise bad(at, f'{at} must be {{"type": "tool_use", "id": string, "name": string, "input": object}}')
    arguments = json.dumps(block["input"], ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _tool_result(block: dict, at: str) -> dict:
    if not set(block) <= {"type", "tool_use_id", "content", "is_error"} | _BLOCK_EXTRAS or not isinstance(
        block.get("tool_use_id"), str
    ):
        raise bad(at, f'{at} must be {{"type": "tool_result", "tool_use_id": string, "content", "is_error"}}')
    content = block.get("content", "")
    if isinstance(content, list):
        content = _text_blocks(content, f"{at}.content")
    if not isinstance(content, str):
        raise bad(f"{at}.content", f"{at}.content must be a string or an array of text blocks")
    if not isinstance(block.get("is_error", False), bool):
        raise bad(f"{at}.is_error", f"{at}.is_error must be a boolean")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools) -> list[dict]:
    """Custom tools as the chat door's functions (parse_tools checks their names and schemas)."""
    if not isinstance(tools, list):
        raise bad("tools", "tools must be an array")
    result = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            raise bad(where, f"{where}: only custom tools (name, description, input_schema) are supported")
        if not set(tool) <= {"type", "name", "description", "input_schema"} | _BLOCK_EXTRAS:
            raise bad(where, f"{where} must be an object of name, description and input_schema")
        if "input_schema" not in tool:
            raise bad(f"{where}.input_schema", f"{where}.input_schema is required")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(choice) -> dict:
    """tool_choice as the chat door's tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    usage = '{"type": "auto" | "any" | "none"} or {"type": "tool", "name": string}'
    if not isinstance(choice, dict) or not set(choice) <= {"type", "name", "disable_parallel_tool_use"}:
        raise bad("tool_choice", f"tool_choice must be {usage}, got {short(repr(choice), 100)}")
    kind, parallel = choice.get("type"), choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad(
            "tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be a boolean"
        )
    if kind == "tool" and isinstance(choice.get("name"), str):
        result = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in _TOOL_CHOICES and "name" not in choice:
        result = {"tool_choice": _TOOL_CHOICES[kind]}
    else:
        raise bad("tool_choice", f"tool_choice must be {usage}, got {short(repr(choice), 100)}")
    return {**result, "parallel_tool_calls": False} if parallel else result


# ---------------------------------------------------------------------------------------------- responses


def message_id(request_id: str) -> str:
    return request_id if request_id.startswith("msg_") else f"msg_{request_id}"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")  # ToolStream's id, in Anthropic's spelling


def stop_reason(reason: str | None, completion: CompletionOutput) -> tuple[str | None, str | None]:
    """The chat path's finish reason (after the tool-call parser's) as stop_reason and stop_sequence."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if reason == "stop" and isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return ("end_turn" if reason == "stop" else None), None


def message_body(call) -> dict:
    """http.py's _Call, finished, as Anthropic's message (Messages has no n: one choice)."""
    completion = call.choices[0].output.outputs[0]
    return _message(call.request_id, call.request, completion, len(call.request.prompts[0]))


def _message(
    request_id: str, request: GenerationRequest, completion: CompletionOutput, input_tokens: int
) -> dict:
    """A whole answer as Anthropic's message: text and tool_use blocks, in the order the model wrote them
    (a call cut off by max_tokens, whose input does not parse, is left out)."""
    reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else None
    content = []
    if request.tools is None:
        text = completion.text
    else:
        message, reason = tool_message(request.tools, completion.text, reason)
        text = message["content"]
        for call in message.get("tool_calls", ()):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                continue
            name = call["function"]["name"]
            content.append(
                {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": name, "input": arguments}
            )
    if text:
        content.insert(0, {"type": "text", "text": text})
    stop, sequence = stop_reason(reason, completion)
    return {
        "id": message_id(request_id),
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": len(completion.token_ids)},
    }


class EventStream:
    """One answer's stream as Anthropic's events: message_start and ping, then per content block its
    content_block_start, deltas (text_delta, input_json_delta) and content_block_stop, then message_delta
    (stop_reason, usage) and message_stop. Fed the chat path's pieces of text and finish reasons."""

    def __init__(self, request_id: str, request: GenerationRequest, input_tokens: int):
        self.tools = None if request.tools is None else ToolStream(request.tools)
        self.block: str | None = None  # the open block's type
        self.blocks = 0
        self.ended = False
        start = _message(request_id, request, CompletionOutput(0, "", []), input_tokens)
        self.start = [{"type": "message_start", "message": start}, {"type": "ping"}]

    def events(self, piece: str, reason: str | None, completion: CompletionOutput) -> list[dict]:
        """The events of a piece of text; with the finish reason, the stream's last ones."""
        final = reason is not None
        if self.tools is None:
            deltas = [{"content": piece}]
        else:
            deltas = self.tools.deltas(piece, final)
            reason = self.tools.finish_reason(reason)
        events = []
        for delta in deltas:
            if delta.get("content"):
                events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    block = {
                        "type": "tool_use",
                        "id": _tool_use_id(call["id"]),
                        "name": call["function"]["name"],
                    }
                    events += self._open("tool_use", {**block, "input": {}})
                if call["function"]["arguments"]:
                    events.append(
                        self._delta(
                            {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
                        )
                    )
        if final:
            events += self._close()
            stop, sequence = stop_reason(reason, completion)
            events.append(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": sequence},
                    "usage": {"output_tokens": len(completion.token_ids)},
                }
            )
            events.append({"type": "message_stop"})
            self.ended = True
        return events

    def _open(self, kind: str, block: dict) -> list[dict]:
        if kind == "text" and self.block == "text":
            return []
        events = self._close()
        self.block = kind
        return events + [{"type": "content_block_start", "index": self.blocks, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.blocks, "delta": delta}

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block, self.blocks = None, self.blocks + 1
        return [{"type": "content_block_stop", "index": self.blocks - 1}]


def sse(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# ------------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_status(error: OpenAIError) -> int:
    # the engine's queue is full: Anthropic's 529 (a key over its quota stays a 429)
    return 529 if error.code == "overloaded" else error.status


def error_body(error: OpenAIError) -> dict:
    """Anthropic's error object; the message names the field (Anthropic's errors have no param)."""
    status = error_status(error)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = error.message
    if status == 401:
        message = "a valid API key is required: x-api-key: KEY (or Authorization: Bearer KEY)"
    elif error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: OpenAIError) -> web.Response:
    headers = None
    if error.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return web.json_response(error_body(error), status=error_status(error), headers=headers)


async def write_events(call, send: Callable[[bytes], Awaitable[None]], from_rpc: Callable) -> None:
    """A streamed /v1/messages answer (http.py's _Call, of one choice: Messages has no n), written with
    the door's `send` (its backpressure); an engine error mid-stream is Anthropic's error event."""
    choice = call.choices[0]
    stream = EventStream(call.request_id, call.request, len(call.request.prompts[0]))
    events = stream.start
    while True:
        while choice.deltas:
            delta = choice.deltas.popleft()
            events += stream.events(delta.text, delta.finish_reason, choice.output.outputs[0])
        if choice.error is not None or choice.done and not stream.ended:
            error = (
                from_rpc(choice.error)
                if choice.error is not None
                else OpenAIError(503, "the request was aborted")
            )
            events.append(error_body(error))
        if events:
            await send(b"".join(sse(event) for event in events))
            events = []
        if choice.done:
            return
        await call.wake.wait()
        call.wake.clear()
