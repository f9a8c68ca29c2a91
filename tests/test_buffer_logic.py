"""RolloutBuffer logic: group completion, staleness (hand-worked), failures, duplicates, overflow,
re-sent groups, snapshots, and the accounting invariant under a long random sequence of
operations."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from logic.buffer import (
    BufferConfig,
    BufferSnapshot,
    RolloutBuffer,
    Sample,
    check_group,
    check_version,
)
from runtime.facts import RunFacts


def mk(gid: str, index: int, w: int = 0, status: str = "ok") -> Sample:
    return Sample(group_id=gid, index=index, domain="math", prompt_ids=[1, 2],
                  response_ids=[3, 4], loss_mask=[1, 0], rollout_logprobs=[-0.1, -0.2],
                  weight_version=w, status=status)


def facts(group_size: int = 2, groups_per_batch: int = 1) -> RunFacts:
    return RunFacts(group_size=group_size, groups_per_batch=groups_per_batch)


def buffer(group_size: int = 2, groups_per_batch: int = 1, **kw) -> RolloutBuffer:
    return RolloutBuffer(BufferConfig(**kw), facts(group_size, groups_per_batch))


def add_group(buf: RolloutBuffer, gid: str, w: int = 0, n: int | None = None) -> list[str]:
    return [buf.add(mk(gid, i, w)) for i in range(n or buf.facts.group_size)]


def keys(batch: list[Sample] | None) -> list[tuple[str, int]]:
    return [(s.group_id, s.index) for s in batch or []]


# ----------------------------------------------------------------------------- config / schema
def test_config_checks():
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_stalenes`"):
        msgspec.convert({"max_stalenes": 4}, BufferConfig)
    for kw, message in [({"max_staleness": -1}, "max_staleness must be >= 0"),
                        ({"journal_compact_bytes": -1}, "journal_compact_bytes must be >= 0")]:
        with pytest.raises(ValueError, match=message):
            BufferConfig(**kw)
    # against the run's batch shape (the rollout's): at load (launch/plan.py) and in the logic
    for kw, shape, message in [
            ({}, (0, 1), "group_size \\(0\\) and groups_per_batch \\(1\\) must be >= 1"),
            ({}, (1, 1), "min_ok_per_group \\(2\\) must be <= the run's group_size \\(1\\)"),
            ({"max_pending_groups": 4}, (2, 8),
             "max_pending_groups \\(4\\) must be >= the run's groups_per_batch \\(8\\)")]:
        with pytest.raises(ValueError, match=message):
            RolloutBuffer(BufferConfig(**kw), facts(*shape))


def test_sample_round_trips_tagged_without_defaults():
    sample = mk("g", 1, w=3)
    wire = msgspec.msgpack.encode(sample)
    assert msgspec.msgpack.decode(wire, type=Sample) == sample
    as_dict = msgspec.to_builtins(sample)
    assert as_dict["type"] == "Sample" and "status" not in as_dict and "reward" not in as_dict


# ----------------------------------------------------------------------------- completion
def test_group_completes_when_every_index_arrived():
    buf = buffer(group_size=3)
    assert [buf.add(mk("g", 2)), buf.add(mk("g", 0))] == ["pending", "pending"]
    assert buf.next_batch(0) is None
    assert buf.add(mk("g", 1)) == "complete"
    assert keys(buf.next_batch(0)) == [("g", 0), ("g", 1), ("g", 2)]  # index order
    assert buf.next_batch(0) is None
    acc = buf.accounting()
    assert acc["emitted"] == 3 and acc["pending"] == 0 and acc["groups_emitted"] == 1


def test_batches_follow_completion_order():
    buf = buffer(groups_per_batch=2)
    buf.add(mk("a", 0))
    add_group(buf, "b")
    add_group(buf, "c")
    assert buf.add(mk("a", 1)) == "complete"
    add_group(buf, "d", n=1)
    assert keys(buf.next_batch(0)) == [("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    assert buf.next_batch(0) is None  # only "a" is ready; "d" is open
    buf.add(mk("d", 1))
    assert [k[0] for k in keys(buf.next_batch(0))] == ["a", "a", "d", "d"]
    assert buf.accounting()["batches_emitted"] == 2


def test_failed_samples():
    buf = buffer(group_size=4, min_ok_per_group=2)
    statuses = ["ok", "failed", "failed", "aborted"]
    results = [buf.add(mk("bad", i, status=s)) for i, s in enumerate(statuses)]
    assert results[-1] == "dropped_failed_group"
    statuses = ["failed", "ok", "aborted", "ok"]
    assert [buf.add(mk("good", i, status=s)) for i, s in enumerate(statuses)][-1] == "complete"
    assert keys(buf.next_batch(0)) == [("good", 1), ("good", 3)]
    acc = buf.accounting()
    assert acc["dropped_failed_group"] == 4 and acc["groups_dropped_failed"] == 1
    assert acc["dropped_failed_sample"] == 2 and acc["emitted"] == 2 and acc["added"] == 8


def test_duplicates_are_never_stored_twice():
    buf = buffer(group_size=3)
    buf.add(mk("g", 0))
    assert buf.add(mk("g", 0)) == "dropped_duplicate"  # while open
    add_group(buf, "g")  # index 0 again, then 1 and 2 complete it
    assert buf.add(mk("g", 1)) == "dropped_duplicate"  # complete, not yet emitted
    assert len(buf.next_batch(0)) == 3
    assert buf.add(mk("g", 2)) == "dropped_duplicate"  # already emitted
    assert buf.next_batch(0) is None
    acc = buf.accounting()
    assert acc["dropped_duplicate"] == 4 and acc["emitted"] == 3 and acc["added"] == 7


def test_malformed_samples_raise_and_are_not_counted():
    buf = buffer(group_size=2)
    for sample, message in [(mk("g", 2), "index must be in \\[0, 2\\)"),
                            (mk("g", 0, status="done"), "status must be one of"),
                            (Sample(group_id="g", index=0, domain="d", prompt_ids=[1],
                                    response_ids=[1, 2], loss_mask=[1],
                                    rollout_logprobs=[0.0, 0.0]), "must have the length"),
                            (Sample(group_id="g", index=0, domain="d", prompt_ids=[1],
                                    response_ids=[1], loss_mask=[2], rollout_logprobs=[0.0]),
                             "only 0 and 1")]:
        with pytest.raises(ValueError, match=message):
            buf.add(sample)
    assert buf.accounting()["added"] == 0


def test_overflow_drops_new_groups_and_their_siblings():
    buf = buffer(max_pending_groups=2)
    buf.add(mk("a", 0))
    add_group(buf, "b")
    assert buf.pending_capacity_left() == 0
    assert buf.add(mk("c", 0)) == "dropped_overflow"
    keys(buf.next_batch(0))  # emits "b": room for one group again
    assert buf.pending_capacity_left() == 1
    assert buf.add(mk("c", 1)) == "dropped_overflow"  # its group was already dropped
    assert buf.add(mk("d", 0)) == "pending"
    acc = buf.accounting()
    assert acc["dropped_overflow"] == 2 and acc["groups_dropped_overflow"] == 1


# ----------------------------------------------------------------------------- staleness
def test_permit_rule():
    table = {0: [(0, 0, True), (1, 0, False), (1, 1, True), (5, 4, False), (5, 5, True)],
             1: [(0, 0, True), (1, 0, True), (2, 0, False), (2, 1, True), (6, 5, True)],
             2: [(2, 0, True), (3, 0, False), (3, 1, True)]}
    for k, rows in table.items():
        buf = buffer(max_staleness=k)
        for batch_index, version, allowed in rows:
            assert buf.may_start_batch(batch_index, version) is allowed, (k, batch_index, version)
    with pytest.raises(ValueError, match="batch_index must be >= 0"):
        buf.may_start_batch(-1, 0)


def test_staleness_0_synchronous():
    buf = buffer(max_staleness=0)
    assert buf.may_start_batch(0, 0) and not buf.may_start_batch(1, 0)
    add_group(buf, "b0", w=0)
    add_group(buf, "b0-extra", w=0)  # over-generated at version 0
    assert keys(buf.next_batch(0))[0][0] == "b0"  # trainer steps: version 0 -> 1
    assert buf.may_start_batch(1, 1)
    buf.add(mk("late", 0, w=0))  # an open group from version 0
    buf.set_trainer_version(1)  # drops "b0-extra" (ready) and "late" (open)
    acc = buf.accounting()
    assert acc["dropped_stale"] == 3 and acc["groups_dropped_stale"] == 2 and acc["pending"] == 0
    assert buf.add(mk("late", 1, w=1)) == "dropped_stale"  # its group is gone
    assert buf.add(mk("b1", 0, w=0)) == "dropped_stale"  # stale on arrival
    assert add_group(buf, "b1'", w=1)[-1] == "complete"
    assert buf.next_batch(1) is not None
    assert buf.accounting()["dropped_stale"] == 5


def test_staleness_1_one_step_off_policy():
    buf = buffer(max_staleness=1)
    # version 0: batches 0 and 1 may both be generated
    assert buf.may_start_batch(1, 0) and not buf.may_start_batch(2, 0)
    add_group(buf, "b0", w=0)
    add_group(buf, "b1", w=0)
    assert keys(buf.next_batch(0))[0][0] == "b0"  # -> version 1
    assert buf.may_start_batch(2, 1)
    buf.add(mk("b2", 0, w=0))  # started on version 0 weights ...
    buf.add(mk("b2", 1, w=1))  # ... its sibling on version 1: the group's version is 0
    assert keys(buf.next_batch(1))[0][0] == "b1"  # b1 (w=0) is 1 version old: kept -> version 2
    assert buf.ready_groups() == 1  # b2 was fresh at version 1
    add_group(buf, "b2'", w=1)
    add_group(buf, "b3", w=2)
    assert keys(buf.next_batch(2))[0][0] == "b2'"  # b2 is 2 versions old: dropped; b2' 1 old
    assert buf.accounting()["dropped_stale"] == 2
    assert buf.next_batch(4) is None  # b3 (w=2) is 2 versions old at version 4: dropped
    acc = buf.accounting()
    assert acc["dropped_stale"] == 4 and acc["emitted"] == 6 and acc["pending"] == 0


def test_failed_samples_do_not_age_a_group():
    buf = buffer(group_size=3, max_staleness=0)
    buf.set_trainer_version(5)
    assert buf.add(mk("g", 0, w=0, status="aborted")) == "pending"  # no tokens trained on
    buf.add(mk("g", 1, w=5))
    assert buf.add(mk("g", 2, w=5)) == "complete"
    assert keys(buf.next_batch(5)) == [("g", 1), ("g", 2)]
    with pytest.raises(ValueError, match="went back from 5 to 4"):
        buf.set_trainer_version(4)


# ----------------------------------------------------------------------------- invariant
class RandomRollout:
    """Feeds a buffer like a rollout would, with noise: up to 5 groups in flight, samples in a
    random order, some failed, some re-sent, some strays for long-finished groups."""

    def __init__(self, rng: random.Random, staleness: int):
        self.rng, self.staleness = rng, staleness
        self.in_flight: dict[str, tuple[int, list[int]]] = {}  # gid -> (version, indices left)
        self.started = 0

    def next_sample(self, version: int) -> Sample:
        rng = self.rng
        if rng.random() < 0.05 and self.started:  # a re-sent or stray sample
            return mk(f"g{rng.randrange(self.started)}", rng.randrange(3), w=version)
        if len(self.in_flight) < 5 and rng.random() < 0.3 or not self.in_flight:
            w = max(0, version - rng.randrange(self.staleness + 2))  # sometimes too old
            self.in_flight[f"g{self.started}"] = (w, rng.sample(range(3), 3))
            self.started += 1
        gid = rng.choice(sorted(self.in_flight))
        w, left = self.in_flight[gid]
        index = left.pop()
        if not left:
            del self.in_flight[gid]
        status = rng.choices(["ok", "failed", "aborted"], [6, 1, 1])[0]
        return mk(gid, index, w=w, status=status)


@pytest.mark.parametrize("seed, staleness", [(11, 0), (12, 1), (13, 3)])
def test_accounting_holds_under_random_operations(seed, staleness):
    rng = random.Random(seed)
    config = BufferConfig(max_staleness=staleness, max_pending_groups=6, min_ok_per_group=2)
    buf, rollout = RolloutBuffer(config, facts(3, 2)), RandomRollout(rng, staleness)
    version, added, emitted, emitted_groups = 0, 0, set(), set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.85:
            buf.add(rollout.next_sample(version))
            added += 1
        elif op < 0.9:
            version += rng.randrange(2)
            buf.set_trainer_version(version)
        else:
            batch = buf.next_batch(version)
            for group in {s.group_id for s in batch or []}:
                samples = [s for s in batch if s.group_id == group]
                assert group not in emitted_groups and len(samples) >= 2
                assert min(s.weight_version for s in samples) >= version - staleness
                emitted_groups.add(group)
            for s in batch or []:
                assert s.status == "ok" and (s.group_id, s.index) not in emitted
                emitted.add((s.group_id, s.index))
            if batch is not None:
                version += 1  # the trainer steps on it
        acc = buf.accounting()  # raises unless every sample is in exactly one place
        assert acc["added"] == added and acc["emitted"] == len(emitted)
        assert not buf.pending_keys() & emitted
        assert acc["pending"] == len(buf.pending_keys())
        assert buf.pending_capacity_left() >= 0
    acc = buf.accounting()
    for counter in ("emitted", "dropped_duplicate", "dropped_stale", "dropped_failed_group",
                    "dropped_failed_sample", "dropped_overflow"):
        assert acc[counter] > 0, counter  # the sequence exercised every path


def test_upcoming_teachers_hint_the_next_batch_in_order():
    buf = buffer(groups_per_batch=2)
    for gid, teacher in [("g1", "reverse"), ("g2", ""), ("g3", "arith"), ("g4", "code")]:
        for i in range(2):
            s = mk(gid, i)
            s.teacher = teacher
            buf.add(s)
    # the ready groups of the next batch are g1 and g2: only their (named) teachers, in order
    assert buf.upcoming_teachers() == ["reverse"]
    buf.next_batch(0)
    assert buf.upcoming_teachers() == ["arith", "code"]
    buf.next_batch(0)
    assert buf.upcoming_teachers() == []


# ----------------------------------------------------------------------------- boundary checks
def test_check_sample_and_group_refuse_out_of_range_values():
    cfg, shape = BufferConfig(max_sample_tokens=16), facts(8, 1)
    check_group([mk("g", i) for i in range(8)], cfg, shape)  # a whole, valid group passes
    for samples, message in [
            ([mk("g", 99)], "index must be in \\[0, 8\\)"),
            ([mk("g", -1)], "index must be in \\[0, 8\\)"),
            ([], "1 to group_size = 8"),
            ([mk("g", i % 8) for i in range(9)], "got 9"),
            ([mk("g", 0), mk("h", 1)], "share one group_id"),
            ([mk("g", 0, w=-3)], "weight_version must be >= 0"),
            ([msgspec.structs.replace(mk("g", 0), reward=float("nan"))], "reward finite"),
            ([msgspec.structs.replace(mk("g", 0), prompt_ids=[-5])], "token ids must be >= 0"),
            ([msgspec.structs.replace(mk("g", 0), prompt_ids=[1] * 20)], "max_sample_tokens"),
            ([msgspec.structs.replace(mk("g", 0), teacher_logprobs=[0.0] * 3)], "outnumber")]:
        with pytest.raises(ValueError, match=message):
            check_group(samples, cfg, shape)
    # a run that knows its vocabulary refuses ids beyond it (one that does not, cannot)
    sized, wide = msgspec.structs.replace(shape, vocab_size=5), mk("g", 0)
    check_group([wide], cfg, sized)  # ids 1..4: inside
    check_group([msgspec.structs.replace(wide, response_ids=[3, 5])], cfg, shape)
    for bad in (dict(response_ids=[3, 5]), dict(prompt_ids=[7, 2])):
        with pytest.raises(ValueError, match="outside the policy's vocabulary \\(vocab_size 5"):
            check_group([msgspec.structs.replace(wide, **bad)], cfg, sized)
    buf = RolloutBuffer(cfg, shape)
    with pytest.raises(ValueError, match="index must be in"):  # add() runs the same checks
        buf.add(mk("g", 99))
    assert buf.accounting()["added"] == 0


def with_topk(sample: Sample, k: int = 3, seed: int = 0) -> Sample:
    """`sample` with a teacher's top-k: [response length, k] int32 ids, float32 log-probs."""
    rng = np.random.default_rng(seed)
    n = len(sample.response_ids)
    return msgspec.structs.replace(
        sample, teacher="t", teacher_topk_ids=rng.integers(0, 50, (n, k)).astype(np.int32),
        teacher_topk_logprobs=-rng.exponential(1.0, (n, k)).astype(np.float32))


