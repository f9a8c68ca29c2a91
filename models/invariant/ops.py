"""The invariant operators with gradients: forward by the batch-invariant kernels of the tensor's
device (models/invariant/cpu.py, models/invariant/gpu.py), backward by ordinary torch ops.

The forward value is what must match between the inference worker and the trainer; the
backward is the gradient of that same function computed the usual way (cuBLAS / MKL matmuls,
a recomputed softmax for attention), so it costs what the default backward costs.
`RLX_INVARIANT_BACKEND=triton` runs the Triton kernels on CPU tensors too (with
TRITON_INTERPRET=1: the kernels' tests on machines without a GPU).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from models.invariant import cpu, gpu


def kernels(device: torch.device) -> ModuleType:
    """The kernel module for tensors on `device`: Triton on CUDA, exact torch ops on the CPU."""
    if device.type == "cuda" or os.environ.get("RLX_INVARIANT_BACKEND") == "triton":
        return gpu
    if device.type == "cpu":
        return cpu
    raise ValueError(f"true_on_policy has kernels for CPU and CUDA devices, not {device.type}")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernels(x.device).linear(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x.to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias): row-invariant; `out_dtype` defaults to weight's."""
    lead = x.shape[:-1]
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype or weight.dtype)
    return y.view(*lead, weight.shape[0])


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels(x.device).rmsnorm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat = xf * inv
        g = grad.float()
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gh = g * weight.float()
        gx = inv * (gh - xhat * (gh * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RmsNorm.apply(x, weight, eps)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return kernels(gate.device).silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g, u, dy = gate.float(), up.float(), grad.float()
        sig = torch.sigmoid(g)
        silu = g * sig
        dgate = dy * u * (sig * (1 + g * (1 - sig)))
        return dgate.to(gate.dtype), (dy * silu).to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate, up)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, start, scale):
        ctx.save_for_backward(q, k, v, start)
        ctx.scale = scale
        return kernels(q.device).attention(q, k, v, start, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, start = ctx.saved_tensors
        b, hq, lq, _ = q.shape
        hkv, s = k.shape[1], k.shape[2]
        group = hq // hkv
        qf = q.float()
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = (qf @ kf.transpose(-1, -2)) * ctx.scale
        pos = start.view(b, 1, 1, 1) + torch.arange(lq, device=q.device).view(1, 1, lq, 1)
        keep = torch.arange(s, device=q.device).view(1, 1, 1, s) <= pos
        probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        g = grad.float().transpose(1, 2)  # [B, Hq, Lq, D]
        dv = probs.transpose(-1, -2) @ g
        dp = g @ vf.transpose(-1, -2)
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
        dq = (ds @ kf) * ctx.scale
        dk = (ds.transpose(-1, -2) @ qf) * ctx.scale
        dk = dk.view(b, hkv, group, s, -1).sum(2)
        dv = dv.view(b, hkv, group, s, -1).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention, queries at positions start[b] + i -> [B, Lq, Hq, D] (see the kernels)."""
    return _Attention.apply(q, k, v, start, scale)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, temperature):
        out = kernels(x.device).log_softmax(x, temperature)
        ctx.save_for_backward(out, temperature)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, temperature = ctx.saved_tensors
        gz = grad - out.exp() * grad.sum(-1, keepdim=True)
        return gz / temperature[:, None], None


def log_softmax(x: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log_softmax(x / T) over the last dim, float32, rows independent of each other; T a
    float, or one per row ([N] for x [N, V]). T = 0 (greedy) counts as 1, as everywhere."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    if not torch.is_tensor(temperature):
        t = float(temperature) if temperature and temperature > 0 else 1.0
        temperature = torch.full((x2.shape[0],), t, dtype=torch.float32, device=x.device)
    else:
        temperature = temperature.to(device=x.device, dtype=torch.float32).reshape(-1)
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return _LogSoftmax.apply(x2, temperature).view(*lead, x.shape[-1])
