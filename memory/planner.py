"""Residency planning: which weight set sits in which tier before each switch (pure logic).

A step declares its switch order up front (for example teacher-ordered micro-batches:
`["teacher:math", "teacher:code", "teacher:math", ...]`). The planner turns it into actions:

- GPU: `gpu_slots` fixed slots, one set each. Eviction is Belady's rule: evict the resident set
  whose next use is furthest in the future (or never). For equal-size slots this is optimal: no
  schedule loads fewer sets (the tests check it against exhaustive search). Prefetch looks
  `lookahead` switches ahead during the current compute and brings a set in only into a free slot
  or over a set needed later than it; the set being computed on is never a victim. When Belady's
  victim would be exactly that busy set, prefetch evicts the next-furthest one instead: one more
  load than the optimum (hidden behind compute) in exchange for a switch that does not wait.
  With `lookahead = 0` (demand only, on both tiers) the plan is Belady's and makes the optimal
  number of loads.
- Host: a byte budget. A set must be on the host before it can go to the GPU; host loads come from
  NVMe. The tiers are not inclusive: a set on the GPU may leave the host (its canonical copy is
  on NVMe or in its source checkpoint), so a small host budget still stages the next set while the
  current one computes. A host copy is needed only for a GPU load: a set in a slot that Belady
  keeps there through its uses in the declared order (fewer sets to load before each use than
  slots held by sets needed later) does not need its host copy, which is then the first victim.
  Eviction by furthest such need until the new set fits (with unequal sizes this is the standard
  heuristic, not proven optimal). Disk being the slowest tier, host loads run as far ahead as the
  budget allows, in order of need: at each switch, the next sets that are in neither tier are
  loaded to the host while room can be made from sets needed later than them (never from sets
  being copied to a slot at that switch). With a hint of the next step's order this starts the
  next step's disk reads during this step's last computes.

Invariant: at no point of a plan does a tier hold more than its budget, and a set larger than a
tier's budget is refused before anything runs, with the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Action:
    op: str  # "load" | "evict"
    tag: str
    tier: str  # "gpu" | "host"
    prefetch: bool  # True: issued during the previous compute; False: the switch waits for it


@dataclass
class Step:
    tag: str  # the set computed on at this switch
    demand: list[Action] = field(default_factory=list)  # before compute (the switch waits)
    prefetch: list[Action] = field(default_factory=list)  # issued when compute starts


@dataclass
class Plan:
    steps: list[Step]

    def loads(self, tier: str) -> int:
        return sum(a.op == "load" and a.tier == tier
                   for s in self.steps for a in s.demand + s.prefetch)

    def to_json(self) -> list[dict]:
        return [{"tag": s.tag, "demand": [a.__dict__ for a in s.demand],
                 "prefetch": [a.__dict__ for a in s.prefetch]} for s in self.steps]


def next_use(order: Sequence[str], start: int, tag: str) -> float:
    for j in range(start, len(order)):
        if order[j] == tag:
            return j
    return math.inf


def check_sizes(sizes: dict[str, int], slot_bytes: int, host_budget_bytes: int) -> None:
    for tag, n in sizes.items():
        if n > slot_bytes:
            raise ValueError(f"weight set {tag!r} is {n / 2**30:.3f} GiB, a GPU slot holds "
                             f"{slot_bytes / 2**30:.3f} GiB: raise slot_bytes")
        if n > host_budget_bytes:
            raise ValueError(f"weight set {tag!r} is {n / 2**30:.3f} GiB, the host tier budget is "
                             f"{host_budget_bytes / 2**30:.3f} GiB: raise host_budget_bytes")


class _Tier:
    """Residency of one tier during planning, with its budget (slots or bytes). The host tier
    knows the GPU tier (`gpu`): a set's host copy is needed only for its GPU loads."""

    def __init__(self, name: str, capacity: float, sizes: dict[str, int], resident: Sequence[str],
                 gpu: _Tier | None = None):
        self.name, self.capacity, self.sizes = name, capacity, sizes
        self.resident: list[str] = list(resident)
        self.gpu = gpu

    def next_need(self, order: Sequence[str], now: int, tag: str) -> float:
        if self.gpu is None:
            return next_use(order, now, tag)
        return host_need(order, now, tag, self.gpu.resident, self.gpu.capacity)

    def used(self) -> float:
        return len(self.resident) if self.name == "gpu" else sum(self.sizes[t] for t in
                                                                  self.resident)

    def need(self, tag: str) -> float:
        return 1 if self.name == "gpu" else self.sizes[tag]

    def make_room(self, tag: str, order: Sequence[str], now: int, keep: set[str],
                  limit: float = math.inf) -> list[Action] | None:
        """Evictions (furthest next use first) so that `tag` fits; None when impossible without
        evicting a set in `keep` or one used sooner than `limit`."""
        evicted: list[str] = []
        while self.used() - sum(self.need(t) for t in evicted) + self.need(tag) > self.capacity:
            cands = [t for t in self.resident if t not in keep and t not in evicted]
            if not cands:
                return None
            victim = max(cands, key=lambda t: (self.next_need(order, now, t), t))
            if self.next_need(order, now, victim) <= limit:
                return None
            evicted.append(victim)
        for t in evicted:
            self.resident.remove(t)
        self.resident.append(tag)
        return [Action("evict", t, self.name, False) for t in evicted]


