"""`HttpSession`: the envs.base.Session the rollout hands to an episode, over SGLang's HTTP API.

Invariant: the session's token lists stay aligned: `response_ids`, `loss_mask` and `logprobs`
grow together, policy tokens with mask 1 and the log-prob the server reported, observation tokens
with mask 0 and log-prob 0. A turn is retried (same input) when the server aborts it or the
connection fails, so a dying worker costs time, never a lost or duplicated turn.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from transport.schema import Sample

log = logging.getLogger(__name__)


class SessionFailed(RuntimeError):
    """A turn could not be generated within the retry budget."""


class HttpSession:
    def __init__(self, client: Any, tokenizer: Any, prompt: str, sampling: dict,
                 routing_key: str, max_new_tokens: int, retries: int = 3):
        self.client, self.tokenizer = client, tokenizer
        self.sampling, self.routing_key = sampling, routing_key
        self.max_new_tokens, self.retries = max_new_tokens, retries
        self.prompt_ids = encode_prompt(tokenizer, prompt)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.retried = 0
        self._prompt = prompt
        self._text: list[str] = []

    async def generate(self, max_new_tokens: int | None = None,
                       stop: list[str] | None = None) -> str:
        params = {**self.sampling, "max_new_tokens": max_new_tokens or self.max_new_tokens}
        if stop:
            params["stop"] = stop
        out = await self._generate_with_retries(params)
        ids = list(out["output_ids"])
        meta = out["meta_info"]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise SessionFailed(f"server returned {len(ids)} tokens but {len(lps)} log-probs")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += lps
        self.versions.append(weight_version(meta.get("weight_version")))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._text.append(text)
        return text

    async def _generate_with_retries(self, params: dict) -> dict:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                out = await self.client.generate(self.prompt_ids + self.response_ids, params,
                                                 return_logprob=True,
                                                 routing_key=self.routing_key)
                if out["meta_info"]["finish_reason"]["type"] != "abort":
                    return out
                last = SessionFailed(f"aborted: {out['meta_info']['finish_reason']}")
            except Exception as e:  # noqa: BLE001 - any transport failure is retried
                last = e
            self.retried += 1
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
        raise SessionFailed(f"generation failed after {self.retries + 1} attempts: {last}")

    def observe(self, text: str) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self._text.append(text)

    @property
    def transcript(self) -> str:
        return self._prompt + "".join(self._text)

    def to_sample(self, group_id: str, index: int, domain: str, reward: float,
                  status: str = "ok", error: str = "") -> Sample:
        return Sample(group_id=group_id, index=index, domain=domain, prompt_ids=self.prompt_ids,
                      response_ids=self.response_ids, loss_mask=self.loss_mask,
                      rollout_logprobs=self.logprobs, reward=float(reward),
                      weight_version=min(self.versions, default=0), status=status, error=error)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """BOS (when the tokenizer has one) followed by the prompt's tokens."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + list(ids)


def weight_version(value) -> int:
    """A reply's `meta_info.weight_version` as the trainer's version number. The trainer pushes
    str(version); a server that has had no push yet reports SGLang's default, the string
    "default" (or nothing): it serves the weights it was started from, which are version 0."""
    if value in (None, "", "default"):
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SessionFailed(f"weight_version {value!r} in the reply is no version this trainer "
                            f"pushed (they are integers)") from None