def test_check_sample_refuses_malformed_topk_arrays():
    cfg, shape = BufferConfig(), facts(2, 1)
    good = with_topk(mk("g", 0))
    check_group([good], cfg, shape)
    ids, lps = good.teacher_topk_ids, good.teacher_topk_logprobs
    for change, message in [
            ({"teacher_topk_logprobs": None}, "teacher_topk_logprobs must be an array of float32"),
            ({"teacher_topk_ids": None}, "teacher_topk_ids must be an array of int32"),
            ({"teacher_topk_ids": ids.astype(np.int64)}, "must be an array of int32 .* got int64"),
            ({"teacher_topk_logprobs": lps.astype(np.float64)}, "got float64"),
            ({"teacher_topk_ids": ids.tolist()}, "array of int32 .* got list"),
            ({"teacher_topk_ids": ids[:1], "teacher_topk_logprobs": lps[:1]},
             r"ids \(1, 3\) and log-probs \(1, 3\) must both be \[2, k\]"),
            ({"teacher_topk_logprobs": lps[:, :2]}, r"must both be \[2, k\]"),
            ({"teacher_topk_ids": ids[:, :0], "teacher_topk_logprobs": lps[:, :0]}, "k >= 1"),
            ({"teacher_topk_ids": ids.reshape(-1), "teacher_topk_logprobs": lps.reshape(-1)},
             r"must both be \[2, k\]"),
            ({"teacher_topk_ids": ids - 50}, "ids must be >= 0"),
            ({"teacher_topk_logprobs": np.where(lps < -0.5, np.nan, lps).astype(np.float32)},
             "log-probs finite")]:
        with pytest.raises(ValueError, match=message):
            check_group([msgspec.structs.replace(good, **change)], cfg, shape)
    # a failed sample is never trained on: its top-k are not looked at (as its other lists)
    check_group([msgspec.structs.replace(good, status="failed", teacher_topk_ids=ids[:1])], cfg,
                shape)


