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
`buffer_epoch` (in every Permit), so the rollout re-sends its recent groups to a new one (known
ones are dropped as duplicates). A trainer restarted from a checkpoint announces a new
`trainer_epoch`: its version may go back, and the batches its lost steps consumed are handed
out again (`RolloutBuffer.restart_trainer`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Callable

import msgspec

from logic.buffer import BufferConfig, RolloutBuffer, check_group, check_version
from runtime.actor import Actor
from transport.schema import (
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

    kind: str  # "group" | "version" | "batch"
    group: SampleGroup | None = None
    version: int = 0
    step: int = 0
    epoch: str = ""  # the trainer's (version entries)
    checkpointed: bool = False


class Journal:
    """Length-prefixed msgpack records appended to one file; a record cut short by a crash
    ends the replay and is cut off."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.encoder = msgspec.msgpack.Encoder()
        self.entries = self._read()
        self.file = open(path, "ab")

    def _read(self) -> list[JournalEntry]:
        if not self.path.exists():
            return []
        data, entries, at = self.path.read_bytes(), [], 0
        decoder = msgspec.msgpack.Decoder(JournalEntry)
        while at + 4 <= len(data):
            n = int.from_bytes(data[at:at + 4], "little")
            if at + 4 + n > len(data):
                break
            entries.append(decoder.decode(data[at + 4:at + 4 + n]))
            at += 4 + n
        if at < len(data):
            log.warning("buffer journal %s: cut off a partial last record (%d bytes)", self.path,
                        len(data) - at)
            with open(self.path, "r+b") as f:
                f.truncate(at)
        return entries

    def append(self, entry: JournalEntry) -> None:
        record = self.encoder.encode(entry)
        self.file.write(len(record).to_bytes(4, "little") + record)
        self.file.flush()  # in the OS's hands: survives the process being killed

    def close(self) -> None:
        self.file.close()


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


class BufferActor(Actor):
    Config = BufferConfig
    role = "buffer"

    async def on_start(self) -> None:
        self.logic = RolloutBuffer(self.config)
        self.state = BufferState(self.logic)
        self.changed = asyncio.Condition()
        self.buffer_epoch = uuid.uuid4().hex
        self.batch_waiters = 0  # GetBatch requests waiting for a batch
        self._log = RateLimitedLog(log)
        self.journal = None
        if self.ctx.run_dir:
            self.journal = Journal(Path(self.ctx.run_dir) / "buffer" / f"{self.name}.journal")
            self._closers.append(self.journal.close)
            for entry in self.journal.entries:
                self.state.apply(entry)
            if self.journal.entries:
                self.notify(f"restored from its journal: {len(self.journal.entries)} entries, "
                            f"trainer at step {self.trainer_step} (version "
                            f"{self.trainer_version}), {self.logic.ready_groups()} groups ready")

    def _record(self, entry: JournalEntry) -> None:
        """Journal `entry`, then apply it: the one path for every state change."""
        if self.journal is not None:
            self.journal.append(entry)
        self.state.apply(entry)

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
                VersionUpdate: self.version_update}

    async def on_inbox(self, msg: Msg) -> None:
        if not isinstance(msg, SampleGroup):
            self.counters["inbox.unexpected"] += 1
            return
        if self._invalid(msg, lambda: check_group(msg.samples, self.config)):
            return
        self._record(JournalEntry("group", group=msg))
        await self._notify()

    async def permit(self, msg: RolloutPermit) -> Permit | ErrorReply:
        if msg.batch_index < 0:
            return self._invalid(msg, lambda: self.logic.may_start_batch(msg.batch_index, 0))
        async with self.changed:
            await self.changed.wait_for(lambda: self.trainer_version >= 0 and
                                        self.logic.may_start_batch(msg.batch_index,
                                                                   self.trainer_version,
                                                                   self.batch_waiters > 0))
        return Permit(trainer_version=self.trainer_version, start_batch=self.trainer_step,
                      buffer_epoch=self.buffer_epoch)

    async def get_batch(self, msg: GetBatch) -> TrainBatch | ErrorReply:
        refused = self._trainer_update(msg, msg.trainer_version, msg.step, msg.trainer_epoch)
        if refused:
            return refused
        batch = None

        def ready() -> bool:
            nonlocal batch
            known = msg.step in self.logic.history
            batch = self.logic.batch_for_step(msg.step, self.trainer_version)
            if batch is not None and not known and self.journal is not None:
                self.journal.append(JournalEntry("batch", step=msg.step,
                                                 version=self.trainer_version))
            return batch is not None

        async with self.changed:
            self.batch_waiters += 1
            try:
                self.changed.notify_all()  # the version, or a waiting trainer, may unblock a permit
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
        seen = -1 if restarted else self.trainer_version
        field = "trainer_version" if isinstance(msg, GetBatch) else "version"
        refused = self._invalid(msg, lambda: check_version(field, seen, version, step))
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

    def _invalid(self, msg: Msg, check: Callable[[], object]) -> ErrorReply | None:
        """None if `check()` passes; else counts and logs the refusal and returns the answer."""
        try:
            check()
            return None
        except ValueError as e:
            rtype = type(msg).__name__
            self.counters[f"buffer.refused_{rtype}"] += 1
            if isinstance(msg, SampleGroup):
                self.counters["inbox.refused_invalid"] += 1
            self._log.warning(f"invalid:{rtype}", f"{self.name}: refused {rtype}: {e}")
            return ErrorReply(code=ErrorCode.INVALID_VALUE, message=str(e), request_type=rtype)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _publish(self) -> None:
        if self.metrics:
            # the books: added = emitted + pending + dropped_* (checked by accounting())
            self.metrics.publish({f"buffer/{k}": v for k, v in self.logic.accounting().items()},
                                 step=self.trainer_step)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"buffer.{k}": v for k, v in self.logic.counters.items()}}
