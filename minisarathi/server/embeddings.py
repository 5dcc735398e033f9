"""Embeddings on both doors: OpenAI's POST /v1/embeddings (http.py routes it here) and the msgpack door's
`embed` method. Each input is one engine request with PoolingParams (model/pooling.py): prefill only, in
the same batches as generation, answered once with its last token's normalised hidden state. A key's quota
is charged per input as a completion is per prompt: one request and its prompt tokens (nothing generated).
docs/http.md and docs/protocol.md describe the fields.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
from dataclasses import dataclass

from minisarathi.model.pooling import PoolingParams
from minisarathi.outputs import RequestOutput
from minisarathi.server.auth import Key
from minisarathi.server.hub import EngineRefused, Hub
from minisarathi.server.openai_api import DoorLimits, OpenAIError, bad, check_body, check_prompt_length
from minisarathi.server.protocol import (
    INVALID_PARAMS,
    PROMPT_TOO_LONG,
    RPCError,
    as_int,
    short,
    token_id_list,
)
from minisarathi.server.request_log import REQUEST_ID_RULE, FinishedRequest, valid_request_id

log = logging.getLogger("minisarathi.server")

OPENAI_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
EMBED_FIELDS = {"prompt", "prompt_token_ids", "dimensions", "request_id"}  # the msgpack door's
_INPUT_USAGE = "input must be a string, an array of strings, an array of token ids, or an array of those"
_ids = itertools.count()  # the msgpack door's embed calls without a request_id


@dataclass
class EmbeddingRequest:
    inputs: list[list[int] | None]  # token ids; None: a text input, until the door tokenizes it
    texts: list[str | None]
    params: PoolingParams
    encoding_format: str = "float"  # "float": JSON numbers; "base64": little-endian float32 bytes


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dimensions(value, hidden_size: int, error) -> PoolingParams:
    if value is None:
        return PoolingParams()
    if not _is_int(value) or not 1 <= value <= hidden_size:
        raise error(f"dimensions must be an integer in [1, {hidden_size}] (the model's hidden_size)")
    return PoolingParams(value)


def parse_openai(body, model: str, limits: DoorLimits, hidden_size: int) -> EmbeddingRequest:
    """A /v1/embeddings body; OpenAIError (400, naming the field) for anything wrong."""
    check_body(body, OPENAI_FIELDS, model)
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad(
            "encoding_format", f"encoding_format must be 'float' or 'base64', got {short(repr(encoding))}"
        )
    if "user" in body and not isinstance(body["user"], str):
        raise bad("user", "user must be a string")
    params = _dimensions(body.get("dimensions"), hidden_size, lambda m: bad("dimensions", m))
    given = body.get("input")
    if isinstance(given, str):
        texts, inputs = [given], [None]
    elif isinstance(given, list) and given and all(isinstance(p, str) for p in given):
        texts, inputs = given, [None] * len(given)
    elif isinstance(given, list) and given and all(_is_int(t) for t in given):
        texts, inputs = [None], [given]
    elif (
        isinstance(given, list) and given and all(isinstance(p, list) and all(map(_is_int, p)) for p in given)
    ):
        texts, inputs = [None] * len(given), given
    else:
        raise bad("input", _INPUT_USAGE)
    if len(texts) > limits.lists.max_prompts:
        raise bad("input", f"input holds {len(texts)} inputs; the limit is {limits.lists.max_prompts}")
    for ids in inputs:
        if ids is not None:
            check_prompt_length(ids, limits, "input")
            if not all(0 <= t < limits.vocab_size for t in ids):
                raise bad("input", f"input token ids must be in [0, {limits.vocab_size})")
    return EmbeddingRequest(inputs, texts, params, encoding)


async def run(
    hub: Hub,
    engine_ids: list[str],
    inputs: list[list[int]],
    params: PoolingParams,
    key: Key | None,
    received: float,
) -> list[RequestOutput]:
    """Every input as one engine request, charged to the key's quota (one request and its tokens each);
    their outputs in input order. RPCError if the queue, the quota or the engine refuses one, or one fails;
    a caller cancelled meanwhile (its client went away) has the unfinished ones aborted."""
    for engine_id in engine_ids:
        if hub.in_use(engine_id):
            raise RPCError(
                INVALID_PARAMS, f"request id {engine_id!r} is already in use by a request in flight"
            )
    tokens = sum(map(len, inputs))
    quota = hub.admit(key, 0, tokens, len(inputs))
    loop = asyncio.get_running_loop()
    results = [loop.create_future() for _ in inputs]  # each: a RequestOutput or an RPCError
    submitted = 0
    priority = 0 if key is None else key.priority
    try:
        for engine_id, ids, result in zip(engine_ids, inputs, results):
            hub.open(engine_id, lambda output, result=result: result.done() or result.set_result(output))
            hub.submit(engine_id, ids, params, received, priority, stream=False)
            submitted += 1
        outputs = [await result for result in results]
        error = next((o for o in outputs if isinstance(o, RPCError)), None)
        if error is not None:
            raise error
        return outputs
    finally:
        for engine_id, result in zip(engine_ids[:submitted], results):
            if not result.done():
                hub.cancel(engine_id)
        if quota is not None:
            ran = [
                ids
                for ids, result in zip(inputs[:submitted], results)
                if not (result.done() and isinstance(result.result(), EngineRefused))
            ]
            quota.finish(tokens, sum(map(len, ran)), 0, len(inputs), len(inputs) - len(ran))


def report(hub: Hub, request_id: str, door: str, client: str, prompt, output: RequestOutput) -> None:
    hub.report_finished(
        FinishedRequest(
            request_id,
            door,
            client,
            prompt,
            len(output.prompt_token_ids),
            output.num_cached_tokens,
            0,
            "stop",
            output.metrics,
        )
    )


# ------------------------------------------------------------------------------------------ HTTP


async def http_embeddings(hub: Hub, parsed: EmbeddingRequest, request_id: str, client: str, key, received):
    """OpenAI's response body for a parsed /v1/embeddings request; OpenAIError or RPCError (http.py maps it)
    if it may not run."""
    floor = sum(1 if ids is None else len(ids) for ids in parsed.inputs)
    hub.precheck(key, 0, floor, len(parsed.inputs), len(parsed.inputs))
    for i, text in enumerate(parsed.texts):
        if text is not None:
            try:
                parsed.inputs[i] = await hub.encode_prompt(text, "input")
            except RPCError as e:
                raise OpenAIError(400, e.message, param="input") from None
            if not parsed.inputs[i]:
                raise bad("input", "input is empty")
            if len(parsed.inputs[i]) > hub.max_prompt_tokens:
                raise bad(
                    "input", f"input has {len(parsed.inputs[i])} tokens; the limit is {hub.max_prompt_tokens}"
                )
    count = len(parsed.inputs)
    engine_ids = [f"http:{request_id}" + (f"-{i}" if count > 1 else "") for i in range(count)]
    try:
        outputs = await run(hub, engine_ids, parsed.inputs, parsed.params, key, received)
    except RPCError as e:
        if e.code in (INVALID_PARAMS, PROMPT_TOO_LONG):  # the engine's: about an input
            raise OpenAIError(400, e.message, param="input") from None
        raise
    for i, output in enumerate(outputs):
        report(
            hub,
            engine_ids[i].removeprefix("http:"),
            "http",
            client,
            parsed.texts[i] or parsed.inputs[i],
            output,
        )
    log.info(
        "%s from %s: %d input(s) embedded, %d tokens", request_id, client, count, sum(map(len, parsed.inputs))
    )
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(o, parsed.encoding_format)}
            for i, o in enumerate(outputs)
        ],
        "model": hub.model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encode(output: RequestOutput, encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: the float32 array's bytes, little-endian
        return base64.b64encode(output.embedding.astype("<f4").tobytes()).decode("ascii")
    return output.embedding.tolist()


# ------------------------------------------------------------------------------------------ msgpack


async def msgpack_embed(door, conn, msgid, params: list) -> dict:
    """The msgpack door's `embed`: params [{"prompt": str} or {"prompt_token_ids": [int]}, "dimensions",
    "request_id"}]; the result {"request_id", "embedding", "prompt_tokens", "cached_tokens", "e2e_s"}.
    Answered as any non-generate call (a coroutine: MsgpackDoor._respond_later); a closed connection
    cancels it, which aborts its engine request."""
    hub = door.hub
    received = time.monotonic()
    if len(params) != 1 or not isinstance(params[0], dict):
        raise RPCError(
            INVALID_PARAMS, "params must be [{prompt or prompt_token_ids, dimensions, request_id}]"
        )
    fields = {k: v for k, v in params[0].items() if v is not None}
    for name in fields:
        if name not in EMBED_FIELDS:
            raise RPCError(INVALID_PARAMS, f"unknown field {short(repr(name))}")
    prompt, token_ids = fields.get("prompt"), fields.get("prompt_token_ids")
    if (prompt is None) == (token_ids is None):
        raise RPCError(INVALID_PARAMS, "exactly one of prompt, prompt_token_ids must be given")
    if prompt is not None and not isinstance(prompt, str):
        raise RPCError(INVALID_PARAMS, "prompt must be a string")
    if token_ids is not None:
        if not isinstance(token_ids, list) or not token_ids:
            raise RPCError(INVALID_PARAMS, "prompt_token_ids must be a non-empty list of token ids")
        token_ids = token_id_list(token_ids, "prompt_token_ids", hub.engine.tokenizer.vocab_size)
    request_id = fields.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and valid_request_id(request_id)):
        raise RPCError(INVALID_PARAMS, f"request_id must be {REQUEST_ID_RULE}")
    hidden = hub.engine.model_config.hidden_size
    pooling = _dimensions(as_int(fields.get("dimensions")), hidden, lambda m: RPCError(INVALID_PARAMS, m))
    hub.precheck(conn.key, 0, len(token_ids or [0]), 1, 1)
    if prompt is not None:
        token_ids = await hub.encode_prompt(prompt, "prompt")
        if not token_ids:
            raise RPCError(INVALID_PARAMS, "prompt is empty")
    if len(token_ids) > hub.max_prompt_tokens:
        raise RPCError(
            PROMPT_TOO_LONG, f"prompt has {len(token_ids)} tokens; the limit is {hub.max_prompt_tokens}"
        )
    public_id = request_id or f"embed-{next(_ids)}"
    (output,) = await run(hub, [f"msgpack-embed:{public_id}"], [token_ids], pooling, conn.key, received)
    report(hub, public_id, "msgpack", conn.peer, prompt if prompt is not None else token_ids, output)
    return {
        "request_id": public_id,
        "embedding": output.embedding.tolist(),
        "prompt_tokens": len(output.prompt_token_ids),
        "cached_tokens": output.num_cached_tokens,
        "e2e_s": time.monotonic() - received,
    }
