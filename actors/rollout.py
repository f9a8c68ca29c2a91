"""The rollout actor: plays environment episodes against the inference endpoint.

For each batch it first gets a permit from the buffer (so it runs at most `max_staleness` weight
versions ahead of the trainer), then plays `group_size` episodes for each of `groups_per_batch`
tasks with at most `max_concurrency` episodes in flight, and streams each finished group to the
buffer. `/generate` goes to the router (sticky per episode through `X-SMG-Routing-Key`). An
episode whose environment raises becomes a `failed` sample, counted and passed on, never dropped;
so does one whose environment's own code (generation not counted: `GenerationClock`) runs past
`env_timeout_s`, named with its environment and task.
Every `eval_every` batches it scores the eval tasks of each domain greedily.

What a user reads: each batch's metrics record carries `samples_per_batch` of its episodes as
text (one per domain in turn), plus the first failed episode of each domain with its error, and
each evaluation's record carries every response it scored (`Metrics.samples`, texts cut by
transport/metrics.py `sample_record`); the launcher writes them to <run_dir>/samples/*.jsonl
and prints some (launch/console.py). Failed episodes are counted per batch as `rollout/failed`
and, those whose environment's own code failed (it raised or ran past `env_timeout_s`; not a
generation that failed on the workers), as `rollout/failed_env`; a sample record of a failed
episode says which in `cause` ("env" or "generation"). The launcher ends a run with failed
environment episodes with exit code 1 (launch/endings.py).

Accounting: `samples_generated` counts the samples of every training group handed to the sink
the first time (eval episodes are not), `samples_resent` those sent again to a restarted buffer.
Both are run totals kept in `<run_dir>/rollout/<name>.totals.json` (rewritten before each send,
so a restarted rollout goes on counting) and published with each batch. The buffer counts a
re-sent sample it already had as a copy, not as an added one (re-sends are requests, when the
buffer is the sink, so that it can tell them from new groups), so that after any fault
samples_generated = the buffer's added + what is still in flight to it, and added = emitted +
pending + dropped_* (`bench.faults` checks both). Through a teacher pool (`sink`) re-sends go the
way of every group, and the buffer counts the copies among them as dropped_duplicate.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from actors.rollout_config import (  # noqa: F401 - the config: also read from here
    EnvSpec,
    RolloutActorPlan,
    RolloutConfig,
)
from engine.chat_template import chat_format
from engine.client import SglangClient
from engine.errors import UnusableAnswer
from engine.session import (
    AGENT_STATS,
    AgentLink,
    HttpSession,
    SessionFailed,
    checkpoint_expert_layout,
)
from engine.weight_sync_plan import adapter_name
from envs.loader import load_envs
from envs.openai_api import AgentEndpoint
from models.moe_shape import TINY_MOE, MoeShape
from models.names import TINY_NAMES
from models.tokenizer_load import load_tokenizer
from runtime.actor import EndRun
from transport.errors import RlxError
from transport.metrics import sample_record
from transport.rpc import RemoteError
from transport.schema import EvalReply, EvalRequest, RolloutPermit, SampleGroup

log = logging.getLogger(__name__)


NO_SIGNAL_NOTICE_S = 600.0  # a domain without learning signal is said at most this often


def expert_layout(model: str, tokenizer: Any) -> MoeShape:
    """The expert layout of the run's policy (a tiny name's config, else the checkpoint's
    config.json); ValueError naming the fix for a dense model."""
    shape = TINY_MOE.get(model) if model in TINY_NAMES else \
        checkpoint_expert_layout(str(getattr(tokenizer, "name_or_path", "") or ""))
    if shape is None:
        raise ValueError(f"routed_experts = true but the model {model!r} has no routed experts "
                         f"(a dense model): remove `moe` from [rl] (or routed_experts from the "
                         f"rollout's table)")
    return shape


class EpisodeTimeout(RlxError):
    """An episode's environment ran its own code past `env_timeout_s`."""


class GenerationClock:
    """A client of the inference endpoint for one episode that keeps the time spent waiting on
    generation, so that the rest of the episode's time is the environment's own."""

    def __init__(self, client):
        self._client = client
        self._done_s, self._active, self._since = 0.0, 0, 0.0

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def generate(self, *args, **kwargs):
        if not self._active:
            self._since = time.monotonic()
        self._active += 1
        try:
            return await self._client.generate(*args, **kwargs)
        finally:
            self._active -= 1
            if not self._active:
                self._done_s += time.monotonic() - self._since

    def generating_s(self) -> float:
        """Seconds spent in generate() calls so far, the one in progress included."""
        return self._done_s + (time.monotonic() - self._since if self._active else 0.0)


