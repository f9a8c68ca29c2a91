"""The buffer actor: a thin I/O shell around `logic.buffer.RolloutBuffer`.

Rollout streams SampleGroups into the inbox; the trainer asks for batches (GetBatch, answered
when a full batch of fresh-enough groups is ready) and announces new weight versions
(VersionUpdate); the rollout asks for permits (RolloutPermit) so that it never runs more than
`max_staleness` versions ahead. Every decision is made by the pure RolloutBuffer; this actor only
waits, wakes and reports.

Invariant: input is checked (logic.buffer's checks) before it changes any state. A bad request is
answered with an ErrorReply(invalid_value) naming the field and values; a bad SampleGroup (no
reply path) is dropped whole, counted (`inbox.refused_invalid`) and logged at a limited rate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

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


class BufferActor(Actor):
    Config = BufferConfig
    role = "buffer"

    async def on_start(self) -> None:
        self.logic = RolloutBuffer(self.config)
        self.changed = asyncio.Condition()
        self.trainer_version = -1  # unknown until the trainer announces itself
        self.trainer_step = 0
        self._log = RateLimitedLog(log)

    def rpc_handlers(self):
        return {RolloutPermit: self.permit, GetBatch: self.get_batch,
                VersionUpdate: self.version_update}

    async def on_inbox(self, msg: Msg) -> None:
        if not isinstance(msg, SampleGroup):
            self.counters["inbox.unexpected"] += 1
            return
        if self._invalid(msg, lambda: check_group(msg.samples, self.config)):
            return
        for sample in msg.samples:
            self.logic.add(sample)
        await self._notify()

    async def permit(self, msg: RolloutPermit) -> Permit | ErrorReply:
        if msg.batch_index < 0:
            return self._invalid(msg, lambda: self.logic.may_start_batch(msg.batch_index, 0))
        async with self.changed:
            await self.changed.wait_for(lambda: self.trainer_version >= 0 and
                                        self.logic.may_start_batch(msg.batch_index,
                                                                   self.trainer_version))
        return Permit(trainer_version=self.trainer_version, start_batch=self.trainer_step)

    async def get_batch(self, msg: GetBatch) -> TrainBatch | ErrorReply:
        refused = self._invalid(msg, lambda: check_version(
            "trainer_version", self.trainer_version, msg.trainer_version, msg.step))
        if refused:
            return refused
        self.trainer_version, self.trainer_step = msg.trainer_version, msg.step
        self.logic.set_trainer_version(msg.trainer_version)
        batch = None

        def ready() -> bool:
            nonlocal batch
            batch = self.logic.next_batch(self.trainer_version)
            return batch is not None

        async with self.changed:
            self.changed.notify_all()  # the version may unblock a permit
            await self.changed.wait_for(ready)
        self._publish()
        return TrainBatch(step=msg.step, samples=batch, counters=dict(self.logic.counters),
                          next_teachers=self.logic.upcoming_teachers())

    async def version_update(self, msg: VersionUpdate) -> Ack | ErrorReply:
        refused = self._invalid(msg, lambda: check_version(
            "version", self.trainer_version, msg.version, msg.step))
        if refused:
            return refused
        self.trainer_version, self.trainer_step = msg.version, msg.step
        self.logic.set_trainer_version(msg.version)
        await self._notify()
        return Ack()

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
            self.metrics.publish({f"buffer/{k}": v for k, v in self.logic.counters.items()},
                                 step=self.trainer_step)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"buffer.{k}": v for k, v in self.logic.counters.items()}}