def test_check_sample_refuses_malformed_sorted_term_arrays():
    cfg, shape = BufferConfig(), facts(2, 1)
    pos, lps = np.array([0, 1], np.int32), np.full((2, 3), -1.0, np.float32)
    good = msgspec.structs.replace(with_topk(mk("g", 0)), teacher_sorted_positions=pos,
                                   teacher_sorted_logprobs=lps)
    check_group([good], cfg, shape)
    check_group([msgspec.structs.replace(good, teacher_sorted_positions=pos[:0],
                                         teacher_sorted_logprobs=lps[:0])], cfg, shape)
    for change, message in [
            ({"teacher_sorted_logprobs": None}, "teacher_sorted_logprobs must be an array"),
            ({"teacher_sorted_positions": pos.astype(np.int64)}, "got int64"),
            ({"teacher_sorted_positions": pos[::-1].copy()}, "must be increasing"),
            ({"teacher_sorted_positions": pos + 1}, r"in \[0, 2\)"),
            ({"teacher_sorted_logprobs": lps[:1]}, r"\[positions, k >= 1\]"),
            ({"teacher_sorted_logprobs": lps * np.inf}, "finite")]:
        with pytest.raises(ValueError, match=message):
            check_group([msgspec.structs.replace(good, **change)], cfg, shape)


