"""`python -m launch.watch ADDRESS|RUN_DIR`: a live board of every actor's latest metrics.

ADDRESS is the metrics endpoint a launcher prints (ipc://... or tcp://...); RUN_DIR is a run
directory, whose endpoints.json names it. With a run directory (or the ipc:// address of one) the
board starts from the last known state of every actor, read from RUN_DIR/metrics.jsonl, then
follows the live stream; actors of config.json that never reported are listed under the table.

One line per actor, with the metrics that matter for its role (trainer: loss, reward per domain,
step time; rollout: reward per domain, eval, tokens/s; workers: device memory; buffer: pending
and emitted samples; ...), as many as fit the terminal's width (80 columns is enough for the
main ones; narrower, the lower-priority metrics, then the `lost` and `step` columns, go); written
to a file or a pipe, the board is 80 columns wide, and the messages on stderr are wrapped at 80. An
actor silent for longer than a few times its usual publishing interval (estimated from its
records; `--stale-s` sets one threshold for all) is shown as `stale` with how long ago it last
reported. `lost` counts records the publisher dropped plus those missing from the stream.

`--jsonl FILE` appends every live record as one JSON line; `--no-live` (with --jsonl) shows no
board; `--duration-s 0` prints the board once and exits.

The watcher ends by itself with the run: a run directory whose exit.json is newer than the run's
start (config.json, endpoints.json: a resumed run rewrites both) has ended, and the watcher says
so (exit code and reason) and exits, at once when started on it, or once the launcher has gone
when it was following it. When nothing answers at the metrics address for a few seconds
(`--gone-s`) and the run directory records no end, its launcher is not running (killed, or its
host went down): the watcher says so and exits with code 1. While the run starts, the actors not
up yet are named (`waiting for router to start (12s)`; without a board, on stderr now and then).
Ctrl-C or SIGTERM ends it with code 0, whatever signal state it inherited.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import re
import signal
import statistics
import sys
import textwrap
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from transport.metrics import MetricsSubscriber
from transport.schema import Metrics
from transport.sockets import Security, SocketFactory

STALE_FACTOR = 3.0  # silent for this many usual intervals: stale
STALE_MIN_S = 5.0  # ... but never before this many seconds
DEFAULT_INTERVAL_S = 20.0  # an actor's interval until it has two records
HISTORY = 16  # record times kept per actor for the interval estimate (and read back on attach)
REFRESH_S = 0.25
GONE_S = 5.0  # nothing answers at the metrics address this long: the launcher is not running
ENDED_GRACE_S = 1.0  # once exit.json is there, records still in flight may arrive this long
PROGRESS_S = 10.0  # without a board, a wait (actors not up yet) is said again this often
ROLE_ORDER = ("trainer", "rollout", "buffer", "teachers", "prefetcher", "worker", "other")
# actor class module -> role, for actors whose metric names do not say it (yet)
CLS_ROLES = {"actors.trainer": "trainer", "actors.rollout": "rollout", "actors.buffer": "buffer",
             "actors.teacher_pool": "teachers", "actors.prefetcher": "prefetcher",
             "actors.inference": "worker", "actors.sglang_worker": "worker"}
LABEL_MAX = 14  # longest metric label (a long domain or teacher name is shortened)
ACTOR_MAX = 18  # widest actor column
ACTOR_MIN = 6
WIDTH = 80  # columns of the text written to a file or a pipe, and of the messages on stderr
METRICS_MIN = 24  # below this, the lost and step columns go and the actor column shrinks


# ----------------------------------------------------------------------------- formatting
def num(v: float) -> str:
    """A value in at most about 6 characters, 3 significant digits."""
    if math.isnan(v) or math.isinf(v):
        return str(v)
    a = abs(v)
    if a >= 1e15 or 0 < a < 1e-3:
        mantissa, _, exp = f"{v:.2g}".partition("e")
        return f"{mantissa}e{int(exp)}"
    if v == int(v) and a < 1e5:
        return str(int(v))
    if 1e3 <= a < 1e4:
        return f"{v:.0f}"
    if a >= 1e4:
        for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if a >= div:
                return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def secs(v: float) -> str:
    return num(v) + "s"


def nbytes(v: float) -> str:
    for div, suffix in ((1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{int(v)}B"


def ago(s: float) -> str:
    s = max(0.0, s)
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def shorten(name: str, width: int) -> str:
    """`name` in at most `width` characters, its middle replaced by '…' (ends tell actors and
    domains apart: worker-0 / worker-12)."""
    if len(name) <= width:
        return name
    if width <= 1:
        return name[:width]
    tail = (width - 1) // 2
    return name[:width - 1 - tail] + "…" + (name[-tail:] if tail else "")


# ----------------------------------------------------------------------------- metrics per role
@dataclass
class Field:
    """One metric in a row: `label=value`, or a flag shown as its label when true."""

    label: str
    value: float
    fmt: Callable[[float], str] | None = num  # None: a flag

    def text(self) -> str:
        label = shorten(self.label, LABEL_MAX)
        if self.fmt is None:
            return label if self.value else ""
        return f"{label}={self.fmt(self.value)}"


class _Picker:
    """Fields in priority order from one actor's values, remembering which keys it used."""

    def __init__(self, values: dict[str, float]):
        self.values, self.used, self.fields = values, set(), []

    def one(self, key: str, label: str, fmt: Callable[[float], str] | None = num) -> None:
        if key in self.values and key not in self.used:
            self.used.add(key)
            self.fields.append(Field(label, self.values[key], fmt))

    def each(self, pattern: str, label: str, fmt: Callable[[float], str] = num) -> None:
        """Every key matching `pattern` (one group: the name, e.g. a domain) as `label % name`."""
        rx = re.compile(pattern)
        for key in self.values:
            match = rx.fullmatch(key)
            if match and key not in self.used:
                self.used.add(key)
                self.fields.append(Field(label % match.group(1), self.values[key], fmt))

    def rest(self) -> list[Field]:
        """The keys no role picked, shown last (on a wide terminal), without their first part
        (train/entropy: entropy) where that leaves them apart."""
        keys = [k for k in self.values if k not in self.used]
        short = [k.partition("/")[2] or k for k in keys]
        for key, label in zip(keys, short):
            self.fields.append(Field(label if short.count(label) == 1 else key,
                                     self.values[key]))
        return self.fields


