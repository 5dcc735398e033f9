"""LLMEngine: requests in, one batch per step (schedule, build, forward, sample, update), outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

from minisarathi import structured
from minisarathi.backends.cpu.process_setup import configure_cpu
from minisarathi.batch import Batch, make_batch
from minisarathi.config import EngineConfig
from minisarathi.engine.block_manager import BlockManager
from minisarathi.engine.cost_model import CostModel, StepShape, step_shape
from minisarathi.engine.overlap import Overlap, overlaps
from minisarathi.engine.profile import run_profile
from minisarathi.engine.scheduler import SchedulerOutput
from minisarathi.engine.sequence import Sequence, SequenceStatus
from minisarathi.engine.slo_scheduler import make_scheduler
from minisarathi.engine.speculative import Speculation
from minisarathi.engine.step_log import STEP_RECORDS_KEPT, StepLog, StepRecord
from minisarathi.model import pooling
from minisarathi.model.families import load_model
from minisarathi.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from minisarathi.parallel.group import TensorParallelError, TensorParallelModel
from minisarathi.paths import default_model_dir
from minisarathi.sampler import PendingSample, SamplerOutput, make_generator
from minisarathi.sampling_params import SamplingParams
from minisarathi.tokenizer import STREAM_CONTEXT, IncrementalDetokenizer, Tokenizer
from minisarathi.validation import PRIORITY_RANGE, check_float, check_int

CPU_KV_CACHE_BYTES = 256 << 20  # the default KV budget where the backend reports no device memory
GPU_KV_CACHE_FRACTION = 0.9  # of the device memory free after the weights: the rest is for activations

log = logging.getLogger("minisarathi.engine")


def kv_cache_budget(config: EngineConfig, model) -> int:
    """config.kv_cache_bytes, else a share of the device memory the model reports free (called after the
    weights are placed), else (host memory: it reports none) CPU_KV_CACHE_BYTES. Per rank under tensor
    parallelism, as each rank holds its own KV heads' cache."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    free = model.free_memory_bytes()
    return CPU_KV_CACHE_BYTES if free is None else int(GPU_KV_CACHE_FRACTION * free)


def load_engine_model(path: Path, config: EngineConfig):
    """A LlamaModel in this process, or with tensor_parallel_size > 1 a TensorParallelModel (its ranks)."""
    if config.tensor_parallel_size == 1:
        return load_model(path, device=config.device, dtype=config.dtype)
    return TensorParallelModel(
        path, config.device, config.dtype, config.tensor_parallel_size, config.rank_timeout_s
    )


@dataclass(eq=False)
class Step:
    """A step whose forward (then sampling) is issued on the backend; its ids are not on the host yet."""

    schedule: SchedulerOutput
    starts: list[int]  # each scheduled chunk's first position
    samplers: list[Sequence]  # the sequences that sample: one per row of logits, then of the ids
    logits: Any  # float32 or activation dtype [len(samplers), vocab], on the device
    shape: StepShape
    predicted: float | None
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    schedule_time: float  # scheduling and batch building
    issue_time: float  # issuing the forward, then the sampling
    sampled: PendingSample | None = None
    mask_time: float = 0.0  # structured outputs: the constrained rows' masks, computed and applied (in issue)
    pooled: tuple = ()  # embedding requests whose prompt ended here, and their rows (model/pooling.py)


def engine_config(config: EngineConfig | None, options: dict) -> EngineConfig:
    """config with `options` (EngineConfig fields) replaced, or the defaults with them."""
    unknown = set(options) - {f.name for f in dataclasses.fields(EngineConfig)}
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(config, **options) if config else EngineConfig(**options)


