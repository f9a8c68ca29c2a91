"""The buffer actor across restarts: its journal restores it exactly (groups in flight, ready
groups, counters, the batch of each step), a cut-off last record is tolerated, and a trainer that
restarted from a checkpoint gets the batches of its lost steps again. Compaction: a compacted
journal replays to the state the full one does, a kill -9 in the middle of a compaction leaves a
journal that replays, and the journal's size stays bounded over a long run. Accounting: the
rollout's re-sends to a restarted buffer are counted once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from actors.buffer import BufferActor, BufferState, Journal, JournalEntry
from actors.rollout import RolloutActor, RolloutConfig, RolloutTotals
from logic.buffer import BufferConfig, RolloutBuffer
from runtime.facts import RunFacts
from tests.helpers import context, running
from tests.test_buffer_logic import keys, mk, state_of, with_topk
from transport.rpc import RpcClient
from transport.schema import ErrorReply, GetBatch, SampleGroup, TrainBatch, VersionUpdate

ROOT = Path(__file__).resolve().parent.parent

CFG = BufferConfig(max_staleness=1)
FACTS = RunFacts(group_size=2, groups_per_batch=1)


def group(gid: str, w: int = 0, indices=(0, 1)) -> SampleGroup:
    return SampleGroup(samples=[mk(gid, i, w) for i in indices])


def snapshot(actor: BufferActor) -> tuple:
    logic = actor.logic
    return (dict(logic.counters), logic.pending_keys(), {s: keys(b) for s, b in
                                                         logic.history.items()},
            actor.trainer_version, actor.trainer_step, actor.trainer_epoch)


async def test_a_restarted_buffer_is_where_it_was(ipc, tmp_path):
    first = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(first):
        await first.on_inbox(group("a"))
        batch0 = await first.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t1"))
        await first.version_update(VersionUpdate(version=1, step=1, trainer_epoch="t1"))
        await first.on_inbox(group("b", w=1))
        await first.on_inbox(group("c", w=1, indices=(0,)))  # half a group in flight
        before = snapshot(first)
    assert before[1] == {("b", 0), ("b", 1), ("c", 0)}
    second = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(second):
        assert snapshot(second) == before
        again = await second.get_batch(GetBatch(step=0, trainer_version=1, trainer_epoch="t1"))
        assert keys(again.samples) == keys(batch0.samples)  # step 0's batch, not a new one
        await second.on_inbox(group("c", w=1, indices=(1,)))  # the rest of the group arrives
        step1 = await second.get_batch(GetBatch(step=1, trainer_version=1, trainer_epoch="t1"))
        assert keys(step1.samples) == [("b", 0), ("b", 1)]
        second.logic.accounting()
    journal = tmp_path / "buffer" / "buf.journal"
    size = journal.stat().st_size
    journal.write_bytes(journal.read_bytes() + b"\x40\x00\x00\x00\x92")  # cut off mid-record
    third = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(third):
        assert keys(third.logic.history[1]) == [("b", 0), ("b", 1)]
        assert third.logic.ready_groups() == 1  # "c"
    assert journal.stat().st_size == size  # the partial record was cut off


async def test_a_resumed_trainer_may_go_back_and_gets_its_lost_batches_again(ipc, tmp_path):
    buf = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(buf):
        emitted = []
        for step, gid in enumerate("abc"):
            await buf.on_inbox(group(gid, w=step))
            reply = await buf.get_batch(GetBatch(step=step, trainer_version=step,
                                                 trainer_epoch="t1"))
            emitted.append(keys(reply.samples))
            await buf.version_update(VersionUpdate(version=step + 1, step=step + 1,
                                                   trainer_epoch="t1",
                                                   checkpointed=step + 1 == 1))
        # the same trainer process may not go back ...
        refused = await buf.version_update(VersionUpdate(version=1, step=1, trainer_epoch="t1"))
        assert isinstance(refused, ErrorReply) and "versions only advance" in refused.message
        # ... a restarted one (new epoch) resumed from its step-1 checkpoint may
        back = await buf.version_update(VersionUpdate(version=1, step=1, trainer_epoch="t2"))
        assert not isinstance(back, ErrorReply) and buf.trainer_version == 1
        replay = []
        for step in (1, 2):
            reply = await buf.get_batch(GetBatch(step=step, trainer_version=step,
                                                 trainer_epoch="t2"))
            assert isinstance(reply, TrainBatch)
            replay.append(keys(reply.samples))
            await buf.version_update(VersionUpdate(version=step + 1, step=step + 1,
                                                   trainer_epoch="t2"))
        assert replay == emitted[1:]  # exactly what the lost steps had trained on
        assert buf.logic.counters["trainer_restarts"] == 1
        assert buf.logic.counters["batches_replayed"] == 2
        assert buf.logic.counters["batches_emitted"] == 3


# ----------------------------------------------------------------------------- compaction
def full_state(actor: BufferActor) -> dict:
    """Every part of the buffer's state (state_of: the logic's, all of it) and the trainer's."""
    return {**state_of(actor.logic), "trainer": (actor.trainer_version, actor.trainer_step,
                                                 actor.trainer_epoch)}


