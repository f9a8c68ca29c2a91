"""Fault injection on the main job: one fault per run, each run must complete with nothing lost.

`python -m bench.faults [--steps 30] [--save-every 5] [--seed 0] [--only buffer,trainer,...]`
runs `examples/local.toml` (shortened to `--steps` steps, a checkpoint every `--save-every`)
once per fault:
- `kill -9` of each actor (worker0, worker1, router, buffer, rollout, trainer) at a random step;
  the launcher restarts it and the run must finish every step;
- `kill -9` of the launcher at a random step: every actor process must be gone within 5 s, then
  `--resume` must finish the run;
- a corrupt checkpoint: the launcher is killed after a checkpoint, the newest checkpoint's
  weights are truncated, and `--resume` must report it and continue from the one before.
Per run it checks: exit code 0, the trainer's final version = steps, the buffer's books
(`added = emitted + pending + dropped_*`, else the difference is `lost_samples`), samples emitted
twice outside a replay for a restarted trainer (`duplicated_samples`, from the buffer's journal
replayed through the buffer logic), and processes of the run alive after it ended (`orphans`).
Final line: RESULT faults=N survived=N unsurvived=N lost_samples=N duplicated_samples=N orphans=N
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import psutil

from actors.buffer import BufferState, Journal
from logic.buffer import BufferConfig, RolloutBuffer

ROOT = Path(__file__).resolve().parent.parent
ACTORS = ("worker0", "worker1", "router", "buffer", "rollout", "trainer")
FAULTS = ACTORS + ("launcher", "corrupt_checkpoint")


def hosts_file(folder: Path, steps: int, save_every: int) -> Path:
    text = (ROOT / "examples" / "local.toml").read_text()
    text = re.sub(r"num_steps = \d+", f"num_steps = {steps}", text)
    text = re.sub(r"checkpoint = \{ save_every = \d+ \}",
                  f"checkpoint = {{ save_every = {save_every} }}", text)
    text = re.sub(r"eval_every = \d+", "eval_every = 0", text)
    text = re.sub(r"eval_tasks = \d+", "eval_tasks = 20", text)
    text = text.replace("progress_interval_s = 5.0", "progress_interval_s = 0.0\n"
                        "request_retry_s = 5.0")
    path = folder / "hosts.toml"
    path.write_text(text)
    return path


class Run:
    """One launcher process, its console lines, and every process it ever had."""

    def __init__(self, hosts: Path, run_dir: Path, resume: bool = False):
        args = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", str(hosts), *args],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self.pids: set[int] = set()

    def track(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def until(self, pattern: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.track()
            if not line and self.proc.poll() is not None:
                break
            self.lines.append(line)
            if re.search(pattern, line):
                return
        raise RuntimeError(f"never saw {pattern!r}: {''.join(self.lines[-20:])}")

    def actor(self, name: str) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children():
            if any(part.endswith(f"specs/{name}.json") for part in child.cmdline()):
                return child
        raise RuntimeError(f"no process for actor {name}")

    def finish(self, timeout_s: float = 600) -> int:
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.lines.append(out)
        return self.proc.returncode

    def orphans(self, grace_s: float = 5.0) -> int:
        procs = [psutil.Process(p) for p in self.pids if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        return sum(1 for p in alive if _running(p))


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def final_version(run_dir: Path) -> int:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [r["values"]["version"] for r in records
                if r["actor"] == "trainer" and "version" in r["values"]]
    return int(max(versions, default=0))


def lost_samples(run_dir: Path) -> int:
    """added - (emitted + pending + dropped) in the buffer's last published books."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    books = [r["values"] for r in records if r["actor"] == "buffer"][-1]
    dropped = sum(v for k, v in books.items() if k.startswith("buffer/dropped_"))
    return int(books["buffer/added"] - books["buffer/emitted"] - books["buffer/pending"] - dropped)


class _Counting(RolloutBuffer):
    def __init__(self, config: BufferConfig):
        super().__init__(config)
        self.emitted_keys: dict[tuple[str, int], int] = {}

    def next_batch(self, trainer_version: int):
        batch = super().next_batch(trainer_version)
        for s in batch or []:
            self.emitted_keys[(s.group_id, s.index)] = self.emitted_keys.get(
                (s.group_id, s.index), 0) + 1
        return batch


def duplicated_samples(run_dir: Path, config: BufferConfig) -> int:
    """Samples the buffer emitted in more than one batch (a replay for a restarted trainer
    hands out the remembered batch and emits nothing), from its journal."""
    journal = Journal(run_dir / "buffer" / "buffer.journal")
    journal.close()
    state = BufferState(_Counting(config))
    for entry in journal.entries:
        state.apply(entry)
    return sum(n - 1 for n in state.logic.emitted_keys.values())


def run_fault(fault: str, folder: Path, steps: int, save_every: int,
              rng: random.Random) -> dict:
    hosts, run_dir = folder / "hosts.toml", folder / "run"
    at = rng.randint(3, steps - 5)
    if fault == "corrupt_checkpoint":  # two checkpoints exist: the newest is damaged
        at = max(at, 2 * save_every + 1)
    run, orphans = Run(hosts, run_dir), 0
    run.until(rf"trainer: step {at}/")
    if fault in ACTORS:
        run.actor(fault).send_signal(signal.SIGKILL)
        run.until(rf"{fault} failed .*restart 1/")
    else:
        if fault == "corrupt_checkpoint":
            newest = sorted((run_dir / "checkpoints").glob("step_*[0-9]"))[-1]
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        orphans += run.orphans()
        if fault == "corrupt_checkpoint":
            weights = next(newest.glob("*.safetensors"))
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        run = Run(hosts, run_dir, resume=True)
    code = run.finish()
    orphans += run.orphans()
    text = "".join(run.lines)
    survived = code == 0 and final_version(run_dir) == steps
    if fault == "corrupt_checkpoint":
        survived = survived and "resume skipped a damaged checkpoint" in text
    config = msgspec.convert(json.loads((run_dir / "config.json").read_text())["actors"]
                             ["buffer"]["config"], BufferConfig)  # the run's own
    out = {"fault": fault, "at_step": at, "exit": code, "survived": survived,
           "lost": lost_samples(run_dir), "duplicated": duplicated_samples(run_dir, config),
           "orphans": orphans}
    if not survived:
        out["tail"] = text[-2000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    for fault in args.only.split(","):
        with tempfile.TemporaryDirectory(prefix=f"faults-{fault}-") as tmp:
            folder = Path(tmp)
            hosts_file(folder, args.steps, args.save_every)
            t0 = time.monotonic()
            result = run_fault(fault, folder, args.steps, args.save_every, rng)
            result["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    survived = sum(r["survived"] for r in results)
    print(f"RESULT faults={len(results)} survived={survived} "
          f"unsurvived={len(results) - survived} lost_samples={sum(r['lost'] for r in results)} "
          f"duplicated_samples={sum(r['duplicated'] for r in results)} "
          f"orphans={sum(r['orphans'] for r in results)}")


if __name__ == "__main__":
    main()
