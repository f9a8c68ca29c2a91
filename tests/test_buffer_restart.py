"""The buffer actor across restarts: its journal restores it exactly (groups in flight, ready
groups, counters, the batch of each step), a cut-off last record is tolerated, and a trainer that
restarted from a checkpoint gets the batches of its lost steps again."""

from __future__ import annotations

from actors.buffer import BufferActor
from logic.buffer import BufferConfig
from tests.helpers import context, running
from tests.test_buffer_logic import keys, mk
from transport.schema import ErrorReply, GetBatch, SampleGroup, TrainBatch, VersionUpdate

CFG = BufferConfig(group_size=2, groups_per_batch=1, max_staleness=1)


def group(gid: str, w: int = 0, indices=(0, 1)) -> SampleGroup:
    return SampleGroup(samples=[mk(gid, i, w) for i in indices])


def snapshot(actor: BufferActor) -> tuple:
    logic = actor.logic
    return (dict(logic.counters), logic.pending_keys(), {s: keys(b) for s, b in
                                                         logic.history.items()},
            actor.trainer_version, actor.trainer_step, actor.trainer_epoch)


async def test_a_restarted_buffer_is_where_it_was(ipc, tmp_path):
    first = BufferActor(context("buf", ipc, run_dir=str(tmp_path)), CFG)
    async with running(first):
        await first.on_inbox(group("a"))
        batch0 = await first.get_batch(GetBatch(step=0, trainer_version=0, trainer_epoch="t1"))
        await first.version_update(VersionUpdate(version=1, step=1, trainer_epoch="t1"))
        await first.on_inbox(group("b", w=1))
        await first.on_inbox(group("c", w=1, indices=(0,)))  # half a group in flight
        before = snapshot(first)
    assert before[1] == {("b", 0), ("b", 1), ("c", 0)}
    second = BufferActor(context("buf", ipc, run_dir=str(tmp_path)), CFG)
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
    third = BufferActor(context("buf", ipc, run_dir=str(tmp_path)), CFG)
    async with running(third):
        assert keys(third.logic.history[1]) == [("b", 0), ("b", 1)]
        assert third.logic.ready_groups() == 1  # "c"
    assert journal.stat().st_size == size  # the partial record was cut off


async def test_a_resumed_trainer_may_go_back_and_gets_its_lost_batches_again(ipc, tmp_path):
    buf = BufferActor(context("buf", ipc, run_dir=str(tmp_path)), CFG)
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