def role_of(values: dict[str, float], cls: str = "") -> str:
    keys = list(values)
    if any(k.startswith("train/") for k in keys) or "time/step_s" in values:
        return "trainer"
    if any(k.startswith("rollout/") for k in keys):
        return "rollout"
    if "memory/device_bytes" in values or any(k.startswith("engine/") for k in keys):
        return "worker"
    if any(k.startswith("buffer/") for k in keys):
        return "buffer"
    if any(k.startswith("prefetch/") for k in keys):
        return "prefetcher"
    if any(k.startswith("opd/") for k in keys):
        return "teachers"
    return CLS_ROLES.get(cls.partition(":")[0], "other")


def fields_of(role: str, values: dict[str, float]) -> list[Field]:
    p = _Picker(values)
    if role == "trainer":
        p.one("train/loss", "loss")
        p.one("time/step_s", "dt", secs)
        p.each(r"reward/(.+)", "r/%s")
        p.each(r"final_eval/(.+)", "eval/%s")
        p.one("time/wait_batch_s", "wait", secs)
        p.one("time/weight_sync_s", "sync", secs)
        p.one("train/kl_loss", "kl")
        p.one("train/grad_norm", "gnorm")
        p.one("train/entropy", "ent")
        p.one("train/staleness_mean", "stale")
        p.one("train/ppo_kl", "ppo_kl")
        p.one("train/value_loss", "vloss")
        p.one("version", "ver")
        p.each(r"memory/(\w+)/trainer_device_bytes", "mem/%s", nbytes)
        p.each(r"memory/(\w+)/trainer_nvml_bytes", "nvml/%s", nbytes)
    elif role == "rollout":
        p.each(r"rollout/reward/(.+)", "r/%s")
        p.each(r"eval/(.+)", "eval/%s")
        p.one("rollout/tokens_per_s", "tok/s")
        p.one("rollout/failed", "failed")
        p.one("rollout/batch_s", "batch", secs)
        p.one("rollout/trainer_version", "ver")
        p.each(r"rollout/response_len/(.+)", "len/%s")
    elif role == "worker":
        p.one("memory/device_bytes", "mem", nbytes)
        p.one("memory/nvml_bytes", "nvml", nbytes)
        p.one("memory/released", "released", None)
        p.one("engine/running", "run")
        p.one("engine/waves", "waves")
    elif role == "buffer":
        p.one("buffer/pending", "pend")
        p.one("buffer/ready_groups", "ready")
        p.one("buffer/emitted", "emit")
        dropped = {k: v for k, v in values.items() if k.startswith("buffer/dropped_")}
        if dropped:
            p.used |= set(dropped)
            p.fields.append(Field("drop", sum(dropped.values())))
        p.one("buffer/added", "added")
        p.one("buffer/journal_bytes", "journal", nbytes)
    elif role == "teachers":
        p.each(r"opd/([^/]+)/sampled_reverse_kl", "kl/%s")
        p.each(r"opd/([^/]+)/failed_samples", "fail/%s")
        p.one("opd/unrouted_samples", "unrouted")
        p.each(r"opd/([^/]+)/tokens_scored", "tok/%s")
    elif role == "prefetcher":
        p.one("prefetch/gbps", "GB/s")
        p.one("prefetch/bytes", "read", nbytes)
        p.one("prefetch/in_flight", "in_flight")
    return p.rest()


