"""`python -m launch.watch`: the board fits 80x24 (and narrower), starts from the run's
metrics.jsonl, and marks actors that went silent as stale."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from rich.cells import cell_len
from rich.console import Console

from launch import watch
from launch.watch import Board, ago, nbytes, num, read_history
from transport.metrics import MetricsProxy, MetricsPublisher
from transport.schema import Metrics
from transport.sockets import SocketFactory

T0 = 1_800_000_000.0

TRAINER = {"reward/math": 0.6975, "reward/reverse": 0.125, "train/loss": -0.01234567,
           "train/clipfrac": 0.01, "train/ppo_kl": 3.2e-6, "train/entropy": 1.734,
           "train/grad_norm": 0.4567, "train/staleness_mean": 0.5, "time/wait_batch_s": 0.0123,
           "time/train_s": 0.9, "time/weight_sync_s": 0.2, "time/step_s": 1.2345,
           "version": 79.0, "weight_sync/fallbacks": 0.0}
ROLLOUT = {"rollout/tokens_per_s": 3771.4, "rollout/batch_s": 1.1, "rollout/failed": 0.0,
           "rollout/trainer_version": 78.0, "rollout/reward/math": 0.61,
           "rollout/reward/reverse": 0.1875, "rollout/response_len/math": 2.5,
           "rollout/response_len/reverse": 4.1}
WORKER = {"memory/device_bytes": 311040.0, "memory/released": 0.0, "engine/waves": 12.0,
          "engine/running": 3.0}
BUFFER = {"buffer/added": 12544.0, "buffer/emitted": 11760.0, "buffer/pending": 128.0,
          "buffer/dropped_stale": 16.0, "buffer/dropped_duplicate": 4.0,
          "buffer/ready_groups": 1.0, "buffer/journal_bytes": 123456.0}
TEACHERS = {"opd/unrouted_samples": 0.0, "opd/arith/tokens_scored": 5000.0,
            "opd/arith/failed_samples": 0.0, "opd/arith/sampled_reverse_kl": 0.0421}
PREFETCH = {"prefetch/bytes": 3.5 * 2**30, "prefetch/gbps": 6.25, "prefetch/in_flight": 1.0}


LONG = "a-custom-actor-with-a-very-long-name"
ORDER = ["trainer", "rollout", "buffer", "teacher-pool", "prefetcher", "worker0", "worker1", LONG]


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def feed(board: Board, actor: str, times, values: dict, step0: int | None = None,
         total: int | None = None, dropped: int = 0) -> None:
    for i, t in enumerate(times):
        board.update(Metrics(actor=actor, seq=i + 1, time_s=T0 + t, values=values,
                             step=None if step0 is None else step0 + i, total_steps=total,
                             dropped=dropped))


def full_board(clock: Clock, others: bool = True) -> Board:
    """A main job (plus the distillation actors and an actor with a long name), all fresh but
    worker1, which stopped 41 s ago (its interval is 1 s)."""
    b = Board(clock=clock, label="grpo-local-20260101-120000")
    feed(b, "trainer", [63 + 1.2 * i for i in range(30)], TRAINER, step0=50, total=200)
    feed(b, "rollout", [61 + 1.2 * i for i in range(30)], ROLLOUT, step0=51)
    feed(b, "buffer", range(70, 99), BUFFER, step0=1, dropped=2)
    feed(b, "worker0", range(70, 99), WORKER)
    feed(b, "worker1", range(50, 60), {**WORKER, "engine/running": 5.0})
    if others:
        feed(b, "teacher-pool", range(90, 99), TEACHERS)
        feed(b, "prefetcher", range(90, 99), PREFETCH)
        feed(b, LONG, range(90, 99), {"items_per_s": 12.5})
    b.expect({"router": "actors.router:RouterActor", "trainer": "actors.trainer:TrainerActor"})
    return b


def render(board: Board, width: int, height: int = 24) -> list[str]:
    console = Console(width=width, height=height, record=True, file=io.StringIO(),
                      color_system=None)
    console.print(board)
    return console.export_text().rstrip("\n").split("\n")


def row(lines: list[str], name: str) -> str:
    found = [line for line in lines if line.split(" ")[0] == name]
    assert len(found) == 1, (name, lines)
    return found[0]


# ----------------------------------------------------------------------------- formatting
def test_values_are_short():
    assert num(3771.4) == "3771"
    assert num(12544.0) == "12544"
    assert num(123456.7) == "123k"
    assert num(2.5e9) == "2.5G"
    assert num(-0.01234567) == "-0.0123"
    assert num(3.2e-6) == "3.2e-6"
    assert num(0.6975) == "0.698"
    assert num(float("nan")) == "nan"
    assert nbytes(311040) == "304K"
    assert nbytes(1.5 * 2**30) == "1.5G"
    assert nbytes(512) == "512B"
    assert ago(5.24) == "5.2s"
    assert ago(42.9) == "42s"
    assert ago(125) == "2m05s"
    assert ago(3725) == "1h02m"
    assert ago(2 * 86400 + 3 * 3600) == "2d03h"
    assert watch.shorten("a-custom-actor-with-a-very-long-name", 9) == "a-cu…name"


def test_roles_and_the_order_of_their_metrics():
    assert [watch.role_of(v) for v in (TRAINER, ROLLOUT, WORKER, BUFFER, TEACHERS, PREFETCH)] == [
        "trainer", "rollout", "worker", "buffer", "teachers", "prefetcher"]
    # a trainer's first record can be its memory per phase: its class says the role
    memory = {"memory/train/trainer_device_bytes": 2.0 * 2**30}
    assert watch.role_of(memory) == "other"
    assert watch.role_of(memory, "actors.trainer:TrainerActor") == "trainer"
    texts = [f.text() for f in watch.fields_of("worker", {
        **WORKER, "memory/released": 1.0, "memory/nvml_bytes": 1.5 * 2**30})]
    assert texts == ["mem=304K", "nvml=1.5G", "released", "run=3", "waves=12"]
    texts = [f.text() for f in watch.fields_of("worker", WORKER)]
    assert texts == ["mem=304K", "", "run=3", "waves=12"]  # released = 0: no flag
    # keys no role knows come last, without their first part unless that would mix them up
    texts = [f.text() for f in watch.fields_of("other", {"a/x": 1.0, "b/x": 2.0, "c/y": 3.0,
                                                          "plain": 4.0})]
    assert texts == ["a/x=1", "b/x=2", "y=3", "plain=4"]


# ----------------------------------------------------------------------------- layout
def test_board_fits_80x24_with_every_actor_and_the_metrics_of_its_role():
    clock = Clock(T0 + 100)
    lines = render(full_board(clock), 80)
    assert len(lines) <= 24
    assert all(cell_len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("rlx watch · grpo-local-20260101-120000 · ")
    assert "8 actors · 1 stale" in lines[0]
    assert lines[1].split() == ["actor", "step", "last", "lost", "metrics"]
    trainer = row(lines, "trainer")
    # step/total, age of the last record (at 63 + 1.2 * 29 = 97.8), then loss, step time and
    # the reward of every domain, shortened to 3 significant digits
    assert trainer.split()[:3] == ["trainer", "79/200", "2.2s"]
    assert trainer.endswith(" loss=-0.0123 dt=1.23s r/math=0.698")  # r/reverse: no room
    rollout = row(lines, "rollout")
    assert rollout.split()[:3] == ["rollout", "80", "4.2s"]
    assert "r/math=0.61 r/reverse=0.188" in rollout
    buffer = row(lines, "buffer")
    assert buffer.split()[:4] == ["buffer", "29", "2.0s", "2"]  # 2 records lost
    assert "pend=128 ready=1 emit=11760 drop=20" in buffer
    assert "mem=304K run=3" in row(lines, "worker0")
    worker1 = row(lines, "worker1")
    assert "stale 41s" in worker1 and "mem=304K run=5" in worker1
    assert "kl/arith=0.0421" in row(lines, "teacher-pool")
    assert "GB/s=6.25 read=3.5G" in row(lines, "prefetcher")
    assert "items_per_s=12.5" in row(lines, "a-custom-…ong-name")
    assert lines[-1] == "no record yet: router"
    # role order: the trainer first, workers after the other roles
    names = [line.split(" ")[0] for line in lines[2:-1]]
    assert names == [watch.shorten(n, watch.ACTOR_MAX) for n in ORDER]


def test_the_main_job_at_80_columns_shows_the_reward_of_every_domain():
    lines = render(full_board(Clock(T0 + 100), others=False), 80)
    assert [line.split(" ")[0] for line in lines[2:-1]] == ORDER[:3] + ORDER[5:7]
    assert row(lines, "trainer").endswith(" loss=-0.0123 dt=1.23s r/math=0.698 r/reverse=0.125")
    assert row(lines, "rollout").endswith(" r/math=0.61 r/reverse=0.188 tok/s=3771 failed=0")


@pytest.mark.parametrize("width, header, actor_w, trainer_metrics", [
    (60, ["actor", "step", "last", "metrics"], 18, "loss=-0.0123 dt=1.23s"),
    (40, ["actor", "last", "metrics"], 6, "loss=-0.0123 dt=1.23s"),
    (30, ["actor", "last", "metrics"], 6, "loss=-0.0123"),
])
def test_narrower_terminals_drop_columns_and_metrics_never_rows(width, header, actor_w,
                                                                trainer_metrics):
    lines = render(full_board(Clock(T0 + 100)), width)
    assert all(cell_len(line) <= width for line in lines), lines
    assert lines[1].split() == header
    assert re.match(r"actor +", lines[1]).end() - 1 == actor_w  # the actor column's width
    assert [line.split(" ")[0] for line in lines[2:-1]] == [watch.shorten(n, actor_w)
                                                            for n in ORDER]
    trainer = lines[2]
    assert trainer.endswith(" " + trainer_metrics)  # whole metrics, highest priority first
    assert ("79/200" in trainer) == ("step" in header)
    assert "stale 41s" in lines[8]  # worker1


def test_a_wide_terminal_shows_every_metric():
    lines = render(full_board(Clock(T0 + 100)), 240)
    trainer = row(lines, "trainer")
    for text in ("wait=0.0123s", "sync=0.2s", "gnorm=0.457", "ent=1.73", "ppo_kl=3.2e-6",
                 "ver=79", "clipfrac=0.01", "train_s=0.9", "fallbacks=0"):
        assert text in trainer


def test_many_workers_share_a_row_but_stale_ones_keep_theirs():
    clock = Clock(T0 + 100)
    b = full_board(clock)
    for w in range(2, 40):
        silent = w in (7, 23)
        feed(b, f"worker{w}", [30 + i if silent else 95 + i for i in range(5)],
             {**WORKER, "memory/device_bytes": 311040.0 + 1024 * w,
              "memory/released": float(w % 2)})
    lines = render(b, 80, 24)
    assert len(lines) <= 24 and all(cell_len(line) <= 80 for line in lines)
    assert "46 actors · 3 stale" in lines[0]
    for name in ("trainer", "rollout", "buffer", "teacher-pool", "prefetcher"):
        assert row(lines, name)
    for name in ("worker1", "worker7", "worker23"):
        assert "stale" in row(lines, name)
    # the 37 fresh workers: worker0 and 2..39 less 7 and 23; memory as a range, released a count
    shared = row(lines, "worker×37")
    assert "mem=304K..343K" in shared and "released=17" in shared


def test_too_many_stale_actors_for_the_height_end_with_a_count():
    b = Board(clock=Clock(T0 + 1000))
    for w in range(40):
        feed(b, f"w{w}", [1, 2, 3], WORKER)
    lines = render(b, 80, 12)
    assert len(lines) == 11  # one line short of the height (a full-height live view scrolls)
    assert lines[-1].startswith("+32 more")
    assert "40 actors · 40 stale" in lines[0]
    assert [line.split()[0] for line in lines[2:-1]] == [f"w{i}" for i in range(8)]
    assert all("stale 16m37s" in line for line in lines[2:-1])


# ----------------------------------------------------------------------------- staleness
def test_an_actor_is_stale_after_a_few_of_its_intervals_with_a_fake_clock():
    clock = Clock(T0 + 11)
    b = Board(clock=clock)
    feed(b, "fast", [i for i in range(11)], WORKER)  # every 1 s until now
    feed(b, "stopped", [0, 1, 2, 3], WORKER)  # every 1 s, silent since 3
    feed(b, "slow", [-40, -20, 0], TRAINER, step0=1)  # every 20 s
    feed(b, "once", [5], {"x": 1.0})  # one record: the default interval
    assert b.stale_after(b.actors["fast"]) == watch.STALE_MIN_S  # 3 x 1 s, raised to 5 s
    assert b.stale_after(b.actors["slow"]) == 60.0
    assert b.stale_after(b.actors["once"]) == 3 * watch.DEFAULT_INTERVAL_S

    lines = render(b, 80)
    assert [r.name for r in b.rows(clock()) if r.stale] == ["stopped"]
    assert "stale 8.0s" in row(lines, "stopped")
    assert "stale" not in row(lines, "fast") and "stale" not in row(lines, "slow")
    clock.t = T0 + 61  # slow: 61 s silent > 3 x 20 s; once: 56 s < 60 s
    lines = render(b, 80)
    assert "stale 1m01s" in row(lines, "slow")
    assert "stale" not in row(lines, "once")
    assert "4 stale" not in lines[0] and "3 stale" in lines[0]
    clock.t = T0 + 66
    assert "stale 1m01s" in row(render(b, 80), "once")
    # a record brings it back
    feed(b, "slow", [65.5], TRAINER, step0=4)
    assert "stale" not in row(render(b, 80), "slow")
    # one threshold for every actor (--stale-s)
    b2 = Board(clock=Clock(T0 + 11), stale_s=100.0)
    feed(b2, "stopped", [0, 1, 2, 3], WORKER)
    assert not b2.rows(T0 + 11)[0].stale and b2.rows(T0 + 104)[0].stale


def test_history_and_stream_overlap_without_double_counting():
    b = Board(clock=Clock(T0 + 10))
    records = [Metrics(actor="t", seq=i, time_s=T0 + i, values={"train/loss": float(i)}, step=i)
               for i in range(1, 6)]
    for m in records:
        assert b.update(m)
    for m in records[-2:]:  # the same records again from the live stream
        assert not b.update(m)
    assert b.actors["t"].records == 5 and list(b.actors["t"].times) == [T0 + i for i in range(1, 6)]
    # a late record (published before the newest) does not replace newer values or the step
    assert b.update(Metrics(actor="t", seq=9, time_s=T0 + 2.5,
                            values={"train/loss": -1.0, "eval/x": 0.5}, step=2))
    a = b.actors["t"]
    assert a.values == {"train/loss": 5.0, "eval/x": 0.5} and a.step == 5


def test_a_finished_run_is_not_stale(tmp_path):
    b = Board(clock=Clock(T0 + 1000), run_dir=tmp_path)
    feed(b, "w", [1, 2, 3], WORKER)
    assert "stale" in row(render(b, 80), "w")
    exit_json = tmp_path / "exit.json"
    exit_json.write_text(json.dumps({"exit_code": 0, "actors": {}}))
    os.utime(exit_json, (T0 + 4, T0 + 4))
    lines = render(b, 80)
    assert "run ended (exit 0)" in lines[0] and "stale" not in row(lines, "w")
    feed(b, "w2", [5], WORKER)  # a record newer than exit.json: the run was resumed
    lines = render(b, 80)
    assert "run ended" not in lines[0] and "stale" in row(lines, "w")


# ----------------------------------------------------------------------------- history
def write_jsonl(path: Path, records: list[Metrics], tail: bytes = b"") -> None:
    with open(path, "wb") as f:  # as the launcher writes it
        for m in records:
            f.write(msgspec.json.encode(m) + b"\n")
        f.write(tail)


def test_history_is_the_last_records_of_every_actor_in_time_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [Metrics(actor="early", seq=1, time_s=T0, values={"x": 1.0})]
    records += [Metrics(actor=a, seq=i, time_s=T0 + i + (0.5 if a == "b" else 0),
                        values={"v": float(i)}, step=i) for i in range(1, 30) for a in "ab"]
    write_jsonl(path, records, tail=b'{"type":"Metrics","actor":"a","seq":99,"ti')
    with open(path, "r+b") as f:  # a line of junk in the middle
        f.seek(0, 2)
        f.write(b"\nnot json\n")
    for chunk in (1 << 20, 64):  # one read, and lines split across reads
        got = read_history(path, per_actor=4, chunk=chunk)
        assert [(m.actor, m.seq) for m in got] == [
            ("early", 1), ("a", 26), ("b", 26), ("a", 27), ("b", 27), ("a", 28), ("b", 28),
            ("a", 29), ("b", 29)]
        # with the run's actors known, the read stops once each has its records (in small
        # reads: before the first line)
        got = read_history(path, per_actor=4, actors={"a", "b"}, chunk=chunk)
        assert [(m.actor, m.seq) for m in got][-8:] == [
            ("a", 26), ("b", 26), ("a", 27), ("b", 27), ("a", 28), ("b", 28), ("a", 29),
            ("b", 29)]
        assert len(got) == (9 if chunk > path.stat().st_size else 8)
    assert read_history(tmp_path / "missing.jsonl") == []


def test_history_skips_the_lines_of_actors_it_has_without_decoding_them(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    quiet = Metrics(actor='q"uiet', seq=1, time_s=T0, values={"x": 1.0})  # escaped in JSON
    chatty = [Metrics(actor="chatty", seq=i, time_s=T0 + i, values={"v": float(i)})
              for i in range(1, 1001)]
    write_jsonl(path, [quiet] + chatty)
    assert msgspec.json.encode(chatty[0]).startswith(watch._PREFIX + b'chatty"')
    decoded = []
    decoder = msgspec.json.Decoder(Metrics)

    class Counting:
        def __init__(self, _type):
            pass

        def decode(self, line):
            decoded.append(line)
            return decoder.decode(line)

    monkeypatch.setattr(watch.msgspec.json, "Decoder", Counting)
    got = read_history(path, per_actor=3, chunk=4096)
    assert [(m.actor, m.seq) for m in got] == [('q"uiet', 1), ("chatty", 998), ("chatty", 999),
                                                ("chatty", 1000)]
    assert len(decoded) == 4  # not 1001


def test_actor_classes_and_run_dir_of(tmp_path):
    run = Path(tempfile.mkdtemp(prefix="rlxw-"))
    try:
        (run / "config.json").write_text(json.dumps({"actors": {
            "trainer": {"cls": "actors.trainer:TrainerActor"}, "router": {"cls": "x:Y"}}}))
        endpoint = f"ipc://{run}/sock/metrics-out-1"
        (run / "endpoints.json").write_text(json.dumps({"metrics": endpoint}))
        assert watch.actor_classes(run) == {"trainer": "actors.trainer:TrainerActor",
                                            "router": "x:Y"}
        assert watch.actor_classes(tmp_path) == {}
        assert watch.run_dir_of(str(run), endpoint) == run
        assert watch.run_dir_of(endpoint, endpoint) == run  # the address the launcher prints
        assert watch.run_dir_of("ipc:///nowhere/sock/m", "ipc:///nowhere/sock/m") is None
        assert watch.run_dir_of("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555") is None
    finally:
        shutil.rmtree(run)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture
def run_dir():
    run = Path(tempfile.mkdtemp(prefix="rlxw-"))  # ipc paths must be short
    (run / "sock").mkdir()
    yield run
    shutil.rmtree(run, ignore_errors=True)


ACTORS = {"trainer": {"cls": "actors.trainer:TrainerActor"},
          "worker0": {"cls": "actors.inference:InferenceWorker"},
          "router": {"cls": "actors.router:RouterActor"}}


def make_run(run: Path, endpoint: str, t_hist: float, started: bool = True) -> None:
    """A run directory as the launcher writes it: config.json, then endpoints.json (listing the
    actors once every one is up, when `started`), and a trainer's history."""
    (run / "config.json").write_text(json.dumps({"source": "/somewhere/hosts.toml",
                                                 "actors": ACTORS}))
    (run / "endpoints.json").write_text(json.dumps({"metrics": endpoint, **(
        {"actors": {n: {"host": "local"} for n in ACTORS}} if started else {})}))
    write_jsonl(run / "metrics.jsonl", [
        Metrics(actor="trainer", seq=i, time_s=t_hist + i, values={**TRAINER, "train/loss": i / 8},
                step=i, total_steps=200) for i in range(1, 9)])


