"""The prefetcher as the launcher sees it (actors/prefetcher.py is the actor): its settings,
without torch (runtime/loading.py `import_actor`, plan side)."""

from __future__ import annotations

import msgspec

from runtime.actor import Actor


class PrefetcherConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the prefetcher actor (one per trainer host)."""

    chunk_bytes: int = 16 << 20  # NVMe read size per request (a multiple of 4096)
    num_readers: int = 4  # chunk reads in flight per set
    num_sets_in_flight: int = 2  # weight sets read concurrently
    pin: bool = True  # register the arena mapping with CUDA when a GPU is present


class PrefetcherActorPlan(Actor):
    """What the launcher checks of a prefetcher: its settings."""

    Config = PrefetcherConfig
    role = "prefetcher"
