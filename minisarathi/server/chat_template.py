"""Chat templates: the model folder's Jinja2 template, rendered as transformers' apply_chat_template renders
it.

A template is code from the internet, so it runs in Jinja2's ImmutableSandboxedEnvironment (no access to
Python internals, no mutation of the messages), with the environment transformers sets up: trim_blocks,
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block (transformers uses it to mark
assistant tokens; here it renders its body), a `tojson` filter that keeps non-ASCII text as is,
`raise_exception`, `strftime_now`, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
variables. The rendered text is tokenized without adding special tokens: the template writes its own.

The server renders in a worker process (TemplateWorker), killed and restarted when a render runs past its
time limit: the sandbox stops escapes, not a nested loop of range(100000) or `'a' * 10**8`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("minisarathi.http")

# The worker's address space beyond what it has after start: a render past it gets a MemoryError.
WORKER_MEMORY_BYTES = 512 << 20
_WORKER_START_TIMEOUT_S = 60.0  # an interpreter and jinja2 start in ~0.2 s; a loaded machine may be slower


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template raised (raise_exception) or broke a sandbox rule."""


class _GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which a prompt must not get.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            env.parse(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: syntax error on line {e.lineno}: {e.message}") from None
        self._env = env
        self._template: jinja2.Template | None = None
        self.special_tokens = dict(special_tokens)
        self.source = source

    def _compiled(self) -> jinja2.Template:
        # On first use, not at load: Jinja evaluates constant expressions as it compiles (`"a" * 10**9`),
        # which the server leaves to the worker process and its limits.
        if self._template is None:
            self._template = self._env.from_string(self.source)
        return self._template

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_chars: int | None = None,
        kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text; ChatTemplateError if the template refuses, fails, or writes more than
        max_chars characters (checked piece by piece, so a runaway output stops early). kwargs: the
        request's chat_template_kwargs (enable_thinking, ...), variables beside the special tokens, as
        transformers passes them; tools: the request's tools, OpenAI's shape, as transformers' tools=."""
        pieces, length = [], 0
        try:
            for piece in self._compiled().generate(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **(kwargs or {})},
            ):
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise ChatTemplateError(f"the rendered prompt exceeds {max_chars} characters")
                pieces.append(piece)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # SecurityError included
            raise ChatTemplateError(str(e)) from None
        except MemoryError:
            raise ChatTemplateError(f"rendering needed more than {WORKER_MEMORY_BYTES >> 20} MiB") from None
        except (
            Exception
        ) as e:  # the template's own bug on these messages (a TypeError, a division by zero...)
            raise ChatTemplateError(
                f"the template failed on these messages: {type(e).__name__}: {e}"
            ) from None
        text = "".join(pieces)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a "\ud800" literal in the template: no text a tokenizer takes
            raise ChatTemplateError("the template wrote a lone UTF-16 surrogate, which is not text") from None
        return text


def load_chat_template(model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The template of `override` (a file: serve's --chat-template), else the folder's chat_template.jinja,
    else tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one named
    "default"; a GGUF file's `tokenizer.chat_template`); None if it has none."""
    # not at the top: the worker process starts without the tokenizer's imports
    from minisarathi.tokenizer import special_tokens, tokenizer_config

    model_dir = Path(model_dir)
    config = tokenizer_config(model_dir)  # a GGUF file's metadata gives its tokenizer.chat_template
    if override is not None:
        try:
            source = Path(override).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"--chat-template {override}: cannot be read ({getattr(e, 'strerror', None) or e})"
            ) from None
    elif (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special_tokens(model_dir))


class TemplateWorker:
    """A ChatTemplate rendered in a child process, one render at a time, each within timeout_s and max_chars.

    A process, because a runaway render cannot be stopped any other way: a thread cannot be killed, and the
    sandbox bounds neither loops nor one C-level step (`10 ** 10 ** 8`). Past timeout_s the child is killed
    and the next render starts a new one. Requests and answers are JSON lines on its stdin and stdout.
    """

    def __init__(self, template: ChatTemplate, timeout_s: float, max_chars: int):
        self._config = {
            "source": template.source,
            "special_tokens": template.special_tokens,
            "max_chars": max_chars,
            "timeout_s": timeout_s,
        }
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()  # one exchange on the pipes at a time
        self._closed = False

    async def start(self) -> None:
        async with self._lock:
            await self._ensure_started()

    async def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text, or ChatTemplateError (the template's own error, or a limit it hit). A caller
        cancelled meanwhile leaves the exchange to finish, so the pipes stay in step."""
        request = json.dumps(
            {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "kwargs": kwargs,
                "tools": tools,
            }
        )
        return await asyncio.shield(self._exchange(request.encode() + b"\n"))

    async def _exchange(self, request: bytes) -> str:
        async with self._lock:
            if self._closed:
                raise ChatTemplateError("the server is shutting down")
            process = await self._ensure_started()
            try:
                process.stdin.write(request)
                async with asyncio.timeout(self.timeout_s):
                    await process.stdin.drain()
                    line = await process.stdout.readline()
            except TimeoutError:
                log.warning("a chat template render ran past %gs; its worker was restarted", self.timeout_s)
                await self._kill()
                raise ChatTemplateError(f"rendering took more than {self.timeout_s:g}s") from None
            except (ConnectionError, ValueError):  # the child died mid-answer; ValueError: over the limit
                await self._kill()
                raise ChatTemplateError("the template worker failed on these messages") from None
            if not line:
                await self._kill()
                raise ChatTemplateError("the template worker failed on these messages")
            answer = json.loads(line)
            if "error" in answer:
                raise ChatTemplateError(answer["error"])
            return answer["text"]

    async def _ensure_started(self) -> asyncio.subprocess.Process:
        if self._process is not None:
            return self._process
        # -P: the script's folder (minisarathi/server, which has an http.py) stays off sys.path
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",
            __file__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=6 * self.max_chars + 4096,  # the answer's line: JSON escapes a character in 6 bytes at most
        )
        try:
            process.stdin.write(json.dumps(self._config).encode() + b"\n")
            async with asyncio.timeout(_WORKER_START_TIMEOUT_S):
                ready = await process.stdout.readline()
        except (TimeoutError, ConnectionError):
            ready = b""
        if ready != b"ready\n":
            process.kill()
            await process.wait()
            raise ChatTemplateError("the chat template worker did not start")
        self._process = process
        return process

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Kill the child at once (a render in progress ends with an error)."""
        self._closed = True
        await self._kill()


def _worker_main() -> None:
    """The child of TemplateWorker: the config line, then one answer line per request line until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    config = json.loads(stdin.readline())
    with open("/proc/self/statm") as statm:  # the first field: the address space, in pages
        start = int(statm.read().split()[0]) * resource.getpagesize()
    limit = start + WORKER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    template = ChatTemplate(config["source"], config["special_tokens"])
    stdout.write(b"ready\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        # SIGALRM's default action ends the process: a render outlives the parent's timeout by 1 s at most,
        # even if the parent is gone
        signal.setitimer(signal.ITIMER_REAL, config["timeout_s"] + 1.0)
        try:
            text = template.render(
                request["messages"],
                request["add_generation_prompt"],
                config["max_chars"],
                request["kwargs"],
                request["tools"],
            )
            answer = {"text": text}
        except ChatTemplateError as e:
            answer = {"error": str(e)}
        signal.setitimer(signal.ITIMER_REAL, 0)
        stdout.write(json.dumps(answer, ensure_ascii=False).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _worker_main()