def fit(fields: list[Field], width: int) -> str:
    """The fields, in order, that fit in `width` (the first one cut if even it does not)."""
    out: list[str] = []
    used = 0
    for f in fields:
        text = f.text()
        if not text:
            continue
        need = len(text) + (1 if out else 0)
        if used + need > width:
            if not out:
                out.append(_clip(text, width))
            break
        out.append(text)
        used += need
    return " ".join(out)


# ----------------------------------------------------------------------------- the board
@dataclass
class ActorState:
    name: str
    values: dict[str, float] = field(default_factory=dict)  # latest value of every key seen
    value_time: dict[str, float] = field(default_factory=dict)  # ... and when it was published
    step: int | None = None
    total_steps: int | None = None
    last_time: float = -math.inf
    dropped: int = 0
    records: int = 0
    times: deque = field(default_factory=lambda: deque(maxlen=HISTORY + 1))
    seen: deque = field(default_factory=lambda: deque(maxlen=4 * HISTORY))  # (seq, time_s)

    def interval(self) -> float | None:
        """Median time between this actor's recent records; None with fewer than two."""
        gaps = [b - a for a, b in itertools.pairwise(self.times) if b > a]
        return statistics.median(gaps) if gaps else None


@dataclass
class Row:
    name: str
    role: str
    step: str
    status: str
    stale: bool
    lost: int
    fields: list[Field]
    age: float = 0.0


