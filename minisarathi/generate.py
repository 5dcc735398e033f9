"""`minisarathi generate`: one prompt generated offline, its text streamed to the terminal."""

from __future__ import annotations

import argparse
import functools
import sys

from minisarathi.cli_args import (
    add_engine_arguments,
    add_sampling_arguments,
    check_engine_arguments,
    check_sampling_arguments,
    engine_options_from_args,
    sampling_options_from_args,
)
from minisarathi.sampling_params import SamplingParams

DESCRIPTION = """Generate a continuation of PROMPT offline and stream it to the terminal, after the prompt
itself (LLM.generate returns the continuation alone). With one positional argument it is PROMPT, and the
bundled stories260K model runs; with two, they are MODEL PROMPT, next to each other. Sampling is greedy unless
--temperature is above 0."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    add_engine_arguments(parser)
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    add_sampling_arguments(parser)
    parser.set_defaults(check=functools.partial(check_generate_arguments, parser))


def check_generate_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_engine_arguments(parser, args)
    check_sampling_arguments(parser, args)


def run_generate(args: argparse.Namespace) -> int:
    from minisarathi.engine.engine import LLMEngine  # the model code loads only for the command that runs it

    params = SamplingParams(**sampling_options_from_args(args))
    engine = LLMEngine(**engine_options_from_args(args))
    engine.add_request("cli", args.prompt, params)
    sys.stdout.write(args.prompt)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0
