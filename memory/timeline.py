"""A timeline of every copy and compute phase: JSON for tools, a PNG for people.

Each event: kind (`h2d`, `d2h`, `h2h`, `disk`, `compute`, `wait`), tag, lane (the stream or
thread it ran on), start and end in seconds from the timeline's origin, bytes, and the tiers it
moved between. CUDA work is timed with CUDA events (resolved when the timeline is read, so
recording never synchronizes); host work with `time.perf_counter`.

Invariant: recording is cheap and never blocks a stream; `events()` synchronizes only on the
events it resolves.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Event:
    kind: str
    tag: str
    lane: str
    start_s: float
    end_s: float
    nbytes: int = 0
    src: str = ""
    dst: str = ""


class Timeline:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._done: list[Event] = []
        self._pending: list[tuple[Event, Any, Any]] = []  # (event, cuda start, cuda end)
        self._t0 = time.perf_counter()
        self._cuda0 = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add(self, kind: str, tag: str, lane: str, start_s: float, end_s: float | None = None,
            nbytes: int = 0, src: str = "", dst: str = "") -> None:
        if self.enabled:
            ev = Event(kind, tag, lane, start_s, self.now() if end_s is None else end_s, nbytes,
                       src, dst)
            with self._lock:
                self._done.append(ev)

    def cuda_span(self, stream: torch.cuda.Stream) -> CudaSpan:
        """Start a span on `stream`; `.end(...)` records its end event (no synchronization)."""
        if self._cuda0 is None:
            self._cuda0 = torch.cuda.Event(enable_timing=True)
            self._cuda0.record(stream)
            torch.cuda.current_stream().synchronize()
            self._cuda0.synchronize()
            self._cuda_host0 = self.now()  # the origin event ran at about this host time
        return CudaSpan(self, stream)

    def _add_cuda(self, ev: Event, start: Any, end: Any) -> None:
        if self.enabled:
            with self._lock:
                self._pending.append((ev, start, end))

    def events(self) -> list[Event]:
        with self._lock:
            pending, self._pending = self._pending, []
        for ev, start, end in pending:
            end.synchronize()
            ev.start_s = self._cuda_host0 + self._cuda0.elapsed_time(start) / 1e3
            ev.end_s = self._cuda_host0 + self._cuda0.elapsed_time(end) / 1e3
            with self._lock:
                self._done.append(ev)
        with self._lock:
            return sorted(self._done, key=lambda e: e.start_s)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps([asdict(e) for e in self.events()], indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text


class CudaSpan:
    def __init__(self, timeline: Timeline, stream: torch.cuda.Stream):
        self.timeline, self.stream = timeline, stream
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(stream)

    def end(self, kind: str, tag: str, lane: str, nbytes: int = 0, src: str = "",
            dst: str = "") -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.timeline._add_cuda(Event(kind, tag, lane, 0.0, 0.0, nbytes, src, dst), self.start,
                                end)


COLORS = {"compute": "#4c72b0", "h2d": "#dd8452", "d2h": "#55a868", "disk": "#8172b3",
          "h2h": "#937860", "wait": "#c44e52"}


def plot(events: list[Event] | list[dict], path: str | Path, title: str = "") -> None:
    """One row per lane, one bar per event, colored by kind, labelled with the tag."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evs = [e if isinstance(e, Event) else Event(**e) for e in events]
    lanes = sorted({e.lane for e in evs}, key=lambda x: (x != "compute", x))
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(lanes)))
    for e in evs:
        y = lanes.index(e.lane)
        ax.barh(y, e.end_s - e.start_s, left=e.start_s, height=0.7,
                color=COLORS.get(e.kind, "#999999"), edgecolor="black", linewidth=0.3)
        if e.end_s - e.start_s > 0.02 * max(x.end_s for x in evs):
            ax.text((e.start_s + e.end_s) / 2, y, e.tag, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title(title or "weight memory timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", fontsize=7, ncol=len(COLORS))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m memory.timeline TIMELINE.json OUT.png")
    plot(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
