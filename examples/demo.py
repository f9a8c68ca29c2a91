"""The demo cluster: three toy actors that exercise request/reply, a stream and metrics.

`producer` (primary) makes `num_items` random tensors; for each it asks `scaler` over
request/reply to multiply it (checking the answer), then streams the result to `consumer`'s inbox
(with backpressure). All three publish metrics; the run ends when the producer is done.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np

from runtime.actor import Actor
from transport.schema import Msg, Tensor, register_messages


class Scale(Msg):
    """Request: multiply a tensor; the reply carries the product and its sum."""

    tensor: Tensor
    factor: float


class ScaleReply(Msg):
    tensor: Tensor
    total: float


class WorkItem(Msg):
    """Stream item (producer -> consumer)."""

    index: int
    data: np.ndarray
    produced_at_s: float


register_messages(Scale, ScaleReply, WorkItem)  # the demo's own messages on the wire


class ScalerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the scaler."""

    delay_s: float = 0.0  # artificial service time per request


class Scaler(Actor):
    """Serves Scale requests: returns tensor * factor and the sum of the input."""

    Config = ScalerConfig
    role = "scaler"

    def rpc_handlers(self):
        return {Scale: self.scale}

    async def on_start(self) -> None:
        import torch  # noqa: F401 - before READY: its first request must not pay the import

    async def scale(self, msg: Scale) -> ScaleReply:
        if self.config.delay_s:
            await asyncio.sleep(self.config.delay_s)
        self.counters["scaled"] += 1
        if self.metrics and self.counters["scaled"] % 10 == 0:
            self.metrics.publish({"requests": self.counters["scaled"]})
        return ScaleReply(tensor=msg.tensor * msg.factor, total=float(msg.tensor.sum()))


class ProducerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the producer."""

    num_items: int = 200  # items to produce before the run completes
    item_numel: int = 4096  # float32 elements per item
    factor: float = 2.0  # what the scaler multiplies by
    interval_s: float = 0.01  # pause between items
    seed: int = 0


class Producer(Actor):
    Config = ProducerConfig
    role = "producer"

    async def on_start(self) -> None:
        self.scaler = await self.connect("scaler")
        self.out = self.stream_to("consumer", hwm=16)

    async def run(self) -> None:
        # torch is the producer's alone (the scaler's tensors come decoded off the wire, the
        # consumer's items are numpy): the launcher and the consumer start without it
        import torch

        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.seed)
        started = time.monotonic()
        for i in range(1, cfg.num_items + 1):
            x = torch.randn(cfg.item_numel, generator=gen)
            reply = await self.scaler.call(Scale(tensor=x, factor=cfg.factor))
            if not torch.allclose(reply.tensor, x * cfg.factor):
                raise RuntimeError(f"scaler returned a wrong product for item {i}")
            await self.out.send(WorkItem(index=i, data=reply.tensor.numpy(),
                                         produced_at_s=time.time()))
            if self.metrics:
                self.metrics.publish({"items_per_s": i / (time.monotonic() - started)},
                                     step=i, total_steps=cfg.num_items)
            await asyncio.sleep(cfg.interval_s)


class Consumer(Actor):
    """Receives WorkItems; checks ordering and publishes latency."""

    role = "consumer"

    async def on_inbox(self, msg: Msg) -> None:
        assert isinstance(msg, WorkItem)
        self.counters["items"] += 1
        if msg.index != self.counters["items"]:
            self.counters["out_of_order"] += 1
        if self.metrics:
            self.metrics.publish({"latency_ms": 1e3 * (time.time() - msg.produced_at_s),
                                  "items": self.counters["items"],
                                  "mean_abs": float(abs(msg.data).mean())})
