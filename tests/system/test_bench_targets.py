"""The three targets: the engine in process (bundled model), a real server process, and a fake OpenAI
/v1/completions endpoint streaming server-sent events."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest

from minisarathi.bench.capacity import Slo
from minisarathi.bench.metrics import compute_metrics
from minisarathi.bench.targets import EngineTarget, OpenAITarget, ServerTarget, measure_decode_step
from minisarathi.bench.workloads import WorkloadConfig, make_workload
from minisarathi.config import SCHEDULERS

ROOT = Path(__file__).resolve().parents[2]


def small_workload(n=8, qps=50.0, arrivals="poisson"):
    return make_workload(
        WorkloadConfig(
            num_requests=n,
            lengths="uniform",
            min_total_tokens=8,
            max_total_tokens=40,
            pd_ratio=1.0,
            max_model_len=512,
            arrivals=arrivals,
            qps=qps,
            seed=3,
        )
    )


@pytest.fixture(scope="module")
def engine():
    from minisarathi.engine.engine import LLMEngine

    return LLMEngine(chunk_size=32, num_kv_blocks=64)


def check_complete(records, specs):
    by_id = {r.request_id: r for r in records}
    for spec in specs:
        r = by_id[spec.request_id]
        assert r.completed, r.error
        assert r.output_len == spec.max_tokens and r.prompt_len == len(spec.prompt_token_ids)
        assert r.arrival >= spec.arrival_time - 1e-6
        assert r.arrival <= r.token_times[0] <= r.finished and r.token_times == sorted(r.token_times)


def test_engine_target_replays_in_real_time(engine):
    specs = small_workload()
    target = EngineTarget(engine)
    target.warmup()
    result = target.run(specs, time_limit=60)
    assert result.stopped is None
    check_complete(result.requests, specs)
    for r in result.requests:
        assert r.arrival <= r.first_scheduled <= r.token_times[0]
    # Every step of the run is a batch record; their tokens are every prompt token plus every decode input.
    tokens = sum(b.num_tokens for b in result.batches)
    assert tokens == sum(len(s.prompt_token_ids) + s.max_tokens - 1 for s in specs)
    assert max(b.num_tokens for b in result.batches) <= 32
    assert compute_metrics(result.requests, result.batches)["completed"] == len(specs)
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0


def test_engine_target_time_limit_aborts_and_leaves_the_engine_clean(engine):
    specs = small_workload(n=6, qps=2.0)  # arrivals span ~2.5 s, far past the limit
    result = EngineTarget(engine).run(specs, time_limit=0.2)
    assert result.stopped.startswith("time limit")
    assert any(r.error for r in result.requests) and not all(r.completed for r in result.requests)
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0


def test_measure_decode_step_counts_only_full_decode_batches(engine):
    # Chunk 32 against 4 prompts of 20: prefills end in different steps; the first ones wait for the last.
    first = len(engine.step_records)
    step, counted = measure_decode_step(engine, batch_size=4, prompt_len=20, num_steps=5)
    assert len(counted) == 5
    assert all(r.num_seqs == r.num_decode_tokens == 4 and r.num_prefill_tokens == 0 for r in counted)
    assert step == np.median([r.step_time for r in counted])
    records = engine.step_records[first:]
    last_prefill = max(i for i, r in enumerate(records) if r.num_prefill_tokens)
    assert last_prefill > 0 and all(r.num_decode_tokens == 0 for r in records[:last_prefill])
    assert records[last_prefill + 1 : last_prefill + 6] == counted
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_measure_decode_step_when_the_prefills_outlast_the_longest_output(scheduler):
    """README's `bench compare --chunk-sizes 64 --capacity` in small: 8 x 40 prompt tokens take more steps at
    chunk 16 than the 24 tokens max_model_len 64 leaves each one to produce, so had the first requests kept
    decoding they would have finished before the last one's prefill ended."""
    from minisarathi.engine.engine import LLMEngine

    engine = LLMEngine(scheduler=scheduler, chunk_size=16, max_model_len=64, num_kv_blocks=64)
    step, counted = measure_decode_step(engine, batch_size=8, prompt_len=40, num_steps=5)
    assert len(counted) == 5 and all(r.num_decode_tokens == 8 == r.num_seqs for r in counted)
    assert step > 0 and not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match=r"prompt_len must be in \[1, max_model_len - 7\] \(57\), got 58"):
        measure_decode_step(engine, batch_size=8, prompt_len=58, num_steps=5)


