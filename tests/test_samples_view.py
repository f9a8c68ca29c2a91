"""What a user sees, without a cluster: console lines of realistic records fit 80 columns,
samples are shown every `show_samples_every` batches, collapsed eval answers are warned about,
what failed is tallied into the end-of-run summary, sample records reach samples/*.jsonl and
TensorBoard text, and hostile sample records do not stop the stream."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import pytest

from actors.trainer import distill_kl
from launch import cluster, console, sinks
from launch.config import RunConfig, load
from launch.console import LINE, STAMP, Story, collapse, fit
from launch.endings import Failures
from transport.metrics import TOPIC, MetricsProxy, MetricsPublisher
from transport.schema import SAMPLE_TEXT_CHARS, Metrics, SampleRecord
from transport.sockets import SocketFactory

TRAIN = {"reward/math": 0.53125, "reward/reverse": 0.1234567, "train/loss": -1.234567e-9,
         "train/clipfrac": 0.0123, "train/ppo_kl": 1.234e-4, "train/grad_norm": 0.2512345,
         "train/entropy": 1.534567, "train/logprob_abs_diff": 2.123456e-7,
         "train/kl_loss": 0.00123456, "time/step_s": 12.34567, "time/wait_batch_s": 0.1234567,
         "time/train_s": 10.71234, "time/weight_sync_s": 1.234567}
MOPD = {"reward/math": 0.75, "reward/reverse": 0.5, "train/loss": 0.0, "train/clipfrac": 0.0,
        "train/ppo_kl": -4.14e-08,  # (as a real distillation step: float noise around 0) "train/grad_norm": 0.04567, "train/entropy": 0.81234,
        "train/logprob_abs_diff": 3.4e-8, "opd/arith/reverse_kl": 0.0123456,
        "opd/arith/tokens": 40.0, "opd/reverse/reverse_kl": 0.2345678, "opd/reverse/tokens": 60.0,
        "opd/teacher_gpu_loads": 4.0, "time/step_s": 1.5, "time/wait_batch_s": 0.1,
        "time/train_s": 1.2, "time/weight_sync_s": 0.2}
ROLLOUT = {"rollout/reward/math": 0.5312345, "rollout/reward/reverse": 0.1123456,
           "rollout/failed": 3.0, "rollout/tokens_per_s": 912.3456,
           "rollout/trainer_version": 123.0, "rollout/batch_s": 1.0}


def rec(actor: str, values: dict, step: int | None, total: int | None = None,
        samples: list | None = None) -> Metrics:
    return Metrics(actor=actor, seq=1, time_s=1.0, values=values, step=step, total_steps=total,
                   samples=samples or [])


def sample(kind: str, domain: str, prompt: str, response: str, reward: float = 1.0,
           **kw) -> SampleRecord:
    return SampleRecord(kind=kind, domain=domain, prompt=prompt, response=response,
                        reward=reward, weight_version=kw.pop("weight_version", 9), **kw)


def physical(messages: list[str]) -> list[str]:
    """The console lines of the messages, as printed (the stamp before each first line)."""
    out = []
    for m in messages:
        first, *rest = m.split("\n")
        out += ["00:00:00 " + first, *rest]
    return out


def told(story_kw: dict, records: list[Metrics]) -> list[str]:
    said: list[str] = []
    story = Story(said.append, interval_s=0.0, **story_kw)
    for m in records:
        story.on_record(m)
    return said


def test_realistic_records_format_to_lines_of_80_columns_keeping_every_value():
    long_prompt = "rev " + "abcdefghij" * 30 + "="
    said = told({"show_samples_every": 5}, [
        rec("trainer", TRAIN, 123, 200),
        rec("trainer", MOPD | distill_kl(MOPD), 456, 900),
        rec("rollout", ROLLOUT, 125, samples=[
            sample("rollout", "math", "12+7=", "19"),
            sample("rollout", "reverse", long_prompt, "jihgfedcba\n" * 40, reward=0.0),
            sample("rollout", "geo", "capital of peru:", "", status="failed", reward=0.0,
                   error="Traceback (most recent call last):\n  ...\nZeroDivisionError: "
                         "verifier bug on task train-77 " + "x" * 200)]),
        rec("rollout", {"eval/math": 0.84, "eval/reverse": 0.21, "eval/geo": 0.5}, 120),
        rec("buffer", {"buffer/added": 128.0, "buffer/emitted": 120.0, "buffer/pending": 8.0,
                       "buffer/dropped_stale": 0.0, "buffer/dropped_failed_group": 2.0}, 3),
        rec("trainer", {"final_eval/math": 0.9, "final_eval/reverse": 0.2}, 200, 200)])
    lines = physical(said)
    assert max(len(line) for line in lines) <= LINE, "\n".join(lines)
    text = "\n".join(said)
    # nothing lost: every value of the trainer line, in its place
    (step,) = [m for m in said if m.startswith("trainer: step 123/200")]
    for part in ("reward math=0.531 reverse=0.123", "loss=-1.23e-09", "clipfrac=0.0123",
                 "ppo_kl=0.000123", "grad_norm=0.251", "entropy=1.53", "lp_diff=2.12e-07",
                 "kl_loss=0.00123", "step_s=12.3 (wait 0.123, train 10.7, sync 1.23)"):
        assert part in " ".join(step.split()), part
    assert len(step.split("\n")) == 4  # one message; every field of a PPO step: 4 lines
    # distillation: no loss=0, the distillation KL and each teacher's instead
    (mopd,) = [m for m in said if m.startswith("trainer: step 456/900")]
    flat = " ".join(mopd.split())
    assert "loss=" not in flat.replace("kl_loss", "")
    assert "clipfrac" not in flat and "ppo_kl" not in flat  # no policy gradient to clip
    assert "distill_kl=0.146 kl arith=0.0123 reverse=0.235" in mopd.split("\n")[1]
    assert not any(m.startswith("note: train/clipfrac") for m in said)  # no advantages here
    assert "rollout: batch 125 reward math=0.531 reverse=0.112 failed=3 tok/s=912" in text
    # samples of batch 125 (every 5th): one per domain, cut to fit, the failure's last line
    (shown,) = [m for m in said if m.startswith("rollout: samples of batch 125:")]
    math_line, = [ln for ln in shown.split("\n") if "math:" in ln]
    assert math_line.strip() == "math: '12+7=' -> '19' (reward 1, v9)"
    rev, = [ln for ln in shown.split("\n") if "reverse:" in ln]
    assert "'rev abcde..." in rev and "'jihgfedcba\\njihg" in rev and "(reward 0, v9)" in rev
    assert "\\n" in rev  # a newline in the text is escaped, not printed
    geo, = [ln for ln in shown.split("\n") if "geo:" in ln]
    assert geo.strip() == "geo: 'capital of peru:' failed: ZeroDivisionError: verifier bug on..."
    assert "rollout: eval of weight version 120: geo=0.5 math=0.84 reverse=0.21" in said
    assert "trainer: final eval at step 200: math=0.9 reverse=0.2" in said


def test_samples_are_shown_every_n_batches_only_and_never_with_0():
    records = [rec("rollout", ROLLOUT, b, samples=[sample("rollout", "math", "1+1=", "2")])
               for b in range(7)]
    said = told({"show_samples_every": 3}, records)
    assert [m.split(":")[1] for m in said if "samples of batch" in m] == [
        " samples of batch 0", " samples of batch 3", " samples of batch 6"]
    assert not any("samples of batch" in m for m in told({"show_samples_every": 0}, records))


def test_fit_breaks_between_parts_and_keeps_a_long_part_whole():
    path = "/runs/" + "x" * 120
    text = fit(["run directory", path, "and", "more"])
    first, second, third = text.split("\n")
    assert first == "run directory" and second.strip() == path and third.strip() == "and more"
    assert second.startswith(" " * (STAMP + 2))


def test_collapse_by_share_or_entropy_from_eight_responses():
    assert collapse(["7"] * 4 + [str(i) for i in range(3)]) is None  # 7 responses: not judged
    assert collapse(["7 "] * 5 + [str(i) for i in range(4)]) == ("7", 5, pytest.approx(
        (5 / 9 * 0.8480 + 4 / 9 * 3.1699) / 3.1699, abs=1e-3))  # 5 of 9: more than half
    assert collapse(["7"] * 4 + [str(i) for i in range(4)]) is None  # half is not more than half
    # no answer above half, but 100 responses in 2 answers: entropy 1 of 6.64 bits
    answer, count, share = collapse(["a"] * 50 + ["b"] * 50)
    assert (answer, count) == ("a", 50) and share == pytest.approx(1 / 6.6439, abs=1e-4)
    assert share < console.COLLAPSE_ENTROPY
    assert collapse(["a"] * 40 + ["b"] * 30 + ["c"] * 30) is None  # 1.57 bits: 0.24
    assert collapse([str(i % 19) for i in range(100)]) is None  # sums 0..18: healthy


def test_collapsed_eval_answers_are_warned_once_naming_domain_answer_and_count():
    def ev(version: int, answers: list[str]) -> Metrics:
        return rec("rollout", {"eval/math": 0.1}, version, samples=[
            sample("eval", "math", f"{i}+1=", a, reward=0.0) for i, a in enumerate(answers)] + [
            sample("eval", "reverse", f"rev {i}=", f"r{i}") for i in range(10)] + [
            sample("eval", "math", "x", "", status="failed", error="E")])
    collapsed = ["7"] * 61 + [str(i) for i in range(10, 49)]
    said = told({}, [ev(10, [str(i) for i in range(100)]), ev(20, collapsed), ev(30, collapsed),
                     ev(40, ["3"] * 100), ev(50, [str(i) for i in range(100)]),
                     ev(60, collapsed)])
    warnings = [" ".join(m.split()) for m in said if m.startswith("warning:")]
    assert len(warnings) == 3, warnings  # starts at 20, answer changes at 40, again at 60
    assert warnings[0].startswith("warning: 'math' answers collapsed at weight version 20: 61 "
                                  "of its 100 eval responses are '7'")
    assert "100 of its 100 eval responses are '3'" in warnings[1]
    assert "version 60" in warnings[2] and not any("'reverse'" in w for w in warnings)


def failed(kind: str, domain: str, task: str, error: str, cause: str = "env") -> SampleRecord:
    return sample(kind, domain, "p", "", reward=0.0, status="failed", error=error, task=task,
                  env="SometimesBroken", episode=f"{task}-0", cause=cause)


def test_failures_are_tallied_per_batch_once_with_the_first_environment_error():
    f = Failures()
    assert f.summary() is None and f.env_failed() == 0
    f.on_record(rec("rollout", {**ROLLOUT, "rollout/failed": 3.0, "rollout/failed_env": 1.0,
                                "rollout/failed/math": 3.0}, 0,
                    samples=[failed("rollout", "math", "t1", "ConnectionError: worker0 down",
                                    cause="generation")]))
    f.on_record(rec("rollout", {**ROLLOUT, "rollout/failed": 2.0, "rollout/failed_env": 2.0,
                                "rollout/failed/math": 2.0}, 1,
                    samples=[failed("rollout", "math", "train-5",
                                    "Traceback:\n ZeroDivisionError: verifier bug")]))
    # batch 1 again (a restarted rollout redoing it): counts once, its last report
    f.on_record(rec("rollout", {**ROLLOUT, "rollout/failed": 2.0, "rollout/failed_env": 2.0,
                                "rollout/failed/math": 2.0}, 1))
    f.on_record(rec("rollout", {**ROLLOUT, "rollout/failed": 0.0, "rollout/failed_env": 0.0},
                    2))
    f.on_record(rec("rollout", {"eval/math": 0.5}, 2, samples=[
        failed("eval", "math", "eval-1", "ZeroDivisionError: e"),
        sample("eval", "math", "q", "a")]))
    f.on_record(rec("rollout", {"rollout/failed": float("nan")}, 3))  # hostile: counts 0
    totals = f.totals()
    assert {k: totals[k] for k in ("episodes_failed", "env_failed", "generation_failed",
                                   "train_failed", "eval_failed", "by_domain",
                                   "eval_by_domain")} == {
        "episodes_failed": 6, "env_failed": 4, "generation_failed": 2, "train_failed": 5,
        "eval_failed": 1, "by_domain": {"math": 5}, "eval_by_domain": {"math": 1}}
    assert totals["first"] == {"kind": "rollout", "domain": "math", "env": "SometimesBroken",
                               "task": "train-5", "episode": "train-5-0", "cause": "env",
                               "error": "Traceback: ZeroDivisionError: verifier bug"}
    assert f.summary() == (
        "failures: 6 episode(s) failed (4 in their environment, 2 in generation (workers)); 5 "
        "in training batches (math 5) and 1 in evaluations (math 1); first: SometimesBroken, "
        "math task 'train-5' (rollout episode train-5-0): Traceback: ZeroDivisionError: "
        "verifier bug")
    # a rollout that does not publish rollout/failed_env: all its failures are the env's
    old = Failures()
    old.on_record(rec("rollout", {"rollout/failed": 2.0}, 0))
    assert old.env_failed() == 2


def test_distill_kl_weighs_each_teacher_by_its_tokens():
    assert distill_kl(MOPD) == {"opd/reverse_kl": pytest.approx(
        (0.0123456 * 40 + 0.2345678 * 60) / 100)}
    assert distill_kl(TRAIN) == {}
    # the pool's sampled KL and the step's own total are not teachers
    assert distill_kl({"opd/a/reverse_kl": 1.0, "opd/a/tokens": 1.0, "opd/reverse_kl": 9.0,
                       "opd/a/sampled_reverse_kl": 5.0}) == {"opd/reverse_kl": 1.0}


def test_samples_go_to_their_files_and_tensorboard_text_and_metrics_jsonl_stays_lean(tmp_path):
    pytest.importorskip("tensorboardX")
    said: list[str] = []
    out = sinks.open_sinks(RunConfig(name="t", sinks=["jsonl", "tensorboard"]), tmp_path, {},
                           said.append)
    evil = "|\n" + "y" * (3 * SAMPLE_TEXT_CHARS)
    out.write(rec("rollout", ROLLOUT, 4, samples=[
        sample("rollout", "math", "1+2=", "3"),
        failed("rollout", "math", "train-9", "ZeroDivisionError: bug")]))
    out.write(rec("rollout", {"eval/math": 0.5}, 3, samples=[
        sample("eval", "math", "2+2=", evil, reward=0.0)]))
    out.write(rec("rollout", {"x": 1.0}, 5, samples=[sample("../../etc/passwd", "m", "p", "r")]))
    out.close()
    rollout = jsonl(tmp_path / "samples" / "rollout.jsonl")
    assert [(r["step"], r["prompt"], r["response"], r["status"]) for r in rollout] == [
        (4, "1+2=", "3", "ok"), (4, "p", "", "failed")]
    assert rollout[1]["error"] == "ZeroDivisionError: bug" and rollout[1]["env"] == \
        "SometimesBroken" and rollout[1]["task"] == "train-9" and rollout[1]["actor"] == "rollout"
    (ev,) = jsonl(tmp_path / "samples" / "eval.jsonl")
    assert len(ev["response"]) == SAMPLE_TEXT_CHARS and ev["weight_version"] == 9
    # an unknown kind cannot name a path: it goes to other.jsonl
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
        "eval.jsonl", "other.jsonl", "rollout.jsonl"]
    assert "samples" not in (tmp_path / "metrics.jsonl").read_text()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    texts = read_tensorboard_text(tmp_path / "tensorboard")
    (step, table), = texts["rollout/samples/rollout"]
    assert step == 4 and table.splitlines()[0].startswith("| domain | prompt | response |")
    assert "| math | 1+2= | 3 | 1 | 9 | ok |" in table
    (_, eval_table), = texts["rollout/samples/eval"]
    row = eval_table.splitlines()[2]  # the | and newline of the text stay inside the cell
    assert row.startswith("| math | 2+2= | \\| ⏎ yyy") and row.count(" | ") == 8


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_tensorboard_text(logdir: Path) -> dict[str, list[tuple[int, str]]]:
    """tag -> [(step, text)] of the text summaries in `logdir`'s event files."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 16 + length
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "text":
                    text = v.tensor.string_val[0].decode()
                    out.setdefault(v.tag.removesuffix("/text_summary"), []).append(
                        (event.step, text))
    return out