async def test_watch_starts_from_the_history_then_follows_the_stream(run_dir, tmp_path):
    factory = SocketFactory()
    proxy = MetricsProxy(factory, f"ipc://{run_dir}/sock/metrics-in",
                         f"ipc://{run_dir}/sock/metrics-out")
    # the trainer reported last 60 s ago, every 1 s: stale
    make_run(run_dir, proxy.backend, time.time() - 68)
    pub = MetricsPublisher(factory, proxy.frontend, "worker0")
    out = io.StringIO()
    console = Console(file=out, width=80, height=24, color_system=None)
    jsonl = tmp_path / "watch.jsonl"
    target = str(run_dir)
    task = asyncio.ensure_future(watch.watch(
        watch.resolve(target), str(jsonl), 1.5, True, watch.security_of(target, None),
        watch.run_dir_of(target, watch.resolve(target)), console=console))
    try:
        assert await pub.wait_subscribed(5.0)
        for i in range(5):
            pub.publish(WORKER)
            await asyncio.sleep(0.05)
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        pub.close()
        proxy.close()
        factory.close()
    lines = out.getvalue().rstrip("\n").split("\n")
    assert all(cell_len(line) <= 80 for line in lines)
    trainer = row(lines, "trainer")
    assert trainer.split()[:3] == ["trainer", "8/200", "stale"]
    assert "loss=1 dt=1.23s" in trainer  # the last record of the history: loss 8/8
    worker = row(lines, "worker0")
    assert "stale" not in worker and "mem=304K run=3" in worker
    assert lines[-1] == "no record yet: router"
    recorded = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["actor"], r["seq"]) for r in recorded] == [("worker0", i) for i in range(1, 6)]


