"""The buffer actor: a thin I/O shell around `logic.buffer.RolloutBuffer`.

Rollout streams SampleGroups into the inbox; the trainer asks for batches (GetBatch, answered
when a full batch of fresh-enough groups is ready) and announces new weight versions
(VersionUpdate); the rollout asks for permits (RolloutPermit) so that it never runs more than
`max_staleness` versions ahead. Every decision is made by the pure RolloutBuffer; this actor only
waits, wakes and reports.

Invariant: input is checked (logic.buffer's checks) before it changes any state. A bad request is
answered with an ErrorReply(invalid_value) naming the field and values; a bad SampleGroup (no
reply path) is dropped whole, counted (`inbox.refused_invalid`) and logged at a limited rate.

Restarts: every state change (a sample group, a trainer version, an emitted batch) is appended
to a journal in the run directory (`buffer/<name>.journal`) before or as it is applied; a
restarted buffer replays it through the same pure logic and is where it was (groups in flight,
ready groups, counters, the batch of every recent step). Each buffer process has its own
`buffer_epoch` (in every Permit), so the rollout re-sends its recent groups to a new one, as
requests (`resend`) so that they are told from new groups: samples the buffer already has are
counted as `resent_copies`, not added again (`RolloutBuffer.add_resent`). A trainer restarted
from a checkpoint announces a new `trainer_epoch`: its version may go back, and the batches its
lost steps consumed are handed out again (`RolloutBuffer.restart_trainer`).

Permits at scale: a RolloutPermit that may not start yet waits in a heap by batch index, and is
released when a state change allows its index (permits are granted in index order); a group
arriving costs O(1) for the permits then, not one wake-up per waiting request (with 1,000
producers asking, bench/scale.py).

Compaction: once `journal_compact_bytes` (and at least the last snapshot's size) were appended
since the last snapshot, the journal is replaced by one "snapshot" record of the whole state
(`BufferState.snapshot`: the logic's state, with the remembered batches of the steps a resumed
trainer may ask again, and what the trainer said of itself), so it stays proportional to the
live state instead of the run's length. The snapshot is written to `<name>.journal.tmp`, flushed
and fsync'ed, then renamed over the journal (and the directory fsync'ed): a crash before the
rename leaves the old journal whole (the temp file is removed on the next start), after it the
new one; replaying either gives the same state. A failed compaction is logged and the journal
kept as it is.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from logic.buffer import BufferConfig, BufferSnapshot, RolloutBuffer, check_group, check_version
from runtime.actor import Actor
from runtime.facts import RunFacts
from transport import records
from transport.schema import (
    TOPK_IDS_DTYPE,
    TOPK_LOGPROBS_DTYPE,
    Ack,
    ErrorCode,
    ErrorReply,
    GetBatch,
    Msg,
    Permit,
    RolloutPermit,
    SampleGroup,
    TrainBatch,
    VersionUpdate,
)
from transport.sockets import RateLimitedLog

log = logging.getLogger(__name__)


class JournalEntry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One state change of the buffer, in the order it was applied."""

    kind: str  # "group" | "resend" | "version" | "batch" | "snapshot"
    group: SampleGroup | None = None
    version: int = 0
    step: int = 0
    epoch: str = ""  # the trainer's (version entries)
    checkpointed: bool = False
    # the whole state ("snapshot" entries; version/step/epoch: what the trainer said of itself)
    snapshot: BufferSnapshot | None = None


