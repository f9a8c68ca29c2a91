"""The environment API users write against.

An environment hands out tasks (`tasks()`) and plays one episode per sample (`episode()`) through
a `Session`, the rollout's handle on the policy. The session owns the token sequence: every
`generate()` appends policy tokens (trained on: loss mask 1, with their rollout log-probs and the
weight version that produced them); every `observe()` appends tool/observation tokens (not trained
on: loss mask 0). The episode returns the reward. Single-turn environments only implement
`reward()`; `SingleTurnEnv.episode` does the rest, calling `reward()` in a thread of its own
(`in_thread`), so that a slow or hung verifier never stalls the rollout's event loop (its
heartbeats, the other episodes) and the rollout's `env_timeout_s` can give up on it.

Invariant: an environment never sees token ids or log-probs unless it asks; it works on text, so
the same environment runs against the embedded worker and against SGLang.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol


@dataclass(frozen=True)
class Task:
    """One prompt. `id` is unique within the environment; `answer` is for the verifier only."""

    id: str
    prompt: str
    answer: Any = None
    domain: str = ""  # defaults to the environment's domain
    info: dict[str, Any] = field(default_factory=dict)


class Session(Protocol):
    """The policy, as an episode sees it (implemented by the rollout actor)."""

    async def generate(self, max_new_tokens: int | None = None,
                       stop: list[str] | None = None) -> str:
        """Sample a continuation of everything so far; returns its text (trained on)."""
        ...

    def observe(self, text: str) -> None:
        """Append text the policy did not write (tool output, user turn); never trained on."""
        ...

    @property
    def transcript(self) -> str:
        """Prompt plus everything appended so far, as text."""
        ...

    @property
    def base_url(self) -> str:
        """The episode's OpenAI-compatible endpoint, for agents written against the `openai`
        client: `openai.AsyncOpenAI(base_url=session.base_url, api_key="unused")`. Completions
        requested there are sampled from the episode's tokens and recorded exactly as sampled
        (docs/agents.md: what is captured, and what happens when a request edits history).
        Valid until the episode ends."""
        ...


class Environment(abc.ABC):
    """Subclass and give `domain`; implement `tasks()` and `episode()` (or use SingleTurnEnv)."""

    domain: str = "default"
    max_new_tokens: int = 32  # default generation budget per turn

    def __init__(self, **options: Any):
        """Options come from hosts.toml ([env] table, `options = {...}`)."""
        self.options = options

    @abc.abstractmethod
    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        """Tasks in a deterministic order for (split, seed); may be endless for split="train"."""

    @abc.abstractmethod
    async def episode(self, task: Task, session: Session) -> float:
        """Play one episode through `session` and return its reward."""


class SingleTurnEnv(Environment):
    """One prompt, one response, a verifier: implement `tasks()` and `reward()`."""

    stop: list[str] | None = None

    async def episode(self, task: Task, session: Session) -> float:
        response = await session.generate(self.max_new_tokens, self.stop)
        return float(await in_thread(self.reward, task, response))

    @abc.abstractmethod
    def reward(self, task: Task, response: str) -> float:
        """Score the response text (e.g. 1.0 if correct else 0.0)."""


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run in a new daemon thread, awaited: the event loop goes on meanwhile, and a
    caller that stops waiting (a timeout) leaves a call that never returns behind without
    keeping the process from exiting (a pool's threads would be joined at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    call = contextvars.copy_context().run

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def work() -> None:
        try:
            result, error = call(fn, *args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while the call ran: nobody waits for it
            pass

    threading.Thread(target=work, name=f"env:{getattr(fn, '__qualname__', 'call')}",
                     daemon=True).start()
    return await done
