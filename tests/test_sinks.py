"""Metrics sinks (launch/sinks.py): what each sink wrote is read back from its files.

TensorBoard event files are read with a TFRecord reader over tensorboardX's Event protobuf
(checking both CRCs); the offline W&B run is read from its run-<id>.wandb file (W&B's
LevelDB-style log of `Record` protobufs, CRC-checked), since wandb ships no reader for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
import tomllib
import zlib
from pathlib import Path
from typing import Callable

import msgspec
import pytest

from launch import cluster, sinks
from launch.config import ConfigError, RunConfig, WandbConfig, load
from runtime.actor import Actor
from transport.schema import Metrics, SampleRecord

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- readers
def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall time)] over every event file in `logdir`, oldest file first."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out: dict[str, list[tuple[int, float, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert files, f"no event file in {logdir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
            body = data[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == \
                masked_crc32c(body)
            pos += 16 + length
            event = Event()
            event.ParseFromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value, event.wall_time))
    return out


def wandb_records(path: Path) -> list:
    """The Record protobufs of a run-<id>.wandb file: a 7-byte header (':W&B', 0xBEE1,
    version), then 32 KiB blocks of chunks (CRC-32 of type + data, length, type: 1 full, 2
    first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:6] == b":W&B\xe1\xbe", data[:7]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # W&B's own process is still writing it
            raise Incomplete(f"{path} ends inside a record at byte {pos}")
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad CRC at byte {pos} of {path}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


class Incomplete(Exception):
    """A .wandb file read while W&B's own process still writes it."""


