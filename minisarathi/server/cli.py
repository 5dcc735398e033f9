"""`minisarathi serve`, `minisarathi client` and `minisarathi keys` (wired into minisarathi/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import json
import ssl
import sys
from pathlib import Path

from minisarathi.cli_args import (
    API_KEY_ENV,
    HelpFormatter,
    add_engine_arguments,
    add_sampling_arguments,
    check_engine_arguments,
    check_sampling_arguments,
    engine_options_from_args,
    port_number,
    read_api_key,
    refuse_unneeded,
    sampling_options_from_args,
)
from minisarathi.client import DEFAULT_PORT, Client
from minisarathi.server.auth import MIN_SECRET_BITS, KeyStore, add_key, limit_rule_broken, secret_bits
from minisarathi.server.protocol import RPCError, ServerLimits
from minisarathi.server.request_log import configure_logging
from minisarathi.server.tool_calls import FORMATS, tool_format

# ServerLimits fields whose flag is not simply the field's name (without a trailing _s for seconds)
_LIMIT_FLAGS = {"max_tokens": "--max-tokens-limit"}


def _limit_flag(field: dataclasses.Field) -> str:
    return _LIMIT_FLAGS.get(field.name, "--" + field.name.removesuffix("_s").replace("_", "-"))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve MODEL (default: the bundled stories260K) over MessagePack-RPC, and over "
        "HTTP with --http-port. A request's sampling defaults are SamplingParams' "
        "(temperature 1.0, max_tokens 16), not the greedy ones of `generate` and `client`."
    )
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="TCP address to listen on; beyond loopback a key is required"
    )
    g.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="TCP port; 0 picks a free one")
    g.add_argument("--unix-socket", default=None, help="also listen on this Unix socket path")
    g.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="DEBUG adds one line per engine step",
    )
    g.add_argument(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="json: one object per line, a finished request's fields as keys",
    )
    g.add_argument(
        "--no-msgpack", action="store_true", help="no MessagePack-RPC TCP door (with --http-port: HTTP only)"
    )
    h = parser.add_argument_group("HTTP (needs pip install 'minisarathi[http]')")
    h.add_argument(
        "--http-port",
        type=port_number,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port (0 picks a free one); off by default",
    )
    h.add_argument("--http-host", default=None, help="address of the HTTP door (default: --host)")
    h.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve /metrics, /health and /ready on this port (0 picks a free one)",
    )
    h.add_argument(
        "--metrics-key-labels",
        action="store_true",
        help="/metrics also counts per key, labelled by the keys file's names (anyone can read /metrics)",
    )
    h.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the HTTP API (default: the model folder's name)",
    )
    h.add_argument(
        "--chat-template", default=None, help="Jinja2 chat template file (default: the model folder's own)"
    )
    h.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(FORMATS),
        help="the model's tool-call format (default: told from its chat template; docs/http.md)",
    )
    a = parser.add_argument_group("security (docs/security.md)")
    a.add_argument(
        "--api-key-file",
        default=None,
        help=f"file holding the one API key clients must `auth` with (or set ${API_KEY_ENV})",
    )
    a.add_argument(
        "--keys-file",
        default=None,
        help="TOML file of named keys with quotas (`minisarathi keys add`); SIGHUP reloads it",
    )
    a.add_argument(
        "--insecure-no-auth", action="store_true", help="allow listening beyond loopback without any key"
    )
    a.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    a.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    a.add_argument(
        "--tls-client-ca", default=None, help="PEM CA bundle: require client certificates signed by it"
    )
    limits = parser.add_argument_group("limits (docs/protocol.md)")
    for field in dataclasses.fields(ServerLimits):
        default = getattr(ServerLimits, field.name)
        kind = float if "float" in str(field.type) else int
        shown = "--idle-timeout" if default is None else default  # ServerLimits' None: the idle timeout
        limits.add_argument(
            _limit_flag(field),
            dest=f"limit_{field.name}",
            type=kind,
            default=default,
            metavar="SECONDS" if field.name.endswith("_s") else "N",
            help=f"(default: {shown})",
        )
    parser.set_defaults(check=functools.partial(check_serve_arguments, parser))


def check_serve_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_engine_arguments(parser, args)
    if args.no_msgpack and args.unix_socket is None and args.http_port is None:
        raise ValueError("--no-msgpack: with no --http-port and no --unix-socket nothing would be served")
    http, door = args.http_port is not None, args.http_port is not None or args.metrics_port is not None
    refuse_unneeded(
        parser,
        args,
        [
            ("--http-host", door, "needs --http-port or --metrics-port"),
            ("--served-model-name", door, "needs --http-port or --metrics-port"),
            ("--chat-template", http, "needs --http-port"),
            ("--tool-call-parser", http, "needs --http-port"),
            (
                "--metrics-key-labels",
                door and args.keys_file is not None,
                "needs --keys-file, and --http-port or --metrics-port",
            ),
        ],
    )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        **{f.name: getattr(args, f"limit_{f.name}") for f in dataclasses.fields(ServerLimits)}
    )


def run_serve(args: argparse.Namespace) -> int:
    from minisarathi.engine.engine import LLMEngine
    from minisarathi.paths import default_model_dir
    from minisarathi.server.hub import Hub, ListenError
    from minisarathi.server.msgpack_door import MsgpackDoor

    configure_logging(args.log_level, args.log_format)
    if args.http_port is not None or args.metrics_port is not None:
        try:
            import aiohttp  # noqa: F401  (the check only)
            import jinja2  # noqa: F401
            import prometheus_client  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"--http-port and --metrics-port need the http extra ({e.name} is missing): "
                "pip install 'minisarathi[http]'"
            ) from None
    try:
        limits = limits_from_args(args)
    except ValueError as e:
        field = str(e).split()[0]
        flag = next(_limit_flag(f) for f in dataclasses.fields(ServerLimits) if f.name == field)
        raise ValueError(f"{flag}: {e}") from None
    keys = _key_store(args)
    _check_exposure("--host", args.host, keys, args.insecure_no_auth)
    if args.http_host is not None:
        _check_exposure("--http-host", args.http_host, keys, args.insecure_no_auth)
    tls = server_tls_context(args.tls_cert, args.tls_key, args.tls_client_ca)
    options = engine_options_from_args(args)
    model_dir = Path(options["model"] or default_model_dir())
    template = None
    if args.http_port is not None:  # read before the model loads: a wrong path fails in a second, not minutes
        from minisarathi.server.chat_template import load_chat_template

        template = load_chat_template(model_dir, args.chat_template)
    engine = LLMEngine(**options)
    hub = Hub(engine, limits, keys=keys, model_name=model_dir.resolve().name, tls=tls)
    hub.doors.append(MsgpackDoor(hub, None if args.no_msgpack else args.host, args.port, args.unix_socket))
    if args.http_port is not None or args.metrics_port is not None:
        _add_http_doors(hub, args, model_dir, template)
    try:
        asyncio.run(hub.run())
    except ListenError as e:
        raise ValueError(f"{_listener_flags(e.listener, args)}: cannot listen ({e.strerror})") from None
    return 0


def _listener_flags(listener, args: argparse.Namespace) -> str:
    """The flags that chose the address of a listener that could not be opened (Hub.start's ListenError)."""
    if listener == "tcp":
        return f"--host {args.host} --port {args.port}"
    if listener == "unix":
        return f"--unix-socket {args.unix_socket}"
    host = f"--http-host {listener.host}" if args.http_host is not None else f"--host {listener.host}"
    return f"{host} {'--http-port' if listener.serve_api else '--metrics-port'} {listener.port}"


def _add_http_doors(hub, args: argparse.Namespace, model_dir: Path, template) -> None:
    from minisarathi.server.http import HttpDoor
    from minisarathi.server.metrics import Metrics

    name = args.served_model_name or model_dir.resolve().name
    engine = hub.engine
    metrics = Metrics(name, engine.max_model_len, engine.config.chunk_size)
    hub.finish_listeners.append(metrics.request_finished)
    metrics.watch_hub(hub, args.metrics_key_labels)
    host = args.http_host or args.host
    if args.http_port is not None:
        tools = tool_format(template, args.tool_call_parser, engine.tokenizer)
        hub.doors.append(HttpDoor(hub, host, args.http_port, name, template, metrics, tool_format=tools))
    if args.metrics_port is not None:
        hub.doors.append(HttpDoor(hub, host, args.metrics_port, name, None, metrics, serve_api=False))


def _key_store(args) -> KeyStore | None:
    if args.keys_file and args.api_key_file:
        raise ValueError("--keys-file and --api-key-file: give one of them")
    if args.keys_file:
        return KeyStore.from_file(args.keys_file)
    secret = read_api_key(args.api_key_file)
    if secret is None:
        return None
    exposed = [host for host in (args.host, args.http_host) if host and not _is_loopback(host)]
    if exposed and secret_bits(secret) < MIN_SECRET_BITS:
        source = f"--api-key-file {args.api_key_file}" if args.api_key_file else f"${API_KEY_ENV}"
        raise ValueError(
            f"{source}: the key has at most {secret_bits(secret):.0f} bits of entropy, fewer than the "
            f"{MIN_SECRET_BITS} a key served beyond loopback ({exposed[0]}) needs; "
            "`minisarathi keys add` makes strong ones"
        )
    return KeyStore.single(secret)


def _check_exposure(flag: str, host: str, keys: KeyStore | None, insecure: bool) -> None:
    """Refuse to serve every interface, or any non-loopback one, without a key (unless told to)."""
    if not host:
        raise ValueError(
            f"{flag}: an empty host would listen on every interface; give an address "
            "(0.0.0.0 for all, with a key)"
        )
    if keys is not None or insecure:
        return
    if not _is_loopback(host):
        raise ValueError(
            f"{flag} {host}: listening beyond loopback without a key would let anyone who can reach "
            f"it use the server; give --keys-file or --api-key-file (or --insecure-no-auth)"
        )


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_tls_context(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"--tls-cert {cert} / --tls-key {key}: cannot be loaded ({_ssl_reason(e, _PEM_PAIR)})"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"--tls-client-ca {client_ca}: cannot be loaded ({_ssl_reason(e, _PEM_BUNDLE)})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if ca is None and cert is None:
        if key is not None:
            raise ValueError("--tls-key needs --tls-cert")
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-ca {ca}: cannot be loaded ({_ssl_reason(e, _PEM_BUNDLE)})") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            flags = f"--tls-cert {cert}" + ("" if key is None else f" / --tls-key {key}")
            raise ValueError(f"{flags}: cannot be loaded ({_ssl_reason(e, _PEM_PAIR)})") from None
    return context


_PEM_BUNDLE = "a PEM CA bundle"
_PEM_PAIR = "a PEM certificate chain and its private key"


def _ssl_reason(error: OSError, expected: str) -> str:
    """Why a TLS file was refused, in words: OpenSSL's own text is "[SSL] PEM lib (_ssl.c:3905)"."""
    if isinstance(error, ssl.SSLError):
        return f"not {expected}" + (f": {error.reason}" if error.reason else "")
    return error.strerror or str(error)


def add_keys_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    add_help = "add a named key to a keys file; prints the new secret once"
    add = sub.add_parser("add", help=add_help, description=add_help, formatter_class=HelpFormatter)
    add.add_argument("name", metavar="NAME")
    add.add_argument("--file", required=True, help="the TOML keys file (created if missing)")
    for name, help_text in (
        ("rpm", "requests per minute (default: no limit)"),
        ("tpm", "tokens per minute, prompt + max_tokens (default: no limit)"),
        ("concurrent", "requests in flight at once (default: no limit)"),
        ("max-tokens", "cap on max_tokens (default: no limit)"),
        ("priority", "scheduling priority, lower runs first (default 0)"),
    ):
        add.add_argument(f"--{name}", type=int, default=None, help=help_text)


def run_keys(args: argparse.Namespace) -> int:
    limits = dict(
        rpm=args.rpm,
        tpm=args.tpm,
        concurrent=args.concurrent,
        max_tokens=args.max_tokens,
        priority=args.priority,
    )
    for field, value in limits.items():
        rule = limit_rule_broken(field, value)
        if rule:
            raise ValueError(f"--{field.replace('_', '-')} {value}: {rule}")
    secret = add_key(Path(args.file), args.name, **limits)
    print(secret)
    print(
        f"key {args.name!r} added to {args.file}; the secret above is shown only now (the file keeps its "
        "SHA-256). A running server takes it on SIGHUP.",
        file=sys.stderr,
    )
    return 0


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Send PROMPT to a running `minisarathi serve` and print the prompt, then the text "
        "generated (the server answers the continuation alone, as --json shows). Sampling "
        "is greedy unless --temperature is above 0."
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    c = parser.add_argument_group("connection")
    c.add_argument("--host", default="127.0.0.1", help="the server's address")
    c.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="the server's TCP port")
    c.add_argument("--unix-socket", default=None, help="connect to this Unix socket instead of --host/--port")
    c.add_argument("--api-key-file", default=None, help=f"(or set ${API_KEY_ENV})")
    c.add_argument("--tls", action="store_true", help="connect with TLS (system CAs unless --tls-ca)")
    c.add_argument("--tls-ca", default=None, help="PEM CA bundle that signed the server's certificate")
    c.add_argument("--tls-cert", default=None, help="client certificate (PEM), when the server asks for one")
    c.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_sampling_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the whole result map as JSON")
    parser.set_defaults(check=functools.partial(check_client_arguments, parser))


def check_client_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    tcp = args.unix_socket is None
    refuse_unneeded(
        parser,
        args,
        [
            (flag, tcp, "is not used with --unix-socket, which is the address")
            for flag in ("--host", "--port")
        ],
    )
    check_sampling_arguments(parser, args)


def run_client(args: argparse.Namespace) -> int:
    sampling = sampling_options_from_args(args)
    tls = client_tls_context(args.tls_ca, args.tls_cert, args.tls_key)
    if args.tls and tls is None:
        tls = ssl.create_default_context()
    try:
        with Client(
            args.host,
            args.port,
            unix_socket=args.unix_socket,
            api_key=read_api_key(args.api_key_file),
            tls=tls,
        ) as client:
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