class Board:
    """Every actor's last known state (merged over its records), rendered to fit a terminal."""

    def __init__(self, clock: Callable[[], float] = time.time, stale_s: float | None = None,
                 run_dir: Path | None = None, label: str = ""):
        self.clock = clock
        self.stale_s = stale_s
        self.run_dir = run_dir
        self.label = label or (run_dir.name if run_dir else "")
        self.actors: dict[str, ActorState] = {}
        self.classes: dict[str, str] = {}  # actor -> class, from config.json
        self.gaps: dict[str, int] = {}  # records missing from the live stream, per actor
        self._exit: tuple[float, str] | None = None  # exit.json's mtime and 'exit N'
        # the actors the launcher has started (endpoints.json lists them once every one is up):
        # None = not known (no run directory), so every silent actor is 'no record yet'
        self.up: set[str] | None = None
        self.starting_since: float | None = None  # when the start began, while it goes on
        self.start_noted = -math.inf  # the mtime of the endpoints.json read for those two
        # (the metrics address, seconds it has not answered) while it does not
        self.unanswered: tuple[str, float] | None = None

    # -- input
    def expect(self, classes: dict[str, str]) -> None:
        """The run's actors (name -> class): those that never report are named under the table."""
        self.classes.update(classes)

    def update(self, m: Metrics) -> bool:
        """Take one record; False when it was seen before (history and stream overlap)."""
        a = self.actors.get(m.actor)
        if a is None:
            a = self.actors[m.actor] = ActorState(m.actor)
        key = (m.seq, m.time_s)
        if key in a.seen:
            return False
        a.seen.append(key)
        a.records += 1
        for k, v in m.values.items():  # a late record (out of order) replaces no newer value
            if m.time_s >= a.value_time.get(k, -math.inf):
                a.values[k], a.value_time[k] = v, m.time_s
        if m.time_s < a.last_time:
            return True
        if m.step is not None:
            a.step = m.step
        if m.total_steps is not None:
            a.total_steps = m.total_steps
        a.last_time, a.dropped = m.time_s, m.dropped
        a.times.append(m.time_s)
        return True

    # -- state
    def stale_after(self, a: ActorState) -> float:
        """Seconds of silence after which `a` is stale."""
        if self.stale_s is not None:
            return self.stale_s
        return max(STALE_FACTOR * (a.interval() or DEFAULT_INTERVAL_S), STALE_MIN_S)

    def ended(self) -> str | None:
        """'exit N' once the run ended (the launcher's exit.json, newer than every record and
        than the run's start: a resumed run writes into the same folder), else None."""
        if self.run_dir is None:
            return None
        path = self.run_dir / "exit.json"
        try:
            mtime = path.stat().st_mtime
            if self._exit is None or self._exit[0] != mtime:
                self._exit = (mtime, f"exit {json.loads(path.read_text()).get('exit_code')}")
        except (OSError, ValueError):
            return None
        newest = max((a.last_time for a in self.actors.values()), default=-math.inf)
        return self._exit[1] if mtime >= max(newest, started_at(self.run_dir)) else None

    def silent(self, ended: bool = False) -> tuple[list[str], list[str]]:
        """The run's actors not heard from: (those not started yet, the others without any
        record). Not started: not among the actors endpoints.json lists, and no record since
        the start began (a resumed run's actors reported before it). Without a run directory,
        or once the run ended, none counts as not started."""
        waiting = []
        if self.up is not None and not ended:
            since = -math.inf if self.starting_since is None else self.starting_since
            waiting = [n for n in self.classes if n not in self.up and (
                n not in self.actors or self.actors[n].last_time < since)]
        return waiting, [n for n in self.classes if n not in self.actors and n not in waiting]

    def waiting_text(self, now: float) -> str:
        """'waiting for a, b to start (12s)' while some actors of the run are not up, else ''."""
        waiting, _ = self.silent()
        if not waiting:
            return ""
        since = f" ({ago(now - self.starting_since)})" if self.starting_since is not None else ""
        return f"waiting for {', '.join(waiting)} to start{since}"

    def rows(self, now: float, ended: bool = False) -> list[Row]:
        out = []
        for a in self.actors.values():
            age = now - a.last_time
            stale = not ended and age > self.stale_after(a)
            step = "" if a.step is None else f"{a.step}" + (
                f"/{a.total_steps}" if a.total_steps is not None else "")
            role = role_of(a.values, self.classes.get(a.name, ""))
            out.append(Row(a.name, role, step, ("stale " if stale else "") + ago(age), stale,
                           a.dropped + self.gaps.get(a.name, 0), fields_of(role, a.values), age))
        return sorted(out, key=lambda r: (ROLE_ORDER.index(r.role), _natural(r.name)))

    # -- rendering
    def render(self, width: int, height: int, now: float | None = None) -> list[Text]:
        """The board as lines of at most `width` cells, at most `height` lines (every actor
        keeps a line of its own while they fit; past that, fresh actors of one role share one)."""
        now = self.clock() if now is None else now
        ended = self.ended()
        rows = self.rows(now, ended=ended is not None)
        waiting, silent = self.silent(ended is not None)
        n_stale = sum(r.stale for r in rows)
        title = " · ".join(p for p in (
            "rlx watch", shorten(self.label, 32), f"{len(rows)} actors",
            f"{n_stale} stale" if n_stale else "", f"run ended ({ended})" if ended else "",
            time.strftime("%H:%M:%S", time.localtime(now))) if p)
        lines = [Text(_clip(title, width), style="bold")]
        footer = []
        if self.unanswered is not None and not ended:
            address, seconds = self.unanswered
            footer.append(Text(_clip(f"no answer at {address} for {ago(seconds)}: is the "
                                     f"launcher running?", width), style="bold yellow"))
        if waiting:
            footer.append(Text(_clip(self.waiting_text(now), width), style="yellow"))
        if silent:
            footer.append(Text(_clip("no record yet: " + ", ".join(silent), width),
                               style="yellow"))
        if not rows:
            lines.append(Text(_clip("waiting for the first metrics record...", width),
                              style="dim"))
            return (lines + footer)[:max(1, height)]
        room = max(1, height - len(lines) - 1 - len(footer))
        rows = _collapse(rows, room)
        lines += _table(rows, width)
        return (lines + footer)[:max(1, height)]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # one line short of the terminal: a full-height live display scrolls
        yield from self.render(options.max_width, (options.height or options.size.height) - 1)


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def _collapse(rows: list[Row], room: int) -> list[Row]:
    """At most `room` rows: fresh actors of the largest role share one row first (stale ones
    always keep their own); if that is not enough, the last rows become '+N more'."""
    while len(rows) > room:
        by_role: dict[str, list[Row]] = {}
        for r in rows:
            if not r.stale:
                by_role.setdefault(r.role, []).append(r)
        groups = [g for g in by_role.values() if len(g) > 1]
        if not groups:
            break
        group = max(groups, key=len)
        members = {id(r) for r in group}
        at = next(i for i, r in enumerate(rows) if id(r) in members)
        rows = [r for r in rows if id(r) not in members]
        rows.insert(at, _merge(group))
    if len(rows) > room:
        keep = {id(r) for r in sorted(rows, key=lambda r: not r.stale)[:max(0, room - 1)]}
        hidden = len(rows) - len(keep)
        rows = [r for r in rows if id(r) in keep] + [
            Row(f"+{hidden} more", "other", "", "", False, 0, [])]
    return rows


