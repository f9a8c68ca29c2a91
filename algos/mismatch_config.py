"""The trainer's `mismatch` table: how it treats rollout log-probs that differ from its own
(algos/mismatch.py computes the metrics and corrections; its docstring says what each does).

A module of its own, free of torch, so that the launcher checks a trainer's table without
importing the tensor functions (tests/test_import_cost.py).
"""

from __future__ import annotations

import msgspec

CORRECTIONS = ("none", "tis", "rejection_token", "rejection_seq", "decoupled")
PROXIMAL = ("current", "rollout_version")


class MismatchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How the trainer treats rollout log-probs that differ from its own."""

    correction: str = "none"  # none | tis | rejection_token | rejection_seq | decoupled
    tis_mode: str = "truncate"  # truncate: min(w, high); clip: clamp(w, low, high)
    low: float = 0.5  # lower bound on the importance weight (clip, rejection)
    high: float = 2.0  # upper bound on the importance weight (decoupled: mask above it)
    veto_threshold: float = 0.0  # rejection_seq: drop a sequence with any token w below this
    bypass: bool = False  # use rollout log-probs as the old policy and skip the recompute
    proximal: str = "current"  # decoupled: "current" (weights at step start) | "rollout_version"
    proximal_versions: int = 2  # rollout_version: old-actor weight sets kept (max_staleness + 1)

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction = {self.correction!r}; use one of {CORRECTIONS}")
        if self.tis_mode not in ("truncate", "clip"):
            raise ValueError(f"tis_mode = {self.tis_mode!r}; use 'truncate' or 'clip'")
        if not 0 <= self.low < 1 < self.high:
            raise ValueError(f"need 0 <= low < 1 < high, got low = {self.low}, high = {self.high}")
        if self.bypass and self.correction != "none":
            raise ValueError(f"bypass = true and correction = {self.correction!r} conflict: with "
                             "bypass the rollout log-probs are the old policy and nothing is "
                             "recomputed, so there is no mismatch left to correct (and no "
                             "proximal policy for decoupled PPO); set one of them off")
        if self.proximal not in PROXIMAL:
            raise ValueError(f"proximal = {self.proximal!r}; use one of {PROXIMAL}")
        if self.proximal != "current" and self.correction != "decoupled":
            raise ValueError(f"proximal = {self.proximal!r} and correction = "
                             f"{self.correction!r} conflict: the proximal policy belongs to "
                             "decoupled PPO; set correction = 'decoupled' or remove proximal")
        if self.proximal_versions < 1:
            raise ValueError(f"proximal_versions must be >= 1, got {self.proximal_versions}")