def test_the_command_prints_a_finished_run_once(run_dir, capsys):
    endpoint = f"ipc://{run_dir}/sock/metrics-out"  # nobody binds it any more
    make_run(run_dir, endpoint, time.time() - 100)
    (run_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "actors": {}}))
    assert watch.main([str(run_dir), "--duration-s", "0"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert "run ended (exit 0)" in lines[0]
    assert row(lines, "trainer").split()[:2] == ["trainer", "8/200"]
    assert "no record yet: worker0, router" in lines[-1]
    assert watch.main([str(run_dir / "nothing-here")]) == 2


async def test_a_terminal_gets_a_live_board_refreshed_while_it_waits(run_dir):
    endpoint = f"ipc://{run_dir}/sock/metrics-out"  # nothing arrives: the ages still move on
    make_run(run_dir, endpoint, time.time() - 12.5)  # the last record 4.5 s ago, every 1 s
    console = Console(file=io.StringIO(), width=80, height=24, force_terminal=True,
                      color_system=None, record=True)
    assert await watch.watch(endpoint, None, 1.2, True, run_dir=run_dir, console=console) == 0
    frames = console.export_text().split("rlx watch · ")[1:]
    assert len(frames) >= 4  # drawn on entry, then every REFRESH_S
    ages = [re.search(r"\ntrainer +8/200 +(stale )?([\d.]+)s", f).groups() for f in frames]
    assert [float(a) for _, a in ages] == sorted(float(a) for _, a in ages)
    assert float(ages[-1][1]) - float(ages[0][1]) >= 0.7
    # stale once silent for 5 s (3 x its 1 s interval, raised to STALE_MIN_S)
    for stale, age in ages:  # (shown to 0.1 s)
        if abs(float(age) - watch.STALE_MIN_S) > 0.05:
            assert bool(stale) == (float(age) > watch.STALE_MIN_S), ages
    assert ages[0][0] is None and ages[-1][0] == "stale "


# ----------------------------------------------------------------------------- the run's end
ROOT = Path(__file__).resolve().parent.parent
END = {"exit_code": 0, "reason": "trainer completed", "completed": "trainer", "actors": {}}


def command(*args: str, pre: str = "") -> list[str]:
    """`python -m launch.watch ARGS`, after the Python statements `pre` (run in a process that
    then becomes the watcher: what they leave, the watcher inherits)."""
    argv = ["-m", "launch.watch", *args]
    if not pre:
        return [sys.executable, *argv]
    return [sys.executable, "-c", (f"import os, signal, sys\n{pre}\n"
                                   f"os.execv(sys.executable, [sys.executable, *{argv!r}])")]


def flat(text: str) -> str:
    """Messages wrapped at 80 columns, as one line each again."""
    return " ".join(text.split())


def test_the_end_of_a_run_is_exit_json_written_after_its_last_start(run_dir):
    make_run(run_dir, f"ipc://{run_dir}/sock/metrics-out", T0)
    assert watch.run_end(run_dir) is None
    exit_json = run_dir / "exit.json"
    exit_json.write_text(json.dumps(END))
    start = watch.started_at(run_dir)
    os.utime(exit_json, (start + 1, start + 1))
    assert watch.run_end(run_dir) == END
    os.utime(exit_json, (start - 60, start - 60))  # a resumed run: started since its end
    assert watch.run_end(run_dir) is None
    b = Board(clock=Clock(start), run_dir=run_dir)
    feed(b, "trainer", [start - T0 - 10, start - T0 - 9], TRAINER)  # before the start
    assert b.ended() is None
    os.utime(exit_json, (start + 1, start + 1))
    assert b.ended() == "exit 0"
    exit_json.write_text("{not json")
    assert watch.run_end(run_dir) is None


@pytest.mark.parametrize("args", [[], ["--no-live", "--jsonl", "{run}/w.jsonl"]])
def test_the_command_on_a_finished_run_says_how_it_ended_and_exits(run_dir, args):
    """No --duration-s: the watcher does not wait for a run that has ended (it used to wait
    for its silent actors, the router, forever)."""
    make_run(run_dir, f"ipc://{run_dir}/sock/metrics-out", time.time() - 100)
    (run_dir / "exit.json").write_text(json.dumps(END))
    t0 = time.monotonic()
    done = subprocess.run(command(str(run_dir), *(a.format(run=run_dir) for a in args)),
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 30
    # text output, board and messages, in 80 columns (the message wrapped between words)
    assert all(cell_len(line) <= 80 for line in (done.stdout + done.stderr).splitlines())
    assert len(done.stderr.splitlines()) > 1
    assert (f"the run in {run_dir} has ended: exit code 0, trainer completed; nothing more "
            f"will come") in flat(done.stderr)
    if not args:  # its last known state, from metrics.jsonl
        lines = done.stdout.rstrip("\n").split("\n")
        assert "run ended (exit 0)" in lines[0]
        assert row(lines, "trainer").split()[:2] == ["trainer", "8/200"]
        assert lines[-1] == "no record yet: worker0, router"
    else:
        assert done.stdout == ""


def test_a_run_whose_launcher_is_gone_without_an_end_is_said_so(run_dir):
    """Nobody binds the metrics address (its launcher was killed: a stale socket file) and no
    exit.json says the run ended: the watcher gives up after --gone-s, exit code 1."""
    stale = run_dir / "sock" / "metrics-out"
    with socket.socket(socket.AF_UNIX) as s:  # left behind, nobody listening
        s.bind(str(stale))
    make_run(run_dir, f"ipc://{stale}", time.time() - 100)
    t0 = time.monotonic()
    done = subprocess.run(command(str(run_dir), "--no-live", "--gone-s", "1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - t0 < 30
    assert all(len(line) <= 80 for line in done.stderr.splitlines()), done.stderr
    said = flat(done.stderr)
    assert f"no answer at ipc://{stale} yet (is the launcher running?)" in said
    assert (f"nothing answers at ipc://{stale} for 1s, and {run_dir} records no end of the run "
            f"(no exit.json since it started): its launcher is not running") in said
    assert (f"continue the run with python -m launch.cluster /somewhere/hosts.toml --resume "
            f"{run_dir}") in said
    # an address alone: nothing to read the run from, the same wait
    said: list[str] = []
    assert asyncio.run(watch.watch(f"ipc://{stale}", None, None, False, gone_s=0.5,
                                   say=said.append)) == 1
    assert said[-1].startswith(f"nothing answers at ipc://{stale} for 0.5s: no launcher is "
                               f"running there")


async def until(condition, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        await asyncio.sleep(0.02)


async def test_a_run_starting_names_its_actors_not_up_then_ends_the_watch_when_it_ends(run_dir):
    factory = SocketFactory()
    proxy = MetricsProxy(factory, f"ipc://{run_dir}/sock/metrics-in",
                         f"ipc://{run_dir}/sock/metrics-out")
    make_run(run_dir, proxy.backend, time.time() - 100, started=False)  # the start goes on
    pub = MetricsPublisher(factory, proxy.frontend, "worker0")
    said: list[str] = []
    out = io.StringIO()
    console = Console(file=out, width=80, height=24, force_terminal=True, color_system=None,
                      record=True)
    boards = asyncio.ensure_future(watch.watch(proxy.backend, None, None, True, run_dir=run_dir,
                                               console=console, say=said.append))
    task = asyncio.ensure_future(watch.watch(proxy.backend, None, None, False, run_dir=run_dir,
                                             say=said.append))
    try:
        # the trainer reported before this start (a resumed run): not up yet either
        await until(lambda: any(s.startswith("waiting for trainer, worker0, router to start (")
                                for s in said), what="the first wait")
        assert await pub.wait_subscribed(5.0)
        await until(lambda: pub.publish(WORKER) and any(
            s.startswith("waiting for trainer, router to start (") for s in said),
            what="worker0 to count as up")
        await until(lambda: "waiting for trainer, router to start (" in console.export_text(
            clear=False), what="the board's footer")
        assert not task.done() and not boards.done()
        # every actor is up: endpoints.json lists them; the router never reports (the board
        # has the trainer's history)
        (run_dir / "endpoints.json").write_text(json.dumps({"metrics": proxy.backend, "actors": {
            n: {"host": "local"} for n in ACTORS}}))
        await until(lambda: console.export_text(clear=False).rstrip().endswith(
            "\nno record yet: router"), what="the footer once every actor is up")
        n_said = len(said)
        # the run ends: exit.json, then the launcher closes its sockets
        (run_dir / "exit.json").write_text(json.dumps(END))
        pub.close()
        proxy.close()
        assert await asyncio.wait_for(task, 20) == 0
        assert await asyncio.wait_for(boards, 20) == 0
    finally:
        for t in (task, boards):
            t.cancel()
        await asyncio.gather(task, boards, return_exceptions=True)
        pub.close()
        proxy.close()
        factory.close()
    ends = [s for s in said[n_said:] if not s.startswith("waiting")]
    assert ends == [(f"the run in {run_dir} has ended: exit code 0, trainer completed; nothing "
                     f"more will come (exit.json there says how each actor ended)")] * 2
    assert "run ended (exit 0)" in console.export_text().split("rlx watch · ")[-1]


@pytest.mark.parametrize("sig, pre", [
    (signal.SIGINT, "signal.signal(signal.SIGINT, signal.SIG_IGN)"),  # `cmd &` in a script
    (signal.SIGINT, "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})"),
    (signal.SIGTERM, "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})"),
    (signal.SIGINT, ""),
], ids=["sigint-ignored", "sigint-blocked", "sigterm-blocked", "sigint"])
async def test_ctrl_c_and_sigterm_end_the_watcher_whatever_it_inherited(run_dir, tmp_path, sig,
                                                                        pre):
    """A process started in the background by a shell without job control (a CI step, a test
    suite run with `&`) has SIGINT ignored, and its children inherit that, and a blocked mask,
    across exec: the watcher's Ctrl-C did nothing there, however often it came."""
    factory = SocketFactory()
    proxy = MetricsProxy(factory, f"ipc://{run_dir}/sock/metrics-in",
                         f"ipc://{run_dir}/sock/metrics-out")
    make_run(run_dir, proxy.backend, time.time() - 100)
    pub = MetricsPublisher(factory, proxy.frontend, "worker0")
    jsonl = tmp_path / "w.jsonl"
    proc = await asyncio.create_subprocess_exec(
        *command(str(run_dir), "--no-live", "--jsonl", str(jsonl), pre=pre), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # its first record: the watcher is in its loop
        await until(lambda: pub.publish(WORKER) and jsonl.is_file() and jsonl.stat().st_size,
                    30, "the watcher's first record")
        proc.send_signal(sig)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 20)
        except TimeoutError:
            raise AssertionError(f"the watcher outlived {sig.name} by 20 s") from None
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()
        pub.close()
        proxy.close()
        factory.close()
