"""Command line: minisarathi generate | serve | client | keys | bench. This module only dispatches."""

from __future__ import annotations

import argparse

from minisarathi import generate
from minisarathi.bench import cli as bench_cli
from minisarathi.cli_args import HelpFormatter
from minisarathi.server import cli as server_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minisarathi", description=__doc__, formatter_class=HelpFormatter)
    parser.set_defaults(check=None)  # a command's parser sets its own: flags that need one another
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add_arguments, run, help_text in (
        (
            "generate",
            generate.add_generate_arguments,
            generate.run_generate,
            "generate text offline, streamed to the terminal",
        ),
        (
            "serve",
            server_cli.add_serve_arguments,
            server_cli.run_serve,
            "run the MessagePack-RPC server (and the HTTP one)",
        ),
        ("client", server_cli.add_client_arguments, server_cli.run_client, "send one request to a server"),
        ("keys", server_cli.add_keys_arguments, server_cli.run_keys, "manage the API keys file of `serve`"),
        ("bench", bench_cli.add_bench_arguments, bench_cli.run_bench, "serving benchmark"),
    ):
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        add_arguments(command)
        command.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        if args.check is not None:  # before any work: a refused flag costs no model load
            args.check(args)
        return args.run(args) or 0
    except ValueError as e:
        parser.exit(2, f"minisarathi {args.command}: error: {e}\n")
