"""The advantage estimators by name and what the train step does around each, and the KL
estimators' names (no torch).

Role: the tables a config is checked with (training/config.py: the estimator exists, needs a
critic, accepts KL reward shaping; the KL estimator exists), read by the launcher before
anything starts; the tensor functions are algos/advantages.py's (its `ESTIMATORS` extends these
records with them, name for name) and algos/kl.py's. See those for what each one computes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator as a config sees it: how it scores samples and what the step does
    around it."""

    name: str
    scores: Literal["zero", "raw", "group_normalised", "group_centred"]  # `sample_scores`
    whitened: bool = False  # advantages whitened over the whole step (every rank)
    token_rewards: bool = False  # accepts KL reward shaping (kl.in_reward)
    needs_critic: bool = False  # the critic's values (GAE); the config needs `critic`


SPECS: dict[str, EstimatorSpec] = {e.name: e for e in (
    EstimatorSpec("grpo", "group_normalised"),
    EstimatorSpec("dr_grpo", "group_centred"),
    EstimatorSpec("reinforce_plus_plus", "raw", whitened=True, token_rewards=True),
    EstimatorSpec("reinforce_plus_plus_baseline", "group_centred", whitened=True,
                  token_rewards=True),
    EstimatorSpec("ppo", "raw", whitened=True, token_rewards=True, needs_critic=True),
    EstimatorSpec("none", "zero"),  # A = 0 (pure distillation: only OPD trains)
)}
TOKEN_REWARDS = tuple(n for n, e in SPECS.items() if e.token_rewards)  # for messages

KL_ESTIMATORS = ("k1", "k2", "k3")  # algos/kl.py approx_kl


def check_estimator(name: str) -> None:
    if name not in SPECS:
        raise ValueError(f"advantage_estimator = {name!r}; use one of {', '.join(SPECS)}")


def estimator_spec(name: str) -> EstimatorSpec:
    """The estimator named `name` (ValueError naming the choices otherwise)."""
    check_estimator(name)
    return SPECS[name]
