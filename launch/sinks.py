"""Where the launcher writes the metrics stream: `[run] sinks = ["jsonl", "tensorboard", "wandb"]`.

Every record that any actor publishes reaches the launcher's metrics subscriber
(launch/cluster.py `show_progress`), which hands it to each sink of the run:

- `jsonl` (the default): <run_dir>/metrics.jsonl, one JSON object per record, as received
  but without its samples (below) (`launch.plot`, `launch.watch` and the tests read it).
- `tensorboard`: event files under <run_dir>/tensorboard through tensorboardX's SummaryWriter
  (`pip install tensorboardX`); open them with `tensorboard --logdir <run_dir>/tensorboard`.
- `wandb`: a W&B run under <run_dir>/wandb, offline unless `[run.wandb] mode` (or a WANDB_MODE
  variable) says otherwise, so no network is needed; `wandb sync <run_dir>/wandb/offline-run-*`
  uploads it later. The run's config is the resolved config.json; a `--resume`d run logs under
  the same W&B run id (kept in <run_dir>/wandb/rlx-run-id).

Samples: a record's `samples` (the rollout's text of a few episodes of each batch and of
every evaluation response, transport/schema.py SampleRecord) go to
<run_dir>/samples/<kind>.jsonl (`rollout.jsonl`, `eval.jsonl`; always, whatever `sinks` says),
one JSON object per sample with the record's actor, step and time; with the tensorboard sink
also as a text table per record (`<actor>/samples/<kind>`, add_text), with the wandb sink as a
W&B table (same key). metrics.jsonl holds the values only. A text is cut again to
SAMPLE_TEXT_CHARS and a record to MAX_SAMPLES_PER_RECORD samples here (a peer that did not cut
them is said once), so a huge or malformed sample cannot flood the disk or stop the stream.

TensorBoard and W&B get scalars keyed `<actor>/<metric>` (`trainer/train/loss`,
`rollout/rollout/reward/math`) at the record's step. Records without a step (the inference
workers' memory samples, the teacher pool) use the publisher's record number `seq` instead. W&B
keeps one step axis per actor, `<actor>/step` (define_metric), since actors are at different
steps at the same time and W&B's own step must only grow.

Invariants: `check` runs before anything starts and refuses a sink whose package does not import,
with the pip command; a sink that fails to write is closed and said once on the console, and the
other sinks, and the run, go on. The jsonl sink is the exception, since plots, `launch.watch`
and resumed runs read it: it survives a failed write (a full disk), counting what it drops, and
metrics.jsonl only ever holds whole lines (a resumed run appends after the last one).
"""

from __future__ import annotations

import importlib
import os
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

import msgspec

from launch.config import ConfigError, RunConfig, WandbConfig
from transport.errors import RlxError
from transport.metrics import cut
from transport.schema import SAMPLE_TEXT_CHARS, Metrics, SampleRecord

# sink -> (module it imports, what to pip install); the extras of pyproject.toml say the same
PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX>=2.6"),
            "wandb": ("wandb", "wandb>=0.19")}


SAMPLE_KINDS = ("rollout", "eval")  # samples/<kind>.jsonl; any other kind goes to other.jsonl
MAX_SAMPLES_PER_RECORD = 20_000  # samples of one record written; the rest is dropped and said
TEXT_TABLE_CHARS = 300  # a text's characters in a TensorBoard text table / W&B table cell


class SinkError(RlxError):
    """A sink could not be opened (before any actor started)."""


def check(run: RunConfig, path: str | Path) -> None:
    """ConfigError for a sink named twice, a `[run.wandb]` table that no `wandb` sink uses, or a
    sink whose package does not import (naming the pip command that installs it)."""
    where = f"{path}: table [run], field `sinks`"
    if len(set(run.sinks)) != len(run.sinks):
        raise ConfigError(f"{where}: a sink is named twice in {run.sinks}")
    if run.wandb != WandbConfig() and "wandb" not in run.sinks:
        raise ConfigError(f"{where}: [run.wandb] settings are given but `sinks` does not name "
                          f"\"wandb\"; add it: sinks = {[*run.sinks, 'wandb']}")
    for name in run.sinks:
        if name in PACKAGES:
            try:
                _require(name)
            except SinkError as e:
                raise ConfigError(f"{where}: {e}") from None


def _require(sink: str) -> Any:
    module, spec = PACKAGES[sink]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SinkError(f"the {sink!r} sink needs the {module} package, which does not import "
                        f"({e}); install it with: pip install '{spec}' (or, in the rlx "
                        f"checkout, pip install -e '.[{sink}]')") from None


def step_of(m: Metrics) -> int:
    """The x of a record: its step, or the publisher's record number when it has none."""
    return m.step if m.step is not None else m.seq


def scalars(m: Metrics) -> dict[str, float]:
    """The record's values keyed `<actor>/<metric>`."""
    return {f"{m.actor}/{k}": v for k, v in m.values.items()}


def sample_kind(s: SampleRecord) -> str:
    """The file a sample goes to (a kind that is no known one cannot name a path)."""
    return s.kind if s.kind in SAMPLE_KINDS else "other"