def wandb_runs(run_dir: Path, timeout_s: float = 60.0) -> list[dict]:
    """`_wandb_runs` once every run file is complete: W&B's service process writes the file
    on its own and may still be at it when the sink has closed (it ends with the exit record)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            runs = _wandb_runs(run_dir)
            if all(r["exit_code"] is not None for r in runs) or time.monotonic() > deadline:
                return runs
        except Incomplete:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _wandb_runs(run_dir: Path) -> list[dict]:
    """Every offline W&B run under <run_dir>/wandb, oldest first: its run record, its history
    rows (user keys only) and its step-metric definitions."""
    out = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        run, rows, steps, exit_code = None, [], {}, None
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run = r.run
            elif kind == "history":
                row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json)
                       for i in r.history.item}
                rows.append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "metric" and r.metric.glob_name:
                steps[r.metric.glob_name] = r.metric.step_metric
            elif kind == "exit":
                exit_code = r.exit.exit_code
        out.append({"folder": folder, "run": run, "rows": rows, "step_metrics": steps,
                    "exit_code": exit_code})
    return out


# ----------------------------------------------------------------------------- records
T0 = 1_700_000_000.0


def record(actor: str, seq: int, values: dict[str, float], step: int | None) -> Metrics:
    return Metrics(actor=actor, seq=seq, time_s=T0 + seq, values=values, step=step)


RECORDS = [
    record("trainer", 1, {"train/loss": 0.5, "time/train_s": 2.0}, 1),
    record("rollout", 1, {"rollout/reward/math": 0.25}, 0),
    record("trainer", 2, {"train/loss": 0.25, "time/train_s": 1.5}, 2),
    record("worker0", 7, {"memory/device_bytes": 1048576.0}, None),  # no step: seq 7
    record("rollout", 2, {"rollout/reward/math": 0.75}, 1),
    record("trainer", 3, {"train/loss": 0.125, "time/train_s": 1.0}, 3),
]


@pytest.fixture
def wandb_module():
    """wandb, with WANDB_MODE unset during the test and as it was after (the sink sets it)."""
    wandb = pytest.importorskip("wandb")  # CI installs it (.[dev]); skipped only where absent
    before = os.environ.pop("WANDB_MODE", None)
    yield wandb
    wandb.teardown()  # stop wandb's service process started by this test
    os.environ.pop("WANDB_MODE", None)
    if before is not None:
        os.environ["WANDB_MODE"] = before


def said() -> tuple[list[str], Callable[[str], None]]:
    lines: list[str] = []
    return lines, lines.append


def test_jsonl_and_tensorboard_hold_every_record_keyed_actor_slash_metric(tmp_path):
    pytest.importorskip("tensorboardX")
    lines, say = said()
    run = RunConfig(name="t", sinks=["jsonl", "tensorboard"])
    out = sinks.open_sinks(run, tmp_path, {}, say)
    for m in RECORDS:
        out.write(m)
    out.close()
    assert any("tensorboard --logdir" in line for line in lines), lines
    back = [msgspec.json.decode(line, type=Metrics)
            for line in (tmp_path / "metrics.jsonl").read_bytes().splitlines()]
    assert back == RECORDS
    tb = read_tensorboard(tmp_path / "tensorboard")
    assert tb == {
        "trainer/train/loss": [(1, 0.5, T0 + 1), (2, 0.25, T0 + 2), (3, 0.125, T0 + 3)],
        "trainer/time/train_s": [(1, 2.0, T0 + 1), (2, 1.5, T0 + 2), (3, 1.0, T0 + 3)],
        "rollout/rollout/reward/math": [(0, 0.25, T0 + 1), (1, 0.75, T0 + 2)],
        "worker0/memory/device_bytes": [(7, 1048576.0, T0 + 7)],
    }


def test_offline_wandb_run_has_every_record_on_per_actor_steps_and_resumes_same_id(
        tmp_path, wandb_module):
    lines, say = said()
    run = RunConfig(name="t", sinks=["wandb"],
                    wandb=WandbConfig(project="proj", name="nm", tags=["grpo", "cpu"]))
    out = sinks.open_sinks(run, tmp_path, {"run": {"name": "t"}, "answer": 42}, say)
    for m in RECORDS:
        out.write(m)
    out.close()
    (first,) = wandb_runs(tmp_path)
    run_id = (tmp_path / "wandb" / "rlx-run-id").read_text().strip()
    assert first["folder"].name.endswith(f"-{run_id}")
    assert any(f"wandb sync {first['folder']}" in line for line in lines), lines
    assert first["run"].run_id == run_id and first["run"].project == "proj"
    assert first["run"].display_name == "nm" and list(first["run"].tags) == ["grpo", "cpu"]
    config = {u.key: json.loads(u.value_json) for u in first["run"].config.update}
    assert config["answer"] == 42 and config["run"] == {"name": "t"}
    assert first["rows"] == [
        {"trainer/train/loss": 0.5, "trainer/time/train_s": 2.0, "trainer/step": 1},
        {"rollout/rollout/reward/math": 0.25, "rollout/step": 0},
        {"trainer/train/loss": 0.25, "trainer/time/train_s": 1.5, "trainer/step": 2},
        {"worker0/memory/device_bytes": 1048576.0, "worker0/step": 7},
        {"rollout/rollout/reward/math": 0.75, "rollout/step": 1},
        {"trainer/train/loss": 0.125, "trainer/time/train_s": 1.0, "trainer/step": 3},
    ]
    assert first["step_metrics"] == {"trainer/*": "trainer/step", "rollout/*": "rollout/step",
                                     "worker0/*": "worker0/step"}
    # --resume: the same run directory logs a second offline run under the same W&B run id
    again = sinks.open_sinks(run, tmp_path, {}, say)
    again.write(record("trainer", 1, {"train/loss": 0.0625}, 4))
    again.close(exit_code=1)  # a failed run is marked failed
    first_again, second = wandb_runs(tmp_path)
    assert first_again["folder"] == first["folder"]
    assert second["run"].run_id == run_id
    assert second["rows"] == [{"trainer/train/loss": 0.0625, "trainer/step": 4}]
    assert (first_again["exit_code"], second["exit_code"]) == (0, 1)


def test_a_failing_sink_is_dropped_once_and_the_others_go_on(tmp_path):
    class Broken:
        name = "broken"
        closed = 0

        def write(self, m):
            raise OSError("disk full")

        def close(self, exit_code=0):
            Broken.closed += 1

    lines, say = said()
    jsonl = sinks.JsonlSink(tmp_path / "metrics.jsonl")
    out = sinks.Sinks([Broken(), jsonl], say)
    for m in RECORDS:
        out.write(m)
    out.close()
    assert len(lines) == 1 and "metrics sink broken failed (OSError: disk full)" in lines[0]
    assert Broken.closed == 1
    assert len((tmp_path / "metrics.jsonl").read_bytes().splitlines()) == len(RECORDS)


HOSTS = """
[run]
name = "t"
{run}

[[hosts]]
name = "local"

