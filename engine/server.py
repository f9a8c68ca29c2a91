"""SGLang's native HTTP API over the engine (engine/scheduler.py), served with aiohttp.

Role: lets everything that talks to SGLang (our `engine.client.SglangClient`, slime-style rollout
code, sglang-router) talk to this CPU engine unchanged. Invariant: request fields, response
fields and their shapes are SGLang's; a malformed request gets HTTP 400 with SGLang's error body
`{"error": {"message": ...}}` and never disturbs the engine; a body over `max_body_bytes` gets
413 before it is read, and JSON is parsed only within bounds (engine.weight_endpoints.parse_json),
so no input blocks the event loop for long or answers 500.

Matched against (read in the public sglang sources, no server was run):
- `python/sglang/srt/entrypoints/http_server.py` (sgl-project/sglang, 2025-2026 main branch,
  v0.5.x era): routes, methods, response bodies, `_create_error_response`;
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (text / input_ids / sampling_params
  / return_logprob / logprob_start_len / top_logprobs_num / return_text_in_logprobs / rid / stream),
  `PauseGenerationReqInput` (mode "abort" | "retract" | "in_place", default "abort"),
  `UpdateWeightFromDiskReqInput` and the other weight updates: engine/weight_endpoints.py,
  `Release/ResumeMemoryOccupationReqInput` (tags), `AbortReq` (rid, abort_all);
- `tokenizer_manager.py`: meta_info keys (id, finish_reason, prompt_tokens, weight_version,
  total_retractions, completion_tokens, cached_tokens, e2e_latency, input/output_token_logprobs
  as [logprob, token_id, text-or-null] triples, input/output_top_logprobs lists of triples per
  position with null where a position has none) and the pause logic (new requests wait while
  paused; "abort" aborts everything in flight);
- `scheduler_output_processor_mixin.py`, `scheduler.py` and `schedule_batch.py`: the input
  log-prob window. `input_token_logprobs` has one entry per token of input_ids[logprob_start_len:]
  and the FIRST entry's logprob is null whatever its context (the scheduler prepends None to the
  next-token log-probs of the window and drops the last one); `input_top_logprobs` likewise
  starts with null. logprob_start_len = -1 (the default) means len(input_ids) - 1 (one entry,
  null) for a generating request and len(input_ids) (no entry) for max_new_tokens = 0;
  logprob_start_len >= len(input_ids) is refused. Fixtures of these answers, with the versions
  read: tests/fixtures/sglang/;
- `schedule_batch.py`: finish reasons {"type": "stop", "matched": id|str}, {"type": "length",
  "length": n}, {"type": "abort", "message", "status_code", "err_type"};
- `sampling_params.py` `verify()`: the range checks and their messages;
- routed experts (`return_routed_experts`, a single bool for the whole request; the server
  returns them only when started with --enable-return-routed-experts):
  `layers/moe/routed_experts_capturer.py` `get_routed_experts` (the rows of KV slots
  `req_to_token[:seqlen - 1]`: every position that was a model input, [seqlen - 1,
  num_hidden_layers, num_experts_per_tok] int32, 0 in layers without experts), the output
  processor's `maybe_collect_routed_experts` (collected when a request finishes, an abort of a
  running request included; a request never scheduled has none) and `tokenizer_manager.py`
  `_handle_batch_output` (`meta_info["routed_experts"]` = base64 of the int32 array's bytes, set
  only when there is one). Fixtures and versions: tests/fixtures/sglang/ROUTED_EXPERTS.md.

Deliberate differences / not confirmed:
- Unknown top-level /generate fields are rejected with 400 (SGLang's pydantic model ignores them);
  fields SGLang has but this engine does not implement (streaming, images, lora_id, ...) are 400
  unless left at their defaults; so are penalties, min_new_tokens, n > 1 and grammars.
- `/get_weight_version` answers {"weight_version": v} as SGLang ~0.5.x does; the newest SGLang
  answers 404 there and reports it in `/model_info` only (both are served here).
- SGLang answers logprob_start_len >= len(input_ids) with an abort whose status 400 becomes an
  HTTP 400; here it is refused by the parser with 400 (message differs).
- With max_new_tokens = 0, `output_token_logprobs` and `output_top_logprobs` are `[]` here; some
  SGLang versions report the next position's top-k in `output_top_logprobs` there (not read by
  any client of this project).
- Log-probs are those of the temperature-scaled distribution, log_softmax(logits / T) (T = 0
  counts as 1), for output and input tokens alike; top_p / top_k / min_p never renormalise them
  (stock SGLang; slime's top-p patch is not implemented). That SGLang scales input-token
  log-probs by the temperature too was not confirmed.
- Weight updates wait for the running wave to end unless generation is paused (SGLang's
  tokenizer manager likewise waits for in-flight requests under its model-update lock).
- /health_generate answers 200 at once while paused (SGLang would time out), 503 while memory is
  released; generate while released answers 503 (SGLang has no defined behaviour there).
- Routed experts: the engine returns them whenever its model has routed experts unless started
  with routes off (engine/standalone.py, like `sglang.launch_server`, turns them on only with
  --enable-return-routed-experts; an embedded worker of the actors serves them for any MoE
  model). Without routes (off, or a dense model) a request asking for them is answered without
  the field, as SGLang's no-op capturer does. The flag with a dense model is refused at start
  (SGLang's capturer reads `num_experts_per_tok` from the config at start; read, not run).
  `routed_experts_start_len` (newer SGLang) is accepted at its default 0 only.
- A string rid on a batch request becomes "<rid>_<i>" per item (the exact SGLang format was not
  confirmed); /abort_request with rid "x" also aborts "x_<i>".
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import reprlib
import uuid
from typing import Any

import torch
from aiohttp import web

from engine.errors import BadRequest, EngineUnavailable
from engine.scheduler import (
    DEFAULT_MAX_NEW_TOKENS,
    GenRequest,
    GenResult,
    SamplingParams,
    Scheduler,
)
from engine.weight_endpoints import (
    MAX_BODY_BYTES,
    MAX_TENSOR_BODY_BYTES,
    WeightEndpoints,
    parse_json,
    read_body,
)
from transport.http import start_http

VERSION = "rlx-engine-0.1 (SGLang native API subset)"
HEALTH_TIMEOUT_S = 20.0
INT64 = (-(1 << 63), 1 << 63)  # integer request fields must lie in [lo, hi)
MAX_CHARS_PER_TOKEN = 64  # a text prompt longer than context_len * this is refused untokenized

# Top-level /generate fields: accepted, or accepted only at SGLang's default value.
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "rid", "stream", "lora_path",
                   "return_routed_experts"}
IGNORED_FIELDS = {"log_metrics", "priority", "custom_labels", "no_logs", "routing_key",
                  "conversation_id", "extra_key", "session_id", "external_trace_header",
                  "received_time", "routed_dp_rank", "data_parallel_rank", "background",
                  "model"}  # sglang-router adds model (null) and several defaults below
DEFAULT_ONLY_FIELDS = {"input_embeds": None, "image_data": None, "video_data": None,
                       "audio_data": None, "lora_id": None,
                       "session_params": None, "custom_logit_processor": None,
                       "token_ids_logprob": None, "return_hidden_states": False,
                       "routed_experts_start_len": 0, "return_indexer_topk": False,
                       "modalities": None,
                       "return_entropy": False, "require_reasoning": False,
                       "return_bytes": False}
# sampling_params keys: implemented ones, and ones accepted only at their default value.
SAMPLING_DEFAULT_ONLY = {"n": 1, "min_new_tokens": 0, "frequency_penalty": 0.0,
                         "presence_penalty": 0.0, "repetition_penalty": 1.0, "regex": None,
                         "json_schema": None, "ebnf": None, "structural_tag": None,
                         "custom_params": None, "logit_bias": None, "stop_regex": None}
SAMPLING_IGNORED = {"spaces_between_special_tokens", "stream_interval"}


# ----------------------------------------------------------------------------- pure parsing
def _is_int(x: Any) -> bool:
    """A JSON integer that fits in int64 (bigger ones are refused like wrong types)."""
    return isinstance(x, int) and not isinstance(x, bool) and INT64[0] <= x < INT64[1]


def _is_num(x: Any) -> bool:
    """A finite JSON number (an integer too big for a float is not one)."""
    return _is_int(x) or isinstance(x, float) and math.isfinite(x)


def _token_list(x: Any, vocab_size: int, what: str, context_len: int) -> list[int]:
    if isinstance(x, list) and len(x) >= context_len:  # checked first: cheap for huge lists
        raise BadRequest(f"The input ({len(x)} tokens) is longer than the model's context "
                         f"length ({context_len} tokens).")
    if not isinstance(x, list) or not x or not all(_is_int(t) for t in x):
        raise BadRequest(f"{what} must be a non-empty list of integer token ids")
    bad = [t for t in x if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")
    return x


def parse_prompts(body: dict, tokenizer, vocab_size: int,
                  context_len: int = 1 << 40) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, is_batch) from `text` or `input_ids` (exactly one of them); a
    prompt surely longer than `context_len` is refused before its tokens are checked (a text
    longer than context_len * MAX_CHARS_PER_TOKEN characters: before it is tokenized)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("Either text or input_ids should be provided (exactly one of them).")
    if ids is not None:
        if isinstance(ids, list) and ids and all(isinstance(r, list) for r in ids):
            return [_token_list(r, vocab_size, f"input_ids[{i}]", context_len)
                    for i, r in enumerate(ids)], True
        return [_token_list(ids, vocab_size, "input_ids", context_len)], False
    if isinstance(text, str):
        prompts, batch = [text], False
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts, batch = text, True
    else:
        raise BadRequest("text must be a string or a non-empty list of strings")
    max_chars = context_len * MAX_CHARS_PER_TOKEN
    if max(map(len, prompts)) > max_chars:
        raise BadRequest(f"text of {max(map(len, prompts))} characters is surely longer than "
                         f"the model's context length; send at most {max_chars}")
    encoded = [tokenizer.encode(t) for t in prompts]  # as SGLang: the tokenizer's defaults
    if any(not e for e in encoded):
        raise BadRequest("text must not be empty")
    return encoded, batch


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    """A scalar applies to every item; a list must have one entry per item."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _check_range(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def parse_sampling_params(sp: Any, prompt_len: int, context_len: int) -> SamplingParams:
    """SGLang sampling_params -> SamplingParams, with SGLang's checks (`verify()`)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object (or a list of them)")
    known = set(dataclass_fields(SamplingParams)) | set(SAMPLING_DEFAULT_ONLY) | SAMPLING_IGNORED
    unknown = sorted(set(sp) - known)
    if unknown:
        raise BadRequest(f"unknown sampling_params {unknown}")
    for key, default in SAMPLING_DEFAULT_ONLY.items():
        if key in sp and sp[key] is not None and sp[key] != default:
            raise BadRequest(f"sampling_params.{key}={reprlib.repr(sp[key])} is not supported "
                             f"by this engine (only {default!r})")
    p = _checked_numbers(sp)
    _check_range(prompt_len < context_len, f"The input ({prompt_len} tokens) is longer than the "
                 f"model's context length ({context_len} tokens).")
    p.max_new_tokens = min(p.max_new_tokens, context_len - prompt_len)
    p.stop = _stop_strings(sp.get("stop"))
    p.stop_token_ids = _int_list(sp.get("stop_token_ids"), "stop_token_ids")
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        setattr(p, key, _boolean(sp, key, getattr(p, key)))
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest("sampling_params.sampling_seed must be an integer in [-2**63, 2**63)")
    p.sampling_seed = seed
    return p


def _checked_numbers(sp: dict) -> SamplingParams:
    """The numeric sampling params, with SGLang's range checks and messages."""
    p = SamplingParams()
    p.temperature = _number(sp, "temperature", p.temperature)
    p.top_p = _number(sp, "top_p", p.top_p)
    p.min_p = _number(sp, "min_p", p.min_p)
    p.top_k = _integer(sp, "top_k", p.top_k)
    p.max_new_tokens = _integer(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    _check_range(p.temperature >= 0, f"temperature must be non-negative, got {p.temperature}.")
    _check_range(0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}.")
    _check_range(0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}.")
    _check_range(p.top_k == -1 or p.top_k >= 1,
                 f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
    _check_range(p.max_new_tokens >= 0,
                 f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    return p


def dataclass_fields(cls) -> list[str]:
    return list(cls.__dataclass_fields__)


def _number(sp: dict, key: str, default: float) -> float:
    value = sp.get(key)
    if value is None:
        return default
    if not _is_num(value):
        raise BadRequest(f"sampling_params.{key} must be a number, got {reprlib.repr(value)}")
    return float(value)


def _integer(sp: dict, key: str, default: int) -> int:
    value = sp.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"sampling_params.{key} must be an integer in [-2**63, 2**63), "
                         f"got {str(value)[:40]}")
    return value


def _boolean(sp: dict, key: str, default: bool) -> bool:
    value = sp.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"sampling_params.{key} must be true or false, got "
                         f"{reprlib.repr(value)}")
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise BadRequest("sampling_params.stop must be a string or a list of strings")


def _int_list(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return value
    raise BadRequest(f"sampling_params.{name} must be a list of integers")


def _rids(value: Any, n: int, batch: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(value, str):
        return [value] if not batch else [f"{value}_{i}" for i in range(n)]
    if isinstance(value, list) and len(value) == n and all(isinstance(r, str) for r in value):
        if len(set(value)) != n:
            raise BadRequest(f"Duplicate request IDs detected within the request: "
                             f"{reprlib.repr(value)}")
        return value
    raise BadRequest("rid must be a string or a list of strings, one per prompt")


def _check_fields(body: dict) -> None:
    unknown = sorted(set(body) - GENERATE_FIELDS - IGNORED_FIELDS - set(DEFAULT_ONLY_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown} in the /generate request")
    for key, default in DEFAULT_ONLY_FIELDS.items():
        if body.get(key, default) not in (default, [], {}):
            raise BadRequest(f"{key} is not supported by this engine")
    if body.get("stream", False) not in (False, None):
        raise BadRequest("stream=true is not supported by this engine")
    if not isinstance(body.get("return_text_in_logprobs", False), bool):
        raise BadRequest("return_text_in_logprobs must be true or false")
    if not isinstance(body.get("return_routed_experts", False), (bool, type(None))):
        raise BadRequest("return_routed_experts must be true or false (one value for the whole "
                         "request)")


def parse_generate(body: Any, tokenizer, vocab_size: int,
                   context_len: int) -> tuple[list[GenRequest], bool]:
    """A /generate JSON body -> (engine requests, is_batch); BadRequest if malformed."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_fields(body)
    prompts, batch = parse_prompts(body, tokenizer, vocab_size, context_len)
    n = len(prompts)
    sps = _per_item(body.get("sampling_params"), n, "sampling_params", {})
    want_lp = _per_item(body.get("return_logprob"), n, "return_logprob", False)
    starts = _per_item(body.get("logprob_start_len"), n, "logprob_start_len", -1)
    tops = _per_item(body.get("top_logprobs_num"), n, "top_logprobs_num", 0)
    rids = _rids(body.get("rid"), n, batch)
    loras = _per_item(body.get("lora_path"), n, "lora_path", None)
    if not all(x is None or isinstance(x, str) and x for x in loras):
        raise BadRequest("lora_path must be the name of a loaded LoRA adapter (or null), or a "
                         "list of them, one per prompt")
    routes = bool(body.get("return_routed_experts") or False)
    requests = []
    for i, ids in enumerate(prompts):
        _check_logprob_args(want_lp[i], starts[i], tops[i], len(ids))
        params = parse_sampling_params(sps[i], len(ids), context_len)
        requests.append(GenRequest(
            rid=rids[i], input_ids=ids, params=params, return_logprob=want_lp[i],
            logprob_start_len=logprob_window_start(want_lp[i], starts[i], len(ids),
                                                   params.max_new_tokens),
            top_logprobs_num=tops[i], lora=loras[i], return_routed_experts=routes))
    return requests, batch


def logprob_window_start(want: bool, start: int, prompt_len: int, max_new_tokens: int) -> int:
    """Where SGLang's input log-prob window starts: `start` as asked, and for -1 (the default)
    the last input token (one entry, null) or, for a max_new_tokens = 0 request, past the end
    (no entry); -1 (none) when no log-probs were asked for."""
    if not want:
        return -1
    if start >= 0:
        return start
    return prompt_len if max_new_tokens == 0 else prompt_len - 1


def _check_logprob_args(want: Any, start: Any, top: Any, prompt_len: int) -> None:
    if not isinstance(want, bool):
        raise BadRequest("return_logprob must be true or false")
    if not _is_int(start) or not -1 <= start < prompt_len:
        raise BadRequest(f"logprob_start_len must be -1 or in [0, {prompt_len}) for a prompt of "
                         f"{prompt_len} tokens, got {reprlib.repr(start)}")
    if not _is_int(top) or top < 0:
        raise BadRequest(f"top_logprobs_num must be a non-negative integer, got "
                         f"{reprlib.repr(top)}")


# ----------------------------------------------------------------------------- pure formatting
def _lp(value: float | None) -> float | None:
    """JSON-safe log-prob (SGLang clamps -inf the same way)."""
    if value is None:
        return None
    return -999999999.0 if value == float("-inf") else value


def _triples(pairs: list[tuple[float | None, int]], tokenizer, with_text: bool) -> list[list]:
    texts = [tokenizer.decode([t]) for _, t in pairs] if with_text else [None] * len(pairs)
    return [[_lp(lp), t, text] for (lp, t), text in zip(pairs, texts)]


def _top_triples(tops: list, tokenizer, with_text: bool) -> list:
    return [None if top is None else _triples(top, tokenizer, with_text) for top in tops]


def format_result(result: GenResult, req: GenRequest, tokenizer, with_text: bool) -> dict:
    """One SGLang /generate response object."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "weight_version": result.weight_version,
        "total_retractions": result.retractions,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "e2e_latency": result.e2e_latency,
    }
    if len(result.weight_versions) > 1:
        # not SGLang's, and only when a pause held the request across a weight update:
        # [first output token index, weight version] per version that computed output tokens
        # (`weight_version` is SGLang's: the version when the request finished)
        meta["weight_version_spans"] = [[i, v] for i, v in result.weight_versions]
    if req.return_logprob:
        # the window input_ids[start:]; empty when the request ended before its prefill
        in_ids = result.prompt_ids[req.logprob_start_len:][:len(result.input_logprobs)]
        meta["input_token_logprobs"] = _triples(list(zip(result.input_logprobs, in_ids)),
                                                tokenizer, with_text)
        meta["output_token_logprobs"] = _triples(
            list(zip(result.output_logprobs, result.output_ids)), tokenizer, with_text)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = _top_triples(result.input_top, tokenizer, with_text)
            meta["output_top_logprobs"] = _top_triples(result.output_top, tokenizer, with_text)
    if req.return_routed_experts and result.routed_experts is not None:
        meta["routed_experts"] = routes_base64(result.routed_experts)
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


def routes_base64(routes) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of the int32 ids' bytes (little-endian,
    row-major [seqlen - 1, num_hidden_layers, top_k])."""
    array = routes.to(torch.int32).contiguous().numpy().astype("<i4", copy=False)
    return base64.b64encode(array.tobytes()).decode("ascii")


# ----------------------------------------------------------------------------- HTTP
def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request, required: bool,
                     max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The JSON body, read and parsed within bounds (engine.weight_endpoints.parse_json);
    BadRequest (400, or 413 over a bound) otherwise."""
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        if required:
            raise BadRequest("the request body is empty; send a JSON object")
        return {}
    return parse_json(raw)


class EngineServer:
    """aiohttp handlers over one Scheduler; `app` is the web.Application to run."""

    def __init__(self, scheduler: Scheduler, info: dict[str, Any],
                 max_body_bytes: int = MAX_BODY_BYTES, routes_always: bool = False):
        """`routes_always`: a MoE model's answers carry routed experts whether or not the
        request asked (a router that drops the field keeps them reachable)."""
        if routes_always and scheduler.routing is None:
            raise ValueError("return_routed_experts: the served model has no routed experts to "
                             "return (a dense model, or routers that cannot be hooked)")
        self.routes_always = routes_always
        self.scheduler = scheduler
        self.info = info  # model_path, tokenizer_path, host, port, ... for /server_info
        self.max_body_bytes = max_body_bytes  # 413 above it (weight tensors: their own limit)
        self.app = web.Application(client_max_size=max(max_body_bytes, MAX_TENSOR_BODY_BYTES))
        self.weights = WeightEndpoints(scheduler, max_body_bytes=max_body_bytes)
        self._routes()

    def _routes(self) -> None:
        add = self.app.router.add_route
        for method in ("POST", "PUT"):
            add(method, "/generate", self.generate)
        add("GET", "/health", self.health)
        add("GET", "/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            add("GET", path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            add("GET", path, self.model_info)
        for path in ("/get_weight_version", "/weight_version"):
            add("GET", path, self.weight_version)
        for method in ("GET", "POST"):
            add(method, "/flush_cache", self.flush_cache)
            add(method, "/release_memory_occupation", self.release_memory)
            add(method, "/resume_memory_occupation", self.resume_memory)
        add("POST", "/abort_request", self.abort_request)
        self.weights.add_routes(self.app)
        add("POST", "/pause_generation", self.pause_generation)
        add("POST", "/continue_generation", self.continue_generation)

    # ------------------------------------------------------------------ generate
    async def generate(self, request: web.Request) -> web.Response:
        s = self.scheduler
        try:
            body = await _json_body(request, True, self.max_body_bytes)
            reqs, batch = parse_generate(body, s.tokenizer, s.vocab_size, s.context_len)
        except BadRequest as e:
            return error_response(str(e), e.status)
        if self.routes_always:
            for q in reqs:
                q.return_routed_experts = True
        try:
            results = await s.generate(reqs)
        except BadRequest as e:  # an adapter that is not loaded
            return error_response(str(e), e.status)
        except EngineUnavailable as e:  # memory released, or the engine stopped / failed
            return error_response(str(e), status=503)
        with_text = bool(body.get("return_text_in_logprobs", False))
        out = [format_result(r, q, s.tokenizer, with_text) for r, q in zip(results, reqs)]
        return web.json_response(out if batch else out[0])

    # ------------------------------------------------------------------ health / info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        s = self.scheduler
        if s.released:
            return web.Response(status=503)
        if s.paused:
            return web.Response(status=200)
        probe = GenRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                           params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await s.generate([probe])
        except (EngineUnavailable, TimeoutError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.scheduler
        return web.json_response({
            **self.info,
            "max_running_requests": s.max_batch_size,
            "enable_return_routed_experts": s.routing is not None,
            "context_length": s.context_len,
            "weight_version": s.weight_version,
            "internal_states": [s.stats()],
            "version": VERSION,
        })

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.scheduler.model.config
        return web.json_response({
            "model_path": self.info.get("model_path"),
            "tokenizer_path": self.info.get("tokenizer_path"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        })

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.weight_version})

    # ------------------------------------------------------------------ control
    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.scheduler.flush_cache()
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
        return web.Response(text=text, status=200 if ok else 400)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request, True, self.max_body_bytes)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
            if not isinstance(rid, str) or not isinstance(abort_all, bool):
                raise BadRequest("abort_request takes {\"rid\": str, \"abort_all\": bool}")
        except BadRequest as e:
            return error_response(str(e), e.status)
        self.scheduler.abort(rid=rid, abort_all=abort_all)
        return web.Response(status=200)

    async def release_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.scheduler.release)

    async def resume_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.scheduler.resume)

    async def _memory(self, request: web.Request, action) -> web.Response:
        try:
            body = await _json_body(request, False, self.max_body_bytes)
            tags = body.get("tags") if isinstance(body, dict) else None
            if tags is not None and not (isinstance(tags, list)
                                         and all(isinstance(t, str) for t in tags)):
                raise BadRequest("tags must be a list of strings")
            await action(tags)
        except ValueError as e:  # a BadRequest, or the scheduler's refusal
            return error_response(str(e), getattr(e, "status", 400))
        return web.json_response(None)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request, False, self.max_body_bytes)
            mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
            await self.scheduler.pause(mode)
        except ValueError as e:  # a BadRequest, or the scheduler's refusal
            return error_response(str(e), getattr(e, "status", 400))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self.scheduler.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


class _Http2ProbeFilter(logging.Filter):
    """At start-up something in front of the workers (seen with sglang-router) sends an HTTP/2
    prior-knowledge preface (`PRI * HTTP/2.0`); aiohttp refuses it, HTTP/1.1 requests go on
    working, and aiohttp logs each refusal as an ERROR with a traceback. Those (and only those)
    are logged at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and "PRI/Upgrade" in str(exc):
            logging.getLogger(__name__).debug("refused an HTTP/2 prior-knowledge probe")
            return False
        return True


async def start_server(server: EngineServer, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Bind and start; returns the runner (stop it with transport.http `stop_http`) and the
    bound port."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _Http2ProbeFilter) for f in server_log.filters):
        server_log.addFilter(_Http2ProbeFilter())
    return await start_http(server.app, host, port)