def test_measure_decode_step_without_a_full_decode_batch_is_an_error():
    from minisarathi.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="batch_size.*preemption"):  # 8 blocks of 16 hold one request, not 4
        measure_decode_step(LLMEngine(chunk_size=32, num_kv_blocks=8), batch_size=4, prompt_len=20)
    with pytest.raises(ValueError, match="batch_size"):
        measure_decode_step(LLMEngine(chunk_size=32, num_kv_blocks=64, max_num_seqs=2), batch_size=4)


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisarathi", "serve", "--port", "0", "--log-level", "WARNING"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving on" in line, line
        host, port = line.split()[-1].rsplit(":", 1)
        yield host, int(port)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_server_target_end_to_end(server):
    specs = small_workload()
    result = ServerTarget(*server).run(specs, time_limit=60)
    check_complete(result.requests, specs)
    m = compute_metrics(result.requests)
    assert m["completed"] == len(specs) and m["tbt"]["count"] > 0 and m["scheduling_delay"]["count"] == 0


def test_server_target_unreachable_is_an_error_per_request():
    result = ServerTarget("127.0.0.1", 9).run(small_workload(n=2), time_limit=10)
    assert all(r.error and not r.completed for r in result.requests)


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams one SSE event per token over chunked encoding; a character straddles two chunks. With
    max_tokens 6, streams three events of two tokens each with vLLM's continuous usage, then a usage-only
    event."""

    protocol_version = "HTTP/1.1"
    bodies = []
    max_model_len = 512

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.bodies.append((self.path, body))
        if body["max_tokens"] == 13:
            self.send_response(500)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"oops")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if body["max_tokens"] == 6:
            for done in (2, 4, 6):
                event = {
                    "choices": [{"text": "ab", "index": 0, "finish_reason": "length" if done == 6 else None}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": done},
                }
                payload = f"data: {json.dumps(event)}\n\n".encode()
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            closing = json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}})
            done = f"data: {closing}\n\ndata: [DONE]\n\n".encode()
            self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
            return
        for i in range(body["max_tokens"]):
            chunk = json.dumps({"choices": [{"text": "ö", "index": 0}]}, ensure_ascii=False)
            event = f"data: {chunk}\n\n".encode()
            cut = event.index("ö".encode()) + 1  # inside the two UTF-8 bytes of ö
            for piece in (event[:cut], event[cut:]):
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        closing = json.dumps({"choices": [{"text": "", "index": 0, "finish_reason": "length"}]})
        done = f"data: {closing}\n\ndata: [DONE]\n\n".encode()
        self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")

    def do_GET(self):  # /v1/models, as vLLM answers it
        body = json.dumps(
            {
                "object": "list",
                "data": [{"id": "fake", "object": "model", "max_model_len": FakeOpenAI.max_model_len}],
            }
        ).encode()
        self.send_response(200 if self.path.endswith("/v1/models") else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def openai_server():
    FakeOpenAI.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_openai_target_streams_token_ids_and_times(openai_server):
    specs = small_workload(n=5)
    result = OpenAITarget(openai_server + "/prefix", model="m").run(specs, time_limit=30)
    check_complete(result.requests, specs)
    path, body = FakeOpenAI.bodies[0]
    assert path == "/prefix/v1/completions"
    sent = {tuple(b["prompt"]) for _, b in FakeOpenAI.bodies}
    assert sent == {tuple(s.prompt_token_ids) for s in specs}
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["model"] == "m"


def test_openai_target_counts_tokens_by_the_usage_of_each_event(openai_server):
    specs = make_workload(
        WorkloadConfig(num_requests=2, lengths="fixed", prompt_len=4, decode_len=6, arrivals="static")
    )
    target = OpenAITarget(openai_server)
    target.continuous_usage = True  # as model_card() sets it for a vLLM server
    result = target.run(specs, time_limit=30)
    check_complete(result.requests, specs)
    for r in result.requests:  # three events of two tokens: each pair shares its arrival time
        assert len(r.token_times) == 6 and r.token_times[0::2] == r.token_times[1::2]
    assert FakeOpenAI.bodies[0][1]["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }


def test_openai_target_asks_vllm_only_for_usage_in_every_event():
    target = OpenAITarget()
    for owner, asks in (("vllm", True), ("minisarathi", False), ("llamacpp", False)):
        cards = {"data": [{"id": "m", "object": "model", "owned_by": owner}]}
        with patch("http.client.HTTPConnection") as connection:
            connection.return_value.getresponse.return_value.status = 200
            connection.return_value.getresponse.return_value.read.return_value = json.dumps(cards).encode()
            target.model_card()
        assert target.continuous_usage is asks


def test_openai_target_http_error_is_recorded(openai_server):
    specs = make_workload(
        WorkloadConfig(num_requests=2, lengths="fixed", prompt_len=4, decode_len=13, arrivals="static")
    )
    result = OpenAITarget(openai_server).run(specs, time_limit=30)
    assert all(not r.completed and "HTTP 500" in r.error for r in result.requests)


def test_openai_target_rejects_bad_url():
    with pytest.raises(ValueError, match="url"):
        OpenAITarget("https://example.com")


def test_engine_target_rejected_request_fails_alone(engine):
    specs = small_workload(n=3)
    specs[-1].prompt_token_ids = specs[-1].prompt_token_ids * 200  # longer than max_model_len (512)
    result = EngineTarget(engine).run(specs, time_limit=30)
    assert [r.completed for r in result.requests] == [True, True, False]
    assert "rejected" in result.requests[-1].error and "max_model_len" in result.requests[-1].error


def test_engine_target_stops_once_the_median_scheduling_delay_must_fail(engine):
    specs = small_workload(n=12, arrivals="static")  # 12 prompts against a 32-token budget: most wait
    result = EngineTarget(engine).run(
        specs, time_limit=30, slo=Slo(p99_tbt=10.0, median_scheduling_delay=0.001)
    )
    assert "scheduling delay" in result.stopped
    assert sum(r.completed for r in result.requests) < 6
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0
    # An SLO that holds lets the run finish.
    assert EngineTarget(engine).run(specs[:2], time_limit=30, slo=Slo(10.0, 10.0)).stopped is None


def test_engine_target_slo_watch_scans_each_finished_request_once(engine, monkeypatch):
    from minisarathi.bench import targets

    scanned = []  # every token list the watch scanned, kept alive so that identities stay unique
    count = targets._late_and_gaps_over

    def spy(slo, arrival, scheduled, token_times, now):
        scanned.append(token_times)
        return count(slo, arrival, scheduled, token_times, now)

    monkeypatch.setattr(targets, "_late_and_gaps_over", spy)
    result = EngineTarget(engine).run(small_workload(n=8), time_limit=30, slo=Slo(10.0, 10.0))
    assert result.stopped is None and len(result.batches) > 8
    # A finished request's timeline (the record's own list) is scanned once, not again at every later step.
    for r in result.requests:
        assert sum(times is r.token_times for times in scanned) == 1


def test_engine_target_stops_once_p99_tbt_must_fail(engine):
    specs = small_workload(n=6, qps=50.0)
    result = EngineTarget(engine).run(
        specs, time_limit=30, slo=Slo(p99_tbt=1e-6, median_scheduling_delay=10.0)
    )
    assert "P99 TBT" in result.stopped and not all(r.completed for r in result.requests)
    assert not engine.has_unfinished_requests() and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kind", ["server", "openai"])
def test_bench_run_cli_against_remote_targets(kind, server, openai_server, tmp_path, capsys):
    from minisarathi.cli import main

    where = ["--port", str(server[1])] if kind == "server" else ["--url", openai_server]
    args = [
        "bench",
        "run",
        "--target",
        kind,
        *where,
        "--num-requests",
        "4",
        "--lengths",
        "fixed",
        "--prompt-len",
        "12",
        "--decode-len",
        "5",
        "--qps",
        "20",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "4/4" in capsys.readouterr().out
    assert (tmp_path / f"{kind}.json").exists()


def test_bench_run_cli_fits_the_workload_to_the_openai_endpoints_max_model_len(
    openai_server, tmp_path, capsys, monkeypatch
):
    from minisarathi.bench.metrics import load_run
    from minisarathi.cli import main

    monkeypatch.setattr(FakeOpenAI, "max_model_len", 64)  # what GET /v1/models says
    args = [
        "bench",
        "run",
        "--target",
        "openai",
        "--url",
        openai_server,
        "--num-requests",
        "6",
        "--qps",
        "50",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "6/6" in capsys.readouterr().out
    info, _, _ = load_run(tmp_path / "openai.json")
    assert info["workload"]["max_model_len"] == 64
    assert all(
        len(b["prompt"]) + b["max_tokens"] <= 64 and b["model"] == "fake" for _, b in FakeOpenAI.bodies
    )


@pytest.mark.parametrize("kind", ["engine", "openai"])
def test_bench_run_cli_failed_requests_are_summarized_and_exit_1(kind, openai_server, tmp_path, capsys):
    from minisarathi.cli import main

    # openai: the fake answers max_tokens 13 with HTTP 500; engine: 40 tokens need more than 2 KV blocks of
    # 16.
    where = ["--url", openai_server] if kind == "openai" else ["--num-kv-blocks", "2"]
    args = [
        "bench",
        "run",
        "--target",
        kind,
        *where,
        "--num-requests",
        "3",
        "--lengths",
        "fixed",
        "--prompt-len",
        "40",
        "--decode-len",
        "13",
        "--arrivals",
        "static",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "0/3" in out and f"results in {tmp_path}" in out
    assert "3 of 3 requests did not complete" in err
    assert ("3 x RuntimeError: HTTP 500" if kind == "openai" else "3 x rejected: prompt (40 tokens)") in err


@pytest.fixture(scope="module")
def http_door():
    """minisarathi's own HTTP door (no msgpack door): its /v1/models gives max_model_len 512."""
    pytest.importorskip("aiohttp")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minisarathi",
            "serve",
            "--no-msgpack",
            "--http-port",
            "0",
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving on http://" in line, line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bench_run_cli_against_minisarathis_own_http_door(http_door, tmp_path, capsys):
    """The reviewer's command: with max_model_len 2048 assumed, 5 of 8 ShareGPT prompts were refused (HTTP
    400)."""
    from minisarathi.bench.metrics import load_run
    from minisarathi.cli import main

    args = [
        "bench",
        "run",
        "--target",
        "openai",
        "--url",
        http_door,
        "--num-requests",
        "8",
        "--qps",
        "50",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert "8/8" in capsys.readouterr().out
    info, requests, _ = load_run(tmp_path / "openai.json")
    assert info["workload"]["max_model_len"] == 512
    assert all(r.completed for r in requests) and max(r.prompt_len + r.output_len for r in requests) > 256


def test_bench_run_cli_takes_the_servers_max_model_len(server, tmp_path, capsys):
    from minisarathi.bench.metrics import load_run
    from minisarathi.cli import main

    # ShareGPT rows run to thousands of tokens: scaled to 2048 instead of the server's 512, most would fail.
    args = [
        "bench",
        "run",
        "--target",
        "server",
        "--port",
        str(server[1]),
        "--num-requests",
        "6",
        "--lengths",
        "trace",
        "--qps",
        "50",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "6/6" in capsys.readouterr().out
    info, requests, _ = load_run(tmp_path / "server.json")
    assert info["workload"]["max_model_len"] == 512
    assert all(r.completed for r in requests) and max(r.prompt_len + r.output_len for r in requests) > 256