def test_a_record_with_too_many_samples_keeps_the_first_and_says_so(tmp_path):
    said: list[str] = []
    out = sinks.Sinks([sinks.SampleFiles(tmp_path / "samples", said.append)], said.append)
    many = [sample("eval", "m", "p", "r")] * (sinks.MAX_SAMPLES_PER_RECORD + 5)
    out.write(rec("rollout", {}, 1, samples=many))
    out.write(rec("rollout", {}, 2, samples=many))
    out.close()
    assert len((tmp_path / "samples" / "eval.jsonl").read_text().splitlines()) == \
        2 * sinks.MAX_SAMPLES_PER_RECORD
    assert said == [f"samples: a record of rollout held {len(many)} samples; the first "
                    f"{sinks.MAX_SAMPLES_PER_RECORD} are kept (MAX_SAMPLES_PER_RECORD)"]


async def test_garbage_and_a_record_the_console_cannot_tell_are_said_once_and_the_stream_goes_on(
        ipc, monkeypatch):
    factory = SocketFactory()
    proxy = MetricsProxy(factory, ipc("m-in"), ipc("m-out"))
    pub = MetricsPublisher(factory, proxy.frontend, "rollout")
    said: list[str] = []
    monkeypatch.setattr(cluster, "say", said.append)
    got: list[Metrics] = []

    class Record:
        def write(self, m):
            got.append(m)

    class Touchy(Story):
        def on_record(self, m):
            if m.values.get("boom"):
                raise KeyError("boom")
            super().on_record(m)
    failures = Failures()
    task = asyncio.ensure_future(cluster.show_progress(
        proxy.backend, types.SimpleNamespace(factory=factory), Record(),
        Touchy(said.append, 0.0), failures))
    try:
        assert await pub.wait_subscribed(5.0)
        pub.sock.send_nowait([TOPIC, b"\xc1 garbage"])
        for step, values in enumerate([{"boom": 1.0}, {"boom": 1.0},
                                       {**ROLLOUT, "rollout/failed_env": 3.0}]):
            pub.publish(values, step=step)
        async with asyncio.timeout(10):
            while len(got) < 3:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
        proxy.close()
        factory.close()
    assert [m.step for m in got] == [0, 1, 2]  # every record reached the sinks
    flat = [" ".join(m.split()) for m in said]
    assert sum(m.startswith("console: a record of 'rollout' could not be told (KeyError: "
                            "'boom')") for m in flat) == 1
    assert sum(m.startswith("metrics: 1 message(s) on the metrics stream were not records")
               for m in flat) == 1
    assert any(m.startswith("rollout: batch 2 reward") for m in flat)
    assert failures.env_failed() == 3  # told after the failing ones


async def test_the_run_keys_are_removed_when_the_sinks_cannot_be_opened(tmp_path, monkeypatch):
    """The early exit (code 2) of run_cluster removes the run's CURVE key folder too."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "server.key_secret").write_text("secret")

    def refuse(*args, **kwargs):
        raise sinks.SinkError("the disk is gone")
    monkeypatch.setattr(sinks, "open_sinks", refuse)
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[run]\nname = "t"\n[[hosts]]\nname = "local"\n[actors.a]\n'
                     'cls = "examples.demo:Scaler"\n')
    code = await cluster.run_cluster(load(hosts), ["a"], tmp_path, keys=keys)
    assert code == 2 and not keys.exists()
