"""Bad input on the command line: exit status 2, one line naming the flag or file the user gave, no traceback,
and nothing changed on disk (docs/security.md). Each case is one a reviewer hit on a fresh install."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minisarathi.cli import main

REPO = Path(__file__).resolve().parents[2]


def refused(capsys, *argv: str) -> str:
    """main(argv) must exit 2; returns its stderr."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    return err


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisarathi", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def check_refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and all(w in result.stderr for w in words), result.stderr


# ------------------------------------------------------------------ keys add


@pytest.mark.parametrize(
    "flag, value", [("--rpm", "-1"), ("--tpm", "0"), ("--max-tokens", "0"), ("--concurrent", "0")]
)
def test_keys_add_refuses_a_bad_limit_and_leaves_the_file_as_it_was(tmp_path, capsys, flag, value):
    path = tmp_path / "keys.toml"
    assert main(["keys", "add", "alice", "--file", str(path)]) == 0
    before = path.read_bytes()
    err = refused(capsys, "keys", "add", "bob", "--file", str(path), flag, value)
    assert f"{flag} {value}: must be a positive integer" in err
    assert path.read_bytes() == before
    assert main(["keys", "add", "bob", "--file", str(path), "--rpm", "5"]) == 0  # the file still takes keys
    new = tmp_path / "new.toml"
    refused(capsys, "keys", "add", "bob", "--file", str(new), flag, value)
    assert not new.exists()


def test_keys_add_into_a_missing_folder_names_the_file(tmp_path, capsys):
    path = tmp_path / "no" / "keys.toml"
    err = refused(capsys, "keys", "add", "bob", "--file", str(path))
    assert str(path) in err and "cannot be written" in err


# ------------------------------------------------------------------ client TLS files


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tls-ca", "/nonexistent"], "--tls-ca /nonexistent"),
        (["--tls-ca", "README.md"], "--tls-ca README.md: cannot be loaded (not a PEM CA bundle"),
        (
            ["--tls-cert", "/nonexistent", "--tls-key", "/nonexistent"],
            "--tls-cert /nonexistent / --tls-key /nonexistent",
        ),
        (
            ["--tls-cert", "README.md", "--tls-key", "README.md"],
            "not a PEM certificate chain and its private key",
        ),
        (["--tls-key", "README.md"], "--tls-key needs --tls-cert"),
    ],
)
def test_client_tls_files_that_cannot_be_loaded(capsys, monkeypatch, flags, named):
    monkeypatch.chdir(REPO)
    assert named in refused(capsys, "client", "hi", "--port", "9", *flags)


# ------------------------------------------------------------------ engine flags


def test_engine_flags_name_themselves(capsys, tmp_path):
    err = refused(capsys, "generate", "hi", "--kv-cache-mb", "-1")
    assert "--kv-cache-mb must be a positive number of MiB, got -1" in err
    assert "--model /nonexistent: does not exist" in refused(
        capsys, "generate", "hi", "--model", "/nonexistent"
    )
    (tmp_path / "file").write_text("")
    assert f"--model {tmp_path / 'file'}: is neither a folder nor a GGUF file" in refused(
        capsys, "generate", "hi", "--model", str(tmp_path / "file")
    )


# ------------------------------------------------------------------ serve


def test_serve_names_the_listener_that_failed(tmp_path):
    check_refused(
        run_cli("serve", "--port", "0", "--unix-socket", str(tmp_path / "no" / "s.sock")),
        f"--unix-socket {tmp_path / 'no' / 's.sock'}: cannot listen",
    )
    (tmp_path / "regular").write_text("")
    check_refused(
        run_cli("serve", "--port", "0", "--unix-socket", str(tmp_path / "regular")),
        f"--unix-socket {tmp_path / 'regular'}: cannot listen",
    )
    pytest.importorskip("aiohttp")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        check_refused(
            run_cli("serve", "--port", "0", "--http-port", str(port)),
            f"--host 127.0.0.1 --http-port {port}: cannot listen",
        )
        check_refused(
            run_cli("serve", "--port", "0", "--metrics-port", str(port), "--http-host", "127.0.0.1"),
            f"--http-host 127.0.0.1 --metrics-port {port}: cannot listen",
        )
        result = run_cli("serve", "--port", str(port))
        check_refused(result, f"--host 127.0.0.1 --port {port}: cannot listen")
        assert "--http-port" not in result.stderr


def test_a_flag_that_would_not_take_effect_is_refused_before_any_work():
    """In a real process: one line, exit 2, before the model loads or a port opens."""
    for argv, message in (
        (["serve", "--port", "0", "--chat-template", "t.jinja"], "--chat-template needs --http-port"),
        (["generate", "hi", "--top-p", "0.9"], "--top-p needs --temperature above 0"),
    ):
        result = run_cli(*argv)
        check_refused(result, f"minisarathi {argv[0]}: error: {message}")
        assert result.stderr.count("\n") == 1 and not result.stdout, result.stderr


def test_serve_http_flags_name_themselves(tmp_path):
    pytest.importorskip("aiohttp")
    check_refused(
        run_cli("serve", "--port", "0", "--http-port", "0", "--http-host", "0.0.0.0"),
        "--http-host 0.0.0.0: listening beyond loopback without a key",
    )
    for template in ("/nonexistent", str(tmp_path)):
        check_refused(
            run_cli("serve", "--port", "0", "--http-port", "0", "--chat-template", template),
            f"--chat-template {template}: cannot be read",
        )


def test_a_bad_proxy_protocol_network_is_named():
    check_refused(
        run_cli("serve", "--port", "0", "--proxy-protocol-from", "10.0.0.0/8,10.0.0.0/33"),
        "--proxy-protocol-from: '10.0.0.0/33' is not an IP address or network",
    )


# ------------------------------------------------------------------ bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_names_the_file_or_address_it_cannot_use(tmp_path, capsys, monkeypatch):
    from minisarathi.bench import cli as bench_cli

    monkeypatch.setattr(bench_cli._Session, "run", lambda self: pytest.fail("ran before checking --out"))
    (tmp_path / "afile").write_text("")
    assert f"--out {tmp_path / 'afile'}: " in refused(
        capsys, "bench", "run", "--out", str(tmp_path / "afile")
    )
    assert "is a file, not a folder" in refused(
        capsys, "bench", "run", "--out", str(tmp_path / "afile" / "x")
    )
    monkeypatch.undo()
    out = ["--out", str(tmp_path / "out")]
    assert "trace /nonexistent: cannot be read" in refused(
        capsys, "bench", "run", "--trace", "/nonexistent", *out
    )
    assert "arrival_trace /nonexistent: cannot be read" in refused(
        capsys, "bench", "run", "--arrivals", "trace", "--arrival-trace", "/nonexistent", *out
    )
    (tmp_path / "bad.csv").write_text("num_prefill_tokens,num_decode_tokens\n12,x\n")
    assert "line 2: num_decode_tokens must be a number, got 'x'" in refused(
        capsys, "bench", "run", "--trace", str(tmp_path / "bad.csv"), *out
    )
    port = free_port()
    assert f"--host 127.0.0.1 --port {port}: no answer to model_info" in refused(
        capsys, "bench", "run", "--target", "server", "--port", str(port), *out
    )
    assert f"url http://127.0.0.1:{port}/v1/models: no answer" in refused(
        capsys, "bench", "run", "--target", "openai", "--url", f"http://127.0.0.1:{port}", *out
    )
    assert f"path {tmp_path / 'afile' / 'model'}: cannot be written" in refused(
        capsys, "bench", "random-model", str(tmp_path / "afile" / "model")
    )