def plan_switches(order: Sequence[str], sizes: dict[str, int], gpu_slots: int,
                  host_budget_bytes: int, gpu_resident: Sequence[str] = (),
                  host_resident: Sequence[str] = (), lookahead: int = 1) -> Plan:
    """Actions for each switch of `order` (see the module docstring)."""
    if gpu_slots < 1:
        raise ValueError("gpu_slots must be >= 1")
    unknown = sorted(set(order) - set(sizes))
    if unknown:
        raise ValueError(f"switch order names unregistered weight sets {unknown}")
    gpu = _Tier("gpu", gpu_slots, sizes, gpu_resident)
    host = _Tier("host", host_budget_bytes, sizes, host_resident, gpu)
    steps = [Step(tag) for tag in order]
    for i, tag in enumerate(order):
        step = steps[i]
        if tag not in gpu.resident:  # demand: the switch waits for these
            step.demand += _load(host, tag, order, i, keep={tag}, prefetch=False)
            step.demand += _load(gpu, tag, order, i, keep={tag}, prefetch=False)
        keep_gpu = {tag}
        for j in range(i + 1, min(i + 1 + lookahead, len(order))):
            nxt = order[j]
            keep_gpu.add(nxt)
            if nxt in gpu.resident:
                continue
            if nxt not in host.resident:
                acts = _load(host, nxt, order, i + 1, keep=_copying(step) | {nxt},
                             prefetch=True, limit=j)
                if acts is None:
                    break
                step.prefetch += acts
            acts = _load(gpu, nxt, order, i + 1, keep=keep_gpu, prefetch=True, limit=j)
            if acts is None:
                break
            step.prefetch += acts
        if lookahead:
            step.prefetch += _host_ahead(host, order, i, _copying(step))
    return Plan(steps)


def _host_ahead(host: _Tier, order: Sequence[str], i: int, busy: set[str]) -> list[Action]:
    """Host loads issued at switch i for the next sets that need one, in order of need, while
    room can be made from sets needed later (the disk is the slowest tier) and not in `busy`."""
    out: list[Action] = []
    for k in range(i + 1, len(order)):
        tag = order[k]
        if tag in host.resident or host.next_need(order, i + 1, tag) > k:
            continue  # on the host, or in a slot that keeps it until its use at k
        acts = _load(host, tag, order, i + 1, keep=busy | {tag} | {a.tag for a in out},
                     prefetch=True, limit=k)
        if acts is None:
            break
        out += acts
    return out


def _copying(step: Step) -> set[str]:
    """Sets this switch starts copying to a slot: their host copies are being read."""
    return {a.tag for a in step.prefetch if a.op == "load" and a.tier == "gpu"}


def host_need(order: Sequence[str], now: int, tag: str, gpu_resident: Sequence[str],
              gpu_slots: float) -> float:
    """When the host copy of `tag` is next needed (for a GPU load): its next use, unless it is
    in a slot now and Belady keeps it there through its uses in `order`, then never."""
    j = next_use(order, now, tag)
    if tag not in gpu_resident:
        return j
    start = now
    while j != math.inf:
        loads = {t for t in order[start:j] if t not in gpu_resident}
        later = sum(1 for t in gpu_resident if t != tag and next_use(order, start, t) > j)
        if len(loads) > gpu_slots - len(gpu_resident) + later:
            return j  # evicted before its use at j: a load (from the host) then
        start, j = j + 1, next_use(order, j + 1, tag)
    return math.inf


def _load(tier: _Tier, tag: str, order: Sequence[str], now: int, keep: set[str],
          prefetch: bool, limit: float = math.inf) -> list[Action] | None:
    if tag in tier.resident:
        return []
    evictions = tier.make_room(tag, order, now, keep, limit if prefetch else -math.inf)
    if evictions is None:
        if prefetch:
            return None
        raise ValueError(f"{tier.name} tier cannot fit {tag!r} next to {tier.resident} "
                         f"(all needed now)")
    return [Action(a.op, a.tag, a.tier, prefetch) for a in evictions] + \
        [Action("load", tag, tier.name, prefetch)]


def demand_loads(order: Sequence[str], slots: int, policy: str = "belady") -> int:
    """Loads of a demand-paged cache of `slots` equal sets (a reference for the tests)."""
    resident: list[str] = []
    loads = 0
    for i, tag in enumerate(order):
        if tag in resident:
            continue
        loads += 1
        if len(resident) == slots:
            if policy == "belady":
                victim = max(resident, key=lambda t: (next_use(order, i + 1, t), t))
            else:  # lru
                victim = min(resident, key=lambda t: max(j for j in range(i) if order[j] == t))
            resident.remove(victim)
        resident.append(tag)
    return loads
