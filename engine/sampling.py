"""Requests, results and the engine's pure per-token math (no state, no I/O).

Role: the types engine/scheduler.py queues and returns, and the functions it applies per step:
left padding, the top-k/top-p/min-p filter, the inverse-CDF draw, top-k log-prob lists, the
top-p nucleus of a token from its top log-probs, and prompt log-probs. Invariant: every
function here is deterministic given its inputs (draws take an explicit `torch.Generator`), so
it is tested without a model or an event loop.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from algos.logprobs import logits_to_logprobs
from engine.nucleus import nucleus  # noqa: F401 - also read from here

DEFAULT_MAX_NEW_TOKENS = 128


# ----------------------------------------------------------------------------- request / result
@dataclasses.dataclass
class SamplingParams:
    """The subset of SGLang's sampling params this engine implements (validated by the server)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


@dataclasses.dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    return_logprob: bool = False
    # -1: no input log-probs; k >= 0: the window input_ids[k:] (k == len(input_ids): empty).
    # The server resolves SGLang's -1 default before the request gets here (engine/server.py).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora: str | None = None  # the loaded LoRA adapter it runs with (None: the base model)
    # SGLang's return_routed_experts: the result carries the experts each position was routed to
    # (a mixture-of-experts model with routes enabled, engine/scheduler.py)
    return_routed_experts: bool = False


TopList = list[tuple[float, int]]


@dataclasses.dataclass
class GenResult:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    e2e_latency: float
    output_logprobs: list[float]  # one per output token
    output_top: list[TopList]  # one per output token (empty lists unless top_logprobs_num > 0)
    # one per token of the window input_ids[logprob_start_len:] (empty when not computed, e.g.
    # aborted before its prefill); entry 0 is None (see input_logprobs below)
    input_logprobs: list[float | None]
    input_top: list[TopList | None]
    retractions: int = 0  # times its KV cache was dropped (pause mode "retract")
    # (first output token index, weight version) per version that computed output tokens, in
    # order: more than one when a pause held the request across a weight update
    weight_versions: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # the routed experts of every position that was a model input: [seqlen - 1,
    # num_hidden_layers, top_k] int32 (None: not asked, routes disabled, or never prefilled)
    routed_experts: torch.Tensor | None = None




# ----------------------------------------------------------------------------- pure helpers
def right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> (ids [B, L] padded on the right, lengths [B]): every sequence from
    position 0 (the true on-policy forward's layout)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> (ids [B, L], mask [B, L]) padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out what top-k, then top-p, then min-p exclude (1-D probs); renormalised."""
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (sorted_p.cumsum(0) - sorted_p) < top_p
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_p[keep]
    return filtered / filtered.sum()


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF sample of one index from 1-D probs."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(idx, probs.numel() - 1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 logprobs: torch.Tensor | None = None) -> int:
    """Greedy when temperature is 0 or top_k is 1; else a draw from the filtered distribution
    (`exp(logprobs)` when the log-probs at the sampling temperature are given: the true
    on-policy mode draws from exactly the distribution whose log-probs it reports)."""
    if params.temperature <= 0 or params.top_k == 1:
        return int(logits.argmax())
    if logprobs is not None:
        probs = logprobs.exp()
    else:
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    return draw(filter_probs(probs, params.top_k, params.top_p, params.min_p), generator)


def top_list(logprobs: torch.Tensor, k: int) -> TopList:
    """The k most likely (logprob, token_id) pairs of a 1-D log-prob vector."""
    if k <= 0:
        return []
    vals, ids = logprobs.topk(min(k, logprobs.numel()))
    return list(zip(vals.tolist(), ids.tolist()))


def input_logprobs(logits: torch.Tensor, window: list[int], temperature: float,
                   top_k: int, logprobs: torch.Tensor | None = None
                   ) -> tuple[list[float | None], list[TopList | None]]:
    """SGLang's input log-probs over a window of the sequence, `window = input_ids[start:]`.

    `logits[i]` are the logits at the position of `window[i]` (at least len(window) - 1 rows).
    Entry 0 is None whatever its context: SGLang reports no log-prob for the first token of the
    returned window (so a caller wanting log p(x_s | x_<s) asks from s - 1); entry i >= 1 is
    log p(window[i] | everything before it), from logits[i - 1]. Top lists alike (None first).
    `logprobs`, when given, are those rows already at `temperature` (true on-policy mode).
    """
    if not window:
        return [], []
    values: list[float | None] = [None]
    tops: list[TopList | None] = [None]
    if len(window) > 1:
        logprobs = (logits_to_logprobs(logits[:len(window) - 1], temperature) if logprobs is None
                    else logprobs[:len(window) - 1])
        targets = torch.tensor(window[1:], dtype=torch.long)
        values += logprobs.gather(-1, targets[:, None])[:, 0].tolist()
        tops += [top_list(row, top_k) for row in logprobs]
    return values, tops


def cache_kwarg(model) -> str:
    """The forward() keyword of the KV cache: `cache` in newer transformers 5.x releases,
    `past_key_values` before. A wrong name is swallowed by **kwargs and silently disables the
    cache, so it is looked up rather than assumed."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"




def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that means end-of-sequence for this model (config, generation config, tokenizer)."""
    ids: set[int] = set()
    sources = [getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id]
    gen_config = getattr(model, "generation_config", None)
    sources.append(getattr(gen_config, "eos_token_id", None))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
