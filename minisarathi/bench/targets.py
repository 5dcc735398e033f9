"""Where a workload is replayed: the engine in this process, a minisarathi server (msgpack-RPC), or any
OpenAI-compatible /v1/completions endpoint with streaming (vLLM, llama.cpp server), each in real time.

Every target returns one RequestRecord per request (seconds since the run started) and, in process, one
BatchRecord per engine step. Runs are bounded by a time limit: what is still running then is aborted and
recorded as unfinished. Ctrl-C propagates; the result so far stays in `target.partial` to be saved.
"""

from __future__ import annotations

import asyncio
import codecs
import http.client
import json
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from minisarathi.bench.capacity import Slo, SloWatch
from minisarathi.bench.metrics import BatchRecord, RequestRecord
from minisarathi.bench.progress import Progress
from minisarathi.bench.workloads import FIRST_PROMPT_TOKEN, RequestSpec
from minisarathi.client import DEFAULT_PORT
from minisarathi.sampling_params import SamplingParams

DECODE_PROBE_STEPS = 16  # full decode steps measure_decode_step takes the median of


@dataclass
class RunResult:
    requests: list[RequestRecord]
    batches: list[BatchRecord]
    stopped: str | None = None  # why the run ended before every request finished


def forced_params(spec: RequestSpec) -> SamplingParams:
    # Greedy with EOS ignored: every request produces exactly its decode length on every target.
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


def new_records(specs: list[RequestSpec]) -> dict[str, RequestRecord]:
    return {
        s.request_id: RequestRecord(
            s.request_id, len(s.prompt_token_ids), s.arrival_time, error="not sent", group=s.group
        )
        for s in specs
    }


