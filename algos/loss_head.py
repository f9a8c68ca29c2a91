"""Loss heads from the final hidden states: log-probs, entropies and OPD set KLs without logits.

Role: `algos/logprobs.py` and `algos/opd.py` define every formula on logits [B, T, V]; a
model's output layer makes them as z = h W^T from its final hidden states h [N, H] and its weight
W [V, H], and at V = 151,936 those logits, their float32 copies and their gradient are most of a
step's memory. The functions here take h and W instead, walk the tokens in chunks of
`chunk_tokens` (default: `HEAD_CHUNK_BYTES` of float32 logits, `chunk_tokens_for`), build one
chunk's logits at a time, forward and again in the backward, and keep only per-token values for
the backward: memory is O(chunk_tokens x V) plus the outputs, never O(N x V).

Formulas (those of algos/logprobs.py and algos/opd.py on z = h W^T; T the temperature, 0 (greedy)
counting as 1, `effective_temperature`; arithmetic in float32, float64 when h is float64 (where
algos/logprobs.py stays float32); the product h W^T in the inputs' dtype, as the output layer
makes it):
- log-prob and entropy: `lse = logsumexp(z / T)`, `log p(y) = z_y / T - lse`,
  `H = -sum_v p_v log p_v`. With g and g_H the upstream gradients of log p(y) and of H,
      `dL/dz_v = (g * (1[v = y] - p_v) - g_H * p_v * (log p_v + H)) / T`,
  then dL/dh = dL/dz W and dL/dW = dL/dz^T h, summed over the chunks in float32 and cast to the
  inputs' dtype at the end (the products in the inputs' dtype, as autograd through h W^T does).
- set reverse KL (`SET_MODES`): over a token set S_t, both sides renormalised over it,
      `KL_t = sum_{v in S_t} p_S(v) (log p_S(v) - log q_S(v))`,
      `dKL_t / dz_v = p_S(v) (log p_S(v) - log q_S(v) - KL_t) / T` (v in S_t, 0 outside),
  p the student (gradient to h and W), q the teacher (detached, never receives gradient):
  * `full`: the whole vocabulary; the teacher as its hidden states h' [N, H'] and output weight
    W' [V, H'] (its logits h' W'^T, chunk by chunk too);
  * `top_p` with `ids` [N, m]: the nucleus the rollout recorded, `valid` [N, m] marking the
    padding of ragged sets (`ids_reverse_kl`);
  * `top_p` without ids: the nucleus rebuilt from the student's detached logits, chunk by
    chunk: probabilities at T sorted descending, the first n for the smallest n with
    p_(1) + ... + p_(n) >= top_p, every token tied with p_(n) kept (`top_p_reverse_kl`);
    top_p = 1 is `full`;
  * `top_k`: `ids` [N, k] given (the student's k most likely, `head_top_k_ids`, or a teacher
    server's top-k); the teacher either as its log-probs at the ids [N, k] (-inf: padding),
    computed at `teacher_temperature` T' and rescaled exactly, `log_softmax(lp' T' / T)` over S
    (`top_k_reverse_kl`), or as its hidden states and weight read at the ids.
  Sets given as ids never build a row of the vocabulary: the logits at the ids are h . W[ids]
  (the weight's rows gathered, [chunk, k, H]; the teacher's h' . W'[ids] the same way).
  `head_weighted_set_kl` takes per-token weights w and returns sum_t w_t KL_t with its gradient
  computed in the same pass (each side's logits made once, and the teacher not kept until the
  backward).

Vocabulary parallel (`group`, a torch.distributed process group of tp ranks; None = one rank):
rank r holds rows [r Vs, (r + 1) Vs) of W (and of W'), equal shards; h, targets, ids and the
upstream gradients are the same on every rank (ids are global), and so are the results.
log-sum-exp: all-reduce MAX of the row max, then all-reduce SUM of sum exp(z - max), in the same
tensor as the target logit (from its owning rank, 0 elsewhere) and sum exp(z - max)(z - max)
(the entropy, `H = log s - sum e (z - max) / s`); the set KL the same for both sides, then a SUM
of the partial KL; logits at ids: each rank those it owns, SUM; the nucleus: each rank's
candidates (the tokens with less than top_p of its shard's mass above them: a superset of its
part of the nucleus) all-gathered and the threshold found over them; the student's top-k: each
rank's top-k all-gathered. The whole vocabulary is never gathered. The backward has one
collective: an all-reduce SUM of dL/dh (each rank holds the part from its vocabulary rows), so
the gradient of h returned is the whole one on every rank: do not pass h through a
copy-to-tensor-parallel region (Megatron's), which would sum it again; dL/dW is the rank's own
shard's, without collective.

Memory: per chunk, a few [chunk, Vs] float32 temporaries (each side's logits, probabilities,
the gradient; the rebuilt nucleus's sort adds its values and int64 indices); kept for the
backward: the inputs (by reference) and per-token values ([N]; [N, k] for sets given as ids);
in the backward, float32 accumulators of dL/dW [Vs, H] and dL/dh [N, H]. `head_set_kl`'s full
and rebuilt-nucleus sets keep the teacher's hidden states until the backward (they are read
again there); `head_weighted_set_kl` keeps the two gradients instead.
Speed: `head_logprobs`'s passes over a chunk's logits (the log-sum-exp and entropy sums, and
dL/dz) are plain torch functions that run through torch.compile on CUDA (`compiled_kernels`,
the trainer's `micro_batches.head_compile`): one fused read of the chunk's logits in the GEMM's
dtype per pass, no float32 copy of them.
Invariant: no function changes its inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from algos.logprobs import effective_temperature

SET_MODES = ("full", "top_p", "top_k")
# bytes of float32 logits per chunk by default: 441 tokens at V = 151,936 (a step's temporaries
# are a few of these, and each side's logits in the input dtype)
HEAD_CHUNK_BYTES = 256 << 20
_SUM, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


# the chunk's bytes in effect where a caller set them (`chunk_bytes`; None: HEAD_CHUNK_BYTES)
_CHUNK_BYTES: contextvars.ContextVar[int | None] = contextvars.ContextVar("head_chunk_bytes",
                                                                          default=None)


@contextlib.contextmanager
def chunk_bytes(nbytes: int) -> Iterator[None]:
    """Within the block (this thread or task), chunks hold `nbytes` of float32 logits instead of
    HEAD_CHUNK_BYTES: the trainer's `micro_batches.head_chunk_mib`, set for its step."""
    if nbytes < 1:
        raise ValueError(f"a loss-head chunk needs at least 1 byte, got {nbytes}")
    token = _CHUNK_BYTES.set(int(nbytes))
    try:
        yield
    finally:
        _CHUNK_BYTES.reset(token)


