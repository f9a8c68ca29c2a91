"""The buffer actor: a thin I/O shell around `logic.buffer.RolloutBuffer`.

Rollout streams SampleGroups into the inbox; the trainer asks for batches (GetBatch, answered
when a full batch of fresh-enough groups is ready) and announces new weight versions
(VersionUpdate); the rollout asks for permits (RolloutPermit) so that it never runs more than
`max_staleness` versions ahead. Every decision is made by the pure RolloutBuffer; this actor only
waits, wakes and reports.
"""

from __future__ import annotations

import asyncio

from logic.buffer import BufferConfig, RolloutBuffer
from runtime.actor import Actor
from transport.schema import (
    Ack,
    GetBatch,
    Msg,
    Permit,
    RolloutPermit,
    SampleGroup,
    TrainBatch,
    VersionUpdate,
)


class BufferActor(Actor):
    Config = BufferConfig
    role = "buffer"

    async def on_start(self) -> None:
        self.logic = RolloutBuffer(self.config)
        self.changed = asyncio.Condition()
        self.trainer_version = -1  # unknown until the trainer announces itself
        self.trainer_step = 0

    def rpc_handlers(self):
        return {RolloutPermit: self.permit, GetBatch: self.get_batch,
                VersionUpdate: self.version_update}

    async def on_inbox(self, msg: Msg) -> None:
        if not isinstance(msg, SampleGroup):
            self.counters["inbox.unexpected"] += 1
            return
        for sample in msg.samples:
            self.logic.add(sample)
        await self._notify()

    async def permit(self, msg: RolloutPermit) -> Permit:
        async with self.changed:
            await self.changed.wait_for(lambda: self.trainer_version >= 0 and
                                        self.logic.may_start_batch(msg.batch_index,
                                                                   self.trainer_version))
        return Permit(trainer_version=self.trainer_version, start_batch=self.trainer_step)

    async def get_batch(self, msg: GetBatch) -> TrainBatch:
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

    async def version_update(self, msg: VersionUpdate) -> Ack:
        self.trainer_version, self.trainer_step = msg.version, msg.step
        self.logic.set_trainer_version(msg.version)
        await self._notify()
        return Ack()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _publish(self) -> None:
        if self.metrics:
            self.metrics.publish({f"buffer/{k}": v for k, v in self.logic.counters.items()},
                                 step=self.trainer_step)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"buffer.{k}": v for k, v in self.logic.counters.items()}}
