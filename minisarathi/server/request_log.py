"""One log line per finished request, from either door, and the `--log-format text|json` formatters.

The line carries the request id, the door, the client's address, the prompt (truncated), the cached and
completion tokens, and the request's timeline (queue time, TTFT, end-to-end), so one grep for an id finds
everything about that request. In JSON each of those is a key of the line's object.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass

from minisarathi.outputs import RequestMetrics

log = logging.getLogger("minisarathi.requests")

PROMPT_CHARS = 80  # of the prompt text in a log line
REQUEST_ID_RULE = "1 to 128 printable ASCII characters without spaces"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # it goes into headers and log lines as is


def valid_request_id(text: str) -> bool:
    return _REQUEST_ID.fullmatch(text) is not None


@dataclass
class FinishedRequest:
    request_id: str
    door: str  # "msgpack" | "http"
    client: str  # the peer's address, "unix" for the Unix socket
    prompt: str | list[int] | None  # the text, or the token ids the client sent
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: RequestMetrics | None  # None when the engine never reported on it


def log_finished(request: FinishedRequest) -> None:
    if log.isEnabledFor(logging.INFO):  # the fields cost more than the rest of a request's result
        log.info("%s", request.request_id, extra={"fields": _fields(request)})


def _fields(r: FinishedRequest) -> dict:
    m = r.metrics
    prompt = r.prompt if isinstance(r.prompt, str) or r.prompt is None else f"<{len(r.prompt)} token ids>"
    if isinstance(prompt, str) and len(prompt) > PROMPT_CHARS:
        prompt = prompt[:PROMPT_CHARS] + "..."

    def since(start, end):
        return None if start is None or end is None else round(end - start, 6)

    return {
        "request_id": r.request_id,
        "door": r.door,
        "client": r.client,
        "prompt": prompt,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "queue_s": m and since(m.arrival_time, m.first_scheduled_time),
        "ttft_s": m and since(m.arrival_time, m.first_token_time),
        "e2e_s": m and since(m.arrival_time, m.finished_time or time.monotonic()),
        "finish_reason": r.finish_reason,
    }


class TextFormatter(logging.Formatter):
    """The usual line; a record's `fields` are appended as key=value pairs."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(
                f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                for k, v in fields.items()
                if k != "request_id"
            )
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's `fields` as keys."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