def chunk_tokens_for(width: int, requested: int | None = None, itemsize: int = 4) -> int:
    """Tokens per chunk: `requested`, else as many as fit the chunk's bytes (`chunk_bytes`,
    default HEAD_CHUNK_BYTES) at `width` values of `itemsize` bytes per token (Vs logits, or
    k x H gathered weights), at least 1."""
    if requested is not None:
        return max(1, int(requested))
    budget = _CHUNK_BYTES.get() or HEAD_CHUNK_BYTES
    return max(1, budget // (itemsize * max(1, width)))


# --- vocabulary-parallel plumbing (no collectives on one rank) ---------------------------------

def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather_cat(x: torch.Tensor, group) -> torch.Tensor:
    """[c, n] of every rank, concatenated along the last dim in rank order."""
    if _world(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _shard(weight: torch.Tensor, group) -> tuple[int, int]:
    """(global id of this rank's first row, whole vocabulary size): equal contiguous shards."""
    rank = 0 if group is None else dist.get_rank(group)
    return rank * weight.shape[0], weight.shape[0] * _world(group)


def _local(ids: torch.Tensor, lo: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each global id in this shard, clamped into it; True where this rank owns it)."""
    local = ids - lo
    owned = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), owned


def same_rows(weight: torch.Tensor, like: torch.Tensor, group) -> torch.Tensor:
    """`weight`'s rows that this rank's shard `like` [Vs, H] covers: a whole output weight
    [V, H] (a teacher not split over the group) is cut to rows [r Vs, (r + 1) Vs); a weight
    already split like `like` is returned as it is."""
    if _world(group) == 1 or weight.shape[0] == like.shape[0]:
        return weight
    lo, vocab = _shard(like, group)
    if weight.shape[0] != vocab:
        raise ValueError(f"an output weight of {weight.shape[0]} rows beside a vocabulary of "
                         f"{vocab} split over {_world(group)} ranks: the vocabularies differ")
    return weight[lo:lo + like.shape[0]]


class _CopyToGroup(torch.autograd.Function):
    """Identity; the backward sums the gradient over the group (each rank's is the part from
    its vocabulary rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), _SUM, ctx.group), None


class _GatherVocab(torch.autograd.Function):
    """[m, Vs] of every rank -> [m, V]; the backward keeps this rank's columns (the loss on the
    gathered logits is the same on every rank)."""

    @staticmethod
    def forward(ctx, z, group):
        ctx.group, ctx.rows = group, z.shape[-1]
        return _all_gather_cat(z, group)

    @staticmethod
    def backward(ctx, grad):
        lo = (0 if ctx.group is None else dist.get_rank(ctx.group)) * ctx.rows
        return grad[..., lo:lo + ctx.rows], None


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """hidden [m, H] W^T over the whole vocabulary [m, V], differentiable, for a few rows (a
    term that needs the whole distribution of some tokens): under `group` each rank's rows
    gathered, the gradient of hidden summed over the group."""
    if _world(group) == 1:
        return hidden @ weight.T
    return _GatherVocab.apply(_CopyToGroup.apply(hidden, group) @ weight.T, group)


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, who: str = "hidden") -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{who} {tuple(hidden.shape)} and its output weight "
                         f"{tuple(weight.shape)} must be [N, H] and [Vs, H] (this rank's rows)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{who} is {hidden.dtype} and its output weight {weight.dtype}: the "
                         "product h W^T needs one dtype")