def test_check_version_is_monotone_one_step_at_a_time():
    check_version("trainer_version", -1, 57, 57)  # the first announcement may be anything
    for seen, new in [(3, 3), (3, 4), (0, 1)]:
        check_version("trainer_version", seen, new, 0)
    for seen, new, step, message in [
            (3, 10**9, 0, "trainer_version = 1000000000 refused: the buffer last saw version 3"),
            (3, 5, 0, "send 3 or 4"),
            (3, 2, 0, "last saw version 3"),
            (-1, -1, 0, "trainer_version and step must be >= 0"),
            (3, 3, -1, "step = -1")]:
        with pytest.raises(ValueError, match=message):
            check_version("trainer_version", seen, new, step)


# ----------------------------------------------------------------------------- steps, restarts
def test_the_batch_of_a_step_is_the_same_when_asked_again():
    buf = buffer(max_staleness=1)
    add_group(buf, "a")
    add_group(buf, "b")
    first = buf.batch_for_step(0, 0)
    assert keys(first) == [("a", 0), ("a", 1)]
    assert buf.batch_for_step(0, 0) is first  # a re-sent request: no second batch
    assert keys(buf.batch_for_step(1, 1)) == [("b", 0), ("b", 1)]
    assert buf.counters["batches_emitted"] == 2 and buf.counters["batches_replayed"] == 0


