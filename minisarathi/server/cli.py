"""`minisarathi serve` and `minisarathi client` (dispatched by minisarathi/cli.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from minisarathi.cli_args import (API_KEY_ENV, add_engine_arguments, add_sampling_arguments, engine_options_from_args,
                                  read_api_key, sampling_options_from_args)
from minisarathi.client import DEFAULT_PORT, Client
from minisarathi.server.protocol import RPCError, ServerLimits
from minisarathi.server.request_log import configure_logging


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="TCP address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port; 0 picks a free one (default {DEFAULT_PORT})")
    g.add_argument("--unix-socket", default=None, help="also listen on this Unix socket path")
    g.add_argument("--api-key-file", default=None,
                   help=f"file holding the API key clients must `auth` with (or set ${API_KEY_ENV})")
    g.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="DEBUG adds one line per engine step")
    g.add_argument("--log-format", default="text", choices=("text", "json"),
                   help="json: one object per line, a finished request's fields as keys")
    g.add_argument("--no-msgpack", action="store_true",
                   help="no MessagePack-RPC TCP door (with --http-port: HTTP only)")
    h = parser.add_argument_group("HTTP (needs pip install 'minisarathi[http]')")
    h.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API on this port (0 picks a free one); off by default")
    h.add_argument("--http-host", default=None, help="address of the HTTP door (default: --host)")
    h.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics, /health and /ready on this port (0 picks a free one)")
    h.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (default: the model folder's name)")
    h.add_argument("--chat-template", default=None,
                   help="Jinja2 chat template file (default: the model folder's own)")
    defaults = ServerLimits()
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-message-bytes", type=int, default=defaults.max_message_bytes)
    limits.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens)
    limits.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens,
                        help="largest max_tokens a request may ask for")
    limits.add_argument("--max-inflight-per-connection", type=int, default=defaults.max_inflight_per_connection)
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections; more are refused with `overloaded`")
    limits.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                        help="unfinished requests server-wide before new ones get `overloaded`")
    limits.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout_s, help="seconds")
    limits.add_argument("--max-write-buffer-bytes", type=int, default=defaults.max_write_buffer_bytes,
                        help="unsent output past which a client that does not read is disconnected")
    limits.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s, help="seconds")
    limits.add_argument("--max-n", type=int, default=defaults.max_n, help="choices per prompt (`n`) at most")


def run_serve(args: argparse.Namespace) -> int:
    from minisarathi.engine.engine import LLMEngine
    from minisarathi.paths import default_model_dir
    from minisarathi.server.server import Server

    configure_logging(args.log_level, args.log_format)
    if args.no_msgpack and args.unix_socket is None and args.http_port is None:
        raise ValueError("--no-msgpack: with no --http-port and no --unix-socket nothing would be served")
    if args.http_port is not None or args.metrics_port is not None:
        try:
            import aiohttp  # noqa: F401  (the check only)
            import jinja2  # noqa: F401
            import prometheus_client  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--http-port and --metrics-port need the http extra ({e.name} is missing): "
                             "pip install 'minisarathi[http]'") from None
    limits = ServerLimits(max_message_bytes=args.max_message_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens=args.max_tokens_limit,
                          max_inflight_per_connection=args.max_inflight_per_connection,
                          max_connections=args.max_connections,
                          max_queued_requests=args.max_queued_requests, idle_timeout_s=args.idle_timeout,
                          max_write_buffer_bytes=args.max_write_buffer_bytes, shutdown_grace_s=args.shutdown_grace,
                          max_n=args.max_n)
    api_key = read_api_key(args.api_key_file)
    engine = LLMEngine(**engine_options_from_args(args))
    model_dir = Path(args.model or default_model_dir())
    server = Server(engine, limits, api_key=api_key, model_name=str(model_dir))
    if args.http_port is not None or args.metrics_port is not None:
        _add_http_doors(server, args, model_dir)
    asyncio.run(server.run(None if args.no_msgpack else args.host, args.port, args.unix_socket))
    return 0


def _add_http_doors(server, args: argparse.Namespace, model_dir: Path) -> None:
    from minisarathi.server.chat_template import load_chat_template
    from minisarathi.server.http import HttpDoor
    from minisarathi.server.metrics import Metrics

    name = args.served_model_name or model_dir.name
    engine = server.engine
    metrics = Metrics(name, engine.max_model_len, engine.config.chunk_size)
    server.finish_listeners.append(metrics.request_finished)
    host = args.http_host or args.host
    if args.http_port is not None:
        template = load_chat_template(model_dir, args.chat_template)
        server.doors.append(HttpDoor(server, host, args.http_port, name, template, metrics))
    if args.metrics_port is not None:
        server.doors.append(HttpDoor(server, host, args.metrics_port, name, None, metrics, serve_api=False))


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    c = parser.add_argument_group("connection")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=DEFAULT_PORT)
    c.add_argument("--unix-socket", default=None)
    c.add_argument("--api-key-file", default=None, help=f"(or set ${API_KEY_ENV})")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_sampling_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the whole result map as JSON")


def run_client(args: argparse.Namespace) -> int:
    sampling = sampling_options_from_args(args)
    try:
        with Client(args.host, args.port, unix_socket=args.unix_socket,
                    api_key=read_api_key(args.api_key_file)) as client:
            if args.stream:
                sys.stdout.write(args.prompt)
                stream = client.generate_stream(args.prompt, **sampling)
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                result = stream.result
            else:
                result = client.generate(args.prompt, **sampling)
                if not args.json:
                    sys.stdout.write(args.prompt + result.text)
    except RPCError as e:
        print(f"minisarathi client: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"minisarathi client: cannot reach the server: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**{k: v for k, v in vars(result).items() if k != "extra"}, **result.extra}))
    else:
        sys.stdout.write("\n")
    return 0