def _check_ids(ids: torch.Tensor, vocab: int, bounds: tuple[int, int] | None = None) -> None:
    """ValueError for ids outside [0, vocab) (on an accelerator a gather would fail there with a
    device-side assert, which ends the process). `bounds`: (smallest, largest) of `ids` or of a
    superset of them, known on the host; None: read from the device (both at once)."""
    if not ids.numel():
        return
    lo, hi = bounds if bounds is not None else torch.stack(torch.aminmax(ids.reshape(-1))).tolist()
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token ids outside the vocabulary [0, {vocab}) (the whole one, over "
                         "the group's shards); the teacher's tokenizer must match")


def _arith(x: torch.Tensor) -> torch.dtype:
    """The arithmetic dtype: float32, float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _logits(h: torch.Tensor, w: torch.Tensor, t: float, dtype: torch.dtype) -> torch.Tensor:
    """z / T [c, Vs] of rows h [c, H]: the product in the inputs' dtype, then `dtype` (no pass
    over the chunk for T = 1)."""
    z = (h @ w.T).to(dtype)
    return z if t == 1.0 else z.div_(t)


def _lse(zs: list[torch.Tensor], group) -> torch.Tensor:
    """[len(zs), c]: log-sum-exp of each [c, Vs] over the whole vocabulary (-inf: left out)."""
    m = _all_reduce(torch.stack([z.amax(-1) for z in zs]), _MAX, group)
    s = torch.stack([(z - mi[:, None]).exp_().sum(-1) for z, mi in zip(zs, m)])
    return m + _all_reduce(s, _SUM, group).log()


def _nucleus_threshold(z: torch.Tensor, lse: torch.Tensor, top_p: float,
                       group) -> torch.Tensor:
    """[c]: the smallest probability kept in each row's top-p nucleus (ties kept by `>=`)."""
    ordered = (z - lse[:, None]).exp_().sort(dim=-1, descending=True).values
    if _world(group) > 1:
        # a token of the nucleus has less than top_p of mass above it in its own shard too
        above = ordered.cumsum(-1) - ordered
        count = (above < top_p).sum(-1).max().reshape(1) + 1  # + 1: rounding at the edge
        n = min(int(_all_reduce(count, _MAX, group)), ordered.shape[-1])
        merged = _all_gather_cat(ordered[:, :n], group)  # zeros pad the shorter shards
        ordered = merged.sort(dim=-1, descending=True).values
    needed = (ordered.cumsum(-1) < top_p).sum(-1, keepdim=True) + 1
    return ordered.gather(-1, needed.clamp(max=ordered.shape[-1]) - 1)[:, 0]


def _grad_buffers(hidden: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...]
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float32 (float64) zeros for dL/dh and dL/dW, None for an input that needs no gradient."""
    acc = _arith(hidden)
    return (torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if needs[0] else None,
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None)


def _add_grads(gz: torch.Tensor, h: torch.Tensor, w: torch.Tensor, start: int,
               gh: torch.Tensor | None, gw: torch.Tensor | None) -> None:
    """Rows [start, start + c) of dL/dh = gz W, and dL/dW += gz^T h, for the chunk's dL/dz gz."""
    g = gz.to(w.dtype)  # the products in the inputs' dtype, as autograd through h W^T
    if gh is not None:
        gh[start:start + h.shape[0]] = g @ w
    if gw is not None:
        if g.dtype == gw.dtype:
            gw.addmm_(g.T, h)
        else:
            gw += g.T @ h


