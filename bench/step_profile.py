"""Where one train step's time goes: a torch.profiler run summarised by kind of kernel.

    python -m bench.train_mfu --pack --backend torch,megatron --compile --profile
    python -m bench.train_mfu ... --profile --trace traces/   # also a Chrome trace per run

`profiled(fn, device, trace)` runs `fn` once under torch.profiler (CPU activity, and CUDA's on a
GPU) and returns a `StepProfile`: the wall time of that run, the summed time of the device
kernels it launched, the host gap between the two (time the GPU waited on the host: launches,
synchronisations, Python), each kind's time (`KINDS`: attention forward and backward, matrix
products, communication, compiled pointwise kernels, copies, other eager kernels) and the
kernels that took the most. On the CPU there are no device kernels: the table lists the
operators with the most time of their own instead, and no kinds.

The profiled run is an extra step after the timed ones (the profiler's overhead never reaches
the step times bench.train_mfu reports). Kernel time is a sum over kernels: kernels that
overlap (several streams) count once each, so with overlap the host gap reads low.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

# (kind, pattern over the lower-cased kernel name): the first kind whose pattern matches
KINDS: tuple[tuple[str, str], ...] = (
    ("attention bwd", r"flex_attention_backward|flash.*(bwd|backward)|fmha.*(bwd|backward)"
                      r"|attention.*backward|attn.*bwd"),
    ("attention fwd", r"flex_attention|flash|fmha|attention|attn"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|matmul|wgmma|addmm|bmm|_mm_|_mm$"),
    ("communication", r"nccl"),
    ("compiled pointwise", r"^triton_"),  # inductor's fused kernels (reductions too)
    ("copies", r"memcpy|memset|copy|catarray"),
    ("eager other", r""),
)
_PATTERNS = [(kind, re.compile(pattern)) for kind, pattern in KINDS]


def kind_of(kernel: str) -> str:
    """The kind (`KINDS`) of a device kernel's name."""
    name = kernel.lower()
    return next(kind for kind, pattern in _PATTERNS if pattern.search(name))


@dataclass
class StepProfile:
    """One profiled step (module doc); times in milliseconds."""

    wall_ms: float
    kernel_ms: float  # summed device kernel time; 0 on the CPU
    kinds: dict[str, float] = field(default_factory=dict)  # kind -> ms, slowest first
    top: list[tuple[str, float, int]] = field(default_factory=list)  # name, ms, calls

    @property
    def host_gap_ms(self) -> float:
        """Wall time the device had no kernel of this step running (0 on the CPU)."""
        return max(0.0, self.wall_ms - self.kernel_ms) if self.kernel_ms else 0.0

    def lines(self, label: str) -> list[str]:
        """What bench.train_mfu prints for the run `label`."""
        if self.kernel_ms:
            head = (f"profile {label}: step {self.wall_ms:.0f} ms, device kernels "
                    f"{self.kernel_ms:.0f} ms, host gap {self.host_gap_ms:.0f} ms; " + ", ".join(
                        f"{kind} {ms:.0f}" for kind, ms in self.kinds.items()))
            what = "kernels"
        else:
            head = f"profile {label}: step {self.wall_ms:.0f} ms (CPU: operators' own time)"
            what = "operators"
        rows = [f"  {ms:9.1f} ms {calls:6d}x  {name[:110]}" for name, ms, calls in self.top]
        return [head, f"  top {what}:", *rows]


def summarise(kernels: list[tuple[str, float]], wall_ms: float, top: int = 12) -> StepProfile:
    """A StepProfile of (kernel name, ms) pairs, one per launch."""
    per_name: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for name, ms in kernels:
        per_name[name] += ms
        calls[name] += 1
        kinds[kind_of(name)] += ms
    return StepProfile(wall_ms=wall_ms, kernel_ms=sum(per_name.values()),
                       kinds=dict(kinds.most_common()),
                       top=[(n, ms, calls[n]) for n, ms in per_name.most_common(top)])


def profiled(fn: Callable[[], Any], device: str, trace: str | Path | None = None,
             label: str = "step", top: int = 12) -> StepProfile:
    """Run `fn` once under torch.profiler (module doc); with `trace`, a Chrome trace
    `<trace>/<label>.json` too."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    if trace is not None:
        Path(trace).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace) / f"{label}.json"))
    if cuda:
        kernels = [(e.name, e.time_range.elapsed_us() / 1e3) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.is_user_annotation]  # a range on the GPU's row, not a kernel
        return summarise(kernels, wall_ms, top)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return StepProfile(wall_ms=wall_ms, kernel_ms=0.0,
                       top=[(e.key, e.self_cpu_time_total / 1e3, e.count) for e in ops[:top]])
