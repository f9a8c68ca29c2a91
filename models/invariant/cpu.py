"""Batch-invariant forward kernels on the CPU, in plain torch ops whose per-element result is
fixed by construction (no BLAS kernel choice, thread split or vector tail can change it).

Three devices make a row's result independent of how many rows share the call, where the row
sits, how much padding follows it and how many threads run:
- **Exact matmul** (`exact_matmul`): each row of the left operand and each row of the weight
  is scaled by a power of two taken from its own largest magnitude and split into two integers
  of `b` bits (a high part and the next `b` bits), `b = (53 - ceil(log2 K)) // 2`, so every
  product of parts is an integer below 2^(2b) and every partial sum of K of them an integer
  below 2^53. The float64 matrix products (MKL, any blocking, any split, FMA or not) are then
  *exact*, whatever order they add in; the three of them (high x high, high x low, low x high)
  are combined elementwise in a fixed order and scaled back by powers of two, and the last
  rounding is the cast to the output dtype. Each element keeps 2b = 40..46 bits relative to its
  row's largest (K = 4864 .. 64): the result is the float32-rounded exact product up to
  ~2^-40, more accurate than a float32 GEMM.
- **Fixed-tree sums** (`tree_sum`): a reduction over the last dim adds the halves of a
  power-of-two zero-padded vector, level by level, with elementwise adds. Zero padding at the end
  never changes the result (each extra level adds exact zeros), so a query's attention sum is
  the same over its own keys, a KV cache with spare capacity, or a padded training batch.
- **Chunked transcendentals** (`pointwise`): torch's CPU exp/log/silu/cos run a vector body
  and, for the last few elements of a call, a scalar tail that can round differently; every
  such op here runs on fixed 8192-element contiguous chunks (each below torch's parallel grain),
  so every element goes through the vector body.
Multiplication, addition, division and square root are correctly rounded per element on every
path, so they are used directly. Max is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK = 8192  # elements per transcendental call: a multiple of every vector width, < torch's grain


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (elementwise) applied in fixed-size contiguous chunks: position-independent results."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = torch.cat([fn(chunk) for chunk in flat.view(-1, CHUNK)])
    return out[:n].view(x.shape)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree (halves of the zero-padded power of two)."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0 ** exponent in float64, built from its bits (exact; normal range)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _split_rows(t: torch.Tensor, bits: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(high, low, shift) per row (last dim): t ~= (high + low * 2**-bits) * 2**-shift with
    integers |high| <= 2**bits, |low| <= 2**(bits - 1) (all steps exact but the two roundings)."""
    t = t.double()
    _, exponent = torch.frexp(t.abs().amax(-1, keepdim=True))  # max = m * 2**e, 0.5 <= m < 1
    shift = bits - exponent.to(torch.int64)
    scaled = t * _pow2(shift)  # |scaled| < 2**bits, exact (a power of two)
    high = _round(scaled)
    low = _round((scaled - high) * float(2 ** bits))  # the difference is exact
    return high, low, shift


_MAGIC = 1.5 * 2.0 ** 52


def _round(t: torch.Tensor) -> torch.Tensor:
    """Round float64 |t| < 2**51 to the nearest integer (ties to even) by two correctly rounded
    additions (torch.round is a slow scalar loop for float64 on some CPUs)."""
    return (t + _MAGIC) - _MAGIC


def matmul_bits(k: int) -> int:
    """Bits per operand so that K products sum exactly below 2**53."""
    return (53 - (k - 1).bit_length()) // 2


def exact_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., M, K] @ w[..., N, K]^T -> float64 [..., M, N], each row of x and of w quantised
    on its own (see the module docstring): bitwise independent of M, N, batch and threads."""
    bits = matmul_bits(x.shape[-1])
    hx, lx, sx = _split_rows(x, bits)
    hw, lw, sw = _split_rows(w, bits)
    hw, lw = hw.transpose(-1, -2), lw.transpose(-1, -2)
    cross = (hx @ lw) + (lx @ hw)  # each product exact; the sum rounds once, elementwise
    total = (hx @ hw) + cross * float(2.0 ** -bits)
    return total * _pow2(-(sx + sw.transpose(-1, -2)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) in `out_dtype`."""
    y = exact_matmul(x, weight)
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) per row, statistics in float32 (the HF formula with
    the reciprocal square root as sqrt then division, both correctly rounded)."""
    xf = x.float()
    var = tree_sum(xf * xf) / x.shape[-1]
    y = xf / torch.sqrt(var + eps)[..., None]
    return weight * y.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of queries q [B, Hq, Lq, D] at positions start[b] + i over keys/values
    [B, Hkv, S, D] (key j is position j; keys after a query's position are excluded: their
    weight is exactly 0 and the fixed-tree sums ignore a zero tail). -> [B, Lq, Hq, D].
    Dot products and sums are fixed trees in float32; queries go in blocks (bounded memory)."""
    b, hq, lq, d = q.shape
    group = hq // k.shape[1]
    kf, vt = k.float(), v.float().transpose(-1, -2)  # [B, Hkv, S, D], [B, Hkv, D, S]
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vt = vt.repeat_interleave(group, dim=1)
    s = kf.shape[2]
    qf = q.float()
    out = torch.empty(b, hq, lq, d, dtype=torch.float32, device=q.device)
    keys = torch.arange(s, device=q.device).view(1, 1, 1, s)
    step = max(1, (1 << 22) // max(1, b * hq * s * d))
    for i in range(0, lq, step):
        rows = min(step, lq - i)
        scores = tree_sum(qf[:, :, i:i + rows, None, :] * kf[:, :, None, :, :]) * scale
        pos = start.view(b, 1, 1, 1) + torch.arange(i, i + rows, device=q.device).view(
            1, 1, rows, 1)
        scores = scores.masked_fill(keys > pos, float("-inf"))
        weights = pointwise(torch.exp, scores - scores.amax(-1, keepdim=True))  # masked: 0
        total = tree_sum(weights[:, :, :, None, :] * vt[:, :, None, :, :])  # [B, Hq, rows, D]
        out[:, :, i:i + rows] = total / tree_sum(weights)[..., None]
    return out.to(q.dtype).transpose(1, 2)


def log_softmax(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(x / t) per row of x [N, V] (float32), t [N] float32."""
    z = x.float() / temperature[:, None]
    z = z - z.amax(-1, keepdim=True)
    total = tree_sum(pointwise(torch.exp, z))
    return z - pointwise(torch.log, total)[:, None]


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables [P, D] in float32 for float positions [P] (the HF formula)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return pointwise(torch.cos, emb) * scaling, pointwise(torch.sin, emb) * scaling