def _finish(gh: torch.Tensor | None, gw: torch.Tensor | None, hidden: torch.Tensor,
            weight: torch.Tensor, group) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dL/dh summed over the group's vocabulary shards, both cast to the inputs' dtypes."""
    if gh is not None:
        gh = _all_reduce(gh, _SUM, group).to(hidden.dtype)
    return gh, None if gw is None else gw.to(weight.dtype)


# --- one chunk's elementwise passes: plain torch, compiled on CUDA -----------------------------

# the device types whose chunk passes run compiled (`compiled_kernels`; default: CUDA)
_COMPILE_ON: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "head_compile_on", default=("cuda",))
_COMPILED: dict[Any, Any] = {}


@contextlib.contextmanager
def compiled_kernels(on: bool, device_types: tuple[str, ...] = ("cuda",)) -> Iterator[None]:
    """Within the block (this thread or task), the chunk passes of `head_logprobs` run through
    `torch.compile` on `device_types` (`on`), or eagerly everywhere: the trainer's
    `micro_batches.head_compile`. Compiled, each pass reads the chunk's logits once (one fused
    kernel) where eager torch makes several float32 passes over them (cast, max, exp, sums)."""
    token = _COMPILE_ON.set(tuple(device_types) if on else ())
    try:
        yield
    finally:
        _COMPILE_ON.reset(token)


def _kernel(fn, device: torch.device):
    """`fn` compiled (dynamic shapes, made once per process) on the device types in effect."""
    if device.type not in _COMPILE_ON.get():
        return fn
    compiled = _COMPILED.get(fn)
    if compiled is None:
        compiled = _COMPILED[fn] = _explained(torch.compile(fn, dynamic=True))
    return compiled


def _explained(compiled):
    """`compiled`, its compiler's failure (no working Triton or C++ compiler, say) raised with
    the config field that avoids it."""
    def run(*args):
        try:
            return compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            raise RuntimeError(f"torch.compile of the loss head's chunk passes failed "
                               f"({type(e.inner_exception).__name__}: {e.inner_exception}); "
                               "set micro_batches.head_compile = false in the trainer's "
                               "config to run them eagerly") from e
    return run


def _exp_sums(z: torch.Tensor, m: torch.Tensor, t: float, dtype: torch.dtype,
              with_entropy: bool) -> torch.Tensor:
    """[1 or 2, c]: sum_v e_v (and sum_v e_v x_v) over x = z / T - m, e = exp(x), for a chunk's
    logits z [c, Vs] (overwritten when already `dtype`) and its rows' max m [c] of z / T."""
    x = z.to(dtype)
    if t != 1.0:
        x.div_(t)
    x.sub_(m[:, None])
    e = x.exp()
    sums = [e.sum(-1)] + ([torch.linalg.vecdot(e, x)] if with_entropy else [])
    return torch.stack(sums)


def _logit_grads(z: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                 g_ent: torch.Tensor | None, g: torch.Tensor | None, owned: torch.Tensor,
                 local: torch.Tensor, t: float, out: torch.dtype) -> torch.Tensor:
    """dL/dz [c, Vs] in `out` for a chunk's logits z (overwritten when already float32/64):
    `-p (g + g_H (log p + H)) / T`, plus g / T at each row's target `local` where this rank
    owns it (`owned`); lse, ent and the upstream gradients g_H, g [c] in the arithmetic dtype."""
    logq = z.to(lse.dtype)
    if t != 1.0:
        logq.div_(t)
    logq.sub_(lse[:, None])
    p = logq.exp()
    if g_ent is None:
        gz = p.mul_(-g[:, None])
    else:
        gz = logq.add_(ent[:, None]).mul_(g_ent[:, None])
        if g is not None:
            gz.add_(g[:, None])
        gz.mul_(p).neg_()
    if g is not None:
        at = (g * owned)[:, None]
        if torch.compiler.is_compiling():  # an index compare fuses into the kernel
            cols = torch.arange(gz.shape[1], device=gz.device)
            gz = gz + torch.where(cols == local[:, None], at, 0.0)
        else:
            gz.scatter_add_(1, local[:, None], at)
    if t != 1.0:
        gz.div_(t)
    return gz.to(out)


# --- sampled-token log-probs and entropies -----------------------------------------------------

class _HeadLogprobs(torch.autograd.Function):
    """(log p(y) [N], H [N]) chunk by chunk; the backward makes each chunk's logits again from
    the saved log-sum-exp and entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, t, with_entropy, chunk, group):
        dtype, n = _arith(hidden), hidden.shape[0]
        lo = _shard(weight, group)[0]
        lse, logp = (torch.empty(n, dtype=dtype, device=hidden.device) for _ in range(2))
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        sums_of = _kernel(_exp_sums, hidden.device)
        for s in range(0, n, chunk):
            z = hidden[s:s + chunk] @ weight.T  # the inputs' dtype, as the output layer
            local, owned = _local(targets[s:s + chunk], lo, z.shape[1])
            zy = z.gather(-1, local[:, None])[:, 0].to(dtype).masked_fill_(~owned, 0.0)  # owner's
            m = _all_reduce(z.amax(-1).to(dtype), _MAX, group)  # max z / T = (max z) / T, T > 0
            if t != 1.0:
                zy, m = zy / t, m / t
            sums = _all_reduce(torch.cat([zy[None], sums_of(z, m, t, dtype, with_entropy)]),
                               _SUM, group)  # z_y / T (from its owner), sum e, sum e x
            lse[s:s + chunk] = m + sums[1].log()
            logp[s:s + chunk] = sums[0] - lse[s:s + chunk]
            if with_entropy:
                ent[s:s + chunk] = sums[1].log() - sums[2] / sums[1]
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.args = t, with_entropy, chunk, group
        ctx.set_materialize_grads(False)  # an unused entropy costs nothing in the backward
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        lse, ent = lse.detach(), ent.detach()  # outputs: a compiled pass takes them as values
        t, with_entropy, chunk, group = ctx.args
        g_ent = g_ent if with_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        lo = _shard(weight, group)[0]
        gh, gw = _grad_buffers(hidden, weight, ctx.needs_input_grad)
        grads_of = _kernel(_logit_grads, hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            sl = slice(s, s + chunk)
            z = hidden[sl] @ weight.T
            local, owned = _local(targets[sl], lo, z.shape[1])
            gz = grads_of(z, lse[sl], None if g_ent is None else ent[sl],
                          None if g_ent is None else g_ent[sl],
                          None if g_logp is None else g_logp[sl], owned, local, t, weight.dtype)
            _add_grads(gz, hidden[sl], weight, s, gh, gw)
        return *_finish(gh, gw, hidden, weight, group), None, None, None, None, None


@dataclass
class ResponseHead:
    """A micro-batch's response positions' final hidden states and the output weight: the
    logits z = hidden W^T, never made whole (training/heads.py makes them from a model)."""

    hidden: torch.Tensor  # [B, R, H], the model's dtype
    weight: torch.Tensor  # [V, H]; vocabulary parallel: this rank's rows [V / tp, H]
    group: Any = None  # the process group the vocabulary rows are split over (None: one rank)


def response_head_logprobs(head: ResponseHead, tokens: torch.Tensor, temperature: float,
                           with_entropy: bool = True, *,
                           token_bounds: tuple[int, int] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, R] (log-probs of `tokens` [B, R], entropies or None), float32, differentiable in the
    head (`head_logprobs` over its group); `token_bounds` as `head_logprobs`'s (a micro-batch's
    `token_bounds`)."""
    B, R, H = head.hidden.shape
    logp, ent = head_logprobs(head.hidden.reshape(B * R, H), head.weight, tokens.reshape(-1),
                              temperature, with_entropy=with_entropy, group=head.group,
                              token_bounds=token_bounds)
    # float32 as algos.logprobs (a float64 model's values are made in float64, then rounded)
    return logp.view(B, R).float(), None if ent is None else ent.view(B, R).float()


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0, *, with_entropy: bool = True,
                  chunk_tokens: int | None = None, group=None,
                  token_bounds: tuple[int, int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_softmax(h W^T / T)[targets] [N], entropy [N] or None), float32 (float64 for float64
    inputs), differentiable in hidden [N, H] and weight [Vs, H] (this rank's vocabulary rows);
    targets [N] global ids. The logits of `algos.logprobs.response_logprobs`, never all held.
    `token_bounds`: (smallest, largest) of the targets or of a superset of them, known on the
    host: the ids are checked against the vocabulary with them instead of a read of the device
    (which waits for it)."""
    _check_head(hidden, weight)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] for hidden "
                         f"{tuple(hidden.shape)}")
    _check_ids(targets, _shard(weight, group)[1], token_bounds)
    logp, ent = _HeadLogprobs.apply(hidden, weight, targets.long(),
                                    effective_temperature(temperature), with_entropy,
                                    chunk_tokens_for(weight.shape[0], chunk_tokens), group)
    return logp, ent if with_entropy else None


@torch.no_grad()
def head_top_k_ids(hidden: torch.Tensor, weight: torch.Tensor, k: int, *,
                   chunk_tokens: int | None = None, group=None) -> torch.Tensor:
    """[N, k] global ids of the k largest logits h W^T per token (the k most likely at any
    temperature > 0; `algos.opd.top_k_ids`), chunk by chunk; under `group` each rank's top-k
    are all-gathered and the k largest of them kept."""
    _check_head(hidden, weight)
    lo, vocab = _shard(weight, group)
    k = min(int(k), vocab)
    out = torch.empty((hidden.shape[0], k), dtype=torch.long, device=hidden.device)
    chunk = chunk_tokens_for(weight.shape[0], chunk_tokens)
    for s in range(0, hidden.shape[0], chunk):
        top = (hidden[s:s + chunk] @ weight.T).topk(min(k, weight.shape[0]), dim=-1)
        values = _all_gather_cat(top.values, group)
        ids = _all_gather_cat(top.indices + lo, group)
        out[s:s + chunk] = ids.gather(-1, values.topk(k, dim=-1).indices)
    return out


@torch.no_grad()
def head_token_scores(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 1.0, k: int = 0, *, chunk_tokens: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scorer's reply from its head, chunk by chunk (no gradient): (log_softmax(h W^T / T)
    at `targets` [N], the k most likely ids [N, k] and their log-probs [N, k]), float32 (float64
    for float64 inputs); k = 0 gives [N, 0] top-k. What a teacher server returns for a sequence
    (`input_token_logprobs`, `input_top_logprobs`), for a colocated teacher of another
    vocabulary (training/colocated_teachers.py)."""
    _check_head(hidden, weight)
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] for hidden "
                         f"{tuple(hidden.shape)}")
    _check_ids(targets, weight.shape[0])
    t, dtype = effective_temperature(temperature), _arith(hidden)
    n, k = hidden.shape[0], min(max(int(k), 0), weight.shape[0])
    logp = torch.empty(n, dtype=dtype, device=hidden.device)
    ids = torch.empty((n, k), dtype=torch.long, device=hidden.device)
    top = torch.empty((n, k), dtype=dtype, device=hidden.device)
    chunk = chunk_tokens_for(weight.shape[0], chunk_tokens)
    for s in range(0, n, chunk):
        z = _logits(hidden[s:s + chunk], weight, t, dtype)
        z -= z.logsumexp(-1, keepdim=True)
        logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None].long())[:, 0]
        if k:
            best = z.topk(k, dim=-1)
            ids[s:s + chunk], top[s:s + chunk] = best.indices, best.values
    return logp, ids, top


# --- set reverse KL: two ways to walk the sets -------------------------------------------------

class _RowSets:
    """Sets over rows of the vocabulary: all of it (top_p = 1) or the nucleus rebuilt from the
    student's logits; the teacher as its hidden states and weight. State kept for the backward:
    [5, N] = KL, the log-sum-exp over the set of each side, the whole log-sum-exp and the
    nucleus threshold (the set rebuilt exactly, without collectives)."""

    def __init__(self, teacher_hidden, teacher_weight, top_p, t, chunk, group):
        self.th, self.tw = teacher_hidden, teacher_weight
        self.top_p, self.t, self.chunk, self.group = top_p, t, chunk, group

    def run(self, hidden, weight, scale=None, state=None, needs=(True, True)):
        """(KL [N], state, dL/dh, dL/dW) for L = sum_t scale_t KL_t (gradients None without
        `scale`); with `state` (of an earlier run) the values are read, not computed again."""
        dtype, fresh = _arith(hidden), state is None
        if fresh:
            state = torch.zeros((5, hidden.shape[0]), dtype=dtype, device=hidden.device)
        gh, gw = _grad_buffers(hidden, weight, needs) if scale is not None else (None, None)
        for s in range(0, hidden.shape[0], self.chunk):
            sl = slice(s, s + self.chunk)
            gz = self._chunk(hidden[sl], weight, state[:, sl], fresh, scale, sl, dtype)
            if gz is not None:
                _add_grads(gz, hidden[sl], weight, s, gh, gw)
        return (state[0], state, *_finish(gh, gw, hidden, weight, self.group)) \
            if scale is not None else (state[0], state, None, None)

    def _chunk(self, h, w, st, fresh, scale, sl, dtype):
        """The KL of one chunk into st[0] (fresh) and its dL/dz [c, Vs] (with `scale`)."""
        t, group = self.t, self.group
        zs = _logits(h, w, t, dtype)
        zt = _logits(self.th[sl], self.tw, t, dtype)
        if self.top_p < 1:
            if fresh:
                st[3] = _lse([zs], group)[0]
                st[4] = _nucleus_threshold(zs, st[3], self.top_p, group)
            out = (zs - st[3][:, None]).exp_() < st[4][:, None]  # outside the nucleus
            zs.masked_fill_(out, float("-inf"))
            zt.masked_fill_(out, float("-inf"))
        if fresh:
            st[1:3] = _lse([zs, zt], group)
        ls = zs.sub_(st[1][:, None])
        p = ls.exp()
        diff = ls.sub_(zt.sub_(st[2][:, None])).masked_fill_(p == 0, 0.0)  # -inf - -inf outside
        if fresh:
            st[0] = _all_reduce(torch.linalg.vecdot(p, diff), _SUM, group)
        if scale is None:
            return None
        return diff.sub_(st[0][:, None]).mul_(p).mul_(scale[sl, None].to(dtype) / t)


class _IdSets:
    """Sets given as ids [N, k] with `keep` [N, k] (False: padding, its id set to 0): the logits
    at the ids are h . W[ids] over the weight's gathered rows, no row of the vocabulary built;
    the teacher as its values over the set ([N, k], -inf outside) or its hidden states and
    weight. State kept for the backward: (p_S [N, k], log p_S - log q_S [N, k], KL [N])."""

    def __init__(self, ids, keep, scores, teacher_hidden, teacher_weight, t, chunk, group):
        self.ids, self.keep, self.scores = ids, keep, scores
        self.th, self.tw = teacher_hidden, teacher_weight
        self.t, self.chunk, self.group = t, chunk, group

    def _at(self, h, w, local, owned, dtype):
        """[c, k] logits / T at the ids from the gathered rows W[ids] [c, k, H], summed over the
        group. (Picking them from each chunk's h W^T with two GEMMs for the gradient was slower
        on an H200: 0.68 s against 0.60 s in bench.opd_memory's top-k and top-p steps.)"""
        z = torch.bmm(w[local], h[:, :, None])[..., 0]
        return _all_reduce(z.to(dtype).masked_fill_(~owned, 0.0), _SUM, self.group).div_(self.t)

    def run(self, hidden, weight, scale=None, state=None, needs=(True, True)):
        """As `_RowSets.run`."""
        dtype, fresh, n = _arith(hidden), state is None, hidden.shape[0]
        if fresh:
            state = (torch.zeros(self.ids.shape, dtype=dtype, device=hidden.device),
                     torch.zeros(self.ids.shape, dtype=dtype, device=hidden.device),
                     torch.zeros(n, dtype=dtype, device=hidden.device))
        gh, gw = _grad_buffers(hidden, weight, needs) if scale is not None else (None, None)
        lo = _shard(weight, self.group)[0]
        for s in range(0, n, self.chunk):
            sl = slice(s, s + self.chunk)
            local, owned = _local(self.ids[sl], lo, weight.shape[0])
            if fresh:
                self._values(hidden[sl], weight, local, owned, sl, state, dtype)
            if scale is not None:
                p, diff, kl = (x[sl] for x in state)
                gz = (diff - kl[:, None]).mul_(p).mul_(scale[sl, None].to(dtype) / self.t)
                self._grads(gz.masked_fill_(~owned, 0.0), hidden[sl], weight[local], local, owned,
                            s, gh, gw)
        if fresh:
            self.th = self.tw = self.scores = None  # the teacher is not needed any more
        return (state[2], state, *_finish(gh, gw, hidden, weight, self.group)) \
            if scale is not None else (state[2], state, None, None)

    def _values(self, h, w, local, owned, sl, state, dtype):
        """p_S, log p_S - log q_S and KL of the chunk `sl` into `state`."""
        off = ~self.keep[sl]
        zs = self._at(h, w, local, owned, dtype).masked_fill_(off, float("-inf"))
        if self.scores is not None:
            zt = self.scores[sl]
        else:
            zt = self._at(self.th[sl], self.tw, local, owned, dtype).masked_fill_(off,
                                                                                 float("-inf"))
        ls, lt = torch.log_softmax(zs, dim=-1), torch.log_softmax(zt, dim=-1)
        p = ls.exp()
        diff = torch.where(p > 0, ls - lt, torch.zeros_like(ls))
        state[0][sl], state[1][sl], state[2][sl] = p, diff, torch.linalg.vecdot(p, diff)

    @staticmethod
    def _grads(gz, h, rows, local, owned, start, gh, gw):
        """dL/dh rows = sum_j gz_j W[id_j] (this rank's ids); dL/dW[id_j] += gz_j h."""
        if gh is not None:
            gh[start:start + h.shape[0]] = torch.bmm(gz.to(rows.dtype)[:, None, :], rows)[:, 0]
        if gw is not None:
            outer = gz[:, :, None] * h.to(gw.dtype)[:, None, :]  # [c, k, H]
            gw.index_add_(0, local[owned], outer[owned])


class _SetKL(torch.autograd.Function):
    """KL_t [N] of a set walker; the backward runs it again from the saved state."""

    @staticmethod
    def forward(ctx, hidden, weight, sets):
        kl, state, _, _ = sets.run(hidden, weight)
        ctx.save_for_backward(hidden, weight)
        ctx.sets, ctx.state = sets, state
        return kl.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        hidden, weight = ctx.saved_tensors
        _, _, gh, gw = ctx.sets.run(hidden, weight, grad_kl, ctx.state,
                                    ctx.needs_input_grad[:2])
        return gh, gw, None


class _WeightedSetKL(torch.autograd.Function):
    """(sum_t w_t KL_t, KL_t [N] not differentiable); the gradient is made in the forward, in
    the same pass, and kept (float32 dL/dh [N, H] and dL/dW [Vs, H]) for one backward."""

    @staticmethod
    def forward(ctx, hidden, weight, weights, sets):
        kl, _, gh, gw = sets.run(hidden, weight, weights.detach(), None,
                                 ctx.needs_input_grad[:2])
        ctx.grads = gh, gw
        ctx.mark_non_differentiable(kl)
        return (kl * weights.to(kl.dtype)).sum(), kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_kl):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("the weighted set KL's gradient was already used: backward it "
                               "once (it is made in the forward and released)")
        scale = None if float(grad_loss) == 1.0 else grad_loss
        gh, gw = (g if g is None or scale is None else g * scale.to(g.dtype) for g in grads)
        return gh, gw, None, None


# --- set reverse KL: entry points ---------------------------------------------------------------

def _id_set(ids, valid, teacher_logprobs, teacher_temperature, t, dtype, vocab):
    """(ids with padding set to 0, keep [N, k], teacher values over the set or None)."""
    if valid is not None and valid.shape != ids.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must match the ids {tuple(ids.shape)}")
    keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device) if valid is None \
        else valid.bool()
    scores = None
    if teacher_logprobs is not None:
        if teacher_logprobs.shape != ids.shape:
            raise ValueError(f"teacher log-probs {tuple(teacher_logprobs.shape)} must match "
                             f"the ids {tuple(ids.shape)}")
        lps = teacher_logprobs.detach()
        keep = keep & torch.isfinite(lps)  # a server's padding is -inf
        rescale = 1.0 if teacher_temperature is None else \
            effective_temperature(teacher_temperature) / t  # log_softmax(lp' T' / T) over S
        scores = (lps.to(torch.promote_types(lps.dtype, torch.float32)) * rescale).to(dtype)
        scores = scores.masked_fill(~keep, float("-inf"))
    if ids.shape[0] and not bool(keep.any(-1).all()):
        raise ValueError("a token has an empty token set")
    ids = ids.long().masked_fill(~keep, 0)
    _check_ids(ids, vocab)
    return ids, keep, scores


def _set_walker(hidden, weight, mode, temperature, *, teacher_hidden=None, teacher_weight=None,
                teacher_logprobs=None, teacher_temperature=None, ids=None, valid=None,
                top_p=1.0, chunk_tokens=None, group=None):
    """The set walker of `head_set_kl`'s arguments, checked."""
    if mode not in SET_MODES:
        raise ValueError(f"set mode = {mode!r}; use one of {SET_MODES}")
    if not 0 < top_p <= 1 or (top_p != 1 and mode != "top_p"):
        raise ValueError(f"top_p = {top_p} must be in (0, 1], and is only used by mode 'top_p'")
    _check_head(hidden, weight)
    halves = (teacher_hidden is not None) + (teacher_weight is not None)
    has_teacher = halves == 2
    if halves == 1 or has_teacher == (teacher_logprobs is not None):
        raise ValueError("give the teacher as teacher_hidden and teacher_weight, or as "
                         "teacher_logprobs at the ids; exactly one")
    if teacher_temperature is not None and teacher_logprobs is None:
        raise ValueError("teacher_temperature rescales teacher_logprobs; it needs them")
    if has_teacher:
        _check_head(teacher_hidden, teacher_weight, "teacher_hidden")
        if teacher_hidden.shape[0] != hidden.shape[0] or \
                teacher_weight.shape[0] != weight.shape[0]:
            raise ValueError(f"teacher {tuple(teacher_hidden.shape)} x "
                             f"{tuple(teacher_weight.shape)} does not match the student's "
                             f"{tuple(hidden.shape)} x {tuple(weight.shape)}: the same tokens "
                             "and the same (sliced) vocabulary rows")
        teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    t, dtype, vocab = effective_temperature(temperature), _arith(hidden), _shard(weight, group)[1]
    if mode == "top_k" or ids is not None:
        if mode == "full" or ids is None or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"mode {mode!r} takes ids [N, k] for hidden {tuple(hidden.shape)} "
                             "(top_k: needed; top_p: the recorded nucleus; full: none)")
        ids, keep, scores = _id_set(ids, valid, teacher_logprobs, teacher_temperature, t, dtype,
                                    vocab)
        chunk = chunk_tokens_for(ids.shape[1] * hidden.shape[1], chunk_tokens)
        return _IdSets(ids, keep, scores, teacher_hidden, teacher_weight, t, chunk, group)
    if not has_teacher:
        raise ValueError(f"mode {mode!r} over rows of the vocabulary needs teacher_hidden and "
                         "teacher_weight (the teacher's logits)")
    return _RowSets(teacher_hidden, teacher_weight, float(top_p), t,
                    chunk_tokens_for(weight.shape[0], chunk_tokens), group)


def head_set_kl(hidden: torch.Tensor, weight: torch.Tensor, mode: str,
                temperature: float = 1.0, *, teacher_hidden: torch.Tensor | None = None,
                teacher_weight: torch.Tensor | None = None,
                teacher_logprobs: torch.Tensor | None = None,
                teacher_temperature: float | None = None, ids: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, top_p: float = 1.0,
                chunk_tokens: int | None = None, group=None) -> torch.Tensor:
    """Reverse KL_t [N] over the set of `mode` (module docstring), float32 (float64 for float64
    inputs), differentiable in the student's hidden [N, H] and weight [Vs, H]; the teacher as
    teacher_hidden [N, H'] + teacher_weight [Vs, H'] (detached), or for sets given as ids
    ([N, k], global; `valid` [N, k] marks padding) as teacher_logprobs [N, k] computed at
    teacher_temperature (default: `temperature`). Pass the policy tokens only: every token
    needs a non-empty set."""
    sets = _set_walker(hidden, weight, mode, temperature, teacher_hidden=teacher_hidden,
                       teacher_weight=teacher_weight, teacher_logprobs=teacher_logprobs,
                       teacher_temperature=teacher_temperature, ids=ids, valid=valid,
                       top_p=top_p, chunk_tokens=chunk_tokens, group=group)
    return _SetKL.apply(hidden, weight, sets)


def head_weighted_set_kl(hidden: torch.Tensor, weight: torch.Tensor, weights: torch.Tensor,
                         mode: str, temperature: float = 1.0, **set_args
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t weights_t KL_t, a differentiable scalar; KL_t [N], detached), weights [N] (e.g.
    `algos.opd.opd_weights` at the policy tokens), `set_args` those of `head_set_kl`. The
    gradient is made now, in the same pass as the values, and the teacher is not kept: the term
    holds float32 dL/dh [N, H] and dL/dW [Vs, H] until its one backward."""
    if weights.shape != hidden.shape[:1]:
        raise ValueError(f"weights {tuple(weights.shape)} must be [N] for hidden "
                         f"{tuple(hidden.shape)}")
    sets = _set_walker(hidden, weight, mode, temperature, **set_args)
    return _WeightedSetKL.apply(hidden, weight, weights, sets)