def test_a_restarted_trainer_replays_the_batches_of_its_lost_steps_in_order():
    buf = buffer(max_staleness=1, replay_steps=8)
    for step, gid in enumerate("abcd"):
        add_group(buf, gid, w=step)
        assert keys(buf.batch_for_step(step, step))[0] == (gid, 0)
    buf.forget_before(1)  # the trainer checkpointed at step 1
    buf.restart_trainer(version=1, step=1)  # ... and died after step 3; resumed at step 1
    assert buf.trainer_version == 1  # versions may go back for a new trainer epoch
    replayed = [keys(buf.batch_for_step(s, 1 + s - 1))[0][0] for s in (1, 2, 3)]
    assert replayed == ["b", "c", "d"]  # the very batches those steps consumed
    assert buf.counters["batches_replayed"] == 3 and buf.counters["batches_emitted"] == 4
    assert buf.batch_for_step(4, 4) is None  # then new batches, as usual
    add_group(buf, "e", w=4)
    assert keys(buf.batch_for_step(4, 4))[0] == ("e", 0)
    assert 0 not in buf.history  # forgotten at the checkpoint


def test_history_is_bounded_by_replay_steps():
    buf = buffer(max_staleness=10, replay_steps=2)
    for step in range(5):
        add_group(buf, f"g{step}")
        buf.batch_for_step(step, 0)
    assert sorted(buf.history) == [3, 4]
    buf.restart_trainer(version=0, step=1)  # steps 1 and 2 can no longer be replayed
    assert buf.counters["batches_not_replayable"] == 2