async def drive(buf: BufferActor) -> None:
    """Ten steps with checkpoints at steps 4 and 8, a trainer that dies after step 9 and resumes
    from step 8 (steps 8 and 9 replayed), re-sent groups (known and lost), a ready group and half
    a group in flight."""
    for step in range(10):
        await buf.on_inbox(group(f"s{step}", w=step))
        await buf.get_batch(GetBatch(step=step, trainer_version=step, trainer_epoch="t1"))
        await buf.version_update(VersionUpdate(version=step + 1, step=step + 1, trainer_epoch="t1",
                                               checkpointed=step + 1 in (4, 8)))
    await buf.version_update(VersionUpdate(version=8, step=8, trainer_epoch="t2"))
    for step in (8, 9):
        await buf.get_batch(GetBatch(step=step, trainer_version=step, trainer_epoch="t2"))
        await buf.version_update(VersionUpdate(version=step + 1, step=step + 1,
                                               trainer_epoch="t2"))
    await buf.resend(group("s9", w=9))  # had it
    await buf.resend(group("lost", w=9))  # did not: taken
    await buf.on_inbox(group("r", w=10))
    await buf.on_inbox(group("p", w=10, indices=(0,)))


async def test_a_compacted_journal_replays_to_the_same_state_as_the_full_one(ipc, tmp_path):
    runs = {"full": 0, "compacted": 1}  # journal_compact_bytes: never, whenever it has doubled
    live, compactions = {}, {}
    for name, every in runs.items():
        cfg = BufferConfig(max_staleness=1,
                           journal_compact_bytes=every)
        buf = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path / name)), cfg)
        async with running(buf):
            await drive(buf)
            live[name] = full_state(buf)
            compactions[name] = buf.counters["journal.compactions"]
    assert compactions["full"] == 0 and compactions["compacted"] >= 3
    journals = {name: Journal(tmp_path / name / "buffer" / "buf.journal") for name in runs}
    for journal in journals.values():
        journal.close()
    # 10 x (group, batch, version) + the first version + the trainer's restart + 2 x (batch
    # replayed, version) + 2 re-sends + 2 groups
    assert journals["full"].snapshot_size == 0 and len(journals["full"].entries) == 40
    compacted = journals["compacted"]
    assert compacted.entries[0].kind == "snapshot" and len(compacted.entries) < 10
    assert compacted.size < journals["full"].size / 2
    restored = {}
    for name in runs:
        again = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path / name)),
                            BufferConfig(max_staleness=1,
                                         journal_compact_bytes=0))
        async with running(again):
            restored[name] = full_state(again)
            acc = again.logic.accounting()
            history = sorted(again.logic.history)
            pending = again.logic.pending_keys()
    assert restored["compacted"] == restored["full"] == live["full"] == live["compacted"]
    # the concrete state both replays reach
    assert history == [8, 9]
    assert pending == {("lost", 0), ("lost", 1), ("r", 0), ("r", 1), ("p", 0)}
    assert restored["full"]["trainer"] == (10, 10, "t2")
    assert restored["full"]["_resent_first"] == {("lost", 0), ("lost", 1)}
    assert [gid for gid, _ in restored["full"]["_ready"]] == ["lost", "r"]
    assert (acc["added"], acc["emitted"], acc["resent_copies"], acc["resent_taken"]) == (
        2 * 10 + 2 + 2 + 1, 2 * 10, 2, 2)
    assert (acc["batches_emitted"], acc["batches_replayed"], acc["trainer_restarts"]) == (10, 2, 1)


def entries() -> list[JournalEntry]:
    """A journal's worth of entries, as the actor writes them: six steps (a checkpoint at step
    4), a re-sent group, half a group in flight."""
    out = [JournalEntry("version", version=0, step=0, epoch="t1")]
    for step in range(6):
        out += [JournalEntry("group", group=group(f"s{step}", w=step)),
                JournalEntry("batch", step=step, version=step),
                JournalEntry("version", version=step + 1, step=step + 1, epoch="t1",
                             checkpointed=step + 1 == 4)]
    return out + [JournalEntry("resend", group=group("s5", w=5)),
                  JournalEntry("group", group=group("p", w=6, indices=(0,)))]