async def run_episode(env, task, session, clock: GenerationClock, limit_s: float) -> float:
    """`env.episode(task, session)`, abandoned (EpisodeTimeout) once the time it spent outside
    generation passes `limit_s` (0: never)."""
    run = asyncio.ensure_future(env.episode(task, session))
    started = time.monotonic()
    try:
        while limit_s and not run.done():
            own_s = time.monotonic() - started - clock.generating_s()
            if own_s >= limit_s:
                raise EpisodeTimeout(
                    f"{type(env).__name__} ran its own code (reward(), tools; generation not "
                    f"counted) for more than env_timeout_s = {limit_s:g} s; the episode was "
                    f"dropped as failed: make it return sooner, or raise [rollout] "
                    f"env_timeout_s")
            await asyncio.wait({run}, timeout=limit_s - own_s)
        return await run
    finally:
        if not run.done():
            run.cancel()


class RolloutTotals(msgspec.Struct):
    """What the rollout handed on over the whole run, all its processes together
    (`<run_dir>/rollout/<name>.totals.json`)."""

    samples_generated: int = 0  # samples of training groups sent to the sink, the first time
    samples_resent: int = 0  # samples sent again to a restarted buffer
    starts: int = 0  # rollout processes that counted here (a restart adds one)


class RolloutActor(RolloutActorPlan):
    """The rollout itself: its settings and launcher checks are `RolloutActorPlan`'s
    (actors/rollout_config.py)."""

    def __init__(self, ctx, config=None):
        super().__init__(ctx, config)
        cfg = self.config
        self.failed_batches, self.last_notice, self.last_failure = 0, -1e9, ""
        self.moe: MoeShape | None = None  # the policy's expert layout (routed_experts asked)
        self.env_errors = 0  # episodes of the current batch the environment failed
        self.answer_errors = 0  # episodes of the current batch whose answer was unusable
        # the last groups sent, re-sent to a restarted buffer
        self.sent: collections.deque = collections.deque(
            maxlen=cfg.resend_batches * cfg.groups_per_batch)
        self.buffer_epoch = ""
        self.totals = RolloutTotals()
        self.totals_path: Path | None = None  # where they are kept (none without a run dir)
        self.agent: AgentLink | None = None  # the episodes' OpenAI-compatible endpoint
        self.agent_batch: collections.Counter = collections.Counter()  # its counts, this batch
        self.no_signal: collections.Counter = collections.Counter()  # batches in a row, by domain
        self.no_signal_said: dict[str, float] = {}  # when it was last said, by domain
        self.last_eval: tuple[int, dict[str, float], dict[str, int]] | None = None
        self.serving_version = 0  # the newest weight version the workers hold (LoRA: adapter)
        self.eval_lock = asyncio.Lock()  # one evaluation at a time
        # "<group id>-<index>" of episodes whose environment failed (cleared per batch / eval)
        self.env_failed: set[str] = set()

    async def on_start(self) -> None:
        cfg = self.config
        self.envs = load_envs([msgspec.to_builtins(e) for e in cfg.envs])
        self.tokenizer = load_tokenizer(self.facts.model)
        # a MoE policy's expert layout, to read the workers' routed experts (None: not asked)
        self.moe = expert_layout(self.facts.model, self.tokenizer) if cfg.routed_experts \
            else None
        self.client = SglangClient(self.peer(cfg.router).http, timeout_s=cfg.request_timeout_s)
        self._closers.append(self.client.close)
        self.buffer = await self.connect(cfg.buffer)
        self.out = self.stream_to(cfg.sink or cfg.buffer)
        self.gate = asyncio.Semaphore(cfg.max_concurrency)
        await self.start_agent_endpoint()
        if self.ctx.run_dir:
            self.totals_path = Path(self.ctx.run_dir) / "rollout" / f"{self.name}.totals.json"
            if self.totals_path.exists():
                try:
                    self.totals = msgspec.json.decode(self.totals_path.read_bytes(),
                                                      type=RolloutTotals)
                except msgspec.DecodeError as e:
                    raise ValueError(f"{self.totals_path}: not the rollout's totals ({e}); "
                                     f"remove it to count from 0 (bench.faults' accounting of "
                                     f"this run is then off)") from None
        self.totals.starts += 1
        self._save_totals()

    async def start_agent_endpoint(self) -> None:
        """Serve every episode's `session.base_url` (one HTTP server on 127.0.0.1)."""
        cfg = self.config
        endpoint = AgentEndpoint()
        self.agent = AgentLink(endpoint, chat_format(self.tokenizer, cfg.chat_template),
                               model_id=self.facts.model, drift=cfg.agent_drift)
        await endpoint.start()
        self._closers.append(endpoint.close)

    def rpc_handlers(self):
        return {EvalRequest: self.eval_request}

    async def eval_request(self, msg: EvalRequest) -> EvalReply:
        scores, counts = await self.evaluate(msg.step)
        return EvalReply(scores=scores, num_tasks=counts)

    async def run(self) -> None:
        cfg = self.config
        async with self.waiting_for(f"{cfg.buffer}'s first permit", cfg.permit_timeout_s,
                                    "permit_timeout_s"):
            first = await self.call_retrying(
                self.buffer, RolloutPermit(batch_index=0, position_only=True),
                cfg.permit_timeout_s)
        self.buffer_epoch = first.buffer_epoch
        batch_index = first.start_batch
        tasks = self.envs.tasks("train", cfg.seed)
        tasks = itertools.islice(tasks, batch_index * cfg.groups_per_batch, None)
        while cfg.num_batches == 0 or batch_index < cfg.num_batches:
            async with self.waiting_for(f"{cfg.buffer}'s permit for batch {batch_index}",
                                        cfg.permit_timeout_s, "permit_timeout_s"):
                permit = await self.call_retrying(
                    self.buffer, RolloutPermit(batch_index=batch_index), cfg.permit_timeout_s)
            await self._resend_if_buffer_restarted(permit.buffer_epoch)
            self.serving_version = max(self.serving_version, permit.trainer_version)
            if cfg.eval_every and batch_index % cfg.eval_every == 0:
                await self.evaluate(permit.trainer_version)
            batch = [next(tasks) for _ in range(cfg.groups_per_batch)]
            t0 = time.monotonic()
            groups = await asyncio.gather(*(self.play_group(task, f"b{batch_index}-g{j}")
                                            for j, task in enumerate(batch)))
            self.report(batch_index, permit.trainer_version, groups, time.monotonic() - t0,
                        batch)
            self.check_failures(batch_index, groups)
            self.check_signal(batch_index, groups)
            batch_index += 1

    async def play_group(self, task, group_id: str) -> list:
        cfg = self.config
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p}
        samples = await asyncio.gather(*(self.play(task, sampling, group_id, i)
                                         for i in range(cfg.group_size)))
        await self.send_group(SampleGroup(samples=list(samples), temperature=cfg.temperature,
                                          top_p=cfg.top_p))
        return list(samples)

    async def send_group(self, group: SampleGroup) -> None:
        """Hand a new group to the sink: counted (and the count kept) first, so a process
        killed here leaves it counted and in flight, never delivered and uncounted."""
        self.sent.append(group)
        self.totals.samples_generated += len(group.samples)
        self._save_totals()
        await self.out.send(group)

    async def _resend_if_buffer_restarted(self, epoch: str) -> None:
        """A new buffer process may have lost groups in flight to the old one: send the recent
        ones again. When the buffer is the sink they go as requests (`BufferActor.resend`), so
        that it counts the ones it restored from its journal as copies, not as new samples;
        else through the sink, as they went the first time, marked `resent` for the same count
        (a teacher pool between scores them again and passes the mark on)."""
        if epoch == self.buffer_epoch:
            return
        cfg = self.config
        self.buffer_epoch = epoch
        groups = list(self.sent)
        self.counters["resent_groups"] += len(groups)
        log.info("%s: the buffer restarted; re-sending %d recent groups", self.name, len(groups))
        to_buffer = cfg.sink in ("", cfg.buffer)
        for group in groups:
            if not to_buffer:  # marked, so that the buffer counts it as a re-send on arrival
                self.totals.samples_resent += len(group.samples)
                self._save_totals()
                await self.out.send(msgspec.structs.replace(group, resent=True))
                continue
            try:
                await self.call_retrying(self.buffer, group, cfg.permit_timeout_s)
            except RemoteError as e:  # refused as its first copy was: nothing to take again
                self.counters["resend_refused"] += 1
                log.warning("%s: the buffer refused re-sent group %s: %s", self.name,
                            group.samples[0].group_id, e)
                continue
            self.totals.samples_resent += len(group.samples)  # acknowledged: in its books
            self._save_totals()

    def _save_totals(self) -> None:
        """Write the run totals (temp file, then rename: a kill leaves the old or the new)."""
        if self.totals_path is None:
            return
        self.totals_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.totals_path.with_name(self.totals_path.name + ".tmp")
        tmp.write_bytes(msgspec.json.encode(self.totals))
        os.replace(tmp, self.totals_path)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"totals.{k}": v for k, v in
                                    msgspec.structs.asdict(self.totals).items()}}

    def _adapter(self) -> tuple[str, int] | None:
        """A LoRA student's run: the adapter of the newest version the workers hold (the
        buffer's permits and eval requests say it: the trainer pushes before it announces)."""
        if self.facts.lora is None:
            return None
        return adapter_name(self.serving_version), self.serving_version

    async def play(self, task, sampling: dict, group_id: str, index: int):
        env = self.envs.env_for(task)
        domain = task.domain or env.domain
        clock = GenerationClock(self.client)
        session = HttpSession(clock, self.tokenizer, task.prompt, sampling,
                              routing_key=f"{group_id}-{index}",
                              max_new_tokens=getattr(env, "max_new_tokens", 0)
                              or self.config.max_new_tokens, retries=self.config.retries,
                              agent=self.agent,
                              nucleus_top_logprobs=self.config.nucleus_top_logprobs,
                              lora=self._adapter(),
                              routed_experts=self.moe is not None, moe=self.moe)
        async with self.gate:
            try:
                reward = await run_episode(env, task, session, clock, self.config.env_timeout_s)
                self.counters["episodes"] += 1
                self.counters["turn_retries"] += session.retried
                return session.to_sample(group_id, index, domain, reward)
            except Exception as e:  # an env or generation failure fails this sample only
                self.counters["episodes_failed"] += 1
                self.counters[f"episodes_failed/{domain}"] += 1
                self.counters["episodes_timed_out"] += isinstance(e, EpisodeTimeout)
                # the environment's own failure (an agent's error after a failed generation
                # is the workers', as a SessionFailed is)
                if not isinstance(e, SessionFailed) and session.generation_error is None:
                    self.env_errors += 1
                    self.env_failed.add(f"{group_id}-{index}")
                elif isinstance(e, UnusableAnswer) or isinstance(session.generation_error,
                                                                  UnusableAnswer):
                    self.answer_errors += 1  # the workers answer, unusably: not transient
                self.last_failure = (f"{domain} task {task.id!r} (episode {group_id}-{index}): "
                                     f"{type(e).__name__}: {e}")
                log.warning("%s: episode %s-%d failed: %s", self.name, group_id, index, e)
                return session.to_sample(group_id, index, domain, 0.0, status="failed",
                                         error="".join(traceback.format_exception_only(e)))
            finally:
                session.close()
                self.counters["nucleus_fallback_tokens"] += session.nucleus_fallback_tokens
                for key, n in session.agent_stats.items():
                    self.counters[f"agent/{key}"] += n
                    if not group_id.startswith("eval"):
                        self.agent_batch[key] += n

    async def evaluate(self, version: int) -> tuple[dict[str, float], dict[str, int]]:
        """Greedy reward on the first `eval_tasks` eval tasks of each domain, with the weights of
        trainer version `version` (the workers hold it), published as `eval/<domain>` at that
        step. Greedy decoding of the same weights gives the same result, so the version last
        scored is not scored (nor published) again: the final evaluation after the last step is
        not a second record when a periodic one already scored that version."""
        async with self.eval_lock:  # the final request and a periodic eval of one version:
            # the second waits for the first and gets its scores (the same episode ids at once
            # would mix up which of their failures were the environment's)
            if self.last_eval is not None and self.last_eval[0] == version:
                return self.last_eval[1], self.last_eval[2]
            return await self._evaluate(version)

    async def _evaluate(self, version: int) -> tuple[dict[str, float], dict[str, int]]:
        self.serving_version = max(self.serving_version, version)
        cfg = self.config
        by_domain: dict[str, list] = {}
        for task in self.envs.tasks("eval", cfg.seed):
            domain = task.domain or self.envs.env_for(task).domain
            if len(by_domain.setdefault(domain, [])) < cfg.eval_tasks:
                by_domain[domain].append(task)
        greedy = {"temperature": 0.0}
        scores: dict[str, float] = {}
        played: list[tuple] = []  # (sample, task) of every eval episode
        for domain, tasks in by_domain.items():
            samples = await asyncio.gather(*(self.play(t, greedy, f"eval{version}-{i}", 0)
                                             for i, t in enumerate(tasks)))
            scores[domain] = sum(s.reward for s in samples) / max(1, len(samples))
            played += zip(samples, tasks)
        if self.metrics:
            records = [self.sample_text("eval", s, t) for s, t in played]
            self.env_failed -= {f"{s.group_id}-{s.index}" for s, _ in played}
            self.metrics.publish({f"eval/{d}": v for d, v in scores.items()}, step=version,
                                 samples=records)
        log.info("%s: eval of weight version %d: %s", self.name, version, scores)
        self.last_eval = (version, scores, {d: len(t) for d, t in by_domain.items()})
        return self.last_eval[1], self.last_eval[2]

    def check_signal(self, batch_index: int, groups: list) -> None:
        """A domain whose groups all scored the same within each group (every reward 0, or
        every one 1) gives GRPO nothing to learn from: said once it lasted `no_signal_batches`
        batches in a row, with two of its responses; again only if it happens again
        `NO_SIGNAL_NOTICE_S` later (a domain that flickers is said once, not every time)."""
        limit = self.config.no_signal_batches
        if not limit:
            return
        flat: dict[str, list] = {}
        for g in groups:
            ok = [s for s in g if s.status == "ok"]
            if ok:
                flat.setdefault(ok[0].domain, []).append(ok)
        for domain, domain_groups in flat.items():
            if any(len({s.reward for s in g}) > 1 for g in domain_groups):
                self.no_signal[domain] = 0
                continue
            self.no_signal[domain] += 1
            now = time.monotonic()
            if self.no_signal[domain] != limit or \
                    now - self.no_signal_said.get(domain, -1e9) < NO_SIGNAL_NOTICE_S:
                continue
            self.no_signal_said[domain] = now
            rewards = sorted({s.reward for g in domain_groups for s in g})
            examples = "; ".join(self.describe(g[0]) for g in domain_groups[:2])
            self.notify(f"no learning signal in domain {domain!r} for {limit} batches (up to "
                        f"batch {batch_index}): in each of its groups every sample got the same "
                        f"reward ({', '.join(f'{r:g}' for r in rewards)}), so its advantages "
                        f"are 0. Check the verifier and the task difficulty; two responses: "
                        f"{examples}")

    def describe(self, sample) -> str:
        """`prompt -> response (reward r)`, decoded, each cut to 60 characters."""
        def text(ids: list[int]) -> str:
            t = self.tokenizer.decode(ids, skip_special_tokens=True)
            return repr(t if len(t) <= 60 else t[:57] + "...")
        return (f"{text(sample.prompt_ids)} -> {text(sample.response_ids)} "
                f"(reward {sample.reward:g})")

    def check_failures(self, batch_index: int, groups: list) -> None:
        """Failing episodes reach the console (per domain, with the last exception and task);
        `max_failed_batches` batches in a row with no successful group and an environment
        error end the run."""
        failed = [s for g in groups for s in g if s.status != "ok"]
        dead_groups = sum(all(s.status != "ok" for s in g) for g in groups)
        # a batch counts as dead when every group failed and the environment raised (workers
        # that are down fail generation instead: that ends when they are back, not the run)
        env_errors, self.env_errors = self.env_errors, 0
        # so do answers the rollout cannot use (asking again gets the same answer)
        answer_errors, self.answer_errors = self.answer_errors, 0
        dead = dead_groups == len(groups) and env_errors + answer_errors > 0
        self.failed_batches = self.failed_batches + 1 if dead else 0
        limit = self.config.max_failed_batches
        if limit and self.failed_batches >= limit:
            raise EndRun(f"every episode of {limit} consecutive batches failed (batch "
                         f"{batch_index}); last failure: {self.last_failure}; fix the "
                         f"environment (or the workers' answers) or raise rollout "
                         f"max_failed_batches")
        now = time.monotonic()
        if failed and now - self.last_notice >= self.config.failure_notice_interval_s:
            self.last_notice = now
            by_domain = collections.Counter(s.domain for s in failed)
            total = sum(len(g) for g in groups)
            self.notify(f"{len(failed)}/{total} episodes failed in batch {batch_index} ("
                        + ", ".join(f"{d}: {n}" for d, n in sorted(by_domain.items()))
                        + f"); last: {self.last_failure}")

    def sample_text(self, kind: str, sample, task):
        """`sample` (of `task`) as a SampleRecord: decoded text, cut (transport/metrics.py)."""
        episode = f"{sample.group_id}-{sample.index}"
        cause = ""
        if sample.status != "ok":
            cause = "env" if episode in self.env_failed else "generation"
        env = type(self.envs.env_for(task)).__name__ if task is not None else ""
        return sample_record(
            kind, domain=sample.domain, prompt=task.prompt if task is not None else
            self.tokenizer.decode(sample.prompt_ids, skip_special_tokens=True),
            response=self.tokenizer.decode(sample.response_ids, skip_special_tokens=True),
            reward=sample.reward, weight_version=sample.weight_version, status=sample.status,
            error=sample.error.strip(), task=str(task.id) if task is not None else "", env=env,
            episode=episode, cause=cause)

    def batch_samples(self, groups: list, tasks: list) -> list:
        """What of a batch goes to the launcher as text: the first failed episode of each
        domain, then `samples_per_batch` episodes taken one per domain in turn (each group's
        first successful one)."""
        failed: dict[str, tuple] = {}
        ok: dict[str, list[tuple]] = {}
        for group, task in zip(groups, tasks):
            for s in group:
                if s.status != "ok":
                    failed.setdefault(s.domain, (s, task))
            first = next((s for s in group if s.status == "ok"), None)
            if first is not None:
                ok.setdefault(first.domain, []).append((first, task))
        picked = list(failed.values())
        want = self.config.samples_per_batch
        for turn in range(max((len(v) for v in ok.values()), default=0)):
            for domain in sorted(ok):
                if want <= 0:
                    break
                if turn < len(ok[domain]):
                    picked.append(ok[domain][turn])
                    want -= 1
        return [self.sample_text("rollout", s, t) for s, t in picked]

    def report(self, batch_index: int, trainer_version: int, groups: list, wall_s: float,
               tasks: list | None = None) -> None:
        samples = [s for g in groups for s in g]
        tokens = sum(sum(s.loss_mask) for s in samples)
        env_failed = sum(f"{s.group_id}-{s.index}" in self.env_failed for s in samples)
        values: dict[str, float] = {"rollout/tokens_per_s": tokens / max(wall_s, 1e-9),
                                    "rollout/batch_s": wall_s,
                                    "rollout/failed": sum(s.status != "ok" for s in samples),
                                    "rollout/failed_env": env_failed,
                                    "rollout/trainer_version": trainer_version,
                                    "rollout/samples_generated": self.totals.samples_generated,
                                    "rollout/samples_resent": self.totals.samples_resent,
                                    "rollout/nucleus_fallback_tokens":
                                        self.counters["nucleus_fallback_tokens"]}
        for domain in sorted({s.domain for s in samples}):
            mine = [s for s in samples if s.domain == domain]
            values[f"rollout/reward/{domain}"] = sum(s.reward for s in mine) / len(mine)
            values[f"rollout/response_len/{domain}"] = sum(
                len(s.response_ids) for s in mine) / len(mine)
            values[f"rollout/failed/{domain}"] = sum(s.status != "ok" for s in mine)
        if self.agent_batch:  # the batch's agent episodes (docs/agents.md)
            values.update({f"rollout/agent/{k}": self.agent_batch[k] for k in AGENT_STATS})
            self.agent_batch.clear()
        if self.metrics:
            records = self.batch_samples(groups, tasks or [None] * len(groups))
            self.metrics.publish(values, step=batch_index, samples=records)
        self.env_failed -= {f"{s.group_id}-{s.index}" for s in samples}