def test_dropped_groups_are_made_up_by_extra_permits():
    """A failed group used to leave the trainer's batch short forever at max_staleness = 0."""
    buf = buffer(max_staleness=0, groups_per_batch=2)
    assert buf.may_start_batch(0, 0) and not buf.may_start_batch(1, 0)
    add_group(buf, "ok")
    buf.add(mk("bad", 0, status="failed"))
    buf.add(mk("bad", 1, status="failed"))  # the group is dropped: batch 0 is one group short
    assert buf.batch_for_step(0, 0) is None
    assert buf.makeup_batches() == 1 and buf.may_start_batch(1, 0)  # one more batch may start
    add_group(buf, "extra")
    assert keys(buf.batch_for_step(0, 0)) == [("ok", 0), ("ok", 1), ("extra", 0), ("extra", 1)]
    buf.accounting()


def test_a_waiting_trainer_that_went_back_gets_new_batches():
    """A trainer resumed from a checkpoint older than the batches the buffer can replay asks
    for steps the rollout is past: while nothing held can fill its batch, permits are given."""
    buf = buffer(max_staleness=1, groups_per_batch=2)
    buf.restart_trainer(version=5, step=5)
    assert not buf.may_start_batch(14, 5)  # by the batch index alone: 8 versions ahead
    assert buf.may_start_batch(14, 5, trainer_waiting=True)
    add_group(buf, "a", w=5)
    add_group(buf, "b", w=5)  # enough held for its batch: back to the index rule
    assert not buf.may_start_batch(14, 5, trainer_waiting=True)


