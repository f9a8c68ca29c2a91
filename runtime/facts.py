"""The facts of one run: what every actor must agree on, said once.

The launcher derives them from the whole plan (launch/plan.py: from `[rl]` or from the
per-actor tables) before anything starts, checks every actor's settings against them, and hands
them to each actor in its context (`ActorContext.facts`). Facts that travel with data ride on
the data too (a sample group carries the temperature and top-p it was sampled at), and the
receiving actor checks them against these at admission.
"""

from __future__ import annotations

from typing import Any

import msgspec

# each fact and the field that decides it: (the role of the actor, the path in its config)
DECIDED_BY = {"model": ("trainer", "model"), "dtype": ("trainer", "dtype"),
              "mode": ("trainer", "mode"), "true_on_policy": ("trainer", "true_on_policy"),
              "group_size": ("rollout", "group_size"),
              "groups_per_batch": ("rollout", "groups_per_batch"),
              "temperature": ("rollout", "temperature"), "top_p": ("rollout", "top_p"),
              "max_staleness": ("buffer", "max_staleness"), "lora": ("trainer", "lora")}
# names other actors' tables once held a copy under (now read from the facts)
OLD_COPIES = {"student": "model", "loss.temperature": "temperature"}


class TeacherFact(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One distillation teacher as every actor must see it."""

    name: str  # the name samples are routed by (Sample.teacher)
    model: str  # its checkpoint
    domains: list[str] = []  # the sample domains routed to it


class RunFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the actors of one run share (launch/plan.py `run_facts`)."""

    model: str = ""  # the policy's checkpoint (its tokenizer is the run's tokenizer)
    # the policy's vocabulary (its config.json's vocab_size): token ids must be below it
    # (0: unknown where the launcher runs, e.g. a built-in tiny name; ids are then unchecked)
    vocab_size: int = 0
    dtype: str = "float32"  # the trainer's parameter dtype
    group_size: int = 0  # samples per prompt (0: this run has no rollout)
    groups_per_batch: int = 0  # prompts per training batch
    temperature: float = 1.0  # the sampling temperature: the trainer's loss and teachers use it
    top_p: float = 1.0  # the sampling top-p
    mode: str = "decoupled"  # "decoupled" or "colocated" (train and generate in turn)
    max_staleness: int = 0  # weight versions the rollout may run ahead of the trainer
    true_on_policy: bool = False  # workers and trainer compute with the invariant kernels
    teachers: list[TeacherFact] = []  # distillation teachers (empty: no distillation)
    opd_mode: str = ""  # the trainer's opd signal mode ("" = no opd)
    opd_top_k: int = 0  # the trainer's opd top_k (what teacher servers return)
    # the trainer's LoRA table (None: full weights): it pushes adapters, and the rollout's
    # requests name the version's adapter (engine/weight_push.py adapter_name)
    lora: dict[str, Any] | None = None

    def sampled_as(self, temperature: float | None, top_p: float | None) -> str:
        """"" when data sampled at (temperature, top_p) belongs to this run (None: not said),
        else what differs, for a message."""
        wrong = [f"{name} {got} (the run's is {want})" for name, got, want in
                 (("temperature", temperature, self.temperature), ("top_p", top_p, self.top_p))
                 if got is not None and got != want]
        return ", ".join(wrong)


def fact_hint(field: str) -> str:
    """For an unknown config field that is a fact of the run: where to say it instead."""
    fact = OLD_COPIES.get(field, field)
    if fact not in DECIDED_BY:
        return ""
    role, path = DECIDED_BY[fact]
    return (f"; {fact} is a fact of the run, said once (in [rl], or as `{path}` of the {role}) "
            f"and read by every other actor: remove `{field}` here")