def _merge(group: list[Row]) -> Row:
    names = [r.name for r in group]
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix.rstrip("0123456789-_.") or group[0].role
    fields: dict[str, list[Field]] = {}
    for r in group:
        for f in r.fields:
            fields.setdefault(f.label, []).append(f)
    merged = []
    for label, fs in fields.items():
        lo, hi = min(f.value for f in fs), max(f.value for f in fs)
        if fs[0].fmt is None:
            n = sum(1 for f in fs if f.value)
            if n:
                merged.append(Field(label, n))
        elif lo == hi:
            merged.append(Field(label, lo, fs[0].fmt))
        else:
            fmt = fs[0].fmt
            merged.append(Field(label, lo,
                                lambda _, lo=lo, hi=hi, fmt=fmt: f"{fmt(lo)}..{fmt(hi)}"))
    steps = sorted({r.step for r in group if r.step})
    oldest = max(group, key=lambda r: r.age)
    return Row(f"{prefix}×{len(group)}", group[0].role, steps[0] if steps else "", oldest.status,
               False, sum(r.lost for r in group), merged, oldest.age)


def _table(rows: list[Row], width: int) -> list[Text]:
    """Header and one line per row. Columns: actor, step, last (age), lost (only when some
    record was lost), metrics. So that the metrics keep at least METRICS_MIN cells where
    possible, the lost column goes first, then the actor column shrinks to 10, then the step
    column goes, then the actor column shrinks to ACTOR_MIN."""
    status_w = max(len("last"), *(len(r.status) for r in rows))
    cols = {"actor": min(ACTOR_MAX, max(len("actor"), *(len(r.name) for r in rows))),
            "step": max(len("step"), *(len(r.step) for r in rows)),
            "last": status_w}
    if any(r.lost for r in rows):
        cols["lost"] = max(len("lost"), *(len(str(r.lost)) for r in rows))

    def room() -> int:  # what is left for the metrics (a space before each column but the first)
        return width - sum(cols.values()) - len(cols)

    for cut in ("lost", 10, "step", ACTOR_MIN):  # until the metrics have METRICS_MIN cells
        if room() >= METRICS_MIN:
            break
        if isinstance(cut, int):
            cols["actor"] = max(min(cut, cols["actor"]), cols["actor"] - (METRICS_MIN - room()))
        else:
            cols.pop(cut, None)
    while sum(cols.values()) + len(cols) - 1 > width and cols["actor"] > 1:  # tiny terminals
        cols["actor"] -= 1
    metrics_w = room()
    header = Text(style="bold")
    for name, w in cols.items():
        header.append(("" if name == "actor" else " ") + name.ljust(w))
    if metrics_w > 0:
        header.append(" metrics")
    out = [header]
    for r in rows:
        style = "bold red" if r.stale else ""
        line = Text()
        line.append(shorten(r.name, cols["actor"]).ljust(cols["actor"]), style=style or "cyan")
        if "step" in cols:
            line.append(" " + r.step.ljust(cols["step"]))
        line.append(" " + r.status.ljust(cols["last"]), style=style or "dim")
        if "lost" in cols:
            line.append(" " + (str(r.lost) if r.lost else "").ljust(cols["lost"]),
                        style="yellow" if r.lost else "")
        if metrics_w > 0:
            line.append(" " + fit(r.fields, metrics_w))
        out.append(line)
    for line in out:
        line.rstrip()
        line.truncate(width)
    return out


