"""Batch-invariant forward kernels in Triton (CUDA; on the CPU under TRITON_INTERPRET=1 for tests).

Every kernel's launch configuration is a function of the weights' shapes and the dtype alone,
never of the number of rows, so a row is computed by the same instructions in the same order
whatever the batch, the padding or the sequence position:
- `linear`: one program per fixed BLOCK_M x BLOCK_N output tile, the whole K loop inside it in
  BLOCK_K steps from 0 (no split-K, no shape-dependent tile choice); bias in the epilogue.
- `rmsnorm`: one program per row, the row loaded whole (BLOCK = next power of two of the width),
  one `tl.sum` tree.
- `attention`: one program per (query block, batch row, head); keys are visited in BLOCK_N blocks
  aligned to position 0 with an online softmax. A block that holds none of a query's keys (the
  tail of a prefill tile) leaves that query's running max, sum and output untouched (selected,
  not multiplied by exp(0)), so prefill, cached decode (one query over the cache) and the
  training forward run the same sequence of block updates for every query. Queries always go
  through a BLOCK_M tile, one real row or many, so the matrix instructions are the same.
- `log_softmax`: one program per row, a fixed BLOCK_V loop (online max/sum, then the output),
  the temperature divided in the kernel.
Integer arguments that vary between calls are not specialised (`do_not_specialize`), so a
batch of one does not compile a variant of its own. What is left to torch (embedding gather,
RoPE, SiLU * up, residual adds) is elementwise, hence the same per element on CUDA.
"""

from __future__ import annotations

import torch

try:  # Triton is in the GPU image; the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

AVAILABLE = triton is not None

# one configuration per dtype, for every M: bf16/fp16 use the tensor cores; fp32 runs IEEE FMAs
# (Triton's default for a float32 dot would be TF32)
MATMUL_CONFIG = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2),
}
ATTENTION_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


if AVAILABLE:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
                       stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / H
        y = (x / tl.sqrt_rn(var + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(y_ptr + row * stride_y + offs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["Lq", "S"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, Lq, S, Hq, scale,
                          sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, som, soh,
                          GROUP: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // Hq
        h = bh % Hq
        hk = h // GROUP
        start = tl.load(start_ptr + b)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                    mask=offs_m[:, None] < Lq, other=0.0)
        pos = start + offs_m  # each query's position = its last visible key
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        hi = tl.minimum(start + tl.minimum((pid_m + 1) * BLOCK_M, Lq), S)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :],
                        mask=offs_n[:, None] < S, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                        mask=offs_n[:, None] < S, other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            live = n0 <= pos  # the block holds at least one of this query's keys
            l_i = tl.where(live, l_i * alpha + tl.sum(p, 1), l_i)
            acc = tl.where(live[:, None], acc * alpha[:, None] + pv, acc)
            m_i = tl.where(live, m_new, m_i)
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + offs_m[:, None] * som + h * soh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < Lq)

    @triton.jit
    def _log_softmax_kernel(x_ptr, t_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(t_ptr + row)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
            z = x.to(tl.float32) / t
            m_new = tl.maximum(m, tl.max(z, 0))
            total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
        log_total = tl.log(total)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=0.0)
            z = x.to(tl.float32) / t
            tl.store(y_ptr + row * stride_y + offs, (z - m) - log_total, mask=offs < V)


def _require() -> None:
    if not AVAILABLE:
        raise RuntimeError("true_on_policy on CUDA needs Triton (it is part of the GPU install "
                           "of torch); `import triton` failed")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) in `out_dtype`, fp32 accumulation."""
    _require()
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(MATMUL_CONFIG[weight.dtype])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k,
                         x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
                         out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                         IEEE=weight.dtype == torch.float32, **cfg)
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _require()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, shape[-1], x2.stride(0), out.stride(0),
                                        float(eps), BLOCK=triton.next_power_of_2(shape[-1]))
    return out.view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, S, D] (last dim contiguous), start [B] -> [B, Lq, Hq, D]."""
    _require()
    b, hq, lq, d = q.shape
    s = k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    out = torch.empty((b, lq, hq, d), dtype=q.dtype, device=q.device)
    if b == 0 or lq == 0:
        return out
    cfg = ATTENTION_CONFIG
    grid = (triton.cdiv(lq, cfg["BLOCK_M"]), b * hq)
    if start.dtype != torch.int32:
        start = start.to(torch.int32)
    _attention_kernel[grid](q, k, v, out, start.contiguous(), lq, s, hq,
                            float(scale), q.stride(0), q.stride(1), q.stride(2), k.stride(0),
                            k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                            out.stride(0), out.stride(1), out.stride(2),
                            GROUP=hq // k.shape[1], D=d, IEEE=q.dtype == torch.float32, **cfg)
    return out


def log_softmax(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(x / t) per row of x [N, V] (float32), t [N] float32."""
    _require()
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(x.shape[1]), 4096)
        _log_softmax_kernel[(x.shape[0],)](x, temperature.float().contiguous(), out, x.shape[1],
                                           x.stride(0), out.stride(0), BLOCK=block)
    return out


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