[actors.producer]
cls = "examples.demo:Producer"
primary = true
config = {{ num_items = 1 }}
[actors.scaler]
cls = "examples.demo:Scaler"
[actors.consumer]
cls = "examples.demo:Consumer"
"""


def write_hosts(tmp_path: Path, run: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(HOSTS.format(run=run))
    return path


def test_a_sink_whose_package_is_missing_fails_before_anything_starts_with_the_pip_command(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    hosts = write_hosts(tmp_path, 'sinks = ["jsonl", "wandb"]')
    assert cluster.main([str(hosts), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{hosts}: table [run], field `sinks`: the 'wandb' sink needs the wandb package" in err
    assert "pip install 'wandb>=0.19'" in err and "pip install -e '.[wandb]'" in err
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    hosts = write_hosts(tmp_path, 'sinks = ["tensorboard"]')
    assert cluster.main([str(hosts), "--run-dir", str(tmp_path / "run")]) == 2
    assert "pip install 'tensorboardX>=2.6'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was started, not even a run directory


@pytest.mark.parametrize("run, words", [
    ('sinks = ["jsonl", "jsonl"]', "a sink is named twice"),
    ('wandb = { project = "x" }', "[run.wandb] settings are given but `sinks` does not name"),
])
def test_sink_settings_that_cannot_be_meant_fail_naming_the_field(tmp_path, run, words):
    hosts = write_hosts(tmp_path, run)
    with pytest.raises(ConfigError) as info:
        sinks.check(load(hosts).run, hosts)
    assert str(info.value).startswith(f"{hosts}: table [run], field `sinks`: ")
    assert words in str(info.value)


def test_unknown_sink_and_wandb_field_are_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"table \[run.sinks\], field `#2`: Invalid enum "
                                          r"value 'tb'"):
        load(write_hosts(tmp_path, 'sinks = ["jsonl", "tb"]'))
    with pytest.raises(ConfigError, match=r"table \[run.wandb\], field `projekt`: .*unknown"):
        load(write_hosts(tmp_path, 'sinks = ["wandb"]\nwandb = { projekt = "x" }'))
    cfg = load(write_hosts(tmp_path, ""))
    assert cfg.run.sinks == ["jsonl"] and cfg.run.plots and cfg.run.wandb.mode == "offline"


def test_extras_install_what_the_sinks_import():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for sink, (_, spec) in sinks.PACKAGES.items():
        assert extras[sink] == [spec]
        assert spec in extras["dev"]  # CI (.[dev]) runs these tests instead of skipping them


# ----------------------------------------------------------------------------- a real run
class RewardConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the test actor."""

    steps: int = 4  # records with a step to publish


def rollout_sample(kind: str, i: int, response: str, **kw) -> SampleRecord:
    return SampleRecord(kind=kind, domain="math", prompt=f"{i}+1=", response=response,
                        reward=float(response == str(i + 1)), weight_version=i, task=f"t{i}",
                        env="ArithEnv", **kw)


class RewardActor(Actor):
    """Publishes a known rollout-like series, with samples as the rollout sends them (batch 1
    has a failed episode: a verifier that raised), then completes."""

    Config = RewardConfig

    async def run(self) -> None:
        assert self.metrics is not None and await self.metrics.wait_subscribed(20)
        for i in range(self.config.steps):
            failed = [rollout_sample("rollout", i, "", status="failed", cause="env",
                                     error="Traceback ...\nZeroDivisionError: verifier bug")]
            self.metrics.publish(
                {"rollout/reward/math": i / 4, "rollout/failed": float(i == 1),
                 "rollout/failed_env": float(i == 1), "rollout/failed/math": float(i == 1)},
                step=i, samples=[rollout_sample("rollout", i, str(i + 1)),
                                 *(failed if i == 1 else [])])
            # the eval's 10 responses: one answer ("7") for 6 of them from step 2 on
            answers = [str(j + 1) for j in range(10)] if i < 2 else ["7"] * 6 + list("1234")
            self.metrics.publish({"eval/math": 0.5 + i / 8}, step=i,
                                 samples=[rollout_sample("eval", j, a) for j, a in
                                          enumerate(answers)])
        self.metrics.publish({"memory/device_bytes": 3 * 2**20})  # no step
        await asyncio.sleep(0.5)  # the launcher reads the records before it stops us