# ----------------------------------------------------------------------------- history
def read_history(path: Path, per_actor: int = HISTORY, actors: set[str] | None = None,
                 chunk: int = 1 << 20) -> list[Metrics]:
    """The last `per_actor` records of every actor in a metrics.jsonl, oldest first. Read from
    the end, stopping once each of `actors` (all of the file when None) has `per_actor`
    records; a line that does not decode (one being written) is skipped."""
    decoder = msgspec.json.Decoder(Metrics)
    found: dict[str, list[Metrics]] = {}
    full: set[bytes] = set()  # actors (as the launcher encodes them) with all their records
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        pos, rest = f.seek(0, 2), b""
        while pos > 0:
            n = min(chunk, pos)
            pos -= n
            f.seek(pos)
            lines = (f.read(n) + rest).split(b"\n")
            rest = lines.pop(0) if pos > 0 else b""  # may start mid-line: joined to the next
            for line in reversed(lines):
                # the launcher writes the actor first: a line of an actor already complete is
                # skipped undecoded (a long run's file is mostly such lines)
                if not line.strip() or line.startswith(_PREFIX) and \
                        line[len(_PREFIX):].partition(b'"')[0] in full:
                    continue
                try:
                    m = decoder.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                mine = found.setdefault(m.actor, [])
                mine.append(m)
                if len(mine) >= per_actor:
                    full.add(msgspec.json.encode(m.actor)[1:-1])
            if actors and all(len(found.get(a, ())) >= per_actor for a in actors):
                break
    return sorted((m for ms in found.values() for m in reversed(ms)), key=lambda m: m.time_s)


_PREFIX = b'{"type":"Metrics","actor":"'  # how msgspec.json.encode(Metrics) starts


def load_history(board: Board, run_dir: Path) -> None:
    """The board from the last records of the run's metrics.jsonl."""
    for m in read_history(run_dir / "metrics.jsonl", actors=set(board.classes) or None):
        board.update(m)


def actor_classes(run_dir: Path) -> dict[str, str]:
    """name -> class of the actors in run_dir/config.json (empty if there is none)."""
    try:
        actors = json.loads((run_dir / "config.json").read_text()).get("actors", {})
    except (OSError, ValueError):
        return {}
    return {name: a.get("cls", "") for name, a in actors.items() if isinstance(a, dict)}


# ----------------------------------------------------------------------------- the run's state
def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -math.inf


def started_at(run_dir: Path) -> float:
    """When the run in `run_dir` last started: the launcher writes config.json, then
    endpoints.json, at every start, a resumed run's too (-inf when neither is there)."""
    return max(_mtime(run_dir / "config.json"), _mtime(run_dir / "endpoints.json"))


def run_end(run_dir: Path) -> dict | None:
    """exit.json when it records the end of the run now in `run_dir` (written after the run's
    last start), else None: the run goes on, or its launcher died before it could say."""
    path = run_dir / "exit.json"
    try:
        mtime = path.stat().st_mtime
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or mtime < started_at(run_dir):
        return None
    return doc


def end_text(run_dir: Path, doc: dict) -> str:
    reason = doc.get("reason")
    return (f"the run in {run_dir} has ended: exit code {doc.get('exit_code')}"
            + (f", {reason}" if reason else "")
            + "; nothing more will come (exit.json there says how each actor ended)")