def sample_rows(m: Metrics) -> dict[str, list[dict[str, Any]]]:
    """The record's samples by kind, as rows: the record's actor, step and time, then every
    field of the sample, each text cut to SAMPLE_TEXT_CHARS."""
    out: dict[str, list[dict[str, Any]]] = {}
    for s in m.samples[:MAX_SAMPLES_PER_RECORD]:
        row = {"actor": m.actor, "step": m.step, "time_s": m.time_s}
        for k, v in msgspec.structs.asdict(s).items():
            row[k] = cut(v, SAMPLE_TEXT_CHARS) if isinstance(v, str) else v
        out.setdefault(sample_kind(s), []).append(row)
    return out


TABLE_COLUMNS = ["domain", "prompt", "response", "reward", "weight_version", "status", "error",
                 "task", "env"]


def table_cells(row: dict[str, Any]) -> list[Any]:
    return [cut(row[c], TEXT_TABLE_CHARS) if isinstance(row[c], str) else row[c]
            for c in TABLE_COLUMNS]


class Sink(Protocol):
    name: str

    def where(self) -> str: ...  # how to open what it writes, for the console

    def write(self, m: Metrics) -> None: ...

    def close(self, exit_code: int = 0) -> None: ...


class JsonlSink:
    """<run_dir>/metrics.jsonl: every record, appended as it arrives, one whole line each.

    The file always ends on a whole record: opening it cuts a partial last line (a launcher that
    died mid-write), and a write that fails (a full disk) is cut back off and counted, not
    raised; the sink says the first failure and, once writes succeed again, how many records
    were lost, and keeps writing the next records."""

    name = "jsonl"

    def __init__(self, path: Path, say: Callable[[str], None] = lambda text: None):
        self.path, self.say = path, say
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = self._cut_partial_line()  # bytes of whole records in the file
        self.torn = False  # a failed write left bytes past `size`
        self.dropped = 0  # records lost to failed writes since the last that succeeded
        self.dropped_total = 0

    def _cut_partial_line(self) -> int:
        size = os.fstat(self.fd).st_size
        if not size:
            return 0
        with open(self.path, "rb") as f:
            keep = _whole_lines_size(f, size)
        if keep < size:
            os.ftruncate(self.fd, keep)
            self.say(f"{self.path}: cut a partial last record ({size - keep} bytes) left by an "
                     f"earlier launcher; appending after the last whole one")
        return keep

    def where(self) -> str:
        return str(self.path)

    def write(self, m: Metrics) -> None:
        if m.samples:  # they go to samples/*.jsonl (SampleFiles)
            m = msgspec.structs.replace(m, samples=[])
        data = msgspec.json.encode(m) + b"\n"
        try:
            if self.torn:
                os.ftruncate(self.fd, self.size)
                self.torn = False
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            self._failed(e)
            return
        self.size += len(data)
        if self.dropped:
            self.say(f"metrics sink jsonl: writing {self.path} again; {self.dropped} record(s) "
                     f"were lost while it failed")
            self.dropped = 0

    def _failed(self, e: OSError) -> None:
        try:
            os.ftruncate(self.fd, self.size)
        except OSError:
            self.torn = True  # the next write cuts it first
        if not self.dropped:
            self.say(f"metrics sink jsonl: writing {self.path} failed ({e}); records are "
                     f"counted and dropped until a write succeeds, the run goes on")
        self.dropped += 1
        self.dropped_total += 1

    def close(self, exit_code: int = 0) -> None:
        os.close(self.fd)
        if self.dropped_total:
            self.say(f"metrics sink jsonl: {self.dropped_total} record(s) could not be written "
                     f"to {self.path} (see above); every line there is a whole record")


def _whole_lines_size(f: BinaryIO, size: int, chunk: int = 1 << 16) -> int:
    """The size of `f` (of `size` bytes) up to and including its last newline."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


class TensorBoardSink:
    """Event files under `logdir` (a resumed run adds a file there; TensorBoard merges them)."""

    name = "tensorboard"

    def __init__(self, logdir: Path, flush_s: float = 5.0):
        self.logdir = logdir
        self.writer = _require("tensorboard").SummaryWriter(str(logdir), flush_secs=flush_s)

    def where(self) -> str:
        return f"tensorboard --logdir {self.logdir}"

    def write(self, m: Metrics) -> None:
        step = step_of(m)
        for tag, value in scalars(m).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=m.time_s)
        for kind, rows in sample_rows(m).items() if m.samples else ():
            self.writer.add_text(f"{m.actor}/samples/{kind}", markdown_table(rows),
                                 global_step=step, walltime=m.time_s)

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a Markdown table (TensorBoard's text plugin renders it); `|` and backslashes in
    a text are escaped and line breaks shown as ⏎, so a cell stays a cell."""
    def cell(v: Any) -> str:
        text = v if isinstance(v, str) else f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", " ⏎ ")
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(c) for c in table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