def test_a_run_writes_every_sink_and_its_plots(tmp_path, wandb_module):
    pytest.importorskip("tensorboardX")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text("""
[run]
name = "t"
heartbeat_interval_s = 0.2
sinks = ["jsonl", "tensorboard", "wandb"]
wandb = { project = "rlx-test" }
show_samples_every = 2
tolerate_failures = true

[[hosts]]
name = "local"

[actors.rollout]
cls = "tests.test_sinks:RewardActor"
primary = true
""")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    proc = subprocess.run([sys.executable, "-m", "launch.cluster", str(hosts), "--run-dir",
                           str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=90,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {i: i / 4 for i in range(4)}
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["values"]["rollout/reward/math"] for r in jsonl
            if "rollout/reward/math" in r["values"]} == expected
    tb = read_tensorboard(run_dir / "tensorboard")
    assert {s: v for s, v, _ in tb["rollout/rollout/reward/math"]} == expected
    assert [v for _, v, _ in tb["rollout/memory/device_bytes"]] == [3 * 2**20]
    (wb,) = wandb_runs(run_dir)
    assert wb["run"].project == "rlx-test" and wb["run"].display_name == "run"
    assert {r["rollout/step"]: r["rollout/rollout/reward/math"] for r in wb["rows"]
            if "rollout/rollout/reward/math" in r} == expected
    config = {u.key: json.loads(u.value_json) for u in wb["run"].config.update}
    assert config["actors"]["rollout"]["cls"] == "tests.test_sinks:RewardActor"
    # the end-of-run hook: the reward plot (no GPU, no NVMe: no memory plot), the rest skipped
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["reward.png"]
    assert (run_dir / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plots: kl_mismatch.png skipped: none of" in proc.stdout
    assert "plots: memory.png skipped: none of memory/*bytes with a GPU or NVMe" in proc.stdout
    assert "plots: reward.png in" in proc.stdout
    # samples: every batch's in samples/rollout.jsonl, every eval response in eval.jsonl
    rows = [json.loads(line) for line in
            (run_dir / "samples" / "rollout.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"], r["response"], r["status"]) for r in rows] == [
        (0, "0+1=", "1", "ok"), (1, "1+1=", "2", "ok"), (1, "1+1=", "", "failed"),
        (2, "2+1=", "3", "ok"), (3, "3+1=", "4", "ok")]
    assert rows[2]["error"].endswith("ZeroDivisionError: verifier bug") and \
        rows[2]["env"] == "ArithEnv" and rows[2]["task"] == "t1" and \
        rows[2]["actor"] == "rollout"
    evals = [json.loads(line) for line in
             (run_dir / "samples" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [s for s in range(4) for _ in range(10)]
    assert [r["response"] for r in evals if r["step"] == 3] == ["7"] * 6 + list("1234")
    assert not any("samples" in r for r in jsonl)  # metrics.jsonl: values only
    assert [s for s, _, _ in tb["rollout/samples/rollout/text_summary"]] == [0, 1, 2, 3]
    assert [(r["rollout/step"], r["rollout/samples/eval.nrows"]) for r in wb["rows"]
            if "rollout/samples/eval.nrows" in r] == [(s, 10) for s in range(4)]  # W&B tables
    # the console: samples of batches 0 and 2 (show_samples_every = 2), the collapse warning
    out = proc.stdout
    assert "rollout: samples of batch 0:\n" in out and "rollout: samples of batch 2:\n" in out
    assert "rollout: samples of batch 1:" not in out
    assert "math: '2+1=' -> '3' (reward 1, v2)" in out
    flat = " ".join(out.split())  # a message's later lines joined to its first
    assert ("warning: 'math' answers collapsed at weight version 2: 6 of its 10 eval responses "
            "are '7'") in flat
    assert out.count("answers collapsed") == 1  # said when it started, not at every eval
    # what failed: the summary, and exit code 0 all the same (tolerate_failures = true)
    assert ("failures: 1 episode(s) failed (1 in their environment); 1 in training batches "
            "(math 1); first: ArithEnv, math task 't1' (rollout): Traceback ... "
            "ZeroDivisionError: verifier bug") in flat
    assert "run complete: rollout finished in" in out
    done = json.loads((run_dir / "exit.json").read_text())
    assert done["exit_code"] == 0 and done["completed"] == "rollout"
    assert done["failures"]["env_failed"] == 1 and done["failures"]["tolerated"] is True
    assert done["failures"]["first"]["task"] == "t1"
    # every line the console composed fits 80 columns (a path is never broken)
    told = [ln for ln in out.splitlines() if str(run_dir) not in ln]
    assert max(len(ln) for ln in told) <= 80, max(told, key=len)