def gone_text(endpoint: str, seconds: float, run_dir: Path | None, refused: str) -> str:
    text = f"nothing answers at {endpoint} for {seconds:g}s" + (
        f" (the last attempt: {refused})" if refused else "")
    if run_dir is None:
        return text + ": no launcher is running there (its run ended, or it never started)"
    try:
        source = json.loads((run_dir / "config.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    return (f"{text}, and {run_dir} records no end of the run (no exit.json since it started): "
            f"its launcher is not running (it was killed, or its host went down); continue the "
            f"run with python -m launch.cluster {source or '<hosts.toml>'} --resume {run_dir}")


def note_start(board: Board, run_dir: Path) -> None:
    """Which actors the launcher has started: endpoints.json lists them once every one is up
    (until then, none is known to be, and the start began when the file was written)."""
    try:
        mtime = (run_dir / "endpoints.json").stat().st_mtime
        if mtime == board.start_noted:
            return
        doc = json.loads((run_dir / "endpoints.json").read_text())
    except (OSError, ValueError):
        return
    board.start_noted = mtime
    actors = doc.get("actors") if isinstance(doc, dict) else None
    if isinstance(actors, dict):
        board.up, board.starting_since = set(actors), None
    else:
        board.up, board.starting_since = set(), mtime


class Link:
    """Whether anything answers at the subscriber's address, from its socket's events. A
    connection made before the monitor was attached goes unseen, so the address counts as
    answering until an event says otherwise; a refused or dropped connection is retried every
    100 ms, so it always shows."""

    FAILED = frozenset({zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECT_RETRIED,
                        zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH})

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.mon = sock.get_monitor_socket()
        self.since: float | None = None  # time.monotonic() since which nothing answers
        self.refused = ""  # the last handshake failure (CURVE keys), said when giving up

    def poll(self) -> None:
        """Take the events so far."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.since, self.refused = None, ""
            elif event in self.FAILED:
                if self.since is None:
                    self.since = time.monotonic()
                if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                    self.refused = ("the launcher refused our CURVE keys (--keys-dir)"
                                    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
                                    "the handshake failed (CURVE on one side only?)")

    def unanswered(self) -> float:
        """Seconds nothing has answered (0 while connected, or not known otherwise)."""
        return 0.0 if self.since is None else time.monotonic() - self.since

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.mon.close(linger=0)


def _say(text: str) -> None:
    """A message on stderr in lines of at most WIDTH columns (a word longer than that, a long
    path, stays whole so that it can be copied)."""
    print(textwrap.fill(f"rlx watch: {text}", WIDTH, subsequent_indent="  ",
                        break_long_words=False, break_on_hyphens=False),
          file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- command line
def resolve(target: str) -> str:
    if "://" in target:
        return target
    path = Path(target) / "endpoints.json"
    if not path.is_file():
        raise ValueError(f"{target} is neither an endpoint (ipc://..., tcp://...) nor a run "
                         f"directory with endpoints.json")
    return json.loads(path.read_text())["metrics"]


def run_dir_of(target: str, endpoint: str) -> Path | None:
    """The run directory behind `target`: itself, or for an ipc:// address the run whose
    socket folder (<run>/sock) holds it. None for other addresses."""
    if "://" not in target:
        return Path(target)
    if endpoint.startswith("ipc://"):
        run = Path(endpoint[len("ipc://"):]).parent.parent
        try:
            if json.loads((run / "endpoints.json").read_text()).get("metrics") == endpoint:
                return run
        except (OSError, ValueError):
            pass
    return None


def security_of(target: str, keys_dir: str | None) -> Security:
    """CURVE settings: `--keys-dir`, else those of the run directory's config.json (so a run
    with CURVE on is watched with its keys), else none."""
    if keys_dir:
        return Security(curve=True, keys_dir=keys_dir)
    config = Path(target) / "config.json"
    if config.is_file():
        return msgspec.convert(json.loads(config.read_text()).get("security", {}), Security)
    return Security()


async def watch(endpoint: str, jsonl: str | None, duration_s: float | None,
                live: bool, security: Security | None = None, run_dir: Path | None = None,
                console: Console | None = None, stale_s: float | None = None,
                clock: Callable[[], float] = time.time, gone_s: float = GONE_S,
                say: Callable[[str], None] = _say, stop: asyncio.Event | None = None) -> int:
    """Follow the metrics at `endpoint` until `duration_s` has passed, `stop` is set or the run
    is over (what ended it is said through `say`). 0, or 1 when nothing answered at `endpoint`
    for `gone_s` while the run directory (if any) records no end."""
    console = console or make_console()
    board = Board(clock=clock, stale_s=stale_s, run_dir=run_dir,
                  label="" if run_dir else endpoint)
    if run_dir is not None:
        board.expect(actor_classes(run_dir))
        end = run_end(run_dir)
        if end is not None:  # nothing will come: the last known state, and how the run ended
            if live:
                load_history(board, run_dir)
                console.print(board)
            say(end_text(run_dir, end))
            return 0
        note_start(board, run_dir)
    factory = SocketFactory(security=security)
    sub = MetricsSubscriber(factory, endpoint)  # subscribed before the history is read
    link = Link(sub.sock.sock)
    board.gaps = sub.gaps
    if live and run_dir is not None:
        load_history(board, run_dir)
    out = open(jsonl, "a") if jsonl else None
    stop = stop or asyncio.Event()

    async def receive() -> None:
        async for m in sub:
            board.update(m)
            if out is not None:
                out.write(msgspec.json.encode(m).decode() + "\n")
                out.flush()

    # a terminal gets a live view, refreshed from this loop (not rich's thread: the board is
    # only touched here); other outputs get the board once, at the end, and the waits on stderr
    view = Live(board, console=console, auto_refresh=False) if live and console.is_terminal \
        else None
    receiver = asyncio.ensure_future(receive())
    stopped = asyncio.ensure_future(stop.wait())
    deadline = None if duration_s is None else time.monotonic() + duration_s
    code, last_words = 0, ""
    ended_seen: float | None = None  # when exit.json was first seen ending the run
    said: tuple[tuple[str, ...], float] = ((), -math.inf)  # the wait said last, and when
    said_unanswered = False
    try:
        with view or contextlib.nullcontext():
            while True:
                link.poll()
                now, unanswered = time.monotonic(), link.unanswered()
                board.unanswered = (endpoint, unanswered) if unanswered >= min(
                    1.0, gone_s / 2) else None
                if run_dir is not None:
                    note_start(board, run_dir)
                    end = run_end(run_dir)
                    if end is not None:  # the launcher is going: its last records may follow
                        ended_seen = now if ended_seen is None else ended_seen
                        if unanswered > 0 or now - ended_seen >= ENDED_GRACE_S:
                            last_words = end_text(run_dir, end)
                            break
                if unanswered >= gone_s:
                    code, last_words = 1, gone_text(endpoint, gone_s, run_dir, link.refused)
                    break
                if stopped.done() or deadline is not None and now >= deadline:
                    break
                if receiver.done():
                    receiver.result()  # its error ends the watch
                if view is not None:
                    view.refresh()
                else:  # no board to show the waits: said now and then
                    waiting = tuple(board.silent()[0])
                    if waiting and (waiting != said[0] or now - said[1] >= PROGRESS_S):
                        say(board.waiting_text(board.clock()))
                        said = (waiting, now)
                    if board.unanswered is not None and not said_unanswered:
                        say(f"no answer at {endpoint} yet (is the launcher running?); giving "
                            f"up after {gone_s:g}s")
                        said_unanswered = True
                timeout = REFRESH_S if deadline is None else min(REFRESH_S, deadline - now)
                await asyncio.wait({receiver, stopped}, timeout=max(0.0, timeout))
    finally:
        for task in (receiver, stopped):
            task.cancel()
        await asyncio.gather(receiver, stopped, return_exceptions=True)
        if out is not None:
            out.close()
        link.close()
        sub.close()
        factory.close()
        if live and view is None:
            console.print(board)
    if last_words:
        say(last_words)
    return code


def make_console() -> Console:
    """The terminal's width on a terminal; WIDTH columns when the output is a file or a pipe
    (rich would take the width of whichever other stream is a terminal)."""
    console = Console()
    return console if console.is_terminal else Console(width=WIDTH)


def reach_signals() -> None:
    """Let SIGINT and SIGTERM reach this process whatever it inherited: a blocked mask and an
    ignored disposition both survive exec. A shell without job control (a script, a CI step)
    starts a background command (`cmd &`) with SIGINT ignored, and so does every process it
    starts in turn (a test suite and its subprocesses); Python then raises no KeyboardInterrupt
    and asyncio.run installs no handler, so Ctrl-C would do nothing. The loop's own handlers
    (watch_command) take over once it runs; until then, Ctrl-C raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


