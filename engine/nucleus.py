"""The top-p nucleus of a sampled token from its top log-probs (plain Python, no torch): what the
engine reports per token (engine/sampling.py) and the rollout's session records per response
token (engine/session.py), so a process that only reads answers needs no tensor library."""

from __future__ import annotations

import math


def nucleus(top: list[tuple[float, int]], top_p: float) -> tuple[list[int], float] | None:
    """The top-p nucleus from a token's top (logprob, token_id) pairs at the sampling
    temperature (as engine/sampling.py `top_list` gives them, or SGLang's
    `output_top_logprobs`): the ids of the shortest most-likely-first prefix whose probability
    reaches top_p (the set engine/sampling.py `filter_probs` samples from) and the log of that
    prefix's mass; None when the pairs end before the mass reaches top_p (the nucleus holds more
    tokens than were returned)."""
    ids: list[int] = []
    mass = 0.0
    for lp, token in sorted(top, key=lambda pair: -pair[0]):
        ids.append(int(token))
        mass += math.exp(lp)
        if mass >= top_p:
            return ids, math.log(mass)
    return None