class SampleFiles:
    """<run_dir>/samples/<kind>.jsonl: every sample of every record, one JSON object a line,
    appended (a resumed run goes on after the earlier lines)."""

    name = "samples"

    def __init__(self, folder: Path, say: Callable[[str], None] = lambda text: None):
        self.folder, self.say = folder, say
        self.files: dict[str, BinaryIO] = {}
        self.cut_said = False

    def where(self) -> str:
        return str(self.folder)

    def write(self, m: Metrics) -> None:
        if not m.samples:
            return
        if len(m.samples) > MAX_SAMPLES_PER_RECORD and not self.cut_said:
            self.cut_said = True
            self.say(f"samples: a record of {m.actor} held {len(m.samples)} samples; the first "
                     f"{MAX_SAMPLES_PER_RECORD} are kept (MAX_SAMPLES_PER_RECORD)")
        for kind, rows in sample_rows(m).items():
            f = self.files.get(kind)
            if f is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                f = self.files[kind] = open(self.folder / f"{kind}.jsonl", "ab")
            f.write(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))
            f.flush()

    def close(self, exit_code: int = 0) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}


class WandbSink:
    """One W&B run for the whole cluster, with one step axis per actor."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any]):
        wandb = _require("wandb")
        self.mode = os.environ.get("WANDB_MODE") or cfg.mode
        # wandb takes the process's mode from the environment as well: with init(mode=...)
        # alone, its own telemetry to W&B's servers stays on in an offline run
        os.environ["WANDB_MODE"] = self.mode
        root = run_dir / "wandb"
        root.mkdir(exist_ok=True)
        id_file = root / "rlx-run-id"  # a resumed run logs to the same W&B run
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=cfg.project, name=cfg.name or run_dir.name, entity=cfg.entity or None,
            group=cfg.group or None, tags=cfg.tags or None, config=config, dir=str(run_dir),
            mode=self.mode, id=run_id, resume="allow",
            settings=wandb.Settings(console="off", silent=True))
        # <run_dir>/wandb/offline-run-<time>-<id> (its files/ is run.dir); None when disabled
        self.run_path = Path(self.run.dir).parent if self.mode != "disabled" else None
        self.actors: set[str] = set()

    def where(self) -> str:
        if self.mode in ("offline", "dryrun"):
            return f"wandb sync {self.run_path}"
        return f"W&B run {self.run.id} ({self.mode})"

    def write(self, m: Metrics) -> None:
        if m.actor not in self.actors:
            self.actors.add(m.actor)
            self.run.define_metric(f"{m.actor}/step", hidden=True)
            self.run.define_metric(f"{m.actor}/*", step_metric=f"{m.actor}/step")
        row: dict[str, Any] = {**scalars(m), f"{m.actor}/step": step_of(m)}
        if m.samples:
            wandb = _require("wandb")
            for kind, rows in sample_rows(m).items():
                row[f"{m.actor}/samples/{kind}"] = wandb.Table(
                    columns=TABLE_COLUMNS, data=[table_cells(r) for r in rows])
        self.run.log(row)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)  # W&B marks a run that did not exit 0 as failed


class Sinks:
    """The run's sinks; one that raises is closed, said, and left out from then on."""

    def __init__(self, sinks: list[Sink], say: Callable[[str], None]):
        self.active = list(sinks)
        self.say = say

    def write(self, m: Metrics) -> None:
        for sink in list(self.active):
            try:
                sink.write(m)
            except Exception as e:
                self.active.remove(sink)
                self.say(f"metrics sink {sink.name} failed ({type(e).__name__}: {e}); it is "
                         f"off for the rest of the run, the other sinks go on")
                self._close(sink)

    def close(self, exit_code: int = 0) -> None:
        """Close every sink; `exit_code` is the run's (W&B records it)."""
        for sink in self.active:
            self._close(sink, exit_code)
        self.active = []

    def _close(self, sink: Sink, exit_code: int = 0) -> None:
        try:
            sink.close(exit_code)
        except Exception as e:
            self.say(f"metrics sink {sink.name}: closing failed ({type(e).__name__}: {e})")


def open_sinks(run: RunConfig, run_dir: Path, config: dict[str, Any],
               say: Callable[[str], None]) -> Sinks:
    """Open every sink of `run.sinks` (SinkError, with those already open closed, when one
    cannot be opened); `config` is the resolved config W&B records with its run."""
    opened: list[Sink] = [SampleFiles(run_dir / "samples", say)]
    try:
        for name in run.sinks:
            if name == "jsonl":
                opened.append(JsonlSink(run_dir / "metrics.jsonl", say))
            elif name == "tensorboard":
                opened.append(TensorBoardSink(run_dir / "tensorboard"))
            elif name == "wandb":
                opened.append(WandbSink(run.wandb, run_dir, config))
            else:
                raise SinkError(f"unknown metrics sink {name!r}")
    except Exception as e:
        Sinks(opened, say).close()
        if isinstance(e, SinkError):
            raise
        raise SinkError(f"metrics sink {name} could not be opened: {type(e).__name__}: {e}") \
            from e
    for sink in opened:
        if sink.name not in ("jsonl", "samples"):  # the defaults, where they always were
            say(f"metrics sink {sink.name}: {sink.where()}")
    return Sinks(opened, say)
