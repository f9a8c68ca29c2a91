"""The inference engine core: batched decoding with a KV cache, sampling, pause/abort, weight swaps.

Role: owns one causal LM and turns `GenRequest`s into `GenResult`s; engine/server.py puts SGLang's
HTTP API on top. No HTTP here. The request/result types and the per-token math (padding, sampling
filters, draws, log-prob lists) live in engine/sampling.py.

How a request runs:
- `generate()` queues requests; the loop (`run()`) collects the queue for `batch_wait_ms`, takes
  up to `max_batch_size` requests and decodes them TOGETHER as one *wave*: left-padded prefill into
  a `transformers.DynamicCache`, then one decode step per token for the whole batch. Each
  sequence stops on its own (length / eos / stop_token_ids / stop strings / abort); finished rows
  are dropped from the batch and the cache (`batch_select_indices`). Requests that arrive during
  a wave wait for the next wave (they never join a running one), so a wave's shapes only shrink.
- Every forward pass, the sampling and the log-prob math run in one dedicated worker thread
  (`ThreadPoolExecutor(1)`), so the event loop keeps serving HTTP while the model computes.
  Prefill keeps the logits of the last N positions of every row, N the longest input log-prob
  window of the wave (input_ids[logprob_start_len:]; 1 when none asked, since the last
  position's logits are the ones sampled from).

Invariants:
- The log-prob reported for a generated token is `algos.logprobs.logits_to_logprobs(logits, T)`
  at the request's sampling temperature T (T = 0, greedy, counts as 1), i.e. exactly what
  `algos.logprobs.token_logprobs(model, full_sequence, temperature=T)` gives for that position.
  top_p / top_k / min_p change which token is drawn, never the reported log-prob. Input
  log-probs are the same function of the prompt's logits, over SGLang's window (the first
  entry of the window None: engine/sampling.py `input_logprobs`).
- A request with `sampling_seed` draws from its own `torch.Generator` seeded with it, so its
  output does not depend on which other requests share its wave.
- True on-policy mode (`true_on_policy=True`): every forward pass is the project's batch-invariant
  forward (models/invariant: prefill of right-padded rows into its own KV cache indexed by
  position, then one cached decode step per token), and the log-probs (`models.invariant.
  log_softmax` at each row's temperature, on the device, for the whole wave) are bitwise those
  the trainer's forward gives for the same weights and tokens, whatever the wave's size or
  composition; tokens are drawn from exp(those log-probs).
- Control operations (weight update, release/resume) run on the loop task at a safe point:
  between waves, or (weight update only) at a step boundary while generation is paused.

Routed experts (mixture-of-experts models; SGLang's `return_routed_experts`): with routes
enabled (`routed_experts`: None = whenever the model has routed experts and its routers can be
hooked, True = required, False = never, SGLang without --enable-return-routed-experts),
`models.moe.Routing` hooks every router of the model. A forward whose wave holds a request
with `return_routed_experts` records the expert ids of every position it fed: a prefill's rows
are the sequence's whole token list (its left padding dropped) and replace what the sequence
had (a retracted sequence is prefilled again: its routes are those of the new prefill, as
SGLang reads them from the KV slots of the last computation), a decode step appends one row
per sequence. The result carries the first len(tokens) - 1 rows ([seqlen - 1,
num_hidden_layers, top_k] int32, 0 in layers without experts): every position that was a model
input. A request queued and never prefilled (aborted before its wave) has none.

Pause modes (SGLang's `PauseGenerationReqInput.mode`, default "abort"): new requests always wait
until `continue_generation`. "abort": queued and running requests finish at once with
finish_reason abort (partial output kept). "in_place": the running wave stops at the next step
boundary and keeps its KV cache. "retract": it stops and drops its KV cache; on continue the
sequences (prompt + tokens so far) are prefilled again. A weight update while paused is applied
immediately, so a paused wave continues with the new weights (in_place keeps the KV entries
computed with the old ones, as SGLang does).

Memory release (SGLang's `/release_memory_occupation` tags): "weights" (or no tags) parks every
parameter's storage in host memory (memory/device_usage.py `HostOffload`: pinned on CUDA, one
buffer reused by every release; the parameters keep their shapes, their storages hold 0 bytes),
then returns the caching allocator's free blocks and the cuBLAS workspaces to the driver, so
NVML shows the process at its CUDA context plus its buffers (rotary tables: kilobytes).
"kv_cache" and "cuda_graph": the KV cache only lives during a wave and no graph is captured, so
releasing them returns the cached blocks only. Any released tag makes `generate` raise
`EngineUnavailable` until `resume`. Resuming "weights" copies the host copy back in place: the
weights are those of the version the engine reports, whatever path brought them. With
`weights_backup=False` (SGLang's default, no `--enable-weights-cpu-backup`) nothing is copied
out: resumed weights are reloaded from the last checkpoint loaded (the startup model, or the
last weight-update path), or, when the last update came as tensors, come back zeroed until the
trainer pushes (the colocated trainer always pushes after a resume: `weights_backup=False`
saves a device-to-host copy and the host memory of one model per worker).
Release/resume wait until no wave is running.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import DynamicCache

from algos.logprobs import effective_temperature, logits_to_logprobs, position_ids_from_mask
from engine.adapters import AdapterRegistry, base_named_tensors
from engine.errors import BadRequest, EngineUnavailable
from engine.sampling import (
    DEFAULT_MAX_NEW_TOKENS,
    GenRequest,
    GenResult,
    SamplingParams,
    TopList,
    cache_kwarg,
    eos_token_ids,
    input_logprobs,
    left_pad,
    right_pad,
    sample_token,
    top_list,
)
from memory.device_usage import HostOffload, give_back_cached
from memory.safetensors_io import read_safetensors_into, safetensors_shapes
from models.invariant import decoder_for
from models.invariant import log_softmax as invariant_log_softmax
from models.load import load_model
from models.moe import Routing, expert_views, fused_expert_names, moe_shape, routes_array
from models.tiny import TINY

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "GenRequest", "GenResult", "SamplingParams", "Scheduler",
           "cache_kwarg"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclasses.dataclass(eq=False)
class _Seq:
    """A request's mutable state inside the engine."""

    req: GenRequest
    future: asyncio.Future
    generator: torch.Generator
    created: float
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top: list[TopList] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    input_top: list[TopList | None] = dataclasses.field(default_factory=list)
    input_done: bool = False
    retractions: int = 0  # KV cache dropped by a "retract" pause (meta_info.total_retractions)
    # (index of the first output token, weight version) each time the version that computed
    # the output tokens changed: a request held by an in_place / retract pause across a weight
    # update spans two versions
    versions: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    abort_message: str | None = None
    finish: dict[str, Any] | None = None
    adapter: Any = None  # the LoRA adapter it runs with (engine/adapters.py; None: the base)
    # expert ids of every position fed through the model so far, in position order (chunks:
    # a prefill's rows, then one row per decode step); None until a forward recorded any
    routes: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.req.input_ids + self.output_ids