CRASH = """
import os, signal, sys
from pathlib import Path
import actors.buffer as ab
from logic.buffer import RolloutBuffer
from tests.test_buffer_restart import CFG, FACTS, entries

journal = ab.Journal(Path(sys.argv[1]))
state = ab.BufferState(RolloutBuffer(CFG, FACTS))
for entry in entries():
    journal.append(entry)
    state.apply(entry)
def die(*args):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "before_rename":
    ab.os.replace = die  # the temp file is written and fsync'ed, the rename never happens
else:
    ab._fsync_dir = die  # renamed, then killed before anything else
journal.compact(state.snapshot())
"""


async def test_a_kill_in_the_middle_of_a_compaction_leaves_a_journal_that_replays(ipc,
                                                                                 tmp_path):
    expected = BufferState(RolloutBuffer(CFG, FACTS))
    for entry in entries():
        expected.apply(entry)
    snapshot_bytes = len(msgspec.msgpack.encode(expected.snapshot())) + 4
    for point in ("before_rename", "after_rename"):
        run_dir = tmp_path / point
        path = run_dir / "buffer" / "buf.journal"
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CRASH, str(path),
                                                    point, cwd=ROOT, stderr=subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        tmp = path.with_name("buf.journal.tmp")
        if point == "before_rename":  # the old journal, whole, and the finished temp file
            assert tmp.stat().st_size == snapshot_bytes
            old = Journal(path)
            old.close()
            assert old.entries == entries()
        else:  # the snapshot alone
            assert not tmp.exists() and path.stat().st_size == snapshot_bytes
        buf = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(run_dir)), CFG)
        async with running(buf):
            assert full_state(buf) == {**state_of(expected.logic), "trainer": (6, 6, "t1")}
            assert buf.logic.counters["resent_copies"] == 2
            await buf.on_inbox(group("p", w=6, indices=(1,)))  # and it goes on
            reply = await buf.get_batch(GetBatch(step=6, trainer_version=6, trainer_epoch="t1"))
            assert keys(reply.samples) == [("p", 0), ("p", 1)]
        assert not tmp.exists()  # removed by the restarted buffer


async def test_the_journal_stays_bounded_over_a_long_run(ipc, tmp_path):
    """600 steps of 2 groups of 4, a checkpoint every 10 steps: the full journal grows with the
    run (1.3 kB a step), the compacted one stays under its last snapshot + max(that,
    journal_compact_bytes), and the snapshot grows only by the ids of the groups closed."""
    every, sizes = 16384, {}
    for compact in (0, every):
        cfg = BufferConfig(max_staleness=1, journal_compact_bytes=compact)
        buf = BufferActor(context("buf", ipc, run_dir=str(tmp_path / str(compact)),
                                  facts=RunFacts(group_size=4, groups_per_batch=2)), cfg)
        async with running(buf, 60):
            seen = []
            for step in range(600):
                for j in range(2):
                    await buf.on_inbox(SampleGroup(samples=[mk(f"b{step}-g{j}", i, w=step)
                                                            for i in range(4)]))
                await buf.get_batch(GetBatch(step=step, trainer_version=step, trainer_epoch="t"))
                await buf.version_update(VersionUpdate(version=step + 1, step=step + 1,
                                                       trainer_epoch="t",
                                                       checkpointed=(step + 1) % 10 == 0))
                seen.append((buf.journal.size, buf.journal.base))
            compactions = buf.counters["journal.compactions"]
        sizes[compact] = [size for size, _ in seen]
        if compact:
            assert all(size < base + max(every, base) for size, base in seen)
            assert compactions > 30
    full, compacted = sizes[0], sizes[every]
    assert full[-1] > 700_000 and full[-1] > 2 * full[299] - 5_000  # linear in the run
    assert max(compacted) < 40_000  # 1/20 of it
    # the last 200 steps no bigger than steps 100-300 but for the ids of the groups closed
    # since (remembered for good; in the snapshot, so at most twice in the journal)
    ids = sum(len(msgspec.msgpack.encode(f"b{step}-g{j}")) for step in range(100, 600)
              for j in range(2))
    assert max(compacted[400:]) - max(compacted[100:300]) < 2 * ids


