"""Tool calling on /v1/chat/completions: a request's `tools`, `tool_choice` and `parallel_tool_calls`; the
model's own call format (told from its chat template, or serve's --tool-call-parser); the llguidance grammar
that constrains its calls; and the parser that turns its text back into OpenAI's tool_calls, whole or
streamed.

Each format writes a call as one JSON object, its name first, then its arguments:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
    llama3_json  {"name": "f", "parameters": {...}}                            (calls joined by "; ")
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]

With tool_choice "required" or a named function the whole output is calls; with "auto" it is free text until
the format's trigger, then calls (a lazy llguidance rule, as in its docs' tool-calling example). Either way
the arguments follow the tool's JSON schema, so every call the parser returns parses and validates.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from minisarathi import structured
from minisarathi.server.protocol import short


class ToolError(ValueError):
    """A refused tools field: the door answers 400 with `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Format:
    name: str
    trigger: str  # the text that starts the calls (in auto, free text runs until it)
    open: str  # the calls' opening, starting with the trigger
    args_key: str  # the arguments' key in a call object
    separator: str | None  # between two calls (hermes: none, each call opens with the trigger again)
    close: str  # after the last call


FORMATS = {
    f.name: f
    for f in (
        Format("hermes", "<tool_call>", "<tool_call>\n", "arguments", None, "\n</tool_call>"),
        Format("llama3_json", '{"name"', "", "parameters", "; ", ""),
        Format("mistral", "[TOOL_CALLS]", "[TOOL_CALLS][", "arguments", ", ", "]"),
    )
}
# no-parameters tools take the empty object (OpenAI: "omitting parameters defines an empty parameter list")
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def detect_format(template_source: str) -> str | None:
    """The call format a chat template teaches its model, by the markers it writes; None if it names none."""
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|eot_id|>" in template_source and '"parameters"' in template_source:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolFormat:
    """A Format as the engine's tokenizer spells its trigger: a single special token is referenced by id in
    the grammar (a grammar's text never matches one) and kept in the decoded text."""

    format: Format
    trigger_token: int | None  # the trigger's id where it is a special token of the tokenizer

    @classmethod
    def for_tokenizer(cls, format: Format, tokenizer) -> ToolFormat:
        ids = tokenizer.encode(format.trigger, add_special_tokens=False)
        special = len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""
        return cls(format, ids[0] if special else None)


def tool_format(template, override: str | None, tokenizer) -> ToolFormat | None:
    """The HTTP door's tool-call format: serve's --tool-call-parser, else the one the chat template shows."""
    name = override or (None if template is None else detect_format(template.source))
    return None if name is None else ToolFormat.for_tokenizer(FORMATS[name], tokenizer)


@dataclass
class ToolRequest:
    tools: list[dict]  # as the request gave them (the template's `tools`)
    format: ToolFormat
    parallel: bool


def parse_tools(body: dict, tool_format: ToolFormat | None) -> tuple[ToolRequest | None, dict | None]:
    """The request's tools, and the constraint (SamplingParams.structured) for its tool_choice: (None, None)
    without tools or with tool_choice "none" (then the template is not shown the tools either)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            "parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {short(repr(parallel), 100)}"
        )
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"tools must be an array of at most {MAX_TOOLS} tools")
    schemas = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise ToolError(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
        function, where = tool["function"], f"{where}.function"
        if not isinstance(function, dict) or not set(function) <= {
            "name",
            "description",
            "parameters",
            "strict",
        }:
            raise ToolError(where, f"{where} must be an object of name, description, parameters and strict")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.name", f"{where}.name must be 1-64 letters, digits, _, . or -")
        if name in schemas:
            raise ToolError(f"{where}.name", f"{where}.name {name!r} is given twice")
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"{where}.description", f"{where}.description must be a string")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise ToolError(f"{where}.strict", f"{where}.strict must be a boolean")
        schema = function.get("parameters")
        schema = EMPTY_PARAMETERS if schema is None else schema
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ToolError(f"{where}.parameters", f"{where}.parameters must be a JSON schema of an object")
        schema = {**schema, "type": "object"}  # the arguments are an object, whatever else the schema allows
        try:  # llguidance refuses a bad schema here, at admission, with the field's name
            structured.grammar({"json": schema})
        except ValueError as e:
            raise ToolError(f"{where}.parameters", f"{where}.parameters " + str(e).split(" ", 1)[1]) from None
        schemas[name] = schema
    if choice is None or choice == "auto":
        names, required = list(schemas), False
    elif choice == "none":
        return None, None
    elif choice == "required":
        names, required = list(schemas), True
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice) == {"type", "function"}
        and isinstance(choice["function"], dict)
        and set(choice["function"]) == {"name"}
    ):
        name = choice["function"]["name"]
        if name not in schemas:
            raise ToolError(
                "tool_choice.function.name",
                f"tool_choice names {short(repr(name), 100)}, which is not in tools",
            )
        names, required = [name], True
    else:
        raise ToolError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {short(repr(choice), 100)}',
        )
    if tool_format is None:
        raise ToolError(
            "tools",
            "this model's chat template has no tool-call format the server can tell; start it with "
            f"--tool-call-parser NAME ({', '.join(FORMATS)})",
        )
    request = ToolRequest(tools, tool_format, parallel is not False)
    return request, {
        "grammar": calls_grammar(tool_format, {n: schemas[n] for n in names}, required, request.parallel)
    }


def calls_grammar(tool_format: ToolFormat, schemas: dict[str, dict], required: bool, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for the format's calls of these tools, each name's arguments by
    its schema: the whole output where required, else free text until the trigger, then the calls."""
    fmt = tool_format.format
    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/"]

    def literal(text: str) -> str:
        return json.dumps(text) if text else ""

    first, rest = [], []
    for i, (name, schema) in enumerate(schemas.items()):
        head = f'{{"name": {json.dumps(name)}, "{fmt.args_key}": '
        # compact JSON, as structured.JSON_OPTIONS: flexible whitespace lets a small model ramble in blanks
        schema = {**schema, "x-guidance": structured.JSON_OPTIONS}
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
        first.append(f'{literal((fmt.open + head)[len(fmt.trigger) :])} args_{i} "}}"')
        rest.append(f'{literal(head)} args_{i} "}}"')
    lines.append("first: " + " | ".join(first))
    lines.append("call: " + " | ".join(rest))
    if not parallel:
        calls = "first"
    elif fmt.separator is None:  # each call opens again on a line of its own, trigger included
        calls = f"first ({literal(fmt.close + chr(10) + fmt.open)} call)*"
    else:
        calls = f"first ({literal(fmt.separator)} call)*"
    lines.append(f"calls: {calls} {literal(fmt.close)}")
    trigger = f"<[{tool_format.trigger_token}]>" if tool_format.trigger_token is not None else None
    if required:
        lines.append(f"start: {trigger or literal(fmt.trigger)} calls")
    elif trigger is not None:  # free text cannot hold a special token: it ends where the trigger comes
        lines.append(f"start: TEXT | TEXT {trigger} calls")
    else:
        lines.append(f"start: TEXT | head calls\nhead[lazy]: TEXT {literal(fmt.trigger)}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- parsing

_STRING = r'"(?:[^"\\]|\\.)*"'


class ToolCallParser:
    """The model's text, fed in pieces, as events: ("content", text), ("call", index, name) and
    ("arguments", index, fragment). A call is recognized with its name first, as the grammar writes it;
    text that starts like a call but is not one stays content. Text that may still turn out to be the
    trigger or a call's head is held back until it is told apart (or finish())."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        head = r'\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"' + fmt.args_key + r'"\s*:\s*(?=\S)'
        open_ = re.escape(fmt.open.strip()).replace(re.escape(fmt.trigger), re.escape(fmt.trigger) + r"\s*")
        self._first = re.compile(r"\s*".join([open_, head]) if fmt.open else head)
        self._next = re.compile(r"\s*" + head)
        self._pending = ""
        self._mode = "content"  # content | head | next | arguments | end
        self._calls = 0
        self._after_call = False  # the blanks right after a call are dropped
        self._depth, self._in_string, self._escape = 0, False, False

    def feed(self, text: str) -> list[tuple]:
        self._pending += text
        events = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[tuple]:
        """The events of what was held back, at the end of the output."""
        events = []
        while self._step(events, final=True):
            pass
        if self._pending and self._mode in ("content", "head", "next"):
            events.append(("content", self._pending))
        elif self._pending and self._mode == "arguments":  # cut off mid-arguments (finish_reason length)
            events.append(("arguments", self._calls - 1, self._pending))
        self._pending = ""
        return events

    def _step(self, events: list, final: bool) -> bool:
        """One move on the pending text; whether to try another."""
        text, fmt = self._pending, self.fmt
        if self._mode == "content":
            if self._after_call:
                text = self._pending = text.lstrip()
            at = text.find(fmt.trigger)
            if at < 0:  # hold back a tail that may be the trigger's start
                keep = next(
                    (
                        k
                        for k in range(min(len(fmt.trigger) - 1, len(text)), 0, -1)
                        if fmt.trigger.startswith(text[-k:])
                    ),
                    0,
                )
                if final and self._after_call and keep == len(text):  # a next call cut by max_tokens
                    self._pending = ""
                elif final:
                    keep = 0
                if len(text) > keep:
                    events.append(("content", text[: len(text) - keep]))
                    self._pending, self._after_call = text[len(text) - keep :], False
                return False
            if at:
                events.append(("content", text[:at]))
                self._after_call = False
            self._pending, self._mode = text[at:], "head"
            return True
        if self._mode in ("head", "next"):
            match = (self._first if self._mode == "head" else self._next).match(text)
            if match is None:
                # told apart once the arguments' key could have been written: not a call after all
                if final or re.search(r'"' + fmt.args_key + r'"\s*:\s*\S', text) or len(text) > 256:
                    if self._mode == "head":
                        events.append(("content", text[: len(fmt.trigger)]))
                        self._pending = text[len(fmt.trigger) :]
                    self._mode = "content"
                    return True
                return False
            events.append(("call", self._calls, json.loads(match.group(1))))
            self._calls += 1
            self._pending, self._mode = text[match.end() :], "arguments"
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if self._mode == "arguments":
            end = self._scan(text)
            if end is None:
                if text:
                    events.append(("arguments", self._calls - 1, text))
                self._pending = ""
                return False
            events.append(("arguments", self._calls - 1, text[:end]))
            self._pending, self._mode = text[end:], "end"
            return True
        # end: the call object's "}", then another call or the close
        stripped = text.lstrip()
        if not stripped.startswith("}"):
            if stripped or final:
                self._mode, self._after_call = "content", True
                return True
            return False
        after = stripped[1:].lstrip()
        marks = [(m.strip(), mode) for m, mode in ((fmt.separator, "next"), (fmt.close, "content")) if m]
        for mark, mode in marks:
            if after.startswith(mark):
                self._pending, self._mode, self._after_call = after[len(mark) :], mode, mode == "content"
                return True
        if any(mark.startswith(after) for mark, _ in marks):
            if not final:
                return False  # may still be one
            after = ""  # cut short by max_tokens: dropped with the call
        self._pending, self._mode, self._after_call = after, "content", True
        return True

    def _scan(self, text: str) -> int | None:
        """The end (exclusive) of the JSON value the arguments started with, or None if it goes on."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class ToolStream:
    """One choice's parser, with the ids it gave its calls: text pieces in, OpenAI chat deltas out."""

    def __init__(self, request: ToolRequest):
        self.parser = ToolCallParser(request.format.format)
        self.ids: list[str] = []

    def deltas(self, piece: str, final: bool) -> list[dict]:
        events = self.parser.feed(piece) + (self.parser.finish() if final else [])
        deltas = []
        for event in events:
            if event[0] == "content":
                deltas.append({"content": event[1]})
            elif event[0] == "call":
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                function = {"name": event[2], "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": event[1], "id": self.ids[-1], "type": "function", "function": function}
                        ]
                    }
                )
            elif event[2]:
                deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.ids else reason


def tool_message(request: ToolRequest, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A whole output as OpenAI's assistant message (content null where it is only calls) and the finish
    reason ("tool_calls" where it ended after calls)."""
    stream = ToolStream(request)
    content, calls = "", []
    for delta in stream.deltas(text, final=True):
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                calls.append(call)
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message, stream.finish_reason(reason)