class EngineTarget:
    """Drives LLMEngine.step() in wall-clock time: a request is added once its arrival time has passed,
    with that arrival time, so the wait for the step in progress counts as scheduling delay."""

    def __init__(self, engine):
        self.engine = engine
        self.partial: RunResult | None = None

    def warmup(self) -> None:
        """One short request end to end, so one-time costs (allocations, first calls) stay out of the run."""
        self.engine.add_request(
            "warmup",
            list(range(FIRST_PROMPT_TOKEN, FIRST_PROMPT_TOKEN + 8)),
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def run(
        self, specs: list[RequestSpec], time_limit: float, label: str = "engine", slo: Slo | None = None
    ) -> RunResult:
        """With an SLO, the run stops as soon as it is sure to fail it (capacity trials past capacity)."""
        engine = self.engine
        records = new_records(specs)
        first_step = len(engine.step_records)
        pending = deque(sorted(specs, key=lambda s: s.arrival_time))
        in_flight: set[str] = set()
        watch = slo and SloWatch(slo, len(specs), sum(s.max_tokens - 1 for s in specs))
        settled = [0, 0]  # finished requests' share of _over_slo's counts, added once each as they finish
        progress = Progress(label, len(specs))
        start = time.monotonic()
        stopped = None
        self.partial = RunResult(list(records.values()), [])
        try:
            while pending or in_flight:
                now = time.monotonic()
                if now - start > time_limit:
                    stopped = f"time limit ({time_limit:.0f} s)"
                    break
                if watch:
                    stopped = watch.verdict(*self._over_slo(slo, settled, in_flight, pending, start, now))
                    if stopped:
                        break
                while pending and start + pending[0].arrival_time <= now:
                    spec = pending.popleft()
                    try:
                        engine.add_request(
                            spec.request_id,
                            spec.prompt_token_ids,
                            forced_params(spec),
                            arrival_time=start + spec.arrival_time,
                            priority=spec.priority,
                        )
                    except ValueError as e:  # e.g. longer than the KV pool: that request fails alone
                        records[spec.request_id].error = f"rejected: {e}"
                        continue
                    records[spec.request_id].error = None
                    in_flight.add(spec.request_id)
                if not in_flight:
                    if pending:
                        wake = start + min(pending[0].arrival_time, time_limit + 1e-3)
                        time.sleep(max(0.0, wake - time.monotonic()))
                    continue
                for out in engine.step():
                    if out.finished and out.request_id in in_flight:
                        in_flight.discard(out.request_id)
                        record = records[out.request_id]
                        _fill_from_engine(record, out, start)
                        if watch:
                            late, gaps_over = _late_and_gaps_over(
                                slo,
                                record.arrival,
                                record.first_scheduled,
                                record.token_times,
                                record.finished,
                            )
                            settled[0] += late
                            settled[1] += gaps_over
                progress.update(len(specs) - len(pending) - len(in_flight), len(in_flight))
        finally:
            progress.close()
            self.partial = RunResult(list(records.values()), self._batches(first_step, start), stopped)
        if stopped:
            for request_id in in_flight:
                engine.abort_request(request_id)
                records[request_id].error = f"aborted: {stopped}"
            while engine.has_unfinished_requests():
                engine.step()
            for spec in pending:
                records[spec.request_id].error = f"not sent: {stopped}"
        return RunResult(list(records.values()), self._batches(first_step, start), stopped)

    def _over_slo(self, slo: Slo, settled, in_flight, pending, start: float, now: float) -> tuple[int, int]:
        """(requests already scheduled later than the bound or waiting longer, TBT gaps already over the
        SLO, the open gap of a request in flight included). Runs before every step, so it scans only the
        requests in flight: the finished ones were counted once, into `settled`, as they finished."""
        late = settled[0] + sum(now - start - s.arrival_time > slo.median_scheduling_delay for s in pending)
        gaps_over = settled[1]
        for request_id in in_flight:
            m = self.engine.requests[request_id].metrics  # unfinished requests are still in the engine
            scheduled = None if m.first_scheduled_time is None else m.first_scheduled_time - start
            times = [t - start for t in m.token_times] + [now - start]
            request_late, request_gaps = _late_and_gaps_over(
                slo, m.arrival_time - start, scheduled, times, now - start
            )
            late += request_late
            gaps_over += request_gaps
        return late, gaps_over

    def _batches(self, first_step: int, start: float) -> list[BatchRecord]:
        return [
            BatchRecord(
                r.start_time - start, r.num_seqs, r.num_prefill_tokens, r.num_decode_tokens, r.execution_time
            )
            for r in self.engine.step_records[first_step:]
        ]


def _late_and_gaps_over(
    slo: Slo, arrival: float, scheduled: float | None, token_times: list[float], now: float
) -> tuple[int, int]:
    """One request's share of the SLO counts: 1 if it was scheduled (or still waits) past the scheduling-delay
    bound, and how many of its token gaps exceed the P99 TBT SLO."""
    late = int((now if scheduled is None else scheduled) - arrival > slo.median_scheduling_delay)
    return late, int(np.count_nonzero(np.diff(token_times) > slo.p99_tbt))


def _fill_from_engine(record: RequestRecord, out, start: float) -> None:
    m = out.metrics
    record.token_times = [t - start for t in m.token_times]
    record.first_scheduled = None if m.first_scheduled_time is None else m.first_scheduled_time - start
    record.num_preemptions = len(m.preemption_times)
    record.finished = m.finished_time - start
    if out.outputs[0].finish_reason == "abort":
        record.error = "aborted"


def measure_decode_step(
    engine, batch_size: int = 32, prompt_len: int = 128, num_steps: int = DECODE_PROBE_STEPS
):
    """(median time of a step in which `batch_size` sequences all decode and nothing else runs, seconds;
    the StepRecords it is the median of). It is the decode iteration time a TBT SLO is derived from, as
    users see it: the whole step, scheduling and sampling included, at contexts of about `prompt_len`.

    Each request is paused as soon as its prefill ends (its first token is out) and all are resumed once the
    last prefill has ended, so they decode together whatever the policy and chunk size: left running, the
    first ones would decode through all the others' prefills (32 x 417 tokens take ~209 steps at chunk 64)
    and reach max_model_len before the last one starts. They are aborted after `num_steps` such steps."""
    if engine.config.max_num_seqs < batch_size:
        raise ValueError(
            f"batch_size must be at most the engine's max_num_seqs ({engine.config.max_num_seqs}), "
            f"got {batch_size}"
        )
    # The first token, num_steps decodes and, with overlap, one decode issued before a pause takes effect.
    max_tokens = num_steps + 2
    if not 1 <= prompt_len <= engine.max_model_len - max_tokens:
        raise ValueError(
            f"prompt_len must be in [1, max_model_len - {max_tokens}] "
            f"({engine.max_model_len - max_tokens}), got {prompt_len}"
        )
    rng = np.random.default_rng(0)
    ids = [f"decode-step-{i}" for i in range(batch_size)]
    for request_id in ids:
        engine.add_request(
            request_id,
            rng.integers(FIRST_PROMPT_TOKEN, engine.model_config.vocab_size, prompt_len).tolist(),
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
    first_step, first_preemptions = len(engine.step_records), engine.scheduler.num_preemptions
    prefilled: set[str] = set()
    steps, preempted = [], False
    while engine.has_unfinished_requests() and len(steps) < num_steps and not preempted:
        seen = len(engine.step_records)
        for out in engine.step():
            if out.request_id not in prefilled:
                prefilled.add(out.request_id)
                if len(prefilled) < batch_size:
                    engine.pause_request(out.request_id)
                else:
                    for request_id in ids:
                        engine.resume_request(request_id)
        # a preemption means the KV cache cannot hold the batch: it would never settle
        preempted = engine.scheduler.num_preemptions > first_preemptions
        steps += [
            r
            for r in engine.step_records[seen:]
            if r.num_seqs == r.num_decode_tokens == batch_size and r.num_prefill_tokens == 0
        ]
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    if len(steps) < num_steps:
        raise ValueError(
            f"batch_size: only {len(steps)} of {num_steps} steps had all {batch_size} sequences "
            f"decoding alone in {len(engine.step_records) - first_step} steps"
            f"{' (stopped at a preemption: too few KV blocks)' if preempted else ''}"
        )
    return float(np.median([r.step_time for r in steps])), steps


class _RemoteTarget:
    """Shared by the network targets: one asyncio task per request, started at its arrival time."""

    def __init__(self):
        self.partial: RunResult | None = None

    async def stream(self, spec: RequestSpec, record: RequestRecord, start: float) -> None:
        raise NotImplementedError

    def run(self, specs: list[RequestSpec], time_limit: float, label: str = "remote") -> RunResult:
        records = new_records(specs)
        self.partial = RunResult(list(records.values()), [])
        result = asyncio.run(self._run(specs, records, time_limit, label))
        self.partial = result
        return result

    async def _run(self, specs, records, time_limit, label) -> RunResult:
        start = time.monotonic()
        progress = Progress(label, len(specs))

        async def one(spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, start + spec.arrival_time - time.monotonic()))
            record = records[spec.request_id]
            record.error = None
            record.arrival = time.monotonic() - start
            try:
                await self.stream(spec, record, start)
            except asyncio.CancelledError:
                record.error = "cancelled at the time limit"
                raise
            except Exception as e:  # a failed request is a result, not the end of the run
                record.error = f"{type(e).__name__}: {e}"
            else:
                record.finished = time.monotonic() - start

        tasks = [asyncio.create_task(one(s)) for s in specs]
        deadline = start + time_limit
        try:
            while True:
                done = sum(t.done() for t in tasks)
                sent = sum(r.error != "not sent" for r in records.values())
                progress.update(done, sent - done)
                if done == len(tasks) or time.monotonic() > deadline:
                    break
                await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            progress.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        stopped = None
        if not all(r.completed for r in records.values()) and time.monotonic() > deadline:
            stopped = f"time limit ({time_limit:.0f} s)"
        return RunResult(list(records.values()), [], stopped)


class ServerTarget(_RemoteTarget):
    """A running minisarathi server, through its AsyncClient; times are what the client observes."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, api_key: str | None = None):
        super().__init__()
        self.host, self.port, self.api_key = host, port, api_key

    async def stream(self, spec, record, start) -> None:
        from minisarathi.client import AsyncClient

        # One connection per request, as an HTTP client would: no per-connection in-flight limit applies.
        async with AsyncClient(self.host, self.port, api_key=self.api_key) as client:
            async for chunk in client.generate_stream(
                spec.prompt_token_ids,
                max_tokens=spec.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                priority=spec.priority,
            ):
                now = time.monotonic() - start
                record.token_times.extend([now] * len(chunk.token_ids))


class OpenAITarget(_RemoteTarget):
    """An OpenAI-compatible server's POST /v1/completions with stream: true (server-sent events), over
    plain asyncio streams. Prompts go as token-id lists; `ignore_eos` is the vLLM / llama.cpp extension.
    Tokens are counted by the usage in each event where the server sends it, else one per event (llama.cpp,
    minisarathi). A busy vLLM puts several tokens in one event, so a target whose model card (model_card(),
    which `bench run` reads for the context length) says vLLM asks for its `continuous_usage_stats`; other
    servers may reject that option (minisarathi's HTTP door does)."""

    def __init__(
        self, url: str = "http://127.0.0.1:8000", model: str | None = None, api_key: str | None = None
    ):
        super().__init__()
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be http://host[:port][/prefix], got {url!r}")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, parts.port or 80
        self.path = parts.path.rstrip("/") + "/v1/completions"
        self.model, self.api_key = model, api_key
        self.continuous_usage = False  # ask for usage in every event: set by model_card() for vLLM

    def model_card(self) -> dict:
        """The served model's entry in GET /v1/models (`model`'s, else the first; `model` becomes its id), for
        its max_model_len. ValueError naming the URL when the endpoint does not answer it."""
        models_url = self.url + "/v1/models"
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            connection.request(
                "GET",
                self.path.removesuffix("/completions") + "/models",
                headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
            )
            response = connection.getresponse()
            body = response.read()
        except OSError as e:
            raise ValueError(f"url {models_url}: no answer ({e.strerror or e})") from None
        finally:
            connection.close()
        if response.status != 200:
            detail = body.decode("utf-8", "replace").strip()[:200]
            raise ValueError(f"url {models_url}: HTTP {response.status} {response.reason}: {detail}")
        try:
            cards = json.loads(body)["data"]
            card = next(c for c in cards if self.model in (None, c["id"]))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"url {models_url}: not an OpenAI model list") from None
        except StopIteration:
            raise ValueError(
                f"url {models_url}: no model {self.model!r} (it serves "
                f"{', '.join(repr(c.get('id')) for c in cards)})"
            ) from None
        self.model = card["id"]
        self.continuous_usage = card.get("owned_by") == "vllm"
        return card

    async def stream(self, spec, record, start) -> None:
        body = {
            "prompt": spec.prompt_token_ids,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        if self.continuous_usage:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if self.model:
            body["model"] = self.model
        if spec.priority:  # vLLM's extension (its --scheduling-policy priority)
            body["priority"] = spec.priority
        payload = json.dumps(body).encode()
        headers = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            "Connection: close",
            f"Content-Length: {len(payload)}",
        ]
        if self.api_key:
            headers.append(f"Authorization: Bearer {self.api_key}")
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            async for event in _sse_events(reader):
                if event == "[DONE]":
                    return
                data = json.loads(event)
                if "error" in data:
                    raise RuntimeError(f"server error: {data['error']}")
                choice = (data.get("choices") or [None])[0]
                if choice is None:  # the closing usage-only event
                    continue
                usage = data.get("usage") or {}
                if "completion_tokens" in usage:
                    tokens = usage["completion_tokens"] - len(record.token_times)
                else:  # one token, unless it is a closing event with no text, only the finish reason
                    tokens = int(bool(choice.get("text")) or choice.get("finish_reason") is None)
                record.token_times.extend([time.monotonic() - start] * tokens)
        finally:
            writer.close()


async def _sse_events(reader: asyncio.StreamReader):
    """The `data:` payloads of an HTTP response's server-sent events (raises on a non-200 status)."""
    status = (await reader.readline()).decode("latin-1").split()
    headers = {}
    while line := (await reader.readline()).decode("latin-1").strip():
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    if len(status) < 2 or status[1] != "200":
        detail = (await reader.read(2048)).decode("utf-8", "replace")
        raise RuntimeError(f"HTTP {' '.join(status[1:]) or 'no status'}: {detail.strip()[:200]}")
    buffer = ""
    text = codecs.getincrementaldecoder("utf-8")()  # a character may straddle two reads
    async for piece in _body(reader, headers.get("transfer-encoding") == "chunked"):
        buffer += text.decode(piece)
        *events, buffer = buffer.replace("\r\n", "\n").split("\n\n")
        for event in events:
            data = [line[5:].strip() for line in event.split("\n") if line.startswith("data:")]
            if data:
                yield "\n".join(data)


async def _body(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk
