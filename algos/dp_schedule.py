"""The data-parallel micro-batch schedule, as pure functions over sample token lengths.

Role: given per-sample token lengths and prompt-group ids, decide for every optimizer step which
micro-batches (lists of sample indices) each data-parallel rank runs. "Pack first, distribute
second", per step:
1. pack under the token cap: "first_fit" (input order), "first_fit_decreasing" (default, packs
   tighter), or "fixed" (at most `micro_batch_size` samples, input order);
2. equalise: split the largest multi-sample micro-batches (by tokens) into two balanced halves
   until the count is a multiple of `num_ranks`;
3. distribute: equal-count Karmarkar-Karp (largest differencing) over estimated FLOPs, then a
   swap polish between the most and least loaded ranks.

Invariants of every `Schedule` returned by `build_schedule`:
- every sample index appears exactly once; nothing is dropped;
- every micro-batch holds <= `max_tokens_per_mb` tokens, except a micro-batch holding one sample
  longer than the cap, whose index is listed in `oversized`;
- within a step every rank runs the same number of micro-batches;
- all samples of one group (one prompt) are in the same step.

Design differences from slime's `build_dp_schedule`: the cap is enforced in every mode (slime's
FLOPs-balanced packing ignores it), "fixed" micro-batches may be split to align the count, no
trailing groups are dropped (`steps` splits the groups into near-equal contiguous chunks), and
oversized samples are reported instead of passing silently.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

MODES = ("first_fit", "first_fit_decreasing", "fixed")

# Default linear coefficient of `quadratic_flops`: for a dense ~7B model (hidden 4096, SwiGLU,
# GQA) the per-token linear cost is ~15x hidden times the per-token^2 attention cost.
DEFAULT_LINEAR_COEF = 60_000.0

FlopsModel = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------------------------
# FLOPs models
# ---------------------------------------------------------------------------------------------

def quadratic_flops(length, linear_coef: float = DEFAULT_LINEAR_COEF):
    """`linear_coef * L + L**2`; works elementwise on an int, float or numpy array."""
    s = np.asarray(length, dtype=np.float64)
    out = linear_coef * s + s * s
    return out if out.ndim else float(out)


def transformer_flops(length, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int,
                      head_dim: int, vocab: int):
    """Forward FLOPs of one dense (non-MLA, non-MoE) sample of `length` tokens, elementwise.

    Per layer: QKV projections, causal QK^T (halved) plus A.V (not halved), the output projection
    (2 s h^2), a SwiGLU MLP (three matmuls); then the LM head. The embedding is not counted.
    """
    s = np.asarray(length, dtype=np.float64)
    qkv = 2 * s * hidden * heads * head_dim + 4 * s * hidden * kv_heads * head_dim
    attn = heads * s * s * head_dim + heads * s * s * head_dim
    out_proj = 2 * s * hidden * hidden
    mlp = 6 * s * hidden * ffn
    total = layers * (qkv + attn + out_proj + mlp) + 2 * s * hidden * vocab
    return total if total.ndim else float(total)


def _sample_flops(flops: FlopsModel, lengths: np.ndarray) -> np.ndarray:
    """Apply the FLOPs model to every length: vectorised when it accepts arrays, else per item."""
    try:
        out = np.asarray(flops(lengths), dtype=np.float64)
    except (TypeError, ValueError):
        out = None
    if out is None or out.shape != lengths.shape:
        out = np.array([float(flops(int(x))) for x in lengths], dtype=np.float64)
    if out.size and (not np.all(np.isfinite(out)) or out.min() < 0):
        raise ValueError("flops(length) must return finite, non-negative numbers; fix the model")
    return out


# ---------------------------------------------------------------------------------------------
# Step 1: packing
# ---------------------------------------------------------------------------------------------

def _first_fit(items: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """First-fit of `items` (with `sizes`, each <= cap) in the given order, into micro-batches.

    A max segment tree over bin remaining capacities; unopened bins hold `cap`, so the leftmost
    bin that fits is either an open bin or the next fresh one. First-fit leaves at most one bin
    half empty or worse, so 2*sum/cap + 1 leaves always suffice.
    """
    bound = min(len(sizes), 2 * math.ceil(sum(sizes) / cap) + 1)
    size = 1 << max(0, bound - 1).bit_length()
    tree = [cap] * (2 * size)
    bins: list[list[int]] = [[] for _ in range(size)]
    for p, x in zip(items, sizes):
        i = 1
        while i < size:
            i <<= 1
            if tree[i] < x:
                i += 1
        bins[i - size].append(p)
        v = tree[i] - x
        tree[i] = v
        while i > 1:  # raise the new maximum towards the root; stop when a node is unchanged
            s = tree[i ^ 1]
            if s > v:
                v = s
            i >>= 1
            if tree[i] == v:
                break
            tree[i] = v
    used = len(bins)
    while used and not bins[used - 1]:
        used -= 1
    return bins[:used]


def _fixed_chunks(lengths: np.ndarray, positions: np.ndarray, cap: int, mbs: int) -> list[list[int]]:
    """Input-order chunks of at most `mbs` samples, cut early where the cap would be exceeded."""
    out: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for p, x in zip(positions.tolist(), lengths[positions].tolist()):
        if cur and (len(cur) == mbs or tokens + x > cap):
            out.append(cur)
            cur, tokens = [], 0
        cur.append(p)
        tokens += x
    return out + [cur] if cur else out


def _check_mode(mode: str, micro_batch_size: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown packing mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "fixed" and (micro_batch_size is None or micro_batch_size < 1):
        raise ValueError("mode='fixed' needs micro_batch_size >= 1 (samples per micro-batch)")


def pack(lengths: Sequence[int], max_tokens_per_mb: int, mode: str = "first_fit_decreasing",
         micro_batch_size: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Pack positions 0..n-1 into micro-batches of <= max_tokens_per_mb tokens.

    Returns (micro_batches, oversized): each sample longer than the cap gets a micro-batch of its
    own (appended last) and its position is listed in `oversized`.
    """
    _check_mode(mode, micro_batch_size)
    lens = np.asarray(lengths, dtype=np.int64)
    fits = lens <= max_tokens_per_mb
    oversized = np.flatnonzero(~fits).tolist()
    order = np.flatnonzero(fits)
    if mode == "fixed":
        mbs = _fixed_chunks(lens, order, max_tokens_per_mb, micro_batch_size)
        return mbs + [[p] for p in oversized], oversized
    if mode == "first_fit_decreasing":
        order = order[np.argsort(-lens[order], kind="stable")]
    mbs = _first_fit(order.tolist(), lens[order].tolist(), max_tokens_per_mb)
    return mbs + [[p] for p in oversized], oversized


# ---------------------------------------------------------------------------------------------
# Step 2: equalise the micro-batch count
# ---------------------------------------------------------------------------------------------

def required_micro_batches(count: int, num_ranks: int) -> int:
    """The smallest multiple of num_ranks that is >= count (and >= num_ranks)."""
    return max(1, -(-count // num_ranks)) * num_ranks


def _halve(mb: list[int], lens: list[int]) -> tuple[list[int], list[int]]:
    """Split a multi-sample micro-batch into two token-balanced halves (longest first, lighter side)."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for p in sorted(mb, key=lens.__getitem__, reverse=True):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(p)
        loads[side] += lens[p]
    assert halves[0] and halves[1], "halving a multi-sample micro-batch left a side empty"
    return halves


def equalise(micro_batches: list[list[int]], lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Split the largest multi-sample micro-batches until their count is a multiple of num_ranks.

    Halves never hold more tokens than the original, so the cap stays respected.
    """
    lens = np.asarray(lengths, dtype=np.int64).tolist()
    n = sum(len(mb) for mb in micro_batches)
    target = required_micro_batches(len(micro_batches), num_ranks)
    if n < target:
        raise ValueError(f"{n} samples cannot fill {target} micro-batches ({target // num_ranks} on "
                         f"each of {num_ranks} ranks); give the step >= {target} samples or use fewer ranks")
    mbs = list(micro_batches)
    tokens = lambda j: -sum(map(lens.__getitem__, mbs[j]))  # noqa: E731 (heap key: largest first)
    heap = [(tokens(i), i) for i, mb in enumerate(mbs) if len(mb) > 1]
    heapq.heapify(heap)
    while len(mbs) < target:
        i = heapq.heappop(heap)[1]
        mbs[i], half = _halve(mbs[i], lens)
        mbs.append(half)
        for j in (i, len(mbs) - 1):
            if len(mbs[j]) > 1:
                heapq.heappush(heap, (tokens(j), j))
    return mbs


# ---------------------------------------------------------------------------------------------
# Step 3: distribute over ranks
# ---------------------------------------------------------------------------------------------

def _merge(a: tuple[np.ndarray, list[list[int]]], b: tuple[np.ndarray, list[list[int]]]):
    """Combine two KK states, heaviest set of one with lightest of the other; re-sort descending."""
    sums = a[0] + b[0][::-1]
    parts = [pa + pb for pa, pb in zip(a[1], reversed(b[1]))]
    order = np.argsort(-sums, kind="stable")
    return sums[order], [parts[i] for i in order.tolist()]


def karmarkar_karp(weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """Equal-count k-way largest differencing: split indices into num_parts sets of n/num_parts.

    Start from consecutive k-tuples of the ascending weights (one item per set), then repeatedly
    merge the two states of largest spread. A merge never widens the spread beyond the wider
    input's, so the final max load <= mean + (max weight - min weight).
    """
    w = np.asarray(weights, dtype=np.float64)
    if num_parts < 1 or len(w) % num_parts:
        raise ValueError(f"{len(w)} weights do not split into {num_parts} equal-count parts; "
                         "make the count a multiple of num_parts")
    order = np.argsort(w, kind="stable")
    heap = []
    for t, start in enumerate(range(0, len(w), num_parts)):
        idx = order[start:start + num_parts][::-1]
        heap.append((-(w[idx[0]] - w[idx[-1]]), t, (w[idx], [[i] for i in idx.tolist()])))
    heapq.heapify(heap)
    tick = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = _merge(a, b)
        heapq.heappush(heap, (-(merged[0][0] - merged[0][-1]), tick, merged))
        tick += 1
    return heap[0][2][1] if heap else [[] for _ in range(num_parts)]


def _best_swap(hi: list[int], lo: list[int], w: np.ndarray, gap: float) -> tuple[int, int, float] | None:
    """The swap (i in hi, j in lo) whose weight difference d in (0, gap) is closest to gap/2.

    O(m log m): for each i only the two lo weights nearest to w_i - gap/2 can be best.
    """
    lo_order = np.argsort(w[lo], kind="stable")
    lo_w, hi_w = w[lo][lo_order], w[hi]
    at = np.searchsorted(lo_w, hi_w - gap / 2)
    cand = np.stack([np.clip(at - 1, 0, len(lo) - 1), np.clip(at, 0, len(lo) - 1)])
    d = hi_w[None, :] - lo_w[cand]
    score = np.where((d > 0) & (d < gap), np.abs(d - gap / 2), np.inf)
    k = int(np.argmin(score))
    if not np.isfinite(score.flat[k]):
        return None
    row, a = divmod(k, len(hi))
    return a, int(lo_order[cand[row, a]]), float(d[row, a])


def _polish(parts: list[list[int]], w: np.ndarray, max_rounds: int, tol: float = 1e-4) -> None:
    """Swap single micro-batches between the heaviest and lightest rank while that lowers the max.

    Stops after max_rounds, when no such swap exists, or once max load <= (1 + tol) * mean.
    """
    loads = np.array([w[p].sum() for p in parts])
    limit = loads.mean() * (1 + tol)
    for _ in range(max_rounds):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        found = _best_swap(parts[hi], parts[lo], w, loads[hi] - loads[lo]) if loads[hi] > limit else None
        if found is None:
            return
        a, b, d = found
        parts[hi][a], parts[lo][b] = parts[lo][b], parts[hi][a]
        loads[hi] -= d
        loads[lo] += d


def distribute(weights: Sequence[float], num_ranks: int, polish_rounds: int = 4096) -> list[list[int]]:
    """Equal-count assignment of micro-batch indices to ranks: KK, then a bounded swap polish.

    A polish swap never raises the max load, so the KK bound (max <= mean + w_max - w_min)
    still holds.
    """
    w = np.asarray(weights, dtype=np.float64)
    parts = karmarkar_karp(w, num_ranks)
    if len(w):
        _polish(parts, w, polish_rounds)
    return parts


# ---------------------------------------------------------------------------------------------
# The whole schedule
# ---------------------------------------------------------------------------------------------

@dataclass
class Schedule:
    """steps[s][r] is the list of micro-batches rank r runs in step s; each a list of sample ids."""

    steps: list[list[list[list[int]]]]
    oversized: list[int]
    max_tokens_per_mb: int
    rank_flops: list[list[float]] = field(default_factory=list)  # [step][rank] estimated FLOPs
    total_tokens: int = 0
    oversized_tokens: int = 0

    @property
    def num_micro_batches(self) -> int:
        return sum(len(rank) for step in self.steps for rank in step)

    @property
    def micro_batches_per_rank(self) -> list[int]:
        """Per step, the (common) number of micro-batches every rank runs."""
        return [len(step[0]) if step else 0 for step in self.steps]

    @property
    def max_over_mean_flops_per_step(self) -> list[float]:
        """Per step, max rank FLOPs / mean rank FLOPs (1.0 is perfect balance)."""
        out = []
        for loads in self.rank_flops:
            mean = sum(loads) / len(loads) if loads else 0.0
            out.append(max(loads) / mean if mean > 0 else 1.0)
        return out

    @property
    def max_over_mean_flops(self) -> float:
        """The worst step's max/mean rank FLOPs."""
        return max(self.max_over_mean_flops_per_step, default=1.0)

    @property
    def token_utilisation(self) -> float:
        """Tokens / (micro-batches x cap) over capped micro-batches; always <= 1.

        Oversized single-sample micro-batches are left out of both sides (they would exceed 1).
        """
        n = self.num_micro_batches - len(self.oversized)
        tokens = self.total_tokens - self.oversized_tokens
        return tokens / (n * self.max_tokens_per_mb) if n else 0.0


def _validated_lengths(lengths: Sequence[int]) -> np.ndarray:
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError("lengths must be a non-empty flat list of per-sample token counts")
    if not np.issubdtype(lens.dtype, np.integer) or lens.min() < 1:
        raise ValueError("lengths must be positive integers (token counts >= 1)")
    return lens.astype(np.int64)


def _check_sizes(num_ranks: int, max_tokens_per_mb: int, steps: int) -> None:
    for name, v in (("num_ranks", num_ranks), ("max_tokens_per_mb", max_tokens_per_mb), ("steps", steps)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def step_of_samples(group_ids: Sequence, steps: int) -> np.ndarray:
    """Step of every sample: groups, in first-occurrence order, cut into `steps` near-equal chunks."""
    _, first, inverse = np.unique(np.asarray(group_ids), return_index=True, return_inverse=True)
    num_groups = len(first)
    if steps > num_groups:
        raise ValueError(f"steps={steps} but only {num_groups} groups (prompts); a group never "
                         f"spans steps, so use steps <= {num_groups}")
    rank = np.empty(num_groups, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(num_groups)
    return (rank * steps // num_groups)[inverse.reshape(-1)]


def _schedule_step(s: int, pos: np.ndarray, lens: np.ndarray, sample_flops: np.ndarray,
                   num_ranks: int, cap: int, mode: str, mbs: int | None):
    """One step: pack, equalise, distribute. Returns (per-rank micro-batches, rank loads, oversized)."""
    local, over = pack(lens[pos], cap, mode, mbs)
    need = required_micro_batches(len(local), num_ranks)
    if len(pos) < need:
        raise ValueError(f"step {s} has {len(pos)} samples but needs at least {need} "
                         f"({need // num_ranks} micro-batches on each of {num_ranks} ranks); "
                         "give each step more samples (fewer steps) or use fewer ranks")
    local = equalise(local, lens[pos], num_ranks)
    flat = pos[np.fromiter(chain.from_iterable(local), dtype=np.int64, count=len(pos))]
    counts = [len(mb) for mb in local]
    weights = np.bincount(np.repeat(np.arange(len(local)), counts), weights=sample_flops[flat])
    flat_list, ends = flat.tolist(), np.cumsum(counts).tolist()
    gl = [flat_list[e - c:e] for c, e in zip(counts, ends)]
    parts = distribute(weights, num_ranks)
    loads = [float(weights[p].sum()) for p in parts]
    return [[gl[i] for i in part] for part in parts], loads, pos[over].tolist()


def build_schedule(lengths: Sequence[int], group_ids: Sequence | None = None, *, num_ranks: int,
                   max_tokens_per_mb: int, steps: int = 1, flops: FlopsModel | None = None,
                   mode: str = "first_fit_decreasing", micro_batch_size: int | None = None) -> Schedule:
    """Schedule samples into steps x ranks x micro-batches (see the module docstring).

    `group_ids[i]` is sample i's prompt id (default: every sample its own group); `flops` maps a
    length (or an array of lengths, elementwise) to estimated FLOPs (default `quadratic_flops`).
    """
    lens = _validated_lengths(lengths)
    _check_sizes(num_ranks, max_tokens_per_mb, steps)
    _check_mode(mode, micro_batch_size)
    gids = np.arange(len(lens)) if group_ids is None else group_ids
    if len(gids) != len(lens):
        raise ValueError(f"group_ids has {len(gids)} entries for {len(lens)} lengths; give one per sample")
    step_of = step_of_samples(gids, steps)
    sample_flops = _sample_flops(flops or quadratic_flops, lens)
    out = Schedule([], [], max_tokens_per_mb, [], int(lens.sum()))
    for s, pos in enumerate(_positions_by_step(step_of, steps)):
        ranks, loads, over = _schedule_step(s, pos, lens, sample_flops, num_ranks,
                                            max_tokens_per_mb, mode, micro_batch_size)
        out.steps.append(ranks)
        out.rank_flops.append(loads)
        out.oversized.extend(over)
    out.oversized_tokens = int(lens[out.oversized].sum()) if out.oversized else 0
    return out


def _positions_by_step(step_of: np.ndarray, steps: int) -> list[np.ndarray]:
    """Sample indices of each step, in input order."""
    order = np.argsort(step_of, kind="stable")
    return np.split(order, np.cumsum(np.bincount(step_of, minlength=steps))[:-1])
