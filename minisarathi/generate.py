"""`minisarathi generate`: one prompt generated offline, its text streamed to the terminal."""
from __future__ import annotations

import argparse
import sys

from minisarathi.cli_args import (add_engine_arguments, add_sampling_arguments, engine_options_from_args,
                                  sampling_options_from_args)
from minisarathi.sampling_params import SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_engine_arguments(parser, positional_model=False)
    add_sampling_arguments(parser)


def run_generate(args: argparse.Namespace) -> int:
    from minisarathi.engine.engine import LLMEngine   # the model code loads only for the command that runs it

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