class Journal:
    """Length-prefixed msgpack records appended to one file; a record cut short by a crash
    ends the replay and is cut off. `compact` replaces the file by one record, atomically.
    Records are `transport.records` (numpy arrays inline: a sample's teacher top-k); journals
    written before top-k were arrays (nested lists) are read too."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        if self.tmp.exists():  # a compaction died before its rename: the journal is whole
            log.warning("buffer journal %s: removed %s, left by a compaction that did not "
                        "finish (the journal before it is complete)", path, self.tmp.name)
            self.tmp.unlink()
        self.encoder = records.encoder()
        self.size = 0  # bytes in the file
        self.snapshot_size = 0  # bytes of the snapshot record it starts with (0: none)
        self.base = 0  # bytes after the last compaction (or a failed one): `due` counts from it
        self.entries = self._read()
        self.file = open(path, "ab")  # noqa: SIM115 - open for the journal's lifetime

    def _read(self) -> list[JournalEntry]:
        if not self.path.exists():
            return []
        data, entries, at = self.path.read_bytes(), [], 0
        decoder = records.decoder(JournalEntry, _lists_as_topk)
        while at + 4 <= len(data):
            n = int.from_bytes(data[at:at + 4], "little")
            if at + 4 + n > len(data):
                break
            try:
                entries.append(decoder.decode(memoryview(data)[at + 4:at + 4 + n]))
            except msgspec.ValidationError as e:
                raise ValueError(f"buffer journal {self.path}: the record at byte {at} cannot "
                                 f"be read ({e}); it was written by another version of the "
                                 f"project, or damaged: move the journal away to start the "
                                 f"buffer empty") from None
            if entries[-1].kind == "snapshot":
                self.snapshot_size = self.base = at + 4 + n
            at += 4 + n
        if at < len(data):
            log.warning("buffer journal %s: cut off a partial last record (%d bytes)", self.path,
                        len(data) - at)
            with open(self.path, "r+b") as f:
                f.truncate(at)
        self.size = at
        return entries

    def _frame(self, entry: JournalEntry) -> bytes:
        record = self.encoder.encode(entry)
        return len(record).to_bytes(4, "little") + record

    def append(self, entry: JournalEntry) -> None:
        record = self._frame(entry)
        self.file.write(record)
        self.file.flush()  # in the OS's hands: survives the process being killed
        self.size += len(record)

    def due(self, every_bytes: int) -> bool:
        """Whether `compact` is due: `every_bytes` (0 = never), and at least the snapshot's own
        size, appended since the last compaction (so rewriting costs at most one byte per byte
        appended, and the file stays under 2 x snapshot + every_bytes + one record)."""
        return every_bytes > 0 and self.size - self.base >= max(every_bytes, self.base)

    def compact(self, snapshot: JournalEntry) -> None:
        """Replace the file by the one record `snapshot` (which must give, replayed alone, the
        state every record so far gives): temp file, fsync, rename, fsync of the directory.
        OSError leaves the journal as it was."""
        record = self._frame(snapshot)
        new = open(self.tmp, "wb")  # noqa: SIM115 - kept open: it becomes the journal's file
        try:
            new.write(record)
            new.flush()
            os.fsync(new.fileno())  # the data is on disk before the name points at it
            os.replace(self.tmp, self.path)
        except BaseException:
            new.close()
            self.tmp.unlink(missing_ok=True)
            raise
        # the same open file, now named `path`: appends go on after the record
        old, self.file = self.file, new
        self.size = self.snapshot_size = self.base = len(record)
        try:
            old.close()  # flushed at every append: nothing left to write
            _fsync_dir(self.path.parent)  # the rename itself survives a power loss
        except OSError as e:  # the rename happened; only its durability is in doubt
            log.warning("buffer journal %s: after compacting it: %s", self.path, e)

    def close(self) -> None:
        self.file.close()


def _lists_as_topk(tp: type, obj: object) -> np.ndarray | None:
    """Journals written before protocol 2 hold a sample's top-k as rows of numbers: read them
    as the arrays they are now (integer rows: ids, int32; rows with floats: log-probs, float32;
    server log-probs are never all integral). Anything else is refused (ValidationError)."""
    if tp is not np.ndarray or not isinstance(obj, list):
        raise TypeError(f"expected an array, got {type(obj).__name__}")
    if not obj:
        return None
    rows = np.asarray(obj)  # ValueError for ragged rows
    if rows.ndim != 2 or rows.dtype.kind not in "iuf":
        raise ValueError(f"top-k rows of {rows.dtype} shaped {rows.shape}, not rows of numbers")
    if rows.dtype.kind == "f":
        return rows.astype(TOPK_LOGPROBS_DTYPE)
    if rows.min() < 0 or rows.max() > np.iinfo(TOPK_IDS_DTYPE).max:
        raise ValueError("top-k token ids outside int32")
    return rows.astype(TOPK_IDS_DTYPE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BufferState:
    """The buffer's logic plus what the trainer last said of itself, changed only by `apply`:
    the live actor and a journal replay (here, or in bench/faults.py) take the same path."""

    def __init__(self, logic: RolloutBuffer):
        self.logic = logic
        self.trainer_version = -1  # unknown until the trainer announces itself
        self.trainer_step = 0
        self.trainer_epoch = ""

    def apply(self, entry: JournalEntry) -> None:
        if entry.kind == "group":
            for sample in entry.group.samples:
                self.logic.add(sample)
        elif entry.kind == "resend":
            for sample in entry.group.samples:
                self.logic.add_resent(sample)
        elif entry.kind == "version":
            if entry.epoch != self.trainer_epoch and self.trainer_version >= 0:
                self.logic.restart_trainer(entry.version, entry.step)
            self.trainer_version, self.trainer_step = entry.version, entry.step
            self.trainer_epoch = entry.epoch
            self.logic.set_trainer_version(entry.version)
            if entry.checkpointed:
                self.logic.forget_before(entry.step)
        elif entry.kind == "batch":  # replay: the same call that emitted it
            self.logic.batch_for_step(entry.step, entry.version)
        elif entry.kind == "snapshot":  # the whole state, as `snapshot` wrote it
            self.logic.restore(entry.snapshot)
            self.trainer_version, self.trainer_step = entry.version, entry.step
            self.trainer_epoch = entry.epoch
        else:
            raise ValueError(f"buffer journal: unknown entry kind {entry.kind!r}")

    def snapshot(self) -> JournalEntry:
        """One entry that `apply`, on a fresh state, turns into exactly this state."""
        return JournalEntry("snapshot", version=self.trainer_version, step=self.trainer_step,
                            epoch=self.trainer_epoch, snapshot=self.logic.snapshot())


class BufferActor(Actor):
    Config = BufferConfig
    role = "buffer"

    @classmethod
    def check_facts(cls, config: BufferConfig, facts: RunFacts) -> None:
        config.check_facts(facts)

    async def on_start(self) -> None:
        self.logic = RolloutBuffer(self.config, self.facts)
        self.state = BufferState(self.logic)
        self.changed = asyncio.Condition()
        self.buffer_epoch = uuid.uuid4().hex
        self.batch_waiters = 0  # GetBatch requests waiting for a batch
        # RolloutPermit requests not allowed yet: (batch_index, arrival, future), a heap
        self._permit_waiters: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()
        # batches permitted by this process (a repeated request for a recent index counts once)
        # and the groups received since: the difference is what is still being generated
        self._permitted_batches = 0
        self._recent_permits: dict[int, None] = {}
        self._groups_received = 0
        self._log = RateLimitedLog(log)
        self.journal = None
        if self.ctx.run_dir:
            self.journal = Journal(Path(self.ctx.run_dir) / "buffer" / f"{self.name}.journal")
            self._closers.append(self.journal.close)
            for entry in self.journal.entries:
                self.state.apply(entry)
            if self.journal.entries:
                n = len(self.journal.entries)
                what = (f"a snapshot and {n - 1} entries after it" if self.journal.snapshot_size
                        else f"{n} entries")
                self.notify(f"restored from its journal ({what}): trainer at step "
                            f"{self.trainer_step} (version {self.trainer_version}), "
                            f"{self.logic.ready_groups()} groups ready")
            self.journal.entries = []  # replayed: not kept
            self._compact_if_due()

    def _record(self, entry: JournalEntry) -> None:
        """Journal `entry`, then apply it: the one path for every state change."""
        if self.journal is not None:
            self.journal.append(entry)
        self.state.apply(entry)
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        """Replace the journal by a snapshot of the state once enough was appended (call it
        only when every journaled entry is applied, and nothing applied is unjournaled)."""
        journal = self.journal
        if journal is None or not journal.due(self.config.journal_compact_bytes):
            return
        before = journal.size
        try:
            journal.compact(self.state.snapshot())
        except OSError as e:
            self.counters["journal.compact_failed"] += 1
            journal.base = journal.size  # try again once as much again was appended
            self._log.warning("compact", f"{self.name}: journal compaction failed, the journal "
                              f"is kept as it is ({before} bytes): {e}")
            return
        self.counters["journal.compactions"] += 1
        log.info("%s: journal compacted from %d to %d bytes", self.name, before, journal.size)

    @property
    def trainer_version(self) -> int:
        return self.state.trainer_version

    @property
    def trainer_step(self) -> int:
        return self.state.trainer_step

    @property
    def trainer_epoch(self) -> str:
        return self.state.trainer_epoch

    def rpc_handlers(self):
        return {RolloutPermit: self.permit, GetBatch: self.get_batch,
                VersionUpdate: self.version_update, SampleGroup: self.resend}

    def rpc_roles(self):
        """What the trainer says of itself moves versions and hands out batches: only the
        trainer's own connection may say it."""
        return {GetBatch: "trainer", VersionUpdate: "trainer"}

    async def on_inbox(self, msg: Msg) -> None:
        if not isinstance(msg, SampleGroup):
            self.counters["inbox.unexpected"] += 1
            return
        if self._invalid(msg, lambda: self._check_group(msg)):
            self.counters["inbox.refused_invalid"] += 1
            return
        # a re-sent group that came through a stream (a teacher pool between): as `resend`
        self._record(JournalEntry("resend" if msg.resent else "group", group=msg))
        self._groups_received += not msg.resent
        await self._notify()

    async def resend(self, msg: SampleGroup) -> Ack | ErrorReply:
        """A group the rollout sends again because this buffer process is new (the one before
        may have died with it in flight): what the books already hold counts as a copy."""
        refused = self._invalid(msg, lambda: self._check_group(msg))
        if refused:
            return refused
        self._record(JournalEntry("resend", group=msg))
        await self._notify()
        return Ack()

    async def permit(self, msg: RolloutPermit) -> Permit | ErrorReply:
        if msg.batch_index < 0:
            return self._invalid(msg, lambda: self.logic.may_start_batch(msg.batch_index, 0))
        index = 0 if msg.position_only else msg.batch_index  # once the trainer announced itself
        if not self._may_start(index):
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._permit_waiters, (index, next(self._arrivals), fut))
            await fut
        if not msg.position_only and msg.batch_index not in self._recent_permits:
            self._permitted_batches += 1
            self._recent_permits[msg.batch_index] = None
            if len(self._recent_permits) > 4096:  # requests are re-sent for recent batches only
                del self._recent_permits[next(iter(self._recent_permits))]
        return Permit(trainer_version=self.trainer_version, start_batch=self.trainer_step,
                      buffer_epoch=self.buffer_epoch)

    def _may_start(self, batch_index: int) -> bool:
        in_flight = max(0, self._permitted_batches * self.facts.groups_per_batch
                        - self._groups_received)
        return self.trainer_version >= 0 and self.logic.may_start_batch(
            batch_index, self.trainer_version, self.batch_waiters > 0, in_flight)

    def _release_permits(self) -> None:
        """Answer every waiting permit the state now allows: lowest batch index first (a
        higher index is allowed only after a lower one, or all at once when the trainer
        waits); cancelled requests are dropped on the way."""
        heap = self._permit_waiters
        while heap and (heap[0][2].done() or self._may_start(heap[0][0])):
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)

    async def get_batch(self, msg: GetBatch) -> TrainBatch | ErrorReply:
        refused = self._trainer_update(msg, msg.trainer_version, msg.step, msg.trainer_epoch)
        if refused:
            return refused
        batch = None

        def ready() -> bool:
            nonlocal batch
            known = msg.step in self.logic.history
            replayed = self.logic.counters["batches_replayed"]
            batch = self.logic.batch_for_step(msg.step, self.trainer_version)
            # a new batch, or a remembered one handed out again to a restarted trainer, changed
            # the state (a request asked again did not): journaled, so a replay gets there too
            changed = not known or self.logic.counters["batches_replayed"] != replayed
            if batch is not None and changed and self.journal is not None:
                self.journal.append(JournalEntry("batch", step=msg.step,
                                                 version=self.trainer_version))
                self._compact_if_due()
            return batch is not None

        async with self.changed:
            self.batch_waiters += 1
            try:
                self._release_permits()  # the version, or a waiting trainer, may allow a permit
                await self.changed.wait_for(ready)
            finally:
                self.batch_waiters -= 1
        self._publish()
        return TrainBatch(step=msg.step, samples=batch, counters=dict(self.logic.counters),
                          next_teachers=self.logic.upcoming_teachers())

    async def version_update(self, msg: VersionUpdate) -> Ack | ErrorReply:
        refused = self._trainer_update(msg, msg.version, msg.step, msg.trainer_epoch,
                                       msg.checkpointed)
        if refused:
            return refused
        await self._notify()
        return Ack()

    def _trainer_update(self, msg: Msg, version: int, step: int, epoch: str,
                        checkpointed: bool = False) -> ErrorReply | None:
        """Check and record what the trainer says of itself. A new trainer epoch (a restarted
        trainer) may go back to its checkpoint's version; within an epoch versions advance one
        at a time."""
        restarted = epoch != self.trainer_epoch
        field = "trainer_version" if isinstance(msg, GetBatch) else "version"
        refused = self._invalid(msg, lambda: check_version(
            field, self.trainer_version, version, step, restarted, self.trainer_step))
        if refused:
            return refused
        if restarted and self.trainer_version >= 0:
            self.notify(f"trainer restarted at step {step} (version {version}; it was at step "
                        f"{self.trainer_step}): batches of the steps it lost are handed out again")
        if (restarted or version != self.trainer_version or step != self.trainer_step
                or checkpointed):
            self._record(JournalEntry("version", version=version, step=step, epoch=epoch,
                                      checkpointed=checkpointed))
        return None

    def _check_group(self, msg: SampleGroup) -> None:
        """A whole, valid group, sampled at the run's temperature and top-p (ctx.facts)."""
        check_group(msg.samples, self.config, self.facts)
        wrong = self.facts.sampled_as(msg.temperature, msg.top_p)
        if wrong:
            raise ValueError(f"a group sampled at {wrong}: the trainer computes its log-probs at "
                             f"the run's sampling settings; sample at those (the rollout's "
                             f"temperature / top_p, or [rl])")

    def _invalid(self, msg: Msg, check: Callable[[], object]) -> ErrorReply | None:
        """None if `check()` passes; else counts and logs the refusal and returns the answer."""
        try:
            check()
            return None
        except ValueError as e:
            rtype = type(msg).__name__
            self.counters[f"buffer.refused_{rtype}"] += 1
            self._log.warning(f"invalid:{rtype}", f"{self.name}: refused {rtype}: {e}")
            return ErrorReply(code=ErrorCode.INVALID_VALUE, message=str(e), request_type=rtype)

    async def _notify(self) -> None:
        self._release_permits()
        async with self.changed:
            self.changed.notify_all()

    def _publish(self) -> None:
        if self.metrics:
            # the books: added = emitted + pending + dropped_* (checked by accounting()); re-sent
            # copies (resent_copies) are outside them
            values = {f"buffer/{k}": v for k, v in self.logic.accounting().items()}
            if self.journal is not None:
                values["buffer/journal_bytes"] = self.journal.size
            self.metrics.publish(values, step=self.trainer_step)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"buffer.{k}": v for k, v in self.logic.counters.items()}}
