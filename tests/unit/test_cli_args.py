"""The command line's shape, in process: how each command takes the model, the flags refused because they
would not take effect (exit 2, one line), and --help giving the defaults."""

import argparse

import pytest

from minisarathi import generate
from minisarathi.bench import cli as bench_cli
from minisarathi.cli import main
from minisarathi.cli_args import HelpFormatter, engine_options_from_args, model_folder
from minisarathi.paths import default_model_dir
from minisarathi.server import cli as server_cli

MODEL = str(default_model_dir())


def parsed(add_arguments, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def refused(capsys, *argv: str) -> str:
    """main(argv) must exit 2 with one line on stderr, which it returns."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    return err


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


# ------------------------------------------------------------------ the model, MODEL or --model


def test_generate_reads_one_positional_as_the_prompt_and_two_as_model_and_prompt():
    args = parsed(generate.add_generate_arguments, "Once upon")
    assert (args.prompt, model_folder(args)) == ("Once upon", (None, "MODEL"))  # the bundled model
    args = parsed(generate.add_generate_arguments, MODEL, "Once upon", "--max-tokens", "3")
    assert (args.prompt, model_folder(args)) == ("Once upon", (MODEL, "MODEL"))
    args = parsed(generate.add_generate_arguments, "Once upon", "--model", MODEL)
    assert (args.prompt, model_folder(args)) == ("Once upon", (MODEL, "--model"))


@pytest.mark.parametrize(
    "add_arguments, rest",
    [
        (server_cli.add_serve_arguments, []),
        (bench_cli.add_bench_arguments, ["run"]),
        (bench_cli.add_bench_arguments, ["capacity"]),
        (bench_cli.add_bench_arguments, ["compare"]),
    ],
)
def test_every_engine_command_takes_model_or_dash_dash_model(add_arguments, rest):
    for argv in ([MODEL], ["--model", MODEL], [MODEL, "--model", MODEL + "/"]):
        assert engine_options_from_args(parsed(add_arguments, *rest, *argv))["model"] in (MODEL, MODEL + "/")
    assert engine_options_from_args(parsed(add_arguments, *rest))["model"] is None


def test_the_three_forms_of_generate_print_the_same(capsys):
    outputs = []
    for argv in (["Once upon a time"], [MODEL, "Once upon a time"], ["Once upon a time", "--model", MODEL]):
        assert main(["generate", *argv, "--max-tokens", "12"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0].startswith("Once upon a time") and len(outputs[0]) > len("Once upon a time\n")
    assert outputs == outputs[:1] * 3


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "run"]])
def test_two_different_models_are_refused(capsys, tmp_path, command):
    prompt = ["hi"] if command == ["generate"] else []
    err = refused(capsys, *command, str(tmp_path), *prompt, "--model", MODEL)
    assert f"MODEL {tmp_path} and --model {MODEL}: give the model once" in err
    missing = tmp_path / "no"
    assert f"MODEL {missing}: does not exist" in refused(capsys, *command, str(missing), *prompt)


# ------------------------------------------------------------------ flags that would not take effect


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--top-p", "0.9"], "--top-p needs --temperature above 0"),
        (["generate", "hi", "--top-k", "5"], "--top-k needs --temperature above 0"),
        (["generate", "hi", "--min-p", "0.1"], "--min-p needs --temperature above 0"),
        (["generate", "hi", "--sample-seed", "1"], "--sample-seed needs --temperature above 0"),
        (
            ["generate", "hi", "--kv-cache-mb", "4", "--num-kv-blocks", "8"],
            "--kv-cache-mb sizes the cache only without --num-kv-blocks",
        ),
        (
            ["generate", "hi", "--rank-timeout-s", "5"],
            "--rank-timeout-s needs --tensor-parallel-size above 1",
        ),
        (["serve", "--http-host", "127.0.0.1"], "--http-host needs --http-port or --metrics-port"),
        (["serve", "--served-model-name", "x"], "--served-model-name needs --http-port or --metrics-port"),
        (["serve", "--chat-template", "t.jinja", "--metrics-port", "0"], "--chat-template needs --http-port"),
        (["serve", "--tool-call-parser", "hermes"], "--tool-call-parser needs --http-port"),
        (
            ["serve", "--no-msgpack"],
            "--no-msgpack: with no --http-port and no --unix-socket nothing would be",
        ),
        (
            ["client", "hi", "--unix-socket", "/tmp/s", "--port", "7001"],
            "--port is not used with --unix-socket",
        ),
        (["client", "hi", "--unix-socket", "/tmp/s", "--host", "h"], "--host is not used with --unix-socket"),
        (["client", "hi", "--top-p", "0.5"], "--top-p needs --temperature above 0"),
        (["bench", "run", MODEL, "--target", "server"], "MODEL needs --target engine"),
        (["bench", "run", "--model", MODEL, "--target", "openai"], "--model needs --target engine"),
        (
            ["bench", "capacity", "--target", "server", "--chunk-size", "8"],
            "--chunk-size needs --target engine",
        ),
        (["bench", "run", "--port", "7001"], "--port needs --target server"),
        (["bench", "run", "--target", "server", "--url", "http://h"], "--url needs --target openai"),
        (["bench", "run", "--openai-model", "m"], "--openai-model needs --target openai"),
        (["bench", "run", "--api-key-file", "k"], "--api-key-file needs --target server or openai"),
        (["bench", "run", "--prompt-len", "8"], "--prompt-len needs --lengths fixed"),
        (
            ["bench", "run", "--lengths", "fixed", "--pd-ratio", "2"],
            "--pd-ratio needs --lengths uniform or zipf",
        ),
        (["bench", "run", "--lengths", "uniform", "--zipf-theta", "1"], "--zipf-theta needs --lengths zipf"),
        (["bench", "run", "--lengths", "zipf", "--trace-scale", "2"], "--trace-scale needs --lengths trace"),
        (["bench", "compare", "--cv", "3"], "--cv needs --arrivals gamma"),
        (["bench", "run", "--arrival-trace", "a.csv"], "--arrival-trace needs --arrivals trace"),
        (["bench", "run", "--long-factor", "4"], "--long-factor needs --long-fraction above 0"),
        (
            ["bench", "capacity", "--slo-tbt", "0.1", "--slo-scale", "3"],
            "--slo-scale scales the measured decode",
        ),
    ],
)
def test_a_flag_that_would_not_take_effect_is_refused(capsys, argv, message):
    assert message in refused(capsys, *argv)


def test_companion_flags_given_together_pass_the_checks(monkeypatch):
    """The pairs above with their companion: each command gets as far as running (stubbed here)."""
    ran = []
    for module, name in (
        (generate, "run_generate"),
        (server_cli, "run_serve"),
        (server_cli, "run_client"),
        (bench_cli, "run_bench"),
    ):
        monkeypatch.setattr(module, name, lambda args: ran.append(args.command))
    for argv in (
        ["generate", "hi", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5", "--sample-seed", "1"],
        ["generate", "hi", "--kv-cache-mb", "4", "--tensor-parallel-size", "2", "--rank-timeout-s", "5"],
        ["serve", "--http-port", "0", "--http-host", "127.0.0.1", "--chat-template", "t.jinja"],
        ["serve", "--http-port", "0", "--tool-call-parser", "mistral"],
        ["serve", "--metrics-port", "0", "--served-model-name", "x"],
        ["client", "hi", "--unix-socket", "/tmp/s", "--temperature", "1", "--min-p", "0.1"],
        ["bench", "run", "--target", "server", "--port", "7001", "--max-model-len", "64"],
        ["bench", "run", "--target", "openai", "--url", "http://h", "--openai-model", "m"],
        ["bench", "run", "--lengths", "zipf", "--zipf-theta", "1", "--pd-ratio", "2"],
        [
            "bench",
            "compare",
            MODEL,
            "--arrivals",
            "gamma",
            "--cv",
            "3",
            "--long-fraction",
            "0.1",
            "--long-factor",
            "4",
        ],
        ["bench", "capacity", "--slo-scale", "3"],
    ):
        assert main(argv) == 0, argv
    assert len(ran) == 11


# ------------------------------------------------------------------ --help


def test_help_gives_the_defaults_and_where_the_cli_differs_from_the_api(capsys):
    text = help_text(capsys, "generate")
    assert "[MODEL] PROMPT" in text and "With one positional argument it is PROMPT" in text
    assert "after the prompt itself (LLM.generate returns the continuation alone)" in text
    assert (
        "--temperature TEMPERATURE 0 samples greedily (default 0; SamplingParams and the server: 1.0)" in text
    )
    assert "(default 64; SamplingParams and the server: 16)" in text
    assert "--chunk-size CHUNK_SIZE per-iteration token budget (default: 512)" in text
    assert "--top-p TOP_P nucleus sampling: keep this share of the mass (default: 1.0)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    text = help_text(capsys, "serve")
    assert "[MODEL]" in text and "--port PORT TCP port; 0 picks a free one (default: 7000)" in text
    assert "--idle-timeout SECONDS (default: 300.0)" in text and "not the greedy ones of `generate`" in text
    text = help_text(capsys, "client")
    assert "--max-tokens MAX_TOKENS tokens to generate at most (default 64" in text
    assert "print the prompt, then the text generated" in text
    text = help_text(capsys, "bench", "run")
    assert "[MODEL]" in text and "--num-requests NUM_REQUESTS requests in the workload (default: 64)" in text
    assert "--hidden-size HIDDEN_SIZE the model's config.json field (default: 512)" in help_text(
        capsys, "bench", "random-model"
    )


@pytest.mark.parametrize(
    "add_arguments, bench_command",
    [
        (generate.add_generate_arguments, None),
        (server_cli.add_serve_arguments, None),
        (server_cli.add_client_arguments, None),
        *((bench_cli.add_bench_arguments, name) for name in ("run", "capacity", "compare", "random-model")),
    ],
)
def test_every_flag_with_a_default_value_shows_it(add_arguments, bench_command):
    """Only unset (None) flags and off switches have no default to show."""
    command = argparse.ArgumentParser()
    add_arguments(command)
    if bench_command:
        sub = next(a for a in command._actions if isinstance(a, argparse._SubParsersAction))
        command = sub.choices[bench_command]
    formatter = HelpFormatter("minisarathi")
    shown = [
        a
        for a in command._actions
        if a.option_strings and a.default is not False and a.default not in (None, [], argparse.SUPPRESS)
    ]
    assert shown
    for action in shown:
        assert "default" in formatter._get_help_string(action), action.option_strings
