"""Fault injection on the main job: one fault per run, each run must complete with nothing lost.

`python -m bench.faults [--steps 30] [--save-every 5] [--seed 0] [--only buffer,trainer,...]
[--compact-bytes 65536]` runs `examples/local.toml` (shortened to `--steps` steps, a checkpoint
every `--save-every`, the buffer's journal compacted every `--compact-bytes`, so that faults
meet compacted journals) once per fault:
- `kill -9` of each actor (worker0, worker1, router, buffer, rollout, trainer) at a random step;
  the launcher restarts it and the run must finish every step;
- `kill -9` of the launcher at a random step: every actor process must be gone within 5 s, then
  `--resume` must finish the run;
- a damaged checkpoint: the launcher is killed after a checkpoint, the newest checkpoint's
  weights (`corrupt_checkpoint`) or trainer state (`corrupt_state`) are truncated, and
  `--resume` must report it and continue from the one before;
- a hung worker (`hang_worker`): worker0 is stopped (SIGSTOP) and never continued; the run
  must go on (`stall_s`: from the stop until two more steps were trained);
- a full disk (`disk_full`, as root: the run directory is a tmpfs): at a random step a ballast
  file fills it; the run must end on its own with a non-zero exit code and a readable
  exit.json (never hang), then, with the ballast removed, `--resume` must finish the run.
Per run it checks: exit code 0, the trainer's final version = steps, the buffer's books
(`added = emitted + pending + dropped_*`, else the difference is `lost_samples`), samples emitted
twice outside a replay for a restarted trainer (`duplicated_samples`, from the buffer's journal
replayed through the buffer logic; a compacted journal shows the emissions after its snapshot,
and the replay's `accounting()` fails if a group was taken twice), processes of the run alive
after it ended (`orphans`), and that every sample the rollout generated is accounted for once
(`unreconciled_samples`):
- generated (the rollout's run total, `rollout/<name>.totals.json`) = trained (emitted) +
  dropped (by reason) + pending + in flight (not in the buffer's books); re-sent copies are in
  none of them (`resent_copies`, and `late_originals` for first copies that arrived after their
  re-sent copy was taken), so in flight must be >= 0 (it was negative by the re-sent copies
  when they were counted as added) and at most one batch per rollout process (groups counted
  but not delivered when a process was killed or the run stopped);
- the rollout's `samples_resent` = the buffer's `resent_copies` + `resent_taken` (re-sends are
  acknowledged requests);
- the replay's books balance; what misses counts as unreconciled.
Final line: RESULT faults=N survived=N unsurvived=N lost_samples=N duplicated_samples=N orphans=N
unreconciled_samples=N
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import msgspec
import psutil

from actors.buffer import BufferState, Journal
from logic.buffer import BufferConfig, RolloutBuffer
from runtime.facts import RunFacts

ROOT = Path(__file__).resolve().parent.parent
ACTORS = ("worker0", "worker1", "router", "buffer", "rollout", "trainer")
DAMAGE = {"corrupt_checkpoint": "*.safetensors", "corrupt_state": "trainer_state.pt"}
FAULTS = ACTORS + ("launcher", *DAMAGE, "hang_worker", "disk_full")
DISK_BYTES = 256 << 20  # the tmpfs of the disk_full fault
STEP_LINE = re.compile(r"trainer: step (\d+)/")


def hosts_file(folder: Path, steps: int, save_every: int, compact_bytes: int,
               eval_tasks: int = 20) -> Path:
    """examples/local.toml, shortened: its [rl] values rewritten, a buffer table added."""
    text = (ROOT / "examples" / "local.toml").read_text()
    for key, value in (("num_steps", steps), ("save_every", save_every), ("eval_every", 0),
                       ("eval_tasks", eval_tasks)):
        text, found = re.subn(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.M)
        if found != 1:
            raise RuntimeError(f"examples/local.toml: no `{key} = N` line in [rl]; update "
                               f"hosts_file")
    text = text.replace('model = "base-tiny"', f'model = "{ROOT / "examples" / "base-tiny"}"')
    text = text.replace('name = "grpo-local"\n', 'name = "grpo-local"\nprogress_interval_s = 0.0'
                        '\nrequest_retry_s = 5.0\n')
    text += f"\n[actors.buffer.config]\njournal_compact_bytes = {compact_bytes}\n"
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
        self.step_times: list[float] = []  # when each trainer step line was read (monotonic)

    def track(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def until(self, pattern: str, timeout_s: float = 300) -> None:
        """Until a console line matches `pattern`."""
        self._read_until(lambda line: re.search(pattern, line) is not None, repr(pattern),
                         timeout_s)

    def until_step(self, step: int, timeout_s: float = 600) -> None:
        """Until the console says the trainer reached `step` (or a later one)."""
        def reached(line: str) -> bool:
            found = STEP_LINE.search(line)
            return found is not None and int(found.group(1)) >= step

        self._read_until(reached, f"step {step}", timeout_s)

    def _read_until(self, done: Callable[[str], bool], what: str, timeout_s: float) -> None:
        """Read console lines (timing the trainer's step lines) until `done(line)`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.track()
            if not line and self.proc.poll() is not None:
                break
            self.lines.append(line)
            if STEP_LINE.search(line):
                self.step_times.append(time.monotonic())
            if done(line):
                return
        raise RuntimeError(f"never saw {what}: {''.join(self.lines[-20:])}")

    def actor(self, name: str) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children():
            if any(part.endswith(f"specs/{name}.json") for part in child.cmdline()):
                return child
        raise RuntimeError(f"no process for actor {name}")

    def finish(self, timeout_s: float = 600) -> int:
        """The launcher's exit code; -1 (and the launcher killed) if it did not exit in time."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.track()
            self.proc.kill()
            out, _ = self.proc.communicate()
            self.lines.append(out + f"\n[bench] the launcher did not exit in {timeout_s:g} s\n")
            return -1
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


class Tmpfs:
    """A small tmpfs mounted on `path` (the run directory), that a ballast file can fill."""

    def __init__(self, path: Path, size_bytes: int = DISK_BYTES):
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                       check=True, capture_output=True)
        self.path, self.ballast = path, path / "ballast"

    def fill(self) -> int:
        """Write the ballast until the disk is full; its bytes."""
        chunk, n = b"\0" * (1 << 20), 0
        with open(self.ballast, "wb", buffering=0) as f:
            try:
                while True:
                    n += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        return n

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


def can_mount() -> bool:
    return os.geteuid() == 0


def exit_record(run_dir: Path) -> dict:
    """exit.json as the launcher left it ({"unreadable": ...} when it is not JSON)."""
    try:
        return json.loads((run_dir / "exit.json").read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": str(e)}


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
    def __init__(self, config: BufferConfig, facts: RunFacts):
        super().__init__(config, facts)
        self.emitted_keys: dict[tuple[str, int], int] = {}

    def next_batch(self, trainer_version: int):
        batch = super().next_batch(trainer_version)
        for s in batch or []:
            self.emitted_keys[(s.group_id, s.index)] = self.emitted_keys.get(
                (s.group_id, s.index), 0) + 1
        return batch

    def restore(self, snap) -> None:  # a compacted journal: its remembered batches were emitted
        super().restore(snap)
        for _, batch in self.history.items():
            for s in batch:
                self.emitted_keys.setdefault((s.group_id, s.index), 1)


def run_buffer(run_dir: Path) -> tuple[BufferConfig, RunFacts]:
    """The buffer's config and facts, as the run's config.json recorded them."""
    run = json.loads((run_dir / "config.json").read_text())
    return (msgspec.convert(run["actors"]["buffer"]["config"], BufferConfig),
            msgspec.convert(run["facts"]["buffer"], RunFacts))


def replay_journal(run_dir: Path, config: BufferConfig, facts: RunFacts
                   ) -> tuple[BufferState, Journal]:
    journal = Journal(run_dir / "buffer" / "buffer.journal")
    journal.close()
    state = BufferState(_Counting(config, facts))
    for entry in journal.entries:
        state.apply(entry)
    return state, journal


def duplicated_samples(state: BufferState) -> int:
    """Samples the buffer emitted in more than one batch (a replay for a restarted trainer
    hands out the remembered batch and emits nothing), from its journal."""
    return sum(n - 1 for n in state.logic.emitted_keys.values())


def reconcile(run_dir: Path, state: BufferState) -> dict:
    """generated = trained + dropped (by reason) + in flight, from the rollout's run totals
    and the buffer's books as its journal replays them; `unreconciled` is what misses."""
    totals = json.loads((run_dir / "rollout" / "rollout.totals.json").read_text())
    logic, error = state.logic, ""
    try:
        logic.accounting()
    except AssertionError as e:
        error = str(e)
    books = logic.counters
    pending = len(logic.pending_keys())
    dropped = {k: v for k, v in books.items() if k.startswith("dropped_") and v}
    in_flight = totals["samples_generated"] - books["added"]  # not (yet) in the books
    bound = totals["starts"] * logic.facts.group_size * logic.facts.groups_per_batch
    resent_gap = totals["samples_resent"] - books["resent_copies"] - books["resent_taken"]
    books_gap = books["added"] - books["emitted"] - pending - sum(dropped.values())
    out = {"generated": totals["samples_generated"], "trained": books["emitted"],
           "dropped": dropped, "pending": pending, "in_flight": in_flight,
           "resent": totals["samples_resent"], "resent_copies": books["resent_copies"],
           "resent_taken": books["resent_taken"], "late_originals": books["late_originals"],
           "unreconciled": (max(-in_flight, 0) + max(in_flight - bound, 0) + abs(resent_gap)
                            + abs(books_gap))}
    if error:
        out["books_error"] = error
    return out


def run_fault(fault: str, folder: Path, steps: int, save_every: int,
              rng: random.Random) -> dict:
    hosts, run_dir = folder / "hosts.toml", folder / "run"
    at = rng.randint(3, steps - 5)
    if fault in DAMAGE:  # two checkpoints exist: the newest is damaged
        at = max(at, 2 * save_every + 1)
    disk = Tmpfs(run_dir) if fault == "disk_full" else None
    try:
        return _run_fault(fault, hosts, run_dir, steps, at, disk)
    finally:
        if disk is not None:
            disk.close()


def _run_fault(fault: str, hosts: Path, run_dir: Path, steps: int, at: int,
               disk: Tmpfs | None) -> dict:
    run, orphans, extra = Run(hosts, run_dir), 0, {}
    run.until(rf"trainer: step {at}/")
    if fault in ACTORS:
        run.actor(fault).send_signal(signal.SIGKILL)
        run.until(rf"{fault} failed .*restart 1/")
    elif fault == "hang_worker":
        run.actor("worker0").suspend()
        t0 = time.monotonic()
        run.until(rf"trainer: step {at + 2}/")
        extra["stall_s"] = round(time.monotonic() - t0, 1)
    elif fault == "disk_full":
        extra["ballast_mib"] = disk.fill() >> 20
        extra["full_exit"] = run.finish(timeout_s=600)
        extra["full_exit_json"] = exit_record(run_dir)
        extra["full_said"] = [line.strip() for line in "".join(run.lines).splitlines()
                              if re.search(r"failed|error|No space|exit", line)][-8:]
        orphans += run.orphans()
        disk.free()
        run = Run(hosts, run_dir, resume=True)
    else:
        if fault in DAMAGE:
            newest = max((run_dir / "checkpoints").glob("step_*[0-9]"))
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        run.proc.stdout.close()
        orphans += run.orphans()
        if fault in DAMAGE:
            damaged = next(newest.glob(DAMAGE[fault]))
            damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        run = Run(hosts, run_dir, resume=True)
    code = run.finish()
    orphans += run.orphans()
    text = "".join(run.lines)
    survived = code == 0 and final_version(run_dir) == steps
    if fault in DAMAGE:
        survived = survived and "resume skipped a damaged checkpoint" in text
    if fault == "disk_full":  # it ended on its own, saying so, and the resume finished it
        full = extra["full_exit_json"]
        survived = survived and extra["full_exit"] not in (0, -1) \
            and full.get("exit_code") == extra["full_exit"]
    state, journal = replay_journal(run_dir, *run_buffer(run_dir))  # the run's own
    out = {"fault": fault, "at_step": at, "exit": code, "survived": survived,
           "lost": lost_samples(run_dir), "duplicated": duplicated_samples(state),
           "orphans": orphans, **reconcile(run_dir, state), **extra,
           "journal_bytes": journal.size, "journal_compacted": journal.snapshot_size > 0}
    if not survived:
        out["tail"] = text[-3000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults")
    ap.add_argument("--compact-bytes", type=int, default=65536,
                    help="the buffer's journal_compact_bytes (0: never compact)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = []
    for fault in args.only.split(","):
        if fault not in FAULTS:
            ap.error(f"--only: unknown fault {fault!r}; the faults are {', '.join(FAULTS)}")
        if fault == "disk_full" and not can_mount():
            print(json.dumps({"fault": fault, "skipped": "needs root to mount a tmpfs"}))
            continue
        with tempfile.TemporaryDirectory(prefix=f"faults-{fault}-") as tmp:
            folder = Path(tmp)
            hosts_file(folder, args.steps, args.save_every, args.compact_bytes)
            t0 = time.monotonic()
            result = run_fault(fault, folder, args.steps, args.save_every, rng)
            result["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    survived = sum(r["survived"] for r in results)
    print(f"RESULT faults={len(results)} survived={survived} "
          f"unsurvived={len(results) - survived} lost_samples={sum(r['lost'] for r in results)} "
          f"duplicated_samples={sum(r['duplicated'] for r in results)} "
          f"orphans={sum(r['orphans'] for r in results)} "
          f"unreconciled_samples={sum(r['unreconciled'] for r in results)}")


if __name__ == "__main__":
    main()