# ----------------------------------------------------------------------------- re-sent groups
def test_resent_samples_are_counted_once_whether_the_buffer_had_them_or_not():
    """After a buffer restart the rollout re-sends "a" (restored from the journal), "b" (lost in
    flight to the dead process) and "c" (emitted, then stale-dropped "s"); the first copy of "b"
    arrives after all; a restarted rollout generates "a" again."""
    buf = buffer(max_staleness=0)
    add_group(buf, "a")
    add_group(buf, "c")
    add_group(buf, "s", w=0)
    assert keys(buf.next_batch(0)) == [("a", 0), ("a", 1)]
    buf.set_trainer_version(1)  # "c" and "s" are now stale: dropped
    generated = 8 + 2  # a, c, s and b by the rollout, then a again by a restarted one
    outcomes = [buf.add_resent(mk(gid, i)) for gid in ("a", "c", "s") for i in (0, 1)]
    assert outcomes == ["resent_copies"] * 6  # in the books already
    assert [buf.add_resent(mk("b", i, w=1)) for i in (0, 1)] == ["pending", "complete"]
    assert buf.add_resent(mk("b", 0, w=1)) == "resent_copies"  # a second re-send: a copy
    assert [buf.add(mk("b", i, w=1)) for i in (0, 1)] == ["late_originals"] * 2
    assert buf.add(mk("a", 1, w=1)) == "dropped_duplicate"  # generated again: a real drop
    assert buf.add(mk("a", 0, w=1)) == "dropped_duplicate"
    acc = buf.accounting()
    assert acc["added"] == generated == 10  # a, c, s, b once each, and the second "a"
    assert acc["emitted"] == 2 and acc["pending"] == 2 and acc["dropped_stale"] == 4
    assert acc["dropped_duplicate"] == 2
    assert acc["resent_copies"] == 7 and acc["resent_taken"] == 2 and acc["late_originals"] == 2
    assert buf.add(mk("b", 0, w=1)) == "dropped_duplicate"  # the late original came only once


def test_accounting_fails_when_a_group_is_taken_twice():
    buf = buffer()
    add_group(buf, "g")
    buf.next_batch(0)
    del buf._closed["g"]  # as if a restart or a snapshot had forgotten the group
    add_group(buf, "g")  # ... so that it goes in again: the sample books still balance
    assert buf.counters["added"] == buf.counters["emitted"] + len(buf.pending_keys()) == 4
    with pytest.raises(AssertionError, match="1 group ids closed as 'complete' but "
                                             "groups_completed = 2"):
        buf.accounting()


# ----------------------------------------------------------------------------- snapshots
def state_of(buf: RolloutBuffer) -> dict:
    """Every attribute but the config (so a new one is compared too), in order where the order
    decides what the buffer does (ready groups are emitted oldest first)."""
    state = {k: v for k, v in vars(buf).items() if k != "config"}
    state["_open"] = [(gid, list(group.items())) for gid, group in buf._open.items()]
    state["_ready"] = list(buf._ready.items())
    state["history"] = list(buf.history.items())
    return state


def round_trip(buf: RolloutBuffer) -> RolloutBuffer:
    """A fresh buffer restored from `buf`'s snapshot, through msgpack as the journal stores it."""
    wire = msgspec.msgpack.encode(buf.snapshot())
    fresh = RolloutBuffer(buf.config, buf.facts)
    fresh.restore(msgspec.msgpack.decode(wire, type=BufferSnapshot))
    return fresh


