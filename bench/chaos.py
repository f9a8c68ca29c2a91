"""Chaos on the main job: random actors killed with random signals while it trains, against a
fault-free run of the same seed.

`python -m bench.chaos [--steps 200] [--every 10,20] [--seed 0] [--signals KILL,TERM,SEGV]`
runs `examples/local.toml` (`--steps` steps, a checkpoint every `--save-every`, 100 eval tasks
per domain) twice: once untouched, then once while, every 10 to 20 trainer steps (`--every`), a
random actor of the run (worker0, worker1, router, rollout, buffer, trainer, and the teacher
pool or prefetcher where the run has them) gets a random signal: SIGKILL, SIGTERM (an orderly
stop nobody asked for) or SIGSEGV (a crash). Every actor may restart `--max-restarts` times
(the default policy, 2 per 60 s, is meant for rare faults, and a kill every 10 steps is not).

Checked on the chaos run, with bench/faults.py's accounting: the run completes every step
(exit 0), no sample lost (`lost_samples`: the buffer's books) or trained twice outside a replay
for a restarted trainer (`duplicated_samples`: its journal replayed), every generated sample
accounted for (`unreconciled_samples`), no process left behind (`orphans`); and how its final
evaluation and wall time compare with the clean run's (`eval_gap`: the largest per-domain
difference of final accuracy; `wall_vs_clean`). The main job's clean runs themselves differ
(math 0.78-0.87 over three runs: the rollout overlaps training), so read eval_gap against that.
Final line: RESULT kills=N survived=0|1 lost_samples=N duplicated_samples=N orphans=N
unreconciled_samples=N eval_gap=X wall_vs_clean=X
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import time
import tomllib
from pathlib import Path

import psutil

from bench.faults import (
    Run,
    duplicated_samples,
    final_version,
    hosts_file,
    lost_samples,
    reconcile,
    replay_journal,
    run_buffer,
)
from launch import rl as rl_table

VICTIMS = ("worker0", "worker1", "router", "rollout", "buffer", "trainer", "teachers",
           "prefetcher")
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "SEGV": signal.SIGSEGV}


def chaos_hosts(folder: Path, steps: int, save_every: int, max_restarts: int) -> Path:
    """The main job for `steps` steps, every actor allowed `max_restarts` restarts."""
    path = hosts_file(folder, steps, save_every, compact_bytes=1 << 20, eval_tasks=100)
    text = path.read_text()
    for name in sorted(rl_table.expand(tomllib.loads(text))):
        text += f"\n[actors.{name}]\nrestart = {{ max_restarts = {max_restarts} }}\n"
    path.write_text(text)
    return path


def actors_of(run_dir: Path) -> list[str]:
    doc = json.loads((run_dir / "config.json").read_text())
    return [name for name in VICTIMS if name in doc["actors"]]


def final_eval(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "final_eval.json").read_text())["scores"]


def clean_run(hosts: Path, run_dir: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    run = Run(hosts, run_dir)
    code = run.finish(timeout_s=3600)
    return code, time.monotonic() - t0


def chaos_run(hosts: Path, run_dir: Path, steps: int, every: tuple[int, int],
              signals: list[str], rng: random.Random) -> dict:
    """The run with a kill every `every` steps; what was killed, the exit code, wall time."""
    t0, kills = time.monotonic(), []
    run = Run(hosts, run_dir)
    at = rng.randint(*every)
    while at < steps - 1:
        run.until_step(at)
        name, sig = rng.choice(actors_of(run_dir)), rng.choice(signals)
        try:
            run.actor(name).send_signal(SIGNALS[sig])
        except (RuntimeError, psutil.NoSuchProcess):  # between a crash and its restart
            name = f"{name} (not running)"
        kills.append({"step": at, "actor": name, "signal": sig, "at": time.monotonic()})
        at += rng.randint(*every)
    try:
        run.until_step(steps, timeout_s=3600)  # the step lines after the last kill, timed
    except RuntimeError:
        pass  # the run ended short: its exit code says so
    code = run.finish(timeout_s=3600)
    for kill in kills:  # until the trainer's next step line (read as the run went on)
        at_s = kill.pop("at")
        after = [t for t in run.step_times if t > at_s]
        kill["t_s"] = round(at_s - t0, 1)
        kill["next_step_s"] = round(after[0] - at_s, 1) if after else None
        print(json.dumps(kill), flush=True)
    return {"exit": code, "wall_s": time.monotonic() - t0, "kills": kills,
            "orphans": run.orphans(), "tail": "".join(run.lines)[-3000:]}


def check(run_dir: Path, steps: int) -> dict:
    """The accounting of bench/faults.py on a finished run."""
    state, _ = replay_journal(run_dir, *run_buffer(run_dir))
    books = reconcile(run_dir, state)
    return {"final_version": final_version(run_dir), "steps": steps,
            "lost": lost_samples(run_dir), "duplicated": duplicated_samples(state),
            "unreconciled": books["unreconciled"], "books": books}


def eval_gap(clean: dict[str, float], chaos: dict[str, float]) -> float:
    return max((abs(clean[k] - chaos.get(k, 0.0)) for k in clean), default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--every", default="10,20", help="steps between kills: low,high")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--signals", default="KILL,TERM,SEGV")
    ap.add_argument("--max-restarts", type=int, default=10)
    ap.add_argument("--skip-clean", action="store_true", help="no fault-free run (no eval_gap)")
    args = ap.parse_args()
    every = tuple(int(x) for x in args.every.split(","))
    signals = args.signals.split(",")
    unknown = set(signals) - set(SIGNALS)
    if len(every) != 2 or not 1 <= every[0] <= every[1] or unknown:
        ap.error(f"--every low,high with 1 <= low <= high; --signals from {sorted(SIGNALS)}")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        folder = Path(tmp)
        hosts = chaos_hosts(folder, args.steps, args.save_every, args.max_restarts)
        clean_eval, clean_wall = {}, float("nan")
        if not args.skip_clean:
            code, clean_wall = clean_run(hosts, folder / "clean")
            if code != 0:
                raise SystemExit(f"the fault-free run failed (exit {code})")
            clean_eval = final_eval(folder / "clean")
            print(json.dumps({"clean": clean_eval, "wall_s": round(clean_wall, 1)}), flush=True)
        chaos = chaos_run(hosts, folder / "chaos", args.steps, every, signals, rng)
        books = check(folder / "chaos", args.steps)
        survived = chaos["exit"] == 0 and books["final_version"] == args.steps
        chaos_eval = final_eval(folder / "chaos") if survived else {}
        out = {"chaos": chaos_eval, "wall_s": round(chaos["wall_s"], 1), **books,
               "exit": chaos["exit"]}
        if not survived:
            out["tail"] = chaos["tail"]
        print(json.dumps(out), flush=True)
    gap = eval_gap(clean_eval, chaos_eval) if survived and clean_eval else float("nan")
    print(f"RESULT kills={len(chaos['kills'])} survived={int(survived)} "
          f"lost_samples={books['lost']} duplicated_samples={books['duplicated']} "
          f"orphans={chaos['orphans']} unreconciled_samples={books['unreconciled']} "
          f"eval_gap={gap:.3f} wall_vs_clean={chaos['wall_s'] / clean_wall:.2f}")


if __name__ == "__main__":
    main()
