"""A scripted `Session` (test double): plays given responses in order and records every segment.

Invariant: `transcript == prompt + "".join(text for text, _ in segments)`; each `generate()`
appends exactly one segment marked policy (True) and each `observe()` one marked not policy
(False). A response is cut just after the first stop string it contains (the stop string is kept,
as the policy did write it); an exhausted script answers "" (a policy that emits <eos> at once).
Token budgets are recorded in `calls`, not enforced.
"""

from __future__ import annotations

from typing import Iterable


class ScriptedSession:
    """Implements `envs.base.Session` from a list of responses."""

    def __init__(self, prompt: str, responses: Iterable[str]):
        if isinstance(responses, str):
            raise TypeError("responses must be a list of strings, not one string")
        self.prompt = prompt
        self.responses = list(responses)
        self.segments: list[tuple[str, bool]] = []  # (text, is_policy)
        self.calls: list[tuple[int | None, list[str] | None]] = []  # generate() arguments

    async def generate(self, max_new_tokens: int | None = None,
                       stop: list[str] | None = None) -> str:
        turn = len(self.calls)
        self.calls.append((max_new_tokens, None if stop is None else list(stop)))
        text = self.responses[turn] if turn < len(self.responses) else ""
        text = cut_at_stop(text, stop)
        self.segments.append((text, True))
        return text

    def observe(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"observe() takes text (str), got {type(text).__name__}")
        self.segments.append((text, False))

    @property
    def transcript(self) -> str:
        return self.prompt + "".join(text for text, _ in self.segments)

    @property
    def policy_text(self) -> str:
        """Everything the policy wrote (what the loss mask trains on)."""
        return "".join(text for text, is_policy in self.segments if is_policy)


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """`text` up to and including the earliest occurrence of any stop string."""
    ends = [text.find(s) + len(s) for s in stop or () if s and s in text]
    return text[:min(ends)] if ends else text