async def watch_command(*args, **kwargs) -> int:
    """`watch` until SIGINT or SIGTERM, which end it like its other ends (code 0)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await watch(*args, stop=stop, **kwargs)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.watch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="metrics endpoint or run directory")
    parser.add_argument("--jsonl", help="append every record to this file as JSON lines")
    parser.add_argument("--duration-s", type=float, help="stop after this many seconds")
    parser.add_argument("--no-live", action="store_true", help="no table (with --jsonl)")
    parser.add_argument("--keys-dir", help="CURVE keys of a run with security.curve = true "
                                           "(read from RUN_DIR/config.json when not given)")
    parser.add_argument("--stale-s", type=float,
                        help=f"an actor silent this long is stale (default: {STALE_FACTOR:g} "
                             f"times its usual interval, at least {STALE_MIN_S:g} s)")
    parser.add_argument("--gone-s", type=float, default=GONE_S,
                        help="stop (exit code 1) when nothing answers at the metrics address "
                             "this long and the run directory records no end (default: "
                             "%(default)g s)")
    args = parser.parse_args(argv)
    try:
        endpoint = resolve(args.target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        reach_signals()
        security = security_of(args.target, args.keys_dir)
        return asyncio.run(watch_command(endpoint, args.jsonl, args.duration_s,
                                         not args.no_live, security,
                                         run_dir_of(args.target, endpoint),
                                         stale_s=args.stale_s, gone_s=args.gone_s))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