@dataclasses.dataclass(eq=False)
class _Wave:
    """One batch decoded together; `cache` covers every row's tokens except its last one."""

    seqs: list[_Seq]
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None
    keep: list[int] | None = None  # rows to keep before the next forward (finished ones dropped)


@dataclasses.dataclass
class _RowOut:
    """What one forward pass produced for one row (computed in the worker thread)."""

    token: int | None = None
    logprob: float = 0.0
    top: TopList = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopList | None] | None = None
    # expert ids [positions fed, layers, k] (int32, CPU) when the row's request asked for them
    routes: torch.Tensor | None = None
    routes_prefill: bool = False  # from a prefill: they replace the sequence's rows


# ----------------------------------------------------------------------------- step helpers
def finish_reason(seq: _Seq, eos_ids: set[int], text: str) -> dict[str, Any] | None:
    """SGLang's check after a token was appended: length, then stop token, then stop string."""
    p = seq.req.params
    if len(seq.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": p.max_new_tokens}
    last = seq.output_ids[-1]
    if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
        return {"type": "stop", "matched": last}
    for stop in p.stop:
        if stop and stop in text:
            return {"type": "stop", "matched": stop}
    return None


def abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def visible_text(tokenizer, seq: _Seq) -> str:
    """The response text: decoded output with SGLang's trimming of the matched stop."""
    p, finish = seq.req.params, seq.finish or {}
    ids = seq.output_ids
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    if isinstance(matched, int) and not p.no_stop_trim:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if isinstance(matched, str) and not p.no_stop_trim and matched in text:
        text = text[:text.index(matched)]
    return text




# ----------------------------------------------------------------------------- the engine
class Scheduler:
    """Batched generation over one model; every method is called from the event loop's thread."""

    def __init__(self, model, tokenizer, *, source: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, max_batch_size: int = 64,
                 batch_wait_ms: float = 5.0, weight_version: str = "0",
                 executor: ThreadPoolExecutor | None = None, true_on_policy: bool = False,
                 weights_backup: bool = True, routed_experts: bool | None = None):
        self.model, self.tokenizer = model, tokenizer
        # mixture of experts: the expert layout, and the router hooks that record routes
        self.moe = moe_shape(model.config)
        if self.moe is not None and true_on_policy:
            raise ValueError(f"true_on_policy: {getattr(model.config, 'model_type', '?')} is a "
                             f"mixture-of-experts model; the batch-invariant forward "
                             f"(models/invariant) has no routed-experts path, so it cannot "
                             f"serve it: set true_on_policy = false for a MoE policy")
        if routed_experts and self.moe is None:
            raise ValueError(f"--enable-return-routed-experts: {source} is not a "
                             f"mixture-of-experts model (its config names no routed experts "
                             f"and num_experts_per_tok), so there are no routes to return")
        self.routing: Routing | None = None
        if self.moe is not None and routed_experts is not False:
            try:
                self.routing = Routing(model, self.moe)
            except ValueError as e:  # routers this transformers version does not expose
                if routed_experts:
                    raise ValueError(f"--enable-return-routed-experts: {e}") from e
                log.warning("%s: routed experts cannot be recorded, so none are returned: %s",
                            source, e)
        self.source: str | None = source  # checkpoint the weights equal (None: pushed tensors)
        self.device, self.dtype, self.seed = device, dtype, seed
        self.max_batch_size = max(1, max_batch_size)
        self.batch_wait_s = max(0.0, batch_wait_ms) / 1000.0
        self.weight_version = weight_version
        self.context_len = int(getattr(model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(model.config.vocab_size)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._cache_kw = cache_kwarg(model)  # looked up once, not per decode step
        # true on-policy: the batch-invariant forward (ValueError for an uncovered architecture)
        self.true_on_policy = true_on_policy
        self._invariant = decoder_for(model) if true_on_policy else None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.paused: str | None = None  # pause mode while paused
        self.released: set[str] = set()
        self.on_memory_change = None  # called (in the loop) after every release / resume
        self.wave_sizes: list[int] = []  # batch size of every wave started, in order
        self.decode_steps = 0  # forward passes over all waves
        self.step_hooks: list[Callable[[int], Awaitable[None] | None]] = []  # after each step
        self._pool = executor or ThreadPoolExecutor(1, thread_name_prefix="engine-forward")
        self._queue: collections.deque[_Seq] = collections.deque()
        self._ops: collections.deque[tuple[Callable[[], Awaitable[Any]], bool, asyncio.Future]] = (
            collections.deque())
        self._active: list[_Seq] = []
        self._wake = asyncio.Event()
        self._quiet = asyncio.Event()  # set while no forward pass is running
        self._quiet.set()
        self._seed_rng = random.Random(seed)
        # released weights: a host copy in memory pinned once (weights_backup), or nothing
        self._parked = HostOffload(backup=weights_backup,
                                   pin=str(device).startswith("cuda") and weights_backup)
        self._closed = False
        # LoRA adapters by name (engine/adapters.py); the invariant forward has no adapter path
        self.adapters = AdapterRegistry(model, refuse="this worker runs true_on_policy: its "
                                        "batch-invariant forward has no LoRA path"
                                        if true_on_policy else "")

    @classmethod
    async def create(cls, source: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     seed: int = 0, **kw) -> Scheduler:
        """Load `source` (tiny name or HF dir) in the engine's own thread, then build the engine."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="engine-forward")
        try:
            loop = asyncio.get_running_loop()
            model, tokenizer = await loop.run_in_executor(pool, load_model, source, device,
                                                          dtype, seed)
            return cls(model, tokenizer, source=source, device=device, dtype=dtype, seed=seed,
                       executor=pool, **kw)
        except BaseException:  # a model the options refuse (true_on_policy, routed experts)
            pool.shutdown(wait=True)
            raise

    # ------------------------------------------------------------------ public API
    async def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Queue the requests, wait for all of them; cancelling aborts those still running."""
        if self._closed:
            raise EngineUnavailable("the engine is stopped")
        if self.released:
            raise EngineUnavailable(f"memory is released ({', '.join(sorted(self.released))}); "
                                    f"call /resume_memory_occupation before generating")
        adapters = [self.adapters.get(r.lora) for r in requests]  # BadRequest: not loaded
        seqs = [self._new_seq(r) for r in requests]
        for s, adapter in zip(seqs, adapters):
            s.adapter = adapter
        self._queue.extend(seqs)
        self._wake.set()
        try:
            return list(await asyncio.gather(*(s.future for s in seqs)))
        except asyncio.CancelledError:
            for s in seqs:
                self._abort_seq(s, "client disconnected")
            raise

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Abort by user") -> int:
        """Abort queued/running requests whose rid is `rid` (or starts with `rid_`); or all."""
        targets = [s for s in list(self._queue) + self._active
                   if abort_all or (rid and (s.req.rid == rid or s.req.rid.startswith(rid + "_")))]
        for s in targets:
            self._abort_seq(s, message)
        return len(targets)

    async def pause(self, mode: str = "abort") -> None:
        """Stop decoding until `continue_generation` (modes: see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        self.paused = mode
        if mode == "abort":
            self.abort(abort_all=True, message="Abort by pause_generation")
        self._wake.set()
        while True:
            await self._quiet.wait()
            if mode != "abort" or not self._active:
                return
            await asyncio.sleep(0.001)

    async def continue_generation(self) -> None:
        self.paused = None
        self._wake.set()

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> tuple[bool, str, int]:
        """Load `path` into the running model in place; (success, message, num_paused_requests)."""
        return await self.update_weights(lambda: self._load_into_model(path), path,
                                         weight_version, abort_all_requests, "disk")

    async def update_weights(self, load: Callable[[], Any], source: str | None,
                             weight_version: str | None = None, abort_all_requests: bool = False,
                             what: str = "tensors") -> tuple[bool, str, int]:
        """Run `load()` (it changes the model's weights) in the engine thread at a safe point;
        `source` is the checkpoint the weights now equal (None: none on disk, e.g. tensors
        received over a process group). (success, message, num_paused_requests)."""
        if abort_all_requests:
            self.abort(abort_all=True, message=f"Abort by update_weights_from_{what}")

        async def op():
            held = len(self._active)
            if "weights" in self.released:
                return False, "weights are released; call /resume_memory_occupation first", held
            try:
                await self._in_thread(load)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
                where = source or "memory"
                return False, f"Failed to update weights from {what} ({where}): {e}", held
            self.source = source
            message = "Succeeded to update model weights."
            if weight_version is not None:
                self.weight_version = weight_version
                message += f" Weight version updated to {weight_version}."
            return True, message, held

        return await self._submit_op(op, needs_idle=False)

    async def load_adapter(self, name: str, path: str, config: dict, tensors: dict,
                           pinned: bool = False) -> None:
        """Hold a LoRA adapter under `name` (engine/adapters.py), at a safe point like a weight
        update; BadRequest when it does not fit."""
        if "weights" in self.released:
            raise BadRequest("weights are released; call /resume_memory_occupation first")

        async def op():
            return await self._in_thread(self.adapters.load, name, path, config, tensors, pinned)

        await self._submit_op(op, needs_idle=False)

    async def release(self, tags: list[str] | None = None) -> None:
        tags = self._check_tags(tags)

        async def op():
            weights = "weights" in tags and "weights" not in self.released
            before = set(self.released)
            # said before the memory goes: a reading taken meanwhile is "released", never
            # "held" with the weights half gone
            self.released.update(tags)
            try:
                await self._in_thread(self._free_memory, weights)
            except BaseException:
                self.released = before
                raise
            self._memory_changed()

        await self._submit_op(op, needs_idle=True)

    async def resume(self, tags: list[str] | None = None) -> None:
        tags = self._check_tags(tags)

        async def op():
            if "weights" in tags and "weights" in self.released:
                await self._in_thread(self._restore_weights)
                self.adapters.forget_installed()  # the layers' adapter tensors came back too
            self.released.difference_update(tags)
            self._memory_changed()

        await self._submit_op(op, needs_idle=True)

    def _memory_changed(self) -> None:
        if self.on_memory_change is not None:
            self.on_memory_change()

    def flush_cache(self) -> bool:
        """True when idle (there is no prefix cache to flush); False while requests are queued or
        running, where SGLang refuses to flush too."""
        return not self._queue and not self._active

    def stats(self) -> dict[str, Any]:
        return {"waves": len(self.wave_sizes), "max_wave_size": max(self.wave_sizes, default=0),
                "decode_steps": self.decode_steps, "queued": len(self._queue),
                "running": len(self._active), "paused": self.paused,
                "released": sorted(self.released), "weight_version": self.weight_version}

    async def close(self) -> None:
        """Fail what is left and stop the worker thread (run() must be cancelled first)."""
        self._closed = True
        self._fail_all(EngineUnavailable("the engine stopped"))
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """The scheduling loop; runs until cancelled."""
        try:
            while True:
                await self._run_ops(idle=True)
                if self.paused or not self._queue:
                    await self._wait()
                    continue
                if len(self._queue) < self.max_batch_size and self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)
                    await self._run_ops(idle=True)
                if self.paused:
                    continue
                seqs = self._take_batch()
                if seqs:
                    if self.adapters.shape is not None:  # LoRA layers: this wave's adapter
                        await self._in_thread(self.adapters.use, seqs[0].adapter)
                    await self._run_wave(_Wave(seqs))
        finally:
            self._fail_all(EngineUnavailable("the engine stopped"))

    async def _wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def _take_batch(self) -> list[_Seq]:
        if self.released:
            error = EngineUnavailable("memory was released before this request started")
            while self._queue:
                s = self._queue.popleft()
                if not s.future.done():
                    s.future.set_exception(error)
            return []
        batch: list[_Seq] = []
        others: list[_Seq] = []  # another adapter's requests wait for a later wave, in order
        while self._queue and len(batch) < self.max_batch_size:
            s = self._queue.popleft()
            if s.future.done():
                continue
            if batch and s.adapter is not batch[0].adapter:
                others.append(s)
            else:
                batch.append(s)
        self._queue.extendleft(reversed(others))
        return batch

    async def _run_wave(self, wave: _Wave) -> None:
        self.wave_sizes.append(len(wave.seqs))
        self._active = wave.seqs
        try:
            while True:
                await self._boundary(wave)
                if not wave.seqs:
                    return
                outs = await self._in_thread(self._forward, wave)
                self.decode_steps += 1
                self._apply(wave, outs)
                for hook in list(self.step_hooks):
                    result = hook(self.decode_steps)
                    if asyncio.iscoroutine(result):
                        await result
        except BaseException as e:  # stopped or broken mid-wave: its requests must not hang
            error = e if isinstance(e, Exception) else EngineUnavailable("the engine stopped")
            for s in wave.seqs:
                if not s.future.done():
                    s.future.set_exception(EngineUnavailable(f"generation failed: {error!r}")
                                           if error is e else error)
            raise
        finally:
            self._active = []

    async def _boundary(self, wave: _Wave) -> None:
        """Between two steps: finish aborted rows; while paused, hold here (running ops)."""
        self._drop_aborted(wave)
        while self.paused and wave.seqs:
            if self.paused == "retract":
                if wave.cache is not None:  # counted once per drop, as SGLang counts retracts
                    for s in wave.seqs:
                        s.retractions += 1
                wave.cache, wave.mask, wave.keep = None, None, None
            await self._run_ops(idle=False)
            if not self.paused:
                break
            await self._wait()
            self._drop_aborted(wave)

    def _drop_aborted(self, wave: _Wave) -> None:
        for s in wave.seqs:
            if s.abort_message is not None and s.finish is None:
                s.finish = abort_reason(s.abort_message)
                self._complete(s)
        self._compact(wave)

    def _apply(self, wave: _Wave, outs: list[_RowOut]) -> None:
        """Record one step's tokens and log-probs, check stops, finish rows that are done."""
        for s, out in zip(wave.seqs, outs):
            if out.input_logprobs is not None:
                s.input_logprobs, s.input_top = out.input_logprobs, out.input_top
                s.input_done = True
            if out.routes is not None:
                if out.routes_prefill or s.routes is None:
                    s.routes = [out.routes]
                else:
                    s.routes.append(out.routes)
            if out.token is None:  # max_new_tokens == 0: only the prefill was wanted
                s.finish = {"type": "length", "length": 0}
            else:
                s.output_ids.append(out.token)
                if not s.versions or s.versions[-1][1] != self.weight_version:
                    s.versions.append((len(s.output_ids) - 1, self.weight_version))
                s.output_logprobs.append(out.logprob)
                s.output_top.append(out.top)
                text = (self.tokenizer.decode(s.output_ids, skip_special_tokens=s.req.params
                                              .skip_special_tokens) if s.req.params.stop else "")
                s.finish = finish_reason(s, self.eos_ids, text)
            if s.finish is not None:
                self._complete(s)
        self._compact(wave)

    def _compact(self, wave: _Wave) -> None:
        keep = [i for i, s in enumerate(wave.seqs) if s.finish is None]
        if len(keep) == len(wave.seqs):
            return
        wave.keep = [wave.keep[i] for i in keep] if wave.keep is not None else keep
        wave.seqs = [wave.seqs[i] for i in keep]
        self._active = wave.seqs

    # ------------------------------------------------------------------ worker-thread work
    async def _in_thread(self, fn, *args):
        self._quiet.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._quiet.set()

    def _forward(self, wave: _Wave) -> list[_RowOut]:
        """One forward pass of the wave (prefill when it has no cache), then sampling per row."""
        if self._invariant is not None:
            return self._forward_invariant(wave)
        with torch.no_grad():
            prefill = wave.cache is None
            if prefill:
                ids, mask = left_pad([s.tokens for s in wave.seqs], self.pad_id)
                wave.cache = DynamicCache(config=self.model.config)
                position_ids = position_ids_from_mask(mask)
            else:
                if wave.keep is not None:
                    index = torch.tensor(wave.keep, dtype=torch.long)
                    wave.cache.batch_select_indices(index.to(self.device))
                    wave.mask = wave.mask[index]
                ids = torch.tensor([[s.tokens[-1]] for s in wave.seqs], dtype=torch.long)
                mask = torch.cat([wave.mask, torch.ones((len(wave.seqs), 1), dtype=torch.long)], 1)
                position_ids = mask.sum(-1, keepdim=True) - 1
            wave.keep, wave.mask = None, mask
            # rows are left-padded, so the last `keep` positions of every row are its last
            # `keep` tokens (a window never reaches into the padding: it lies within its row)
            keep = max([self._window_len(s) for s in wave.seqs if prefill] + [1])
            record = self.routing is not None and any(map(self._wants_routes, wave.seqs))
            if record:
                self.routing.recorded, self.routing.record = {}, True
            try:
                out = self.model(input_ids=ids.to(self.device),
                                 attention_mask=mask.to(self.device),
                                 position_ids=position_ids.to(self.device),
                                 **{self._cache_kw: wave.cache},
                                 use_cache=True, logits_to_keep=keep)
            finally:
                if record:
                    self.routing.record = False
            logits = out.logits.float().cpu()
            rows = [self._row(s, logits[b], prefill) for b, s in enumerate(wave.seqs)]
            if record:
                self._attach_routes(wave.seqs, rows, tuple(ids.shape), prefill)
            return rows

    def _attach_routes(self, seqs: list[_Seq], rows: list[_RowOut], shape: tuple[int, int],
                       prefill: bool) -> None:
        """The routes of the forward just run ([B, W] tokens, left-padded) onto the rows whose
        request asked for them: a prefill's real positions (the last len(tokens) of the row),
        or a decode step's one position."""
        b, w = shape
        routes = routes_array(self.routing.recorded, self.moe).view(
            b, w, self.moe.num_layers, self.moe.top_k).cpu()
        self.routing.recorded = {}
        steps = None if prefill else routes.unbind(0)  # [1, layers, k] views of this step's
        for i, (s, out) in enumerate(zip(seqs, rows)):
            if self._wants_routes(s):
                out.routes_prefill = prefill
                out.routes = routes[i, w - len(s.tokens):].clone() if prefill else steps[i]

    def _forward_invariant(self, wave: _Wave) -> list[_RowOut]:
        """`_forward` in true on-policy mode: the invariant prefill (rows from position 0) or
        one cached decode step, then the wave's log-probs at each row's temperature."""
        with torch.no_grad():
            dev = self.device
            if wave.cache is None:
                prefill = True
                ids, lengths = right_pad([s.tokens for s in wave.seqs], self.pad_id)
                keep = max([self._window_len(s) for s in wave.seqs] + [1])
                logits, wave.cache = self._invariant.prefill(ids.to(dev), lengths.to(dev), keep)
            else:
                prefill = False
                if wave.keep is not None:
                    wave.cache.select(torch.tensor(wave.keep, dtype=torch.long, device=dev))
                ids = torch.tensor([s.tokens[-1] for s in wave.seqs], dtype=torch.long)
                positions = torch.tensor([len(s.tokens) - 1 for s in wave.seqs], dtype=torch.long)
                logits = self._invariant.decode(ids.to(dev), positions.to(dev), wave.cache)[:, None]
            wave.keep, wave.mask = None, None
            rows, width = logits.shape[:2]
            temps = torch.tensor([effective_temperature(s.req.params.temperature)
                                  for s in wave.seqs], dtype=torch.float32)
            logprobs = invariant_log_softmax(logits.reshape(rows * width, -1),
                                             temps.repeat_interleave(width).to(dev))
            logprobs = logprobs.view(rows, width, -1).cpu()
            logits = logits.cpu()
            return [self._row(s, logits[b], prefill, logprobs[b])
                    for b, s in enumerate(wave.seqs)]

    def _row(self, s: _Seq, logits: torch.Tensor, prefill: bool,
             logprobs: torch.Tensor | None = None) -> _RowOut:
        """Sample row `s` from its last-position logits; input log-probs on its first prefill
        (`logits` [K, V] are those of the row's last K positions; `logprobs` [K, V], when given,
        the same positions' log-probs at the row's temperature: true on-policy mode)."""
        req, out = s.req, _RowOut()
        temperature = effective_temperature(req.params.temperature)
        if prefill and self._wants_input_logprobs(s):
            window = req.input_ids[req.logprob_start_len:]
            first = logits.shape[0] - len(window)
            out.input_logprobs, out.input_top = input_logprobs(
                logits[first:], window, temperature, req.top_logprobs_num,
                logprobs[first:] if logprobs is not None else None)
        if req.params.max_new_tokens == 0:
            return out
        last = logits[-1]
        if logprobs is not None:
            logprobs = logprobs[-1]
            out.token = sample_token(last, req.params, s.generator, logprobs)
        else:
            out.token = sample_token(last, req.params, s.generator)
            logprobs = logits_to_logprobs(last, temperature)
        out.logprob = float(logprobs[out.token])
        out.top = top_list(logprobs, req.top_logprobs_num)
        return out

    @staticmethod
    def _wants_routes(s: _Seq) -> bool:
        return s.req.return_routed_experts

    @staticmethod
    def _wants_input_logprobs(s: _Seq) -> bool:
        return not s.input_done and s.req.return_logprob and s.req.logprob_start_len >= 0

    @classmethod
    def _window_len(cls, s: _Seq) -> int:
        """Positions whose logits the input log-probs need (the window input_ids[start:])."""
        if not cls._wants_input_logprobs(s):
            return 0
        return len(s.req.input_ids) - s.req.logprob_start_len

    def _load_into_model(self, source: str) -> None:
        """Load the weights of `source` into the live model in place: a checkpoint's safetensors
        are read tensor by tensor straight into the parameters' own storage (no second model,
        no state dict of the whole checkpoint, no tokenizer); a built-in tiny model name is
        built from its seed and copied in. Every name and shape is checked against the headers
        before anything changes. A tied weight (lm_head sharing the embeddings) may be absent,
        as `save_pretrained` omits it."""
        state = base_named_tensors(self.model)  # a LoRA layer's base weight by its HF name
        if source in TINY:
            new = load_model(source, self.device, self.dtype, self.seed)[0].state_dict()
            shapes = {n: tuple(t.shape) for n, t in new.items()}
        else:
            new = None
            shapes = {n: shape for n, _, shape in safetensors_shapes(source)}
        views = expert_views(state)  # fused MoE experts, as checkpoints name them: per expert
        if views and any(n in shapes for n in views):
            fused = fused_expert_names(state)
            state = {n: t for n, t in state.items() if n not in fused} | views
        present = {state[n].data_ptr() for n in shapes if n in state}
        missing = [n for n, t in state.items() if n not in shapes and t.data_ptr() not in present]
        unexpected = sorted(set(shapes) - set(state))
        if missing or unexpected:
            raise ValueError(f"checkpoint {source} does not match the model: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        for name, shape in shapes.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"shape of {name}: model {tuple(state[name].shape)}, checkpoint "
                                 f"{shape}")
        if new is None:
            read_safetensors_into(source, state)
            return
        with torch.no_grad():
            for name, tensor in new.items():
                state[name].copy_(tensor)

    def _free_memory(self, weights: bool) -> None:
        """Park the weights (when `weights`), then give the allocator's free blocks back (the
        last waves' KV caches are among them), else NVML keeps showing them."""
        if weights:
            self._parked.offload(self.model.parameters())
        give_back_cached(self.device)

    def _restore_weights(self) -> None:
        self._parked.restore()
        if not self._parked.backup and self.source is not None:
            self._load_into_model(self.source)  # else zeros: the trainer pushes weights next

    # ------------------------------------------------------------------ bookkeeping
    def _new_seq(self, req: GenRequest) -> _Seq:
        seed = req.params.sampling_seed
        if seed is None:
            seed = self._seed_rng.getrandbits(63)
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        future = asyncio.get_running_loop().create_future()
        return _Seq(req=req, future=future, generator=generator, created=time.monotonic())

    def _abort_seq(self, s: _Seq, message: str) -> None:
        if s.finish is not None:
            return
        if s in self._queue:
            self._queue.remove(s)
            s.finish = abort_reason(message)
            self._complete(s)
        else:
            s.abort_message = message
            self._wake.set()

    def _complete(self, s: _Seq) -> None:
        if s.future.done():
            return
        routes = None
        if s.routes and self._wants_routes(s):  # every position that was a model input
            routes = torch.cat(s.routes)[:len(s.tokens) - 1]
        s.routes = None  # the decode steps' views go with the rows still running
        s.future.set_result(GenResult(
            rid=s.req.rid, prompt_ids=s.req.input_ids, output_ids=list(s.output_ids),
            text=visible_text(self.tokenizer, s), finish_reason=s.finish,
            weight_version=self.weight_version, e2e_latency=time.monotonic() - s.created,
            output_logprobs=s.output_logprobs, output_top=s.output_top,
            input_logprobs=s.input_logprobs, input_top=s.input_top, retractions=s.retractions,
            weight_versions=list(s.versions), routed_experts=routes))

    def _fail_all(self, error: Exception) -> None:
        for s in list(self._queue) + list(self._active):
            if not s.future.done():
                s.future.set_exception(error)
        self._queue.clear()
        for _, _, fut in self._ops:
            if not fut.done():
                fut.set_exception(error)
        self._ops.clear()

    async def _submit_op(self, fn: Callable[[], Awaitable[Any]], needs_idle: bool) -> Any:
        if self._closed:
            raise EngineUnavailable("the engine is stopped")
        fut = asyncio.get_running_loop().create_future()
        self._ops.append((fn, needs_idle, fut))
        self._wake.set()
        return await fut

    async def _run_ops(self, idle: bool) -> None:
        deferred: collections.deque = collections.deque()
        while self._ops:
            fn, needs_idle, fut = self._ops.popleft()
            if fut.done():
                continue
            if needs_idle and not idle:
                deferred.append((fn, needs_idle, fut))
                continue
            try:
                result = await fn()
            except Exception as e:  # noqa: BLE001 - the caller gets it
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(result)
        self._ops.extend(deferred)

    @staticmethod
    def _check_tags(tags: list[str] | None) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; expected some of {list(MEMORY_TAGS)}")
        return tags