def test_a_snapshot_restores_every_part_of_the_state():
    buf = buffer(group_size=3, groups_per_batch=1, max_staleness=1, max_pending_groups=3)
    add_group(buf, "e")
    buf.batch_for_step(0, 0)  # "e" emitted for step 0
    add_group(buf, "r")  # ready
    buf.add(mk("o", 2))
    buf.add(mk("o", 0))  # open, indices in arrival order 2, 0
    buf.add_resent(mk("t", 1))  # taken from a re-send
    buf.add(mk("x", 0))  # overflow: 3 groups held
    buf.restart_trainer(version=0, step=0)  # step 0 will be replayed
    buf.set_trainer_version(3)  # "r" and "o" (version 0) are stale now; "t" too
    add_group(buf, "f", w=3)
    fresh = round_trip(buf)
    assert state_of(fresh) == state_of(buf)
    assert [gid for gid, _ in state_of(fresh)["_ready"]] == ["f"]
    assert fresh._closed == {"e": "complete", "r": "complete", "x": "overflow", "o": "stale",
                             "t": "stale", "f": "complete"}
    assert fresh._resent_first == {("t", 1)} and fresh._replay_from == 0
    assert keys(fresh.history[0]) == [("e", 0), ("e", 1), ("e", 2)]
    assert fresh.counters["added"] == 3 + 3 + 2 + 1 + 1 + 3  # e, r, o, t, x, f
    assert fresh.counters["resent_taken"] == 1 and fresh.counters["dropped_stale"] == 6
    assert fresh.trainer_version == 3
    # and it goes on as the original does: step 0 replayed, then "f"
    assert keys(fresh.batch_for_step(0, 3)) == keys(buf.batch_for_step(0, 3))
    assert fresh.counters["batches_replayed"] == buf.counters["batches_replayed"] == 1
    assert fresh.add(mk("t", 1)) == buf.add(mk("t", 1)) == "late_originals"


def test_a_damaged_snapshot_is_refused():
    snap = buffer().snapshot()
    snap.closed = {"complete": ["a"], "vanished": ["b"]}
    with pytest.raises(ValueError, match="closed reasons \\['vanished'\\]"):
        buffer().restore(snap)


@pytest.mark.parametrize("seed", [31, 32, 33])
def test_restored_buffers_behave_as_the_original_under_random_operations(seed):
    """At random points the buffer is snapshot and restored into a fresh one; every buffer so
    far then gets the same operations (samples, re-sends, batches, versions, checkpoints,
    trainer restarts), and all must stay equal."""
    rng = random.Random(seed)
    config = BufferConfig(max_staleness=1, max_pending_groups=6, min_ok_per_group=2,
                          replay_steps=4)
    buffers, rollout = [RolloutBuffer(config, facts(3, 2))], RandomRollout(rng, 1)
    version, step, checkpoint, sent, held = 0, 0, 0, [], []
    for _ in range(2500):
        op = rng.random()
        if op < 0.75:
            sample = rollout.next_sample(version)
            sent.append(sample)
            fate = rng.random()
            if fate < 0.1:  # lost in flight (to a buffer that died)
                continue
            if fate < 0.2:  # held up in flight: it arrives later
                held.append(sample)
                continue
            outcomes = {buf.add(sample) for buf in buffers}
        elif op < 0.78 and held:
            late = held.pop(rng.randrange(len(held)))
            outcomes = {buf.add(late) for buf in buffers}
        elif op < 0.83 and sent:
            resent = rng.choice(sent[-30:])
            outcomes = {buf.add_resent(resent) for buf in buffers}
        elif op < 0.93:
            batches = [buf.batch_for_step(step, version) for buf in buffers]
            outcomes = {tuple(keys(b)) if b else None for b in batches}
            if batches[0] is not None:
                step, version = step + 1, version + 1
        elif op < 0.95:
            checkpoint = step
            for buf in buffers:
                buf.forget_before(checkpoint)
            outcomes = {None}
        elif op < 0.97 and step > checkpoint:  # the trainer died; resumed from its checkpoint
            back = step - checkpoint
            for buf in buffers:
                buf.restart_trainer(version - back, checkpoint)
            step, version, outcomes = checkpoint, version - back, {None}
        else:
            buffers.append(round_trip(buffers[0]))
            outcomes = {None}
        assert len(outcomes) == 1  # every buffer answered alike
    states = [state_of(buf) for buf in buffers]
    assert len(buffers) > 40 and all(state == states[0] for state in states[1:])
    acc = buffers[0].accounting()
    for counter in ("emitted", "dropped_duplicate", "dropped_stale", "resent_copies",
                    "resent_taken", "late_originals", "batches_replayed"):
        assert acc[counter] > 0, counter  # the sequence exercised every path