# ----------------------------------------------------------------------------- top-k arrays
def topk_group(gid: str, w: int = 0, k: int = 4) -> SampleGroup:
    """A group whose samples carry a teacher's top-k arrays (distinct values per sample)."""
    return SampleGroup(samples=[with_topk(mk(gid, i, w), k, seed=hash((gid, i)) % 1000)
                                for i in (0, 1)])


def samples_by_key(samples) -> dict:
    return {(s.group_id, s.index): s for s in samples}


def assert_same_topk(got, want) -> None:
    for name, dtype in (("teacher_topk_ids", np.int32), ("teacher_topk_logprobs", np.float32)):
        a, b = getattr(got, name), getattr(want, name)
        assert isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("compact", [0, 1])
async def test_topk_arrays_survive_the_journal_exactly(ipc, tmp_path, compact):
    """Samples with top-k arrays, replayed from journal records (compact = 0) or from a
    snapshot holding them (compact = 1 byte), come back with every array's dtype, shape and
    bits: in the ready groups and in the remembered batch of a step."""
    cfg = BufferConfig(max_staleness=1,
                       journal_compact_bytes=compact)
    sent = [topk_group("a"), topk_group("b"), SampleGroup(samples=[mk("c", 0)])]
    first = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), cfg)
    async with running(first):
        for g in sent:
            await first.on_inbox(g)
        batch0 = await first.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t"))
        assert (first.counters["journal.compactions"] > 0) == bool(compact)
    want = samples_by_key(s for g in sent for s in g.samples)
    journal = Journal(tmp_path / "buffer" / "buf.journal")
    journal.close()
    if compact:  # the snapshot itself holds top-k samples
        snap = journal.entries[0].snapshot
        held = [s for g in snap.open + snap.ready + list(snap.history.values()) for s in g]
        assert sum(s.teacher_topk_ids is not None for s in held) >= 2
        for s in held:
            if s.teacher_topk_ids is not None:
                assert_same_topk(s, want[(s.group_id, s.index)])
    second = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), cfg)
    async with running(second):
        again = await second.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t"))
        step1 = await second.get_batch(GetBatch(step=1, trainer_version=0, trainer_epoch="t"))
        assert second.logic.pending_keys() == {("c", 0)}
    assert keys(again.samples) == keys(batch0.samples) == [("a", 0), ("a", 1)]
    assert keys(step1.samples) == [("b", 0), ("b", 1)]
    for s in again.samples + step1.samples:
        assert_same_topk(s, want[(s.group_id, s.index)])
    c0 = second.logic._open["c"][0]
    assert c0.teacher_topk_ids is None and c0.teacher_topk_logprobs is None


async def test_a_journal_from_before_topk_arrays_is_read(ipc, tmp_path):
    """Journals written before protocol 2 hold top-k as rows of numbers (the plain msgpack
    encoder of then): replayed as int32 / float32 arrays of the same values. A record that
    cannot be read is refused naming the journal and the record's byte offset."""
    arrays = topk_group("a")
    as_lists = SampleGroup(samples=[msgspec.structs.replace(
        s, teacher_topk_ids=s.teacher_topk_ids.tolist(),
        teacher_topk_logprobs=s.teacher_topk_logprobs.tolist()) for s in arrays.samples])
    path = tmp_path / "buffer" / "buf.journal"
    path.parent.mkdir(parents=True)
    old = [msgspec.msgpack.encode(JournalEntry("group", group=g))
           for g in (as_lists, SampleGroup(samples=[mk("b", 0)]))]
    assert b"\xc7" not in old[0][:40] and b"\x94" in old[0]  # rows, no extension
    path.write_bytes(b"".join(len(r).to_bytes(4, "little") + r for r in old))
    buf = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(buf):
        await buf.on_inbox(topk_group("c"))  # appended in the new format after the old records
        reply = await buf.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t"))
    assert keys(reply.samples) == [("a", 0), ("a", 1)]
    for got, want in zip(reply.samples, arrays.samples, strict=True):
        assert_same_topk(got, want)
    journal = Journal(path)
    journal.close()
    assert [e.group.samples[0].group_id for e in journal.entries[:3]] == ["a", "b", "c"]
    # ragged rows (what no server sent) in an old record: refused, with where to look
    ragged = msgspec.structs.replace(as_lists.samples[0], teacher_topk_ids=[[1, 2], [3]])
    bad = msgspec.msgpack.encode(JournalEntry("group", group=SampleGroup(samples=[ragged])))
    path.write_bytes(path.read_bytes() + len(bad).to_bytes(4, "little") + bad)
    at = path.stat().st_size - len(bad) - 4
    with pytest.raises(ValueError, match=f"buffer journal .*buf.journal: the record at byte {at} "
                                         "cannot be read .*teacher_topk_ids"):
        Journal(path)


