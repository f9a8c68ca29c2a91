"""`python -m launch.plot RUN_DIR`: PNGs of a run's main series, from <run_dir>/metrics.jsonl.

Written into <run_dir>/plots/ (or `--out DIR`), x = the record's step unless said otherwise:

- reward.png: the rollout's reward per domain (`rollout/reward/<domain>`, by batch) and greedy
  eval accuracy per domain (`eval/<domain>`; the trainer's `final_eval/<domain>` as a point).
- kl_mismatch.png: the trainer's KL (`train/ppo_kl`, `train/policy_kl`, `train/kl_loss`); the
  train-rollout mismatch (`mismatch/kl_k3`, `train/logprob_abs_diff`,
  `train/engine_logprob_abs_diff`; log scale) and the share of importance weights outside the
  correction's bounds (`mismatch/token_outside_frac`, `mismatch/seq_outside_frac`), see
  algos/mismatch.py; staleness in weight versions (`train/staleness_mean`, `_max`).
- throughput.png: rollout tokens/s (`rollout/tokens_per_s`) and trainer tokens/s
  (`train/tokens` / `time/step_s` of the same record).
- step_time.png: the trainer's step time, stacked: `time/wait_batch_s`, `time/train_s`,
  `time/weight_sync_s`, with the whole `time/step_s` as a line (the gap is checkpointing).
- memory.png: device memory of every process publishing `memory/...bytes` (workers'
  `memory/device_bytes`, the trainer's `memory/<phase>/trainer_device_bytes`), in MiB, by
  seconds since the run's first record; drawn only where the metrics show a GPU or an NVMe
  tier (a `...nvml_bytes` key, published on CUDA, or the prefetcher's `prefetch/bytes` above
  0): on CPU alone the "device" is host memory, and the figure says nothing new.
- opd.png (distillation runs): the reverse KL to each teacher by trainer step
  (`opd/<teacher>/reverse_kl`, the whole step's `opd/reverse_kl`; the teacher pool's
  `opd/<teacher>/sampled_reverse_kl`); teacher swaps, the trainer's running counts of teacher
  loads onto the device (`opd/teacher_gpu_loads`), of those read from NVMe by GPUDirect
  (`opd/teacher_gds_loads`) and of prefetcher misses read synchronously instead
  (`opd/teacher_sync_fallbacks`); the prefetcher's NVMe reads (`prefetch/bytes`, MiB, by its
  record number: what it prefetched ahead of the switches).

A key is found whichever actor publishes it; a series published by several actors is labelled
`<actor>: <key>`. When an actor sent several records for one step (a restarted trainer redoing
steps), the last one counts. A figure or panel whose series are all missing is skipped with a
note, not an error. The launcher runs this at the end of every run (`[run] plots = false` turns
it off). Exit code: 0 when it ran (notes or not), 1 when there is no metrics.jsonl to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Series:
    x: list[float]
    y: list[float]


@dataclass
class Panel:
    """One axes: lines, optionally a stacked area (same x for all) and points."""

    title: str
    ylabel: str
    lines: dict[str, Series] = field(default_factory=dict)
    stacked: dict[str, Series] = field(default_factory=dict)
    points: dict[str, Series] = field(default_factory=dict)
    logy: bool = False  # log y axis (values spanning decades; see _log_scale)
    steps: bool = False  # a value holds until the next one (memory samples)

    def drawn(self) -> dict[str, Series]:
        return {**self.stacked, **self.lines, **self.points}


@dataclass
class PlotResult:
    written: dict[str, Path] = field(default_factory=dict)  # file name -> path
    notes: list[str] = field(default_factory=list)  # what was skipped, and why
    # file name -> panel title -> label -> the series drawn there
    drawn: dict[str, dict[str, dict[str, Series]]] = field(default_factory=dict)


def read_records(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """metrics.jsonl's records, holding only the values some figure draws (a long run's file
    is mostly other keys); a line that is not a record (a run killed mid-write) is skipped with
    a note."""
    records, bad = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if not (isinstance(r, dict) and isinstance(r.get("actor"), str)
                    and isinstance(r.get("values"), dict)):
                bad += 1
                continue
            r["values"] = {k: v for k, v in r["values"].items()
                           if plotted(k) and isinstance(v, (int, float))}
            if r["values"]:
                records.append(r)
    if bad:
        notes.append(f"{path}: {bad} line(s) that are not metrics records were skipped")
    return records


def _x_step(r: dict[str, Any]) -> float:
    return r["step"] if r.get("step") is not None else r.get("seq", 0)


def by_step(records: list[dict[str, Any]], key: str) -> dict[str, Series]:
    """actor -> its series of `key` by step (the last record of a step wins), sorted."""
    per: dict[str, dict[float, float]] = {}
    for r in records:
        if key in r["values"]:
            per.setdefault(r["actor"], {})[_x_step(r)] = float(r["values"][key])
    return {a: Series(sorted(pts), [pts[x] for x in sorted(pts)]) for a, pts in per.items()}


def ratio_by_step(records: list[dict[str, Any]], num: str, den: str) -> dict[str, Series]:
    """actor -> num / den of the records carrying both (den > 0), by step."""
    per: dict[str, dict[float, float]] = {}
    for r in records:
        v = r["values"]
        if num in v and den in v and v[den] > 0:
            per.setdefault(r["actor"], {})[_x_step(r)] = v[num] / v[den]
    return {a: Series(sorted(pts), [pts[x] for x in sorted(pts)]) for a, pts in per.items()}


def _labelled(found: dict[str, Series], key: str) -> dict[str, Series]:
    if len(found) == 1:
        return {key: next(iter(found.values()))}
    return {f"{actor}: {key}": s for actor, s in sorted(found.items())}


def keys_like(records: list[dict[str, Any]], prefix: str, suffix: str = "") -> list[str]:
    return sorted({k for r in records for k in r["values"]
                   if k.startswith(prefix) and k.endswith(suffix)})


def lines(records: list[dict[str, Any]], keys: list[str]) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for key in keys:
        out |= _labelled(by_step(records, key), key)
    return out


def reward_panels(records: list[dict[str, Any]]) -> list[Panel]:
    rewards = keys_like(records, "rollout/reward/")
    evals = keys_like(records, "eval/")
    finals = keys_like(records, "final_eval/")
    return [Panel("rollout reward per domain", "mean reward", lines(records, rewards)),
            Panel("greedy eval accuracy per domain", "accuracy", lines(records, evals),
                  points=lines(records, finals))]


# mismatch/abs_diff_mean is train/logprob_abs_diff again (the same tokens), so not drawn twice
MISMATCH = ["mismatch/kl_k3", "train/logprob_abs_diff", "train/engine_logprob_abs_diff"]
OUTSIDE = ["mismatch/token_outside_frac", "mismatch/seq_outside_frac"]


def kl_panels(records: list[dict[str, Any]]) -> list[Panel]:
    return [Panel("KL (trainer)", "per token", lines(records, ["train/ppo_kl", "train/policy_kl",
                                                                "train/kl_loss"])),
            Panel("train-rollout mismatch", "KL(rollout || train), mean |Δ log p|",
                  lines(records, MISMATCH), logy=True),
            Panel("importance weights outside [low, high]", "share", lines(records, OUTSIDE)),
            Panel("staleness", "weight versions",
                  lines(records, ["train/staleness_mean", "train/staleness_max"]))]


def throughput_panels(records: list[dict[str, Any]]) -> list[Panel]:
    trainer = _labelled(ratio_by_step(records, "train/tokens", "time/step_s"),
                        "trainer tokens/s (train/tokens / time/step_s)")
    return [Panel("throughput", "tokens/s", {**lines(records, ["rollout/tokens_per_s"]),
                                             **trainer})]


STEP_PARTS = ["time/wait_batch_s", "time/train_s", "time/weight_sync_s"]


def step_time_panels(records: list[dict[str, Any]], notes: list[str]) -> list[Panel]:
    """The parts stacked for each actor that publishes all of them, at the steps where it
    published all of them."""
    panels = []
    parts = {key: by_step(records, key) for key in STEP_PARTS}
    actors = sorted(set.intersection(*(set(p) for p in parts.values())))
    for actor in actors:
        steps = sorted(set.intersection(*(set(parts[k][actor].x) for k in STEP_PARTS)))
        stacked = {}
        for key in STEP_PARTS:
            s = parts[key][actor]
            at = dict(zip(s.x, s.y))
            stacked[key] = Series(steps, [at[x] for x in steps])
        total = by_step(records, "time/step_s").get(actor)
        title = "step time" if len(actors) == 1 else f"{actor}: step time"
        panels.append(Panel(title, "seconds", {"time/step_s": total} if total else {},
                            stacked=stacked))
    some = [k for k, p in parts.items() if p]
    if some and not actors:
        notes.append(f"step_time.png: {', '.join(some)} found, but no actor publishes all of "
                     f"{', '.join(STEP_PARTS)}")
    return panels or [Panel("step time", "seconds")]


def has_gpu_or_nvme(records: list[dict[str, Any]]) -> bool:
    """Whether the metrics show a GPU (an NVML reading: `...nvml_bytes`) or an NVMe tier
    (the prefetcher read bytes from it)."""
    return any(k.endswith("nvml_bytes") or (k == "prefetch/bytes" and v > 0)
               for r in records for k, v in r["values"].items())


def memory_panels(records: list[dict[str, Any]]) -> list[Panel]:
    """Bytes in MiB over seconds since the first record of the run (none on CPU alone)."""
    if not has_gpu_or_nvme(records):
        return [Panel("device memory per process", "MiB")]
    t0 = min((r["time_s"] for r in records if "time_s" in r), default=0.0)
    out: dict[str, Series] = {}
    for key in keys_like(records, "memory/", "bytes"):
        per: dict[str, Series] = {}
        for r in sorted((r for r in records if key in r["values"] and "time_s" in r),
                        key=lambda r: r["time_s"]):
            s = per.setdefault(r["actor"], Series([], []))
            s.x.append(r["time_s"] - t0)
            s.y.append(r["values"][key] / 2**20)
        out |= {f"{actor}: {key}": s for actor, s in sorted(per.items())}
    return [Panel("device memory per process", "MiB", out, steps=True)]


TEACHER_LOADS = ["opd/teacher_gpu_loads", "opd/teacher_gds_loads", "opd/teacher_sync_fallbacks"]


def opd_panels(records: list[dict[str, Any]]) -> list[Panel]:
    kl = [k for k in keys_like(records, "opd/", "/reverse_kl") if k.count("/") == 2]
    reads = {label: Series(s.x, [v / 2**20 for v in s.y])
             for label, s in lines(records, ["prefetch/bytes"]).items()}
    pool = Panel("teacher pool (server mode): sampled-token reverse KL", "per token",
                 lines(records, keys_like(records, "opd/", "/sampled_reverse_kl")), logy=True)
    # the pool's and the prefetcher's panels only where they ran (no note without them)
    total = {f"{k} (all teachers)": v for k, v in lines(records, ["opd/reverse_kl"]).items()}
    return [Panel("reverse KL to each teacher", "per token", {**lines(records, kl), **total},
                  logy=True),
            *[p for p in (pool,) if p.drawn()],
            Panel("teacher swaps (running counts)", "loads", lines(records, TEACHER_LOADS)),
            *[p for p in (Panel("prefetcher: NVMe bytes read (x: its record number)", "MiB",
                                reads),) if p.drawn()]]


FIGURES = [  # file, title, x label, what the missing series are called in a note
    ("reward.png", "reward and eval accuracy", "step", "rollout/reward/*, eval/*"),
    ("kl_mismatch.png", "KL and train-rollout mismatch", "step",
     "train/*_kl, mismatch/*, train/*logprob_abs_diff, train/staleness_*"),
    ("throughput.png", "throughput", "step", "rollout/tokens_per_s, train/tokens + time/step_s"),
    ("step_time.png", "trainer step time", "step", ", ".join(STEP_PARTS)),
    ("memory.png", "memory", "seconds since the first record",
     "memory/*bytes with a GPU or NVMe tier (*nvml_bytes, prefetch/bytes)"),
    ("opd.png", "on-policy distillation", "step",
     "opd/*/reverse_kl, opd/teacher_*_loads, prefetch/bytes"),
]


KEYS = {"train/ppo_kl", "train/policy_kl", "train/kl_loss", *MISMATCH, *OUTSIDE,
        "train/staleness_mean", "train/staleness_max", "rollout/tokens_per_s", "train/tokens",
        *STEP_PARTS, "time/step_s", *TEACHER_LOADS, "prefetch/bytes"}


def plotted(key: str) -> bool:
    """Whether some figure draws `key`."""
    return key in KEYS or key.startswith(("rollout/reward/", "eval/", "final_eval/")) or (
        key.startswith("memory/") and key.endswith("bytes")) or (
        key.startswith("opd/") and key.endswith("reverse_kl"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(panels: list[Panel], path: Path, title: str, xlabel: str) -> None:
    """One row per panel."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.6 + 3.0 * len(panels)),
                             squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel.stacked:
            names = list(panel.stacked)
            ax.stackplot(panel.stacked[names[0]].x, *(panel.stacked[n].y for n in names),
                         labels=names, alpha=0.7)
        for label, s in panel.lines.items():
            few = len(s.x) <= 30
            ax.plot(s.x, s.y, label=label, marker="o" if few else None, markersize=3,
                    color="black" if panel.stacked else None, linewidth=1.2,
                    drawstyle="steps-post" if panel.steps else "default")
        for label, s in panel.points.items():
            ax.scatter(s.x, s.y, label=label, marker="*", s=90, zorder=3)
        if panel.logy:
            _log_scale(ax, [v for s in panel.drawn().values() for v in s.y if math.isfinite(v)])
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if xlabel == "step":
        for ax in axes[:, 0]:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all (a full disk)
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def _log_scale(ax: Any, values: list[float]) -> None:
    """Log y when every value is > 0; with zeros among them, symmetric log (linear up to the
    smallest positive value, so a zero still shows); linear with negative values."""
    positive = [v for v in values if v > 0]
    if not positive or min(values) < 0:
        return
    if min(values) > 0:
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive))


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> PlotResult:
    """Read <run_dir>/metrics.jsonl and write every figure that has data into `out_dir`
    (default <run_dir>/plots); FileNotFoundError when there is no metrics.jsonl."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is `jsonl` among the run's [run] "
                                f"sinks?)")
    result = PlotResult()
    records = read_records(path, result.notes)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    makers = {"reward.png": reward_panels, "kl_mismatch.png": kl_panels,
              "throughput.png": throughput_panels,
              "step_time.png": lambda rs: step_time_panels(rs, result.notes),
              "memory.png": memory_panels, "opd.png": opd_panels}
    for name, title, xlabel, wanted in FIGURES:
        panels = [_finite(p) for p in makers[name](records)]
        empty = [p.title for p in panels if not p.drawn()]
        panels = [p for p in panels if p.drawn()]
        if not panels:
            result.notes.append(f"{name} skipped: none of {wanted} in {path.name}")
            continue
        if empty:
            result.notes.append(f"{name}: no data for {', '.join(empty)}; drawn without")
        out.mkdir(parents=True, exist_ok=True)
        draw(panels, out / name, f"{title} ({run_dir.name})", xlabel)
        result.written[name] = out / name
        result.drawn[name] = {p.title: p.drawn() for p in panels}
    return result


def _finite(panel: Panel) -> Panel:
    """Drop series with no finite value (nothing to draw)."""
    def keep(d: dict[str, Series]) -> dict[str, Series]:
        return {k: s for k, s in d.items() if any(math.isfinite(v) for v in s.y)}
    return Panel(panel.title, panel.ylabel, keep(panel.lines), keep(panel.stacked),
                 keep(panel.points), panel.logy, panel.steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (holding metrics.jsonl)")
    parser.add_argument("--out", help="write the PNGs here instead of <run_dir>/plots")
    args = parser.parse_args(argv)
    try:
        result = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in result.notes:
        print(f"note: {note}")
    for path in result.written.values():
        print(f"wrote {path}")
    if not result.written:
        print("no figure had data; nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