class LLMEngine:
    """The synchronous engine: each step() schedules, builds the batch, runs the forward, samples and
    updates, in that order."""

    overlap = False

    def __new__(cls, model: str | Path | None = None, config: EngineConfig | None = None, **options):
        """The hooks of overlap and speculation (engine/overlap.py, engine/speculative.py)."""
        if cls is LLMEngine and overlaps(config := engine_config(config, options)):
            cls = OverlappingEngine
        elif cls is LLMEngine and config.speculative_config:
            cls = SpeculativeEngine
        return super().__new__(cls)

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **options):
        config = engine_config(config, options)
        path = Path(model) if model is not None else default_model_dir()
        self.config = config
        # Process-wide, before any matmul: BLAS threads (config.blas_threads) and the allocator.
        self.cpu_setup = configure_cpu(config.blas_threads)
        log.info("%s", self.cpu_setup.describe())
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.model = load_engine_model(path, config)
        self.model_config = self.model.config
        max_positions = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({max_positions})"
            )
        self.max_model_len = config.max_model_len or max_positions
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            budget = kv_cache_budget(config, self.model)
            num_blocks = budget // self.model.kv_cache_bytes_per_block(config.block_size)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_bytes ({budget}) holds no KV block of {config.block_size} tokens")
            # No more than the running sequences can ever hold: a tiny model's share of a large GPU would
            # otherwise be millions of blocks, and host bookkeeping (free list, tables) that grows with them.
            num_blocks = min(num_blocks, config.max_num_seqs * -(-self.max_model_len // config.block_size))
        self.kv_cache = self.model.new_kv_cache(num_blocks, config.block_size)
        pool = num_blocks * self.model.kv_cache_bytes_per_block(config.block_size) / 2**20
        weights = f"{self.model.weight_format}, {self.model.weight_bytes / 2**20:.1f} MiB on {config.device}"
        kv_pool = f"{num_blocks} blocks of {config.block_size} tokens, {pool:.1f} MiB"
        log.info("weights: %s; KV pool: %s", weights, kv_pool)
        blocks = (num_blocks, config.block_size, config.enable_prefix_caching, self.model_config.kv_window)
        self.block_manager = BlockManager(*blocks)
        # fitted from every step's record; tbt_slo_ms mode sizes the steps with it, speculation prices drafts
        online = config.tbt_slo_ms is not None or bool(config.speculative_config)
        self.cost_model = CostModel(online=online, overlapped=self.overlap)
        self.scheduler = make_scheduler(config, self.block_manager, self.max_model_len, self.cost_model)
        # The model's own sampler: on the CUDA backend it samples on the device (only ids cross to the host).
        self.sampler = self.model.new_sampler(config.seed, self.tokenizer.eos_token_ids)
        if config.tbt_slo_ms is not None:  # a fit before the first step; the pool holds no sequence yet
            self.cost_model.add_profile(
                *run_profile(
                    self.model,
                    self.kv_cache,
                    self.sampler,
                    config.block_size,
                    num_blocks,
                    config.chunk_size,
                    self.max_model_len,
                    config.max_num_seqs,
                )
            )
        if config.tensor_parallel_size == 1:  # after the profile, whose steps would capture graphs
            self._use_decode_buckets(config)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.model_failure: TensorParallelError | None = None  # set once the model's ranks died or hung
        self.step_records = StepLog(STEP_RECORDS_KEPT)
        self._aborted: list[Sequence] = []  # finished by abort_request, reported by the next step
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0

    def _use_decode_buckets(self, config: EngineConfig) -> None:
        capture = self.model.ops.device in ("cuda", "cuda-emulated")  # the host backends have no graphs
        if config.cuda_graphs if config.cuda_graphs is not None else capture:
            buckets = self.model.use_decode_buckets(
                config.max_num_seqs, self.max_model_len, config.block_size, self.kv_cache if capture else None
            )
            graphs = self.model.decode_graphs.buckets
            log.info(
                "decode steps padded to batch-size buckets %s%s",
                buckets,
                f" (no graphs on {self.model.ops.device})"
                if not capture
                else ", CUDA graphs captured for each"
                if graphs
                else ", CUDA graphs off: capture failed",
            )

    # requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        stream: bool = True,
        priority: int = 0,
    ) -> None:
        """stream=False: step() reports the request only once, when it finishes (vLLM's FINAL_ONLY output
        kind), which spares a RequestOutput and a copy of its tokens per step when only the result matters.
        priority: lower runs first (docs/scheduling.md, "Priorities")."""
        self.add_sequence(
            self.prepare_request(request_id, prompt, params, arrival_time, stream=stream, priority=priority)
        )

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        stream: bool = True,
        priority: int = 0,
    ) -> Sequence:
        """Validate and tokenize a request without queueing it (so a batch can be checked whole first)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        check_int("priority", priority, *PRIORITY_RANGE)
        if arrival_time is not None:
            check_float("arrival_time", arrival_time)
        pooling_params, params = pooling.prefill_only(self, SamplingParams() if params is None else params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or PoolingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        # type(t) is int first: the ABC check alone costs ~1 us a token (7% of a burst's time at stories260K)
        elif isinstance(prompt, (list, tuple)) and all(
            type(t) is int or (isinstance(t, Integral) and not isinstance(t, bool)) for t in prompt
        ):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError("prompt must be a str or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
        if params.n > self.config.max_num_seqs:  # its choices run at once: it could never be admitted
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})"
            )
        # Generation ends at max_tokens or when the sequence reaches max_model_len (at least one token);
        # the last sampled token is never fed back, so the cache holds one token less than the final length.
        final_len = min(len(ids) + params.max_tokens, max(self.max_model_len, len(ids) + 1))
        needed = self.block_manager.blocks_for(final_len - 1)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV blocks of "
                f"{self.config.block_size} tokens but the pool has {self.block_manager.num_blocks}; "
                "lower max_tokens or give the KV cache more blocks"
            )
        return Sequence(
            request_id,
            text,
            ids,
            params,
            RequestMetrics(time.monotonic() if arrival_time is None else arrival_time),
            max_kv_tokens=final_len - 1,
            generator=None if params.seed is None else make_generator(params.seed),
            detokenizer=self._detokenizer(ids, params),
            logprobs=None if params.logprobs is None else [],
            stream=stream,
            priority=priority,
            matcher=structured.matcher(params, self.tokenizer, vocab),
            pooling=pooling_params,
        )

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize:  # token ids only
            return None
        return IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.skip_special_tokens, params.min_tokens
        )

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        seq.seq_id = next(self._arrivals)
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq  # only once queued: a failed add leaves no request behind

    def abort_request(self, request_id: str) -> int | None:
        """Stop a request in any state and free its blocks; the next step reports it once, as "abort".
        Returns the tokens its choices generated (a server's quota pays for them); None if it is unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        now = time.monotonic()
        for choice in seq.choices or [seq]:
            if not choice.is_finished:
                self.scheduler.abort(choice)
                self._finish(choice, "abort", None, now)
        self._aborted.append(seq)
        return sum(len(choice.output_token_ids) for choice in seq.choices or [seq])

    def pause_request(self, request_id: str) -> None:
        """Stop scheduling a request (a server pauses those whose client stopped reading), keeping its KV
        blocks unless memory is needed; resume_request goes on with it. Unknown or finished ids are
        ignored."""
        seq = self.requests.get(request_id)
        for choice in [] if seq is None else seq.choices or [seq]:  # n > 1: every choice
            self.scheduler.pause(choice)

    def resume_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        for choice in [] if seq is None else seq.choices or [seq]:
            self.scheduler.resume(choice)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._aborted)

    def has_work(self) -> bool:
        """Whether step() has anything to do: sequences to schedule (not paused), or aborts to report."""
        return bool(self._aborted or self.scheduler.waiting or self.scheduler.running)

    # the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns a RequestOutput for every request that got a token (stream=False ones: only
        when they finish), and for every request aborted since the last step."""
        if self.model_failure is not None:
            raise self.model_failure
        start = time.monotonic()
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        return outputs + self._run_step(start)

    def _run_step(self, start: float) -> list[RequestOutput]:
        """Schedule, build the batch, issue the forward and the sampling, wait for the ids, update."""
        step = self._launch(start)
        if step is None:
            return []
        self._sample(step)
        ids_wait, outputs = self._complete(step)
        self._record(step, start, ids_wait)
        return outputs

    def _launch(self, start: float) -> Step | None:
        """Schedule, advance, build the batch, issue its forward; None when nothing is scheduled."""
        schedule = self.scheduler.schedule()
        for seq in schedule.preempted:
            seq.metrics.preemption_times.append(start)
        if not schedule.scheduled:
            return None
        shape = step_shape(schedule.scheduled)  # before _advance counts the chunks as computed
        predicted = self.cost_model.predict(shape)
        starts = self._advance(schedule.scheduled, start)
        batch, samplers, num_prefill = self._make_batch(schedule.scheduled, starts)
        scheduled = time.monotonic()
        logits = self._forward(batch)
        logits, samplers, pooled = pooling.take_rows(self.model, logits, samplers, num_prefill)
        return Step(
            schedule,
            starts,
            samplers,
            logits,
            shape,
            predicted,
            batch.num_seqs,
            num_prefill,
            batch.num_tokens - num_prefill,
            schedule_time=scheduled - start,
            issue_time=time.monotonic() - scheduled,
            pooled=pooled,
        )

    def _forward(self, batch: Batch):
        """Issue the step's block copies and forward; the logits of its sampling rows, on the device."""
        copies = self.block_manager.take_copies()
        try:
            # n > 1: shared partial blocks about to be written, copied while they hold what they held
            if copies:
                self.model.copy_blocks(self.kv_cache, [s for s, _ in copies], [d for _, d in copies])
            return self.model.forward(batch, self.kv_cache, device_logits=True)
        except TensorParallelError as e:  # the ranks are gone for good: fail every later step the same way
            self.model_failure = e
            raise

    def _sample(self, step: Step) -> None:
        """Issue the step's sampling; new n > 1 requests fork their choices here."""
        began = time.monotonic()
        logits, samplers = step.logits, step.samplers
        if any(s.params.n > 1 and s.choices is None for s in samplers):
            logits, samplers = self._fork(logits, samplers)
        step.samplers, step.logits = samplers, None
        masking = time.monotonic()
        logits = structured.mask_logits(self.sampler, logits, samplers)
        step.mask_time = time.monotonic() - masking
        step.sampled = self.sampler.launch(
            logits,
            [s.params for s in samplers],
            [s.generator for s in samplers],
            [s.prompt_token_ids for s in samplers],
            [s.output_token_ids for s in samplers],
        )
        step.issue_time += time.monotonic() - began

    def _complete(self, step: Step) -> tuple[float, list[RequestOutput]]:
        """Wait for the step's sampled ids on the host (the only wait on the device), then update its
        sequences; returns the seconds waited and the outputs."""
        began = time.monotonic()
        sampled = step.sampled.result()
        now = time.monotonic()
        return now - began, self._update(step, sampled, now)

    def _record(self, step: Step, start: float, ids_wait: float) -> None:
        """The call's StepRecord, and its time for the cost model and the scheduler."""
        step_time = time.monotonic() - start
        self.cost_model.add(step.shape, step_time, step.predicted, step.mask_time)
        schedule = step.schedule
        self.scheduler.observe(step.predicted, step_time)
        self.step_records.append(
            StepRecord(
                start,
                step.num_seqs,
                step.num_prefill_tokens,
                step.num_decode_tokens,
                len(schedule.preempted),
                step.schedule_time,
                step.issue_time + ids_wait,
                step_time,
                step.shape.prefill_attention,
                step.shape.decode_attention,
                step.predicted,
                schedule.time_limit,
                schedule.admission_stop,
                schedule.overloaded,
                step_time - ids_wait,
                ids_wait,
                step.mask_time,
            )
        )

    def _advance(self, scheduled: dict[Sequence, int], now: float) -> list[int]:
        """Counts each granted chunk as computed (this step's forward computes it) and stamps the request's
        timeline; returns each chunk's first position. A chunk is the sequence's next uncomputed tokens."""
        starts = []
        for seq, n in scheduled.items():
            begin = seq.num_computed_tokens
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.num_cached_tokens = begin
            if begin < seq.num_prefill_tokens:
                seq.metrics.chunk_times.append((now, n))
            seq.num_computed_tokens = begin + n
            starts.append(begin)
        return starts

    def _make_batch(
        self, scheduled: dict[Sequence, int], starts: list[int]
    ) -> tuple[Batch, list[Sequence], int]:
        """The flat batch of this step's chunks, the sequences that sample, and the number of prefill tokens.
        A chunk samples when it reaches the sequence's end."""
        token_ids, rows, sample, samplers = [], [], [], []
        num_prefill = max_end = 0
        for (seq, n), begin in zip(scheduled.items(), starts):
            end = begin + n
            if end > max_end:
                max_end = end
            rows.append(seq.block_row)
            if n == 1 and begin >= seq.num_prefill_tokens:  # a decode: it feeds its last sampled token
                token_ids.append(self._decode_token(seq, len(token_ids)))
                ends = True
            else:
                num_prefill += n
                token_ids += seq.token_slice(begin, end)
                ends = end == seq.num_tokens
            sample.append(ends)
            if ends:
                samplers.append(seq)
        # the tables matrix is at least as wide as the longest block table; keep the columns this step reads
        width = max(self.block_manager.blocks_for(max_end), 1)
        tables = self.block_manager.tables[rows, :width]  # int32[S, width]
        batch = make_batch(
            token_ids, starts, list(scheduled.values()), tables, sample, self.config.block_size
        )
        return batch, samplers, num_prefill

    def _decode_token(self, seq: Sequence, row: int) -> int:
        """Hook: the token a decode at `row` of input_ids feeds, its last sampled one."""
        return seq.output_token_ids[-1]

    def _fork(self, logits, samplers: list[Sequence]):
        """n > 1: a request whose prompt was just computed becomes n choices sharing its blocks, each sampling
        its first token from the same logits row with its own random stream (seed + index when seeded)."""
        rows, expanded = [], []
        for row, seq in enumerate(samplers):
            rows.append(row)
            expanded.append(seq)
            if seq.params.n == 1 or seq.choices is not None:
                continue
            seq.choices = [seq]
            for index in range(1, seq.params.n):
                child = self._child(seq, index)
                self.block_manager.fork(seq, child)
                self.scheduler.add_running(child)
                seq.choices.append(child)
                rows.append(row)
                expanded.append(child)
        return logits[rows], expanded

    def _child(self, parent: Sequence, index: int) -> Sequence:
        params = parent.params
        m = parent.metrics
        return dataclasses.replace(
            parent,
            metrics=RequestMetrics(m.arrival_time, m.first_scheduled_time, chunk_times=list(m.chunk_times)),
            generator=None if params.seed is None else make_generator((params.seed + index) % 2**64),
            detokenizer=self._detokenizer(parent.prompt_token_ids, params),
            seq_id=next(self._arrivals),
            matcher=parent.matcher and parent.matcher.deep_copy(),  # (the parent's has consumed nothing)
            output_token_ids=[],
            logprobs=None if params.logprobs is None else [],
            block_table=[],
            block_row=-1,
            block_hashes=[],
            index=index,
        )

    def _update(self, step: Step, sampled: SamplerOutput, now: float) -> list[RequestOutput]:
        """Appends the sampled tokens, finishes what is done, frees its blocks; the step's outputs."""
        for (seq, n), begin in zip(step.schedule.scheduled.items(), step.starts):
            self.block_manager.register_computed(seq, begin + n)
        outputs, finished, groups = pooling.finish(self, step.pooled, now), [], {}
        for row, (seq, token) in enumerate(zip(step.samplers, sampled.token_ids.tolist())):
            if seq.is_finished:  # speculation: a token after one that finished it (engine/speculative.py)
                continue
            done = self._append_token(seq, token, sampled, row, now)
            if done:
                finished.append(seq)
            self.num_generated_tokens += 1
            if seq.choices is not None:  # n > 1: one output per request, with every choice, after the loop
                groups[id(seq.choices[0])] = seq.choices[0]
            elif done or seq.stream:
                outputs.append(self._output(seq))
        outputs += [
            self._output(head)
            for head in groups.values()
            if head.stream or head.request_id not in self.requests
        ]
        self.scheduler.remove_finished(finished)
        return outputs

    def _append_token(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int, now: float) -> bool:
        """Add a sampled token to seq; returns whether it finished seq."""
        seq.output_token_ids.append(token)
        metrics = seq.metrics
        metrics.first_token_time = metrics.first_token_time or now  # (monotonic times are never 0)
        metrics.token_times.append(now)
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprobs(seq, sampled.logprobs[row], sampled.ranks[row]))
        # A stop token (EOS or a stop id; the sampler masks them until min_tokens are out) ends the request
        # before the detokenizer sees it: as in vLLM, its id is in token_ids but its text is not in text.
        # The detokenizer ignores stop strings until min_tokens are out.
        params = seq.params
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", None, now)
        elif token in params.stop_token_set:
            self._finish(seq, "stop", token, now)
        elif seq.detokenizer is not None and (stop_string := self._detokenize(seq, token)) is not None:
            self._finish(seq, "stop", stop_string, now)
        elif seq.matcher is not None and structured.finished(seq.matcher, token):  # the grammar is complete
            self._finish(seq, "stop", None, now)
        elif seq.num_tokens > seq.max_kv_tokens:  # max_tokens, or max_model_len, reached
            self._finish(seq, "length", None, now)
        else:
            return False
        return True

    def _logprobs(self, seq: Sequence, row: list[tuple[int, float]], rank: int) -> dict[int, Logprob]:
        """The sampled token (seq's last) and the top alternatives, each with its text after seq's earlier
        tokens (the sampled one's is set again by the detokenizer, which also knows an unfinished character's
        bytes)."""
        (sampled_id, sampled_lp), top = row[0], row[1:]
        ids = [t for t, _ in top] + [sampled_id]
        texts = [None] * len(ids)
        if seq.params.detokenize:
            end = seq.num_tokens - 1
            texts = self.tokenizer.token_texts(seq.token_slice(max(0, end - STREAM_CONTEXT), end), ids)
        result = {t: Logprob(lp, r, text) for r, ((t, lp), text) in enumerate(zip(top, texts), start=1)}
        result.setdefault(sampled_id, Logprob(sampled_lp, rank, texts[-1]))
        return result

    @staticmethod
    def _detokenize(seq: Sequence, token: int) -> str | None:
        """Feed token to seq's detokenizer; the stop string it completes, if any. The sampled token's logprobs
        text becomes exactly what it added to the text."""
        stop_string = seq.detokenizer.add(token)[1]
        if seq.logprobs is not None:
            seq.logprobs[-1][token].decoded_token = seq.detokenizer.last_piece
        return stop_string

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.metrics.finished_time = now
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
        if seq.choices is None or all(choice.is_finished for choice in seq.choices):
            del self.requests[seq.request_id]

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        # Snapshots: the token list (and logprobs list) is copied, so an output kept by the caller (or read by
        # another thread, as the server does) never changes as the sequence grows. That copy is the one part
        # of a step that grows with the length of a request (~10 ns per token here); stream=False avoids it.
        choices = seq.choices or [seq]
        completions = [
            CompletionOutput(
                c.index,
                "" if c.detokenizer is None else c.detokenizer.text,
                c.output_token_ids.copy(),
                c.finish_reason,
                c.stop_reason,
                None if c.logprobs is None else c.logprobs.copy(),
            )
            for c in choices
        ]
        return RequestOutput(
            seq.request_id,
            seq.prompt,
            seq.prompt_token_ids,
            completions,
            all(c.is_finished for c in choices),
            seq.metrics,
            seq.num_cached_tokens,
        )

    # introspection -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        blocks = self.block_manager
        queries, hits = blocks.prefix_queries, blocks.prefix_hits
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": blocks.num_used_blocks,
            "kv_blocks_total": blocks.num_blocks,
            "kv_usage": blocks.num_used_blocks / blocks.num_blocks,
            "prefix_cache_queries": queries,  # tokens looked up at every admission (recomputes included)
            "prefix_cache_hits": hits,  # of them, tokens served from the cache
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "tokens_generated": self.num_generated_tokens,
            "steps": len(self.step_records),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "weight_format": self.model.weight_format,  # the matrices' storage: "bfloat16", "Q4_K+Q6_K", ...
            "weight_bytes": self.model.weight_bytes,  # what the placed weights take, over all ranks
            "ranks": self.model.rank_info(),  # one process per rank: rank, pid, host, device
            # coefficients (s per unit), fits, predicted/actual histogram
            "cost_model": self.cost_model.summary(),
            "tbt_slo": self.scheduler.summary(),
        }

    def check_invariants(self) -> None:
        """Block-manager consistency against the live sequences and the scheduler's limits (tests call it
        after every step)."""
        assert all(not s.block_table for s in self.scheduler.waiting), "a waiting sequence holds blocks"
        holding = self.scheduler.running + [s for s in self.scheduler.paused if s.block_table]
        self.block_manager.check_invariants(holding)
        self.scheduler.check_invariants()


class OverlappingEngine(Overlap, LLMEngine):
    """LLMEngine with each step launched before the previous one's ids are on the host (engine/overlap.py)."""


class SpeculativeEngine(Speculation, LLMEngine):
    """LLMEngine with draft tokens verified inside the step's budget (engine/speculative.py)."""