# ----------------------------------------------------------------------------- accounting
class Wire:
    """The rollout's stream to the buffer, in a test: delivers to a buffer's inbox handler,
    loses what is sent (the buffer died with it in flight), or holds it (delivered late)."""

    def __init__(self):
        self.to, self.mode, self.held = None, "deliver", []

    async def send(self, msg: SampleGroup) -> None:
        if self.mode == "deliver":
            await self.to(msg)
        elif self.mode == "hold":
            self.held.append(msg)


async def test_the_rollouts_resends_to_a_restarted_buffer_are_counted_once(ipc, tmp_path):
    """generated = trained + dropped + pending + in flight, exactly, across a buffer restart:
    "a" and "b" reached the first buffer, "c" was lost with it, "d" arrives only after it was
    re-sent; a restarted rollout generates "a" again (a real duplicate)."""
    facts = msgspec.structs.replace(FACTS, model="tiny-qwen2")
    rollout = RolloutActor(context("rollout", ipc, facts=facts),
                           RolloutConfig(envs=[], group_size=2, groups_per_batch=1))
    rollout.totals_path = tmp_path / "rollout" / "rollout.totals.json"
    rollout.out = wire = Wire()
    first = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(first):
        wire.to = first.on_inbox
        for gid in "ab":
            await rollout.send_group(group(gid))
        await first.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t1"))
        wire.mode = "lose"
        await rollout.send_group(group("c"))
        wire.mode = "hold"
        await rollout.send_group(group("d"))
    second = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    client = RpcClient(rollout.factory, second.ctx.endpoints.rpc, "rollout", timeout_s=5.0)
    try:
        async with running(second):
            await client.handshake()
            rollout.buffer, rollout.buffer_epoch = client, first.buffer_epoch
            wire.to, wire.mode = second.on_inbox, "deliver"
            await rollout._resend_if_buffer_restarted(second.buffer_epoch)  # a, b, c, d
            for late in wire.held:  # the stream drains after the re-send
                await second.on_inbox(late)
            await rollout.send_group(group("a", w=1))  # generated again
            books = second.logic.accounting()
    finally:
        await client.close()
        rollout.factory.close()
    generated, resent = rollout.totals.samples_generated, rollout.totals.samples_resent
    assert generated == 2 * 5 and resent == 2 * 4
    # every generated sample once in the books, nothing in flight; the re-sent copies outside
    assert generated == books["added"] == (books["emitted"] + books["pending"]
                                           + books["dropped_duplicate"])
    assert (books["emitted"], books["pending"], books["dropped_duplicate"]) == (2, 6, 2)
    assert resent == books["resent_copies"] + books["resent_taken"]
    assert (books["resent_copies"], books["resent_taken"], books["late_originals"]) == (4, 4, 2)
    assert rollout.counters["resent_groups"] == 4
    assert msgspec.json.decode(rollout.totals_path.read_bytes(), type=RolloutTotals) == \
        rollout.totals
    # a third buffer process replays the re-sends from the journal to the same books
    third = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(third):
        assert third.logic.accounting() == books
        assert json.loads(json.dumps(third.stats()))["buffer.resent_taken"] == 4


async def test_groups_resent_through_a_stream_count_as_resends_not_duplicates(ipc, tmp_path):
    """With a teacher pool between rollout and buffer, re-sends arrive on the inbox, marked."""
    buf = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(buf):
        await buf.on_inbox(group("a"))
        await buf.on_inbox(msgspec.structs.replace(group("a"), resent=True))  # it had it
        await buf.on_inbox(msgspec.structs.replace(group("lost"), resent=True))  # it had not
        await buf.on_inbox(group("a"))  # a true second copy: still a duplicate
        books = buf.logic.counters
        assert (books["added"], books["resent_copies"], books["resent_taken"],
                books["dropped_duplicate"]) == (6, 2, 2, 2)  # added: every arrival but copies
    replayed = BufferActor(context("buf", ipc, facts=FACTS, run_dir=str(tmp_path)), CFG)
    async with running(replayed):  # the journal says which arrivals were re-sends
        assert replayed.logic.counters["resent_copies"] == 2
        assert replayed.logic.counters["dropped_duplicate"] == 2
