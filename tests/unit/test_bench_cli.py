"""`minisarathi bench ...` end to end on the bundled model (in process, seconds)."""

import importlib.util
import json

import pytest

from minisarathi.bench.metrics import load_run
from minisarathi.cli import main

SMALL = [
    "--num-requests",
    "6",
    "--lengths",
    "uniform",
    "--min-total-tokens",
    "8",
    "--max-total-tokens",
    "48",
    "--qps",
    "40",
    "--num-kv-blocks",
    "64",
]


def test_run_saves_json_and_csv_and_prints_a_table(tmp_path, capsys):
    assert main(["bench", "run", *SMALL, "--chunk-size", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "TBT P99 (ms)" in out and "6/6" in out
    info, requests, batches = load_run(tmp_path / "sarathi.json")
    assert info["engine"]["chunk_size"] == 32 and info["workload"]["num_requests"] == 6
    assert len(requests) == 6 and all(r.completed for r in requests) and batches
    assert (tmp_path / "sarathi_requests.csv").exists() and (tmp_path / "sarathi_batches.csv").exists()


def test_compare_policies_with_capacity(tmp_path, capsys):
    args = [
        "bench",
        "compare",
        *SMALL,
        "--policies",
        "sarathi,vllm",
        "--chunk-sizes",
        "16,64",
        "--capacity",
        "--slo-tbt",
        "1.0",
        "--max-trials",
        "1",
        "--out",
        str(tmp_path),
        "--plots",
        str(tmp_path / "docs"),
    ]
    assert main(args) == 0
    out, err = capsys.readouterr()
    data = json.loads((tmp_path / "compare.json").read_text())
    assert list(data["metrics"]) == ["sarathi-16", "sarathi-64", "vllm"]
    assert set(data["capacity_qps"]) == {"sarathi-16", "sarathi-64", "vllm"}
    assert all(len(trail) == 1 for trail in data["trails"].values())
    assert "P99 TBT sarathi-16 / vllm" in out and "capacity (qps)" in out
    for label in ("sarathi-16", "sarathi-64", "vllm"):
        assert (tmp_path / f"{label}.json").exists() and (tmp_path / f"{label}_qps40.000.json").exists()
        info, _, _ = load_run(tmp_path / f"{label}.json")
        assert info["engine"]["scheduler"] == label.split("-")[0] and info["workload"]["num_requests"] == 6
    # compare.json describes the comparison runs, not the last capacity trial's engine or workload.
    assert data["info"]["workload"]["num_requests"] == 6 and data["info"]["workload"]["qps"] == 40
    assert "engine" not in data["info"]
    assert {label: e["chunk_size"] for label, e in data["info"]["engines"].items() if label != "vllm"} == {
        "sarathi-16": 16,
        "sarathi-64": 64,
    }
    if importlib.util.find_spec("matplotlib") is None:
        assert "plots skipped" in err
    else:
        for name in ("tbt_cdf.png", "ttft_cdf.png", "batch_tokens.png", "capacity.png"):
            assert (tmp_path / name).stat().st_size > 1000
            assert (tmp_path / "docs" / name).read_bytes() == (tmp_path / name).read_bytes()
        (tmp_path / "capacity.png").unlink()
        assert main(["bench", "plot", str(tmp_path)]) == 0  # redrawn from the saved results
        assert (tmp_path / "capacity.png").stat().st_size > 1000


def test_slo_driven_variant_and_workload_groups(tmp_path, capsys):
    args = [
        "bench",
        "compare",
        *SMALL,
        "--policies",
        "sarathi",
        "--chunk-sizes",
        "16",
        "--slo-driven",
        "--slo-tbt",
        "0.05",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "compare.json").read_text())
    assert list(data["metrics"]) == ["sarathi-16", "sarathi-slo"]
    engines = data["info"]["engines"]
    assert (
        engines["sarathi-slo"]["tbt_slo_ms"] == pytest.approx(50)
        and engines["sarathi-16"]["tbt_slo_ms"] is None
    )
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "run",
                *SMALL,
                "--long-fraction",
                "0.5",
                "--long-factor",
                "4",
                "--label",
                "fair",
                "--max-partial-prefills",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "fair:long" in capsys.readouterr().out
    info, requests, _ = load_run(tmp_path / "fair.json")
    assert info["engine"]["max_partial_prefills"] == 2 and {r.group for r in requests} == {"long", "short"}
    metrics = json.loads((tmp_path / "fair.json").read_text())["metrics"]
    assert metrics["groups"]["long"]["requests"] + metrics["groups"]["short"]["requests"] == 6


def test_capacity_with_an_slo_from_the_measured_decode_step(tmp_path, capsys):
    # 256 blocks: the decode-step measure needs all 32 sequences decoding at once, with no preemption.
    args = [
        "bench",
        "capacity",
        *SMALL,
        "--num-kv-blocks",
        "256",
        "--max-trials",
        "2",
        "--trial-seconds",
        "0.05",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode step at batch 32" in out and "capacity" in out
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert len(data["trail"]) == 2 and data["info"]["slo"]["p99_tbt"] > 0
    assert data["info"]["slo"]["p99_tbt"] == pytest.approx(5 * data["info"]["decode_step_s"])
    for trial in data["trail"]:  # --trial-seconds: 40 qps x 0.05 s = 2 requests, raised to the floor of 4
        assert trial["requests"] == 4
        _, requests, _ = load_run(tmp_path / f"sarathi_qps{trial['qps']:.3f}.json")
        assert len(requests) == 4


def test_ctrl_c_saves_partial_results(tmp_path, capsys, monkeypatch):
    from minisarathi.engine.engine import LLMEngine

    step, calls = LLMEngine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", interrupted_step)
    assert main(["bench", "run", *SMALL, "--out", str(tmp_path)]) == 130
    assert "interrupted: partial results saved" in capsys.readouterr().err
    _, requests, batches = load_run(tmp_path / "sarathi_partial.json")
    assert len(requests) == 6 and batches


def test_random_model_serves(tmp_path):
    from minisarathi.engine.engine import LLMEngine
    from minisarathi.sampling_params import SamplingParams

    path = tmp_path / "rand"
    assert (
        main(
            [
                "bench",
                "random-model",
                str(path),
                "--hidden-size",
                "64",
                "--num-layers",
                "2",
                "--num-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--intermediate-size",
                "96",
                "--max-position-embeddings",
                "256",
            ]
        )
        == 0
    )
    engine = LLMEngine(model=path, num_kv_blocks=16)
    assert engine.model_config.num_hidden_layers == 2 and engine.max_model_len == 256
    engine.add_request("r", [1, 5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    outputs = [o for _ in range(10) for o in engine.step()]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "args, name",
    [
        (["compare", "--policies", "fifo", "--out", "{tmp}"], "policies"),
        (["run", "--qps", "0", "--out", "{tmp}"], "qps"),
        (["run", "--time-limit", "0", "--out", "{tmp}"], "time_limit"),
        (["plot", "{tmp}"], "results"),
        (["random-model", "{tmp}", "--num-heads", "3"], "num_heads"),
    ],
)
def test_bad_input_names_the_parameter(args, name, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *(a.format(tmp=tmp_path) for a in args)])
    assert exit_info.value.code == 2 and name in capsys.readouterr().err


def test_remote_api_key_from_file_or_environment(tmp_path, monkeypatch):
    import argparse

    from minisarathi.bench.cli import _Session, add_bench_arguments
    from minisarathi.client import DEFAULT_PORT

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["run", "--target", "openai", "--max-model-len", "512"])  # no /v1/models to ask
    assert args.port == DEFAULT_PORT
    monkeypatch.setenv("MINISARATHI_API_KEY", "from-env")
    assert _Session(args, tmp_path).target()[0].api_key == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    args.api_key_file = str(tmp_path / "key")
    assert _Session(args, tmp_path).target()[0].api_key == "from-file"
    (tmp_path / "key").write_text(" \n")
    with pytest.raises(ValueError, match="api-key-file"):
        _Session(args, tmp_path).target()
