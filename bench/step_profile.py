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

Where the device waited (`idle_split`): the step's time with no kernel running on the device,
split by the trainer's phases (its `rlx.*` record_function ranges: recompute, forward, loss,
backward, optimizer; the rest "other") and by the innermost host operators that ran while it
waited ("(python)" where none did: the interpreter between operators).

Where the host's own time goes (`host_profiled`, bench.train_mfu --host-profile): one more step
under cProfile, the host's Python and the operators it calls, without any device activity: the
functions with the most time of their own, and those of the project, megatron-core and
transformers with the most time inside them. Where the device idles while the host runs
(a host-bound pass: a no-grad forward has no backward to hide the host's work), this names the
code that sets the pace.

Where the host waited for the device (`host_waits`): the CUDA synchronisations the step made
(`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`: a value read to
the host, `.item()`, a copy to host memory, `nonzero`), by phase and by the operator that made
each. After each one the device has nothing queued until the host launches again.
"""

from __future__ import annotations

import bisect
import cProfile
import pstats
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
    idle_phases: dict[str, float] = field(default_factory=dict)  # phase -> idle ms
    idle_ops: list[tuple[str, float]] = field(default_factory=list)  # host op, idle ms
    waits: dict[str, int] = field(default_factory=dict)  # phase -> host waits (`host_waits`)
    wait_ops: list[tuple[str, int]] = field(default_factory=list)  # operator, host waits

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
        idle = []
        if self.idle_phases:
            idle.append("  device idle by phase: " + ", ".join(
                f"{name} {ms:.0f}" for name, ms in self.idle_phases.items()))
        if self.idle_ops:
            idle.append("  device idle while the host ran: " + ", ".join(
                f"{name} {ms:.1f}" for name, ms in self.idle_ops))
        if self.kernel_ms:
            idle.append(f"  host waits for the device: {sum(self.waits.values())}" + (
                " (" + ", ".join(f"{name} {n}" for name, n in self.waits.items()) + "; "
                + ", ".join(f"{name} {n}" for name, n in self.wait_ops) + ")"
                if self.waits else ""))
        return [head, *idle, f"  top {what}:", *rows]


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


Span = tuple[str, float, float]  # name, start, end (one clock, any unit)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class _Idle:
    """The gaps between merged kernel intervals inside a window; `within(a, b)`: how much of
    [a, b] they cover."""

    def __init__(self, kernels: list[tuple[float, float]], window: tuple[float, float]):
        gaps, at = [], window[0]
        for start, end in _merged(kernels):
            if start > at:
                gaps.append((at, min(start, window[1])))
            at = max(at, end)
        if at < window[1]:
            gaps.append((at, window[1]))
        self.gaps = [(a, b) for a, b in gaps if b > a]
        self.starts = [a for a, _ in self.gaps]
        self.total = sum(b - a for a, b in self.gaps)

    def within(self, a: float, b: float) -> float:
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        covered = 0.0
        while i < len(self.gaps) and self.gaps[i][0] < b:
            covered += max(0.0, min(b, self.gaps[i][1]) - max(a, self.gaps[i][0]))
            i += 1
        return covered


def idle_split(kernels: list[tuple[float, float]], window: tuple[float, float],
               phases: list[Span], leaves: list[Span], top: int = 8
               ) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """The device's idle time in `window` (no interval of `kernels` running) by phase (the
    innermost of `phases` covering each moment, "other" outside them all) and by host
    operator (`leaves`: operators without children; "(python)" where no operator ran), in
    the spans' unit, largest first; the operators' top `top`. Phases nest (a range inside a
    range): a moment counts for the innermost."""
    idle = _Idle(kernels, window)
    by_phase: Counter[str] = Counter()
    # innermost phase first: a nested span's idle time is taken out of its parents'
    spans = sorted(phases, key=lambda p: p[2] - p[1])
    taken: list[tuple[float, float]] = []
    for name, a, b in spans:
        inner = _merged([(max(a, x), min(b, y)) for x, y in taken if x < b and y > a])
        by_phase[name] += max(0.0, idle.within(a, b) - sum(idle.within(x, y)
                                                            for x, y in inner))
        taken.append((a, b))
    by_phase["other"] = max(0.0, idle.total - sum(by_phase.values()))
    by_op: Counter[str] = Counter()
    busy_host = []
    for name, a, b in leaves:
        covered = idle.within(a, b)
        if covered > 0:
            by_op[name] += covered
        busy_host.append((a, b))
    host = _Idle(busy_host, window)  # moments no operator ran
    python = sum(idle.within(a, b) for a, b in host.gaps)
    if python > 0:
        by_op["(python)"] += python
    return ({k: v for k, v in by_phase.most_common() if v > 0}, by_op.most_common(top))


_RUNTIME = re.compile(r"^(cuda|cu[A-Z]|Memcpy|Memset)")  # CUDA runtime calls, not operators


def idle_of(events: list[Any], device: list[Any]) -> tuple[dict[str, float],
                                                             list[tuple[str, float]]]:
    """`idle_split` of a profiled step's events (ms): the window from the first host event to
    the last end of any event; an operator counts as a leaf when its only children are CUDA
    runtime calls (its launches count as its own time)."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not host or not device:
        return {}, []

    def span(e: Any) -> tuple[float, float]:
        return e.time_range.start / 1e3, e.time_range.end / 1e3

    window = (min(span(e)[0] for e in host),
              max(span(e)[1] for e in [*host, *device]))
    phases = [(e.name, *span(e)) for e in host if e.name.startswith("rlx.")]
    leaves = [(e.name, *span(e)) for e in host
              if not _RUNTIME.match(e.name) and not e.name.startswith("rlx.")
              and all(_RUNTIME.match(c.name) for c in e.cpu_children)]
    return idle_split([span(e) for e in device], window, phases, leaves)


_SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$")


def host_waits(events: list[Any], top: int = 6) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """(phase -> number of CUDA synchronisations the host made in it, the operators that made
    the most: `(name, count)`, the innermost operator around each, "(python)" outside any) of a
    profiled step's events; phases as `idle_of`'s (the innermost `rlx.*` range, else
    "other")."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    phases = [(e.time_range.start, e.time_range.end, e.name) for e in host
              if e.name.startswith("rlx.")]
    by_phase: Counter[str] = Counter()
    by_op: Counter[str] = Counter()
    for e in host:
        if not _SYNC.match(e.name):
            continue
        t = e.time_range.start
        around = [(end - start, name) for start, end, name in phases if start <= t < end]
        by_phase[min(around)[1] if around else "other"] += 1
        parent = getattr(e, "cpu_parent", None)
        by_op[parent.name if parent is not None else "(python)"] += 1
    return dict(by_phase.most_common()), by_op.most_common(top)


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
        events = prof.events()
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.is_user_annotation]  # a range on the GPU's row, not a kernel
        out = summarise([(e.name, e.time_range.elapsed_us() / 1e3) for e in device],
                        wall_ms, top)
        out.idle_phases, out.idle_ops = idle_of(events, device)
        out.waits, out.wait_ops = host_waits(events)
        return out
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return StepProfile(wall_ms=wall_ms, kernel_ms=0.0,
                       top=[(e.key, e.self_cpu_time_total / 1e3, e.count) for e in ops[:top]])


# the code whose time inside it `host_profiled` lists (paths containing one of these)
HOST_CODE = ("/training/", "/backends/", "/algos/", "/models/", "/megatron/core/",
             "/transformers/")


@dataclass
class HostProfile:
    """One step's host time under cProfile (module doc); times in milliseconds."""

    host_ms: float  # the step's call, the host's time (no wait for the device at its end)
    wall_ms: float  # the same call, then the device's queued work done
    by_self: list[tuple[str, float, int]] = field(default_factory=list)  # name, own ms, calls
    by_total: list[tuple[str, float, int]] = field(default_factory=list)  # name, ms inside, calls

    def lines(self, label: str) -> list[str]:
        """What bench.train_mfu prints for the run `label`."""
        return [f"host profile {label}: the host's {self.host_ms:.0f} ms of a "
                f"{self.wall_ms:.0f} ms step (under cProfile, which slows the host)",
                "  most time of their own:", *_rows(self.by_self),
                "  most time inside (the project, megatron-core, transformers):",
                *_rows(self.by_total)]


def _rows(entries: list[tuple[str, float, int]]) -> list[str]:
    return [f"  {ms:9.1f} ms {calls:6d}x  {name[:120]}" for name, ms, calls in entries]


def _function_name(key: tuple[str, int, str]) -> str:
    """pstats' (file, line, function) as `path:line(function)`, the path from the package."""
    path, line, function = key
    if path == "~":  # a built-in: its own description
        return function
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker)[-1]
            break
    else:
        root = str(Path(__file__).resolve().parent.parent) + "/"
        path = path.removeprefix(root)
    return f"{path}:{line}({function})"


def host_profiled(fn: Callable[[], Any], device: str, top: int = 15) -> HostProfile:
    """Run `fn` once under cProfile (module doc)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    host_ms = 1e3 * (time.perf_counter() - t0)
    sync()
    wall_ms = 1e3 * (time.perf_counter() - t0)
    stats = pstats.Stats(profiler).stats  # key -> (primitive calls, calls, own s, total s, _)
    own = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    inside = sorted(((k, v) for k, v in stats.items() if any(c in k[0] for c in HOST_CODE)),
                    key=lambda kv: kv[1][3], reverse=True)[:top]
    return HostProfile(host_ms=host_ms, wall_ms=wall_ms,
                       by_self=[(_function_name(k), 1e3 * v[2], v[1]) for k, v in own],
                       by_total=[(_function_name(k), 1e3 * v[3], v[1]) for k, v in inside])
