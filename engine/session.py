"""`HttpSession`: the envs.base.Session the rollout hands to an episode, over SGLang's HTTP API.

Invariant: the session's token lists stay aligned: `response_ids`, `loss_mask` and `logprobs`
grow together, policy tokens with mask 1 and the log-prob the server reported, observation tokens
with mask 0 and log-prob 0. A turn is retried (same input) when the server aborts it or the
connection fails, so a dying worker costs time, never a lost or duplicated turn.

Agent episodes (docs/agents.md): with an `AgentLink`, `session.base_url` is the episode's
OpenAI-compatible endpoint (envs/openai_api.py) and the session is its backend. Token-exact
capture: every completion is generated from the session's own token lists and its sampled ids
and log-probs are appended verbatim (mask 1), never re-encoded from text. A request that extends
the previous one (its history renders as before, the assistant message it sends back is the one
returned, and the template renders the new messages after it) adds only the new text, tokenized
(mask 0): the template's closing of the assistant turn (what the model did not write of it),
then the new messages and the generation prompt. Any other request is a drift: by the rule
`split` (default) the session starts a new segment whose prompt is the request as rendered, and
the sample of the episode is its last segment (the earlier policy tokens are not trained on and
are counted); by the rule `fail` the same happens and the sample is marked failed.

Routed experts (`routed_experts=True`, mixture-of-experts policies): every turn asks for SGLang's
`return_routed_experts`; the answer's `meta_info.routed_experts` (base64 int32) covers every
position of the turn's input and output but the last token, so the last answer covers the whole
trajectory up to its last generated token and becomes the sample's `routed_experts` ([n, layers,
top_k], `routed_experts_dtype(num_experts)`); tokens after it (a final observation) have no row.
An answer without the field, or whose field does not decode to exactly that shape with expert
ids below num_experts, fails the episode (SessionFailed naming the field), never the rollout.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import functools
import logging
import math
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.chat_template import ChatFormat
from engine.drift import DRIFT_RULES
from engine.errors import SessionFailed, UnusableAnswer
from engine.nucleus import nucleus
from envs.openai_api import (
    AgentEndpoint,
    ChatRequest,
    Completion,
    CompletionRequest,
    OpenAIError,
    parse_tool_calls,
    same_assistant_message,
)
from models.moe_shape import MoeShape, moe_shape
from models.names import checkpoint_text_config
from transport.schema import NUCLEUS_IDS_DTYPE, NUCLEUS_LOGMASS_DTYPE, Sample, routed_experts_dtype

log = logging.getLogger(__name__)

# what `HttpSession.agent_stats` counts (the rollout publishes them as rollout/agent/<name>)
AGENT_STATS = ("episodes", "requests", "tool_calls", "drift_splits", "dropped_tokens", "refused",
               "sampling_overrides")


@dataclass
class AgentLink:
    """What a session needs to serve an OpenAI-compatible base_url (one per rollout)."""

    endpoint: AgentEndpoint  # started; sessions register on first `base_url`
    chat: ChatFormat  # renders chat requests (engine/chat_template.py)
    model_id: str = "policy"  # the model /v1/models lists
    drift: str = "split"  # DRIFT_RULES: what a request that does not extend the episode does

    def __post_init__(self):
        if self.drift not in DRIFT_RULES:
            raise ValueError(f"drift rule {self.drift!r}: use one of {DRIFT_RULES}")


@dataclass
class _Turn:
    """What the last agent request left: enough to tell whether the next one extends it."""

    kind: str  # "chat" | "text"
    rendered: str  # chat: the request rendered with its generation prompt; text: the prompt
    num_messages: int  # chat: messages in the request
    reply: dict  # chat: the assistant message returned (content, tool_calls)
    reply_text: str  # the text returned
    sampled: list[int]  # the completion's token ids


@dataclass
class _Plan:
    """How a request's context relates to the trajectory: "start" (first request: `ids` is the
    prompt), "extend" (`ids` are observation tokens to append) or "drift" (`ids` is the prompt
    of a new segment, for `reason`)."""

    kind: str
    ids: list[int]
    reason: str = ""


class HttpSession:
    def __init__(self, client: Any, tokenizer: Any, prompt: str, sampling: dict,
                 routing_key: str, max_new_tokens: int, retries: int = 3,
                 agent: AgentLink | None = None, honor_request_sampling: bool = False,
                 nucleus_top_logprobs: int = 0, lora: tuple[str, int] | None = None,
                 routed_experts: bool = False, moe: MoeShape | None = None):
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
        # agent episodes: the endpoint link, whether a request's temperature / top_p / seed
        # replace the rollout's (never in training: the trainer assumes the rollout's), what
        # the requests did (requests, tool_calls, drift_splits, dropped_tokens,
        # sampling_overrides, refused), why each drift happened, a failed generation
        self.agent = agent
        self.honor_request_sampling = honor_request_sampling
        self.agent_stats: collections.Counter = collections.Counter()
        self.drifts: list[str] = []
        self.generation_error: SessionFailed | None = None
        self._key: str | None = None
        self._turn: _Turn | None = None
        self._lock = asyncio.Lock()
        # the top-p nucleus of each sampled token (top_p OPD, top_p_replay): with
        # nucleus_top_logprobs = n > 0, turns sampled with top_p < 1 ask for the n top log-probs
        # of every output token and keep, per response token, (the nucleus' ids, log of its
        # mass); None once a policy turn had no nucleus (top_p = 1 or greedy): the sample then
        # carries none. A token whose nucleus the n top log-probs do not determine (it holds
        # more than n tokens, or the token is not among them) keeps an empty nucleus, the
        # episode goes on (dropping it would bias batches towards low-entropy text), and is
        # counted in `nucleus_fallback_tokens`; the trainer gives such a token the fallback of a
        # sample without a nucleus (training/colocated_teachers.py)
        self.nucleus_top_logprobs = nucleus_top_logprobs
        self.nucleus: list[tuple[list[int], float]] | None = [] if nucleus_top_logprobs else None
        self.nucleus_fallback_tokens = 0
        self._turn_params: dict = {}
        # a LoRA student: (the adapter every turn names in lora_path, its weight version); the
        # sample's version is the adapter's (a server reports its base weights' version)
        self.lora = lora
        # a mixture-of-experts policy: ask every turn for its routed experts and keep the last
        # answer's ([n, layers, k]); `moe` is the model's expert layout (default: read from the
        # config.json of the checkpoint directory the tokenizer was loaded from)
        self.routed_experts = routed_experts
        self.moe = (moe or tokenizer_expert_layout(tokenizer)) if routed_experts else None
        self.routes: np.ndarray | None = None
        self._turn_routes: np.ndarray | None = None

    async def generate(self, max_new_tokens: int | None = None,
                       stop: list[str] | None = None) -> str:
        params = {**self.sampling, "max_new_tokens": max_new_tokens or self.max_new_tokens}
        if stop:
            params["stop"] = stop
        out = await self._generate_with_retries(params, self.prompt_ids + self.response_ids)
        ids, _ = self._append_policy(out)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._text.append(text)
        return text

    def _append_policy(self, out: dict) -> tuple[list[int], list[float]]:
        ids = list(out["output_ids"])
        meta = out["meta_info"]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise UnusableAnswer(f"server returned {len(ids)} tokens but {len(lps)} log-probs")
        self._record_nucleus(ids, meta)
        version = weight_version(meta.get("weight_version"))  # when the request finished
        spans = meta.get("weight_version_spans")  # embedded engine, held across an update
        if spans:
            version = min(weight_version(v) for _, v in spans)
        if self.lora is not None:
            version = self.lora[1]
        if self.routed_experts:  # decoded with the answer (_generate_with_retries)
            self.routes, self._turn_routes = self._turn_routes, None
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += lps
        self.versions.append(version)
        return ids, lps

    async def _generate_with_retries(self, params: dict, input_ids: list[int],
                                     refuse_client_errors: bool = False) -> dict:
        """One turn from `input_ids`, retried on aborts and failures. With
        `refuse_client_errors` (agent requests) a 4xx answer is not retried: it becomes an
        OpenAI 400 for the agent (e.g. a prompt longer than the context)."""
        last: Exception | None = None
        self._turn_params = params  # what the turn was sampled with (_record_nucleus)
        extra = {"top_logprobs_num": self.nucleus_top_logprobs} if self._wants_nucleus() else {}
        if self.lora is not None:
            extra["lora_path"] = self.lora[0]
        if self.routed_experts:
            extra["return_routed_experts"] = True
        for attempt in range(self.retries + 1):
            out = None
            try:
                answer = await self.client.generate(input_ids, params, return_logprob=True,
                                                    routing_key=self.routing_key, **extra)
                finish = answer["meta_info"]["finish_reason"]
                if finish["type"] == "abort":
                    last = SessionFailed(f"aborted: {finish}")
                else:
                    out = answer
            except Exception as e:  # noqa: BLE001 - any transport failure is retried
                status = getattr(e, "status", None)
                if refuse_client_errors and isinstance(status, int) and 400 <= status < 500 \
                        and status not in (408, 429):
                    message = str(getattr(e, "message", e))
                    code = "context_length_exceeded" if "context length" in message else None
                    raise OpenAIError(400, f"the inference server refused the request: "
                                      f"{message}", param="messages", code=code) from e
                last = e
            if out is not None:
                if self.routed_experts:  # a wrong field fails the episode: not retried
                    self._turn_routes = self._decode_routes(out, len(input_ids))
                return out
            self.retried += 1
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
        raise SessionFailed(f"generation failed after {self.retries + 1} attempts: {last}")

    def _decode_routes(self, out: dict, context_len: int) -> np.ndarray:
        """The answer's routed experts: one row per position of the turn's input and output
        but the last token."""
        ids = out.get("output_ids")
        if not isinstance(ids, list):
            raise UnusableAnswer("the answer's output_ids is not a list (routed_experts cannot "
                                "be checked against it)")
        if "routed_experts" not in out["meta_info"]:
            raise UnusableAnswer("asked for routed_experts, but the answer's meta_info has none: "
                                "an SGLang server returns them for a mixture-of-experts model "
                                "when started with --enable-return-routed-experts")
        return decode_routed_experts(out["meta_info"]["routed_experts"],
                                     context_len + len(ids) - 1, self.moe)

    def _wants_nucleus(self) -> bool:
        p = self._turn_params
        return bool(self.nucleus_top_logprobs) and float(p.get("top_p", 1.0)) < 1.0 \
            and float(p.get("temperature", 1.0)) > 0.0

    def _record_nucleus(self, ids: list[int], meta: dict) -> None:
        """The nucleus of each of a turn's output tokens from its top log-probs (engine/sampling.py
        `nucleus`); an empty one, counted, where they do not determine it."""
        if self.nucleus is None:
            return
        if not self._wants_nucleus():
            self.nucleus = None  # a policy turn without a nucleus: the sample carries none
            return
        tops = meta.get("output_top_logprobs")
        if not isinstance(tops, list) or len(tops) != len(ids):
            raise UnusableAnswer(f"asked for top_logprobs_num = {self.nucleus_top_logprobs}, got "
                                f"output_top_logprobs for {len(tops or [])} of {len(ids)} tokens")
        top_p = float(self._turn_params["top_p"])
        for token, entries in zip(ids, tops):
            pairs = [(float(e[0]), int(e[1])) for e in entries or []]
            found = token_nucleus(token, pairs, top_p)
            if found is None:
                self.nucleus_fallback_tokens += 1
                found = ([], 0.0)
            self.nucleus.append(found)

    def nucleus_arrays(self) -> dict[str, np.ndarray]:
        """The Sample fields of the recorded nuclei ({} when there are none)."""
        if not self.nucleus or len(self.nucleus) != len(self.response_ids):
            return {}
        sizes = [len(ids) for ids, _ in self.nucleus]
        return {"rollout_nucleus_ids": np.array([t for ids, _ in self.nucleus for t in ids],
                                                dtype=NUCLEUS_IDS_DTYPE),
                "rollout_nucleus_offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(
                    NUCLEUS_IDS_DTYPE),
                "rollout_nucleus_logmass": np.array([m for _, m in self.nucleus],
                                                    dtype=NUCLEUS_LOGMASS_DTYPE)}

    def observe(self, text: str) -> None:
        self._observe_ids(self.tokenizer.encode(text, add_special_tokens=False), text)

    def _observe_ids(self, ids: list[int], text: str) -> None:
        if self.nucleus is not None:
            self.nucleus += [([], 0.0)] * len(ids)
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self._text.append(text)

    @property
    def transcript(self) -> str:
        return self._prompt + "".join(self._text)

    def to_sample(self, group_id: str, index: int, domain: str, reward: float,
                  status: str = "ok", error: str = "") -> Sample:
        if status == "ok" and self.drifts and self.agent and self.agent.drift == "fail":
            status, error = "failed", f"trajectory drift (rule 'fail'): {self.drifts[-1]}"
        return Sample(group_id=group_id, index=index, domain=domain, prompt_ids=self.prompt_ids,
                      response_ids=self.response_ids, loss_mask=self.loss_mask,
                      rollout_logprobs=self.logprobs, reward=float(reward),
                      weight_version=min(self.versions, default=0), status=status, error=error,
                      routed_experts=self.routes, **self.nucleus_arrays())

    # ------------------------------------------------------------------ the agent endpoint
    @property
    def model_id(self) -> str:
        return self.agent.model_id if self.agent else "policy"

    @property
    def base_url(self) -> str:
        """The episode's OpenAI-compatible base URL (valid until `close()`)."""
        if self.agent is None:
            raise RuntimeError("this session has no OpenAI-compatible endpoint (the rollout "
                               "gives one to every episode; outside it, pass an AgentLink)")
        if self._key is None:
            self._key = self.agent.endpoint.register(self)
            self.agent_stats["episodes"] += 1
        return self.agent.endpoint.base_url(self._key)

    def refused(self, error: OpenAIError) -> None:
        """The endpoint answered one of this episode's requests with a 4xx."""
        self.agent_stats["refused"] += 1
        log.info("agent episode %s: request refused: %s", self.routing_key, error.message)

    def close(self) -> None:
        """Forget the episode's base_url: later requests to it answer 404."""
        if self._key is not None and self.agent is not None:
            self.agent.endpoint.unregister(self._key)
        self._key = None

    async def chat_completion(self, req: ChatRequest) -> Completion:
        async with self._lock:
            self.agent_stats["requests"] += 1
            rendered = self._render(req.messages, req.tools, True)
            plan = self._plan_chat(req, rendered)
            ids, lps, finish = await self._complete(plan, req)
            text = self._visible(ids, finish)
            content, calls = text, []
            if req.tool_choice != "none":
                content, calls = parse_tool_calls(text, self.agent.chat.tool_format, req.tools)
            self._turn = _Turn("chat", rendered, len(req.messages),
                               {"role": "assistant", "content": content, "tool_calls": calls},
                               text, ids)
            self.agent_stats["tool_calls"] += len(calls)
            return self._completion(ids, lps, finish, text, content, calls)

    async def text_completion(self, req: CompletionRequest) -> Completion:
        async with self._lock:
            self.agent_stats["requests"] += 1
            plan = self._plan_text(req.prompt)
            ids, lps, finish = await self._complete(plan, req)
            text = self._visible(ids, finish)
            rendered = req.prompt if isinstance(req.prompt, str) else ""
            self._turn = _Turn("text", rendered, 0, {}, text, ids)
            return self._completion(ids, lps, finish, text, text, [])

    def _render(self, messages: list[dict], tools: list[dict] | None,
                add_generation_prompt: bool) -> str:
        try:
            return self.agent.chat.render(self.tokenizer, messages, tools, add_generation_prompt)
        except Exception as e:  # the template's own error (raise_exception, undefined, ...)
            raise OpenAIError(400, f"the chat template ({self.agent.chat.name}) cannot render "
                              f"these messages: {type(e).__name__}: {e}", param="messages") from e

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _plan_chat(self, req: ChatRequest, rendered: str) -> _Plan:
        turn = self._turn
        if turn is None or turn.kind != "chat":
            return self._plan_tokens(self._encode(rendered))
        n, msgs = turn.num_messages, req.messages
        drift = lambda why: _Plan("drift", self._encode(rendered), why)  # noqa: E731
        if len(msgs) <= n:
            return drift(f"the request has {len(msgs)} messages, the previous one had {n}: it "
                         f"does not continue the conversation")
        if not same_assistant_message(msgs[n], turn.reply):
            return drift(f"messages[{n}] is not the assistant message the previous completion "
                         f"returned")
        before = self._render(msgs[:n + 1], req.tools, False)
        if not before.startswith(turn.rendered):
            return drift("the conversation before the returned assistant message renders "
                         "differently than in the previous request (history edited, tools "
                         "changed, or the template renders it differently)")
        if not rendered.startswith(before):
            return drift("the template renders the returned assistant message differently once "
                         "more messages follow it")
        glue = self._glue(before[len(turn.rendered):], turn.sampled)
        return _Plan("extend", self._encode(glue + rendered[len(before):]))

    def _glue(self, section: str, sampled: list[int]) -> str:
        """What the template writes of the assistant turn after the sampled tokens: the rest of
        `section` (the turn as rendered) when the sampled text spells its start, else the
        template's closing less what the sampled text already ends with (its <eos>)."""
        said = self.tokenizer.decode(sampled, skip_special_tokens=False)
        if section.startswith(said):
            return section[len(said):]
        closing = self.agent.chat.closing
        for m in range(len(closing), 0, -1):
            if said.endswith(closing[:m]):
                return closing[m:]
        return closing

    def _plan_text(self, prompt: str | list[int]) -> _Plan:
        if isinstance(prompt, list):
            return self._plan_tokens(list(prompt))
        ids = encode_prompt(self.tokenizer, prompt)
        plan = self._plan_tokens(ids)
        turn = self._turn
        if plan.kind == "drift" and turn is not None and turn.kind == "text" and turn.rendered:
            before = turn.rendered + turn.reply_text
            if prompt.startswith(before):
                return _Plan("extend", self._encode(prompt[len(before):]))
        return plan

    def _plan_tokens(self, ids: list[int]) -> _Plan:
        """Start (nothing generated yet), extend (`ids` begins with the trajectory) or drift."""
        if self._turn is None and not self.response_ids:
            return _Plan("start", ids)
        so_far = self.prompt_ids + self.response_ids
        if ids[:len(so_far)] == so_far:
            return _Plan("extend", ids[len(so_far):])
        return _Plan("drift", ids, "the request's tokens do not begin with the episode's "
                     "tokens so far")

    async def _complete(self, plan: _Plan, req: ChatRequest | CompletionRequest
                        ) -> tuple[list[int], list[float], dict]:
        """Generate from the plan's context; the trajectory changes only once it succeeded."""
        if plan.kind == "extend":
            context = self.prompt_ids + self.response_ids + plan.ids
        else:
            context = plan.ids
        if not context:
            raise OpenAIError(400, "the prompt renders to no tokens", param="messages")
        try:
            out = await self._generate_with_retries(self._params(req), context,
                                                    refuse_client_errors=True)
        except SessionFailed as e:
            self.generation_error = e
            raise
        if plan.kind == "start":
            self.prompt_ids, self._prompt, self._text = plan.ids, self._decode(plan.ids), []
        elif plan.kind == "drift":
            self._split(plan)
        else:
            self._observe_ids(plan.ids, self._decode(plan.ids))
        ids, lps = self._append_policy(out)
        self._text.append(self._decode(ids))
        return ids, lps, out["meta_info"].get("finish_reason") or {}

    def _split(self, plan: _Plan) -> None:
        """Drift: the trajectory so far stops being the sample; a new segment starts."""
        self.agent_stats["drift_splits"] += 1
        self.agent_stats["dropped_tokens"] += sum(self.loss_mask)
        self.drifts.append(plan.reason)
        log.info("agent episode %s: drift (%s); a new segment starts", self.routing_key,
                 plan.reason)
        self.prompt_ids, self._prompt, self._text = plan.ids, self._decode(plan.ids), []
        self.response_ids, self.loss_mask, self.logprobs, self.versions = [], [], [], []
        self.routes = None  # the new segment's come with its answer
        if self.nucleus_top_logprobs:
            self.nucleus = []

    def _params(self, req: ChatRequest | CompletionRequest) -> dict:
        params = dict(self.sampling)
        overridden = False
        for key, value in (("temperature", req.temperature), ("top_p", req.top_p)):
            if value is None:
                continue
            if self.honor_request_sampling:
                params[key] = value
            elif value != params.get(key, 1.0):
                overridden = True
        if self.honor_request_sampling and req.seed is not None:
            params["sampling_seed"] = req.seed
        if overridden:
            self.agent_stats["sampling_overrides"] += 1
        params["max_new_tokens"] = req.max_tokens or self.max_new_tokens
        if req.stop:
            params["stop"] = list(req.stop)
        return params

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _visible(self, ids: list[int], finish: dict) -> str:
        """The text an OpenAI server returns: special tokens skipped, a matched stop trimmed."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        matched = finish.get("matched") if finish.get("type") == "stop" else None
        if isinstance(matched, str) and matched in text:
            text = text[:text.index(matched)]
        return text

    def _completion(self, ids: list[int], lps: list[float], finish: dict, text: str,
                    content: str | None, calls: list[dict]) -> Completion:
        reason = "tool_calls" if calls else ("length" if finish.get("type") == "length"
                                             else "stop")
        return Completion(text=text, finish_reason=reason,
                          prompt_tokens=len(self.prompt_ids) + len(self.response_ids) - len(ids),
                          completion_tokens=len(ids), content=content, tool_calls=calls,
                          token_texts=[self.tokenizer.decode([t]) for t in ids],
                          token_logprobs=lps)


def token_nucleus(token: int, pairs: list[tuple[float, int]], top_p: float
                  ) -> tuple[list[int], float] | None:
    """(ids, log mass <= 0) of the nucleus `token` was sampled from, from its top (logprob, id)
    pairs; None when they do not determine it (the nucleus holds more tokens than the pairs,
    or the token is not among them)."""
    found = nucleus(pairs, top_p)
    if found is None:
        return None
    members, log_mass = found
    if token not in members:  # tied or rounded at the boundary: extend to the token
        ranked = [t for _, t in sorted(pairs, key=lambda pair: -pair[0])]
        if token not in ranked:
            return None
        members = ranked[:ranked.index(token) + 1]
        log_mass = math.log(sum(math.exp(lp) for lp, t in pairs if t in members))
    return members, min(log_mass, 0.0)


def decode_routed_experts(value: Any, rows: int, moe: MoeShape) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of little-endian int32 [rows, layers, top_k])
    as an array of `routed_experts_dtype(num_experts)`; SessionFailed naming the field when it
    is not exactly that (its length is checked before anything is decoded)."""
    if not isinstance(value, str):
        raise UnusableAnswer(f"meta_info.routed_experts must be a base64 string, got "
                            f"{type(value).__name__}")
    count = rows * moe.num_layers * moe.top_k
    chars = 4 * -(-count * 4 // 3)
    if len(value) != chars:
        raise UnusableAnswer(f"meta_info.routed_experts has {len(value)} base64 characters; "
                            f"{rows} positions x {moe.num_layers} layers x {moe.top_k} experts "
                            f"(int32) take {chars}")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UnusableAnswer(f"meta_info.routed_experts is not valid base64: {e}") from None
    if len(raw) != 4 * count:
        raise UnusableAnswer(f"meta_info.routed_experts decodes to {len(raw)} bytes, not the "
                            f"{4 * count} of {rows} x {moe.num_layers} x {moe.top_k} int32 ids")
    ids = np.frombuffer(raw, dtype="<i4").reshape(rows, moe.num_layers, moe.top_k)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= moe.num_experts):
        raise UnusableAnswer(f"meta_info.routed_experts holds expert ids outside [0, "
                            f"{moe.num_experts}): {int(ids.min())}..{int(ids.max())}")
    return ids.astype(routed_experts_dtype(moe.num_experts))


def tokenizer_expert_layout(tokenizer: Any) -> MoeShape:
    """The expert layout of the model whose checkpoint directory `tokenizer` was loaded from
    (its config.json); ValueError when there is none (pass `moe=` to HttpSession instead)."""
    path = str(getattr(tokenizer, "name_or_path", "") or "")
    layout = checkpoint_expert_layout(path) if path else None
    if layout is None:
        raise ValueError(f"routed_experts: the model's expert layout is unknown (the tokenizer's "
                         f"name_or_path {path!r} is no checkpoint directory of a "
                         f"mixture-of-experts model); pass moe=models.moe.MoeShape")
    return layout


@functools.lru_cache(maxsize=16)
def checkpoint_expert_layout(path: str) -> MoeShape | None:
    """`models.moe.moe_shape` of a checkpoint directory's config.json (read as JSON: no model
    library needed); None for a dense model or no such file."""
    fields = checkpoint_text_config(path)
    if fields is None:
        return None
    try:
        return moe_shape(types.SimpleNamespace(**fields))
    except (AttributeError, TypeError):
        return None


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
        raise UnusableAnswer(f"weight_version {value!r} in the reply is no version this trainer "
                            f"pushed (they are integers)") from None
