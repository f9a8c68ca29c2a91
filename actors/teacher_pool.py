"""The teacher-pool actor: the teacher registry, routing by domain, and server-mode scoring.

Sits between rollout and buffer (the rollout's `sink`): each SampleGroup arriving in the inbox
gets every sample routed to its teacher (`Sample.teacher`, by domain, else the default teacher,
else "" and counted in `opd/unrouted_samples`). Then:
- mode "server": each sample is scored by its teacher's inference server (an embedded worker
  named by `worker`, or any SGLang-compatible `url`) with `max_new_tokens = 0` and
  `logprob_start_len = len(prompt) - 1` (`top_logprobs_num = top_k` for top-k, kept as
  [response, k] int32 / float32 arrays that travel as tensor frames; SGLang answers
  null for the first token of that window, the last prompt token: logic/teachers.py), requests
  batched per teacher, with retries and a timeout; a sample whose teacher keeps failing, or
  whose reply is malformed (logged with the teacher and the sample), is marked
  (`teacher = ""`), counted in `opd/<teacher>/failed_samples`, and passed on: the run continues;
- mode "colocated": samples are only routed; the trainer runs the teachers on its own device
  from its weight memory (`training/colocated_teachers.py`).
The group then goes on to the buffer. Per teacher it publishes tokens scored, scoring time and
the sampled reverse-KL estimate mean(log pi_student - log pi_teacher) over the rollout's tokens.
A teacher declared with the student's tokenizer (the default) whose vocabulary differs is refused
before the run starts. One with its own (`tokenizer = "auto"` or a directory) is scored across
vocabularies: each sample is re-tokenized for it (logic/teachers.py `CrossVocab`: the request
carries the teacher's own token ids), and the teacher's scores are moved onto the student's
tokens by aligned character spans (`CrossVocab.onto_student`, algos/cross_tokenizer.py): each
student token of a span gets `teacher_logprobs = rollout log-prob - the span's difference`, so
the trainer's r_t is the span's, or with `span_credit = "prefix"` its causal share from the
teacher's top-k prefix probabilities (the request then asks `top_logprobs_num = prefix_top_k`);
top-k are mapped to student ids by token text at spans of one token on each side, and with opd
`uld_coef` the teacher's top-k at each other span's start travels for the sorted-probability
term (`Sample.teacher_sorted_*`). Per teacher it publishes `aligned_char_frac` (response
characters inside aligned spans), `aligned_spans_per_sample`, and for top-k `topk_matched_frac`
(policy tokens with a mapped set), `topk_dropped_mass` (the teacher's top-k probability without
a student token, per matched token) and `sorted_rows_frac` (policy tokens given the sorted
term). A colocated teacher of another vocabulary is scored the same way inside the trainer
(training/colocated_teachers.py).
Invariant: every group that arrives leaves, once, in arrival order per teacher batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import reprlib
import time
from collections.abc import Mapping
from types import MappingProxyType

from actors.teacher_pool_config import (  # noqa: F401 - the config: also read from here
    TeacherPoolConfig,
    TeacherPoolPlan,
    cross_teachers,
)
from engine.client import SglangClient
from logic.teachers import (
    CrossVocab,
    ScoreError,
    cross_metrics,
    parse_scores,
    route,
    route_table,
    score_request,
)
from transport.schema import TOPK_IDS_DTYPE, TOPK_LOGPROBS_DTYPE, Msg, Sample, SampleGroup

log = logging.getLogger(__name__)


class TeacherPool(TeacherPoolPlan):
    """The pool itself: its settings and launcher checks are `TeacherPoolPlan`'s
    (actors/teacher_pool_config.py)."""

    # teachers of another vocabulary than the student's (server mode), set at start
    cross: Mapping[str, CrossVocab] = MappingProxyType({})

    async def on_start(self) -> None:
        cfg = self.config
        self.table = route_table(cfg.teachers, cfg.default_teacher)
        self.clients: dict[str, SglangClient] = {}
        if cfg.mode == "server":
            for t in cfg.teachers:
                url = t.url or self.peer(t.worker).http
                self.clients[t.name] = SglangClient(url, timeout_s=cfg.request_timeout_s,
                                                    retries=cfg.max_retries)
                self._closers.append(self.clients[t.name].close)
        self.cross = cross_teachers(cfg, self.facts) if cfg.mode == "server" else {}
        self.coefs = {t.name: t.coef for t in cfg.teachers}
        self.out = self.stream_to(cfg.buffer)
        self.stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    async def on_inbox(self, msg: Msg) -> None:
        if not isinstance(msg, SampleGroup):
            self.counters["inbox.unexpected"] += 1
            return
        for s in msg.samples:
            s.teacher = route(s.domain, self.table, self.config.default_teacher)
            s.teacher_coef = self.coefs.get(s.teacher, 1.0)  # the trainer weighs by it
            if not s.teacher:
                self.counters["unrouted_samples"] += 1
        if self.clients:
            by_teacher: dict[str, list[Sample]] = collections.defaultdict(list)
            for s in msg.samples:
                if s.teacher and s.status == "ok":
                    by_teacher[s.teacher].append(s)
            await asyncio.gather(*(self._score(name, samples)
                                   for name, samples in by_teacher.items()))
        await self.out.send(msg)
        self._publish()

    async def _score(self, name: str, samples: list[Sample]) -> None:
        cfg = self.config
        k = cfg.opd.top_k if cfg.opd.mode == "top_k" else 0
        st = self.stats[name]
        t0 = time.perf_counter()
        for start in range(0, len(samples), cfg.max_batch):
            part = samples[start:start + cfg.max_batch]
            cross = self.cross.get(name)
            # "prefix" span credit reads the teacher's top-k prefix probabilities
            spec = next(t for t in cfg.teachers if t.name == name)
            prefix = cross is not None and spec.span_credit == "prefix"
            asked_k = max(k, spec.prefix_top_k) if prefix else k
            try:
                # a teacher of another vocabulary scores the sample in its own tokens
                asked = [cross.retokenize(s.prompt_ids, s.response_ids, s.loss_mask)
                         if cross else None for s in part]
                bodies = [score_request(r.prompt_ids if r else s.prompt_ids,
                                        r.response_ids if r else s.response_ids,
                                        self.facts.temperature, asked_k)
                          for s, r in zip(part, asked)]
                replies = await self.clients[name].generate(
                    [b["input_ids"] for b in bodies], bodies[0]["sampling_params"],
                    logprob_start_len=[b["logprob_start_len"] for b in bodies],
                    **({"top_logprobs_num": asked_k} if asked_k else {}))
                if not isinstance(replies, list) or len(replies) != len(part):
                    raise ScoreError(f"{len(part)} requests answered by {reprlib.repr(replies)}")
            except Exception as e:  # noqa: BLE001 - the teacher failed: mark, count, go on
                log.warning("teacher %s failed to score %d samples: %s", name, len(part), e)
                self._fail(name, part)
                continue
            for s, reply, r in zip(part, replies, asked):
                where = f"teacher {name!r}, sample {s.group_id}/{s.index}"
                try:
                    if r is None:
                        s.teacher_logprobs, s.teacher_topk_ids, s.teacher_topk_logprobs = \
                            parse_scores(reply, s.prompt_ids, s.response_ids, k, where)
                    else:
                        self._cross_scores(s, r, parse_scores(
                            reply, r.prompt_ids, r.response_ids, asked_k, where), cross, st,
                            k, prefix, cfg.opd.uld_coef > 0, spec.topk_map)
                except ScoreError as e:  # this reply only: the batch's others stand
                    log.warning("%s", e)
                    self._fail(name, [s])
                    continue
                for lp, tlp, m in zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask):
                    if m:
                        st["tokens"] += 1
                        st["kl_sum"] += lp - tlp
        st["time_s"] += time.perf_counter() - t0

    @staticmethod
    def _cross_scores(s: Sample, r, scores, cross: CrossVocab, st: collections.Counter,
                      top_k: int, prefix: bool, sorted_term: bool = False,
                      topk_map: str = "exact") -> None:
        """The teacher's scores of its own tokens moved onto the student's (module docstring),
        and the alignment's counts."""
        out = cross.onto_student(r, s.rollout_logprobs, s.response_ids, s.loss_mask, *scores,
                                 top_k, prefix, st, sorted_term, topk_map)
        s.teacher_logprobs = out.values.tolist()
        if out.topk is not None:
            s.teacher_topk_ids = out.topk.ids.astype(TOPK_IDS_DTYPE)
            s.teacher_topk_logprobs = out.topk.logprobs.astype(TOPK_LOGPROBS_DTYPE)
        if out.sorted_positions is not None:
            s.teacher_sorted_positions = out.sorted_positions.astype(TOPK_IDS_DTYPE)
            s.teacher_sorted_logprobs = out.sorted_logprobs.astype(TOPK_LOGPROBS_DTYPE)

    def _fail(self, name: str, samples: list[Sample]) -> None:
        """No signal for these samples: trained without distillation, counted per teacher."""
        for s in samples:
            s.teacher = ""
        self.stats[name]["failed_samples"] += len(samples)

    def _publish(self) -> None:
        if not self.metrics:
            return
        values = {"opd/unrouted_samples": float(self.counters["unrouted_samples"])}
        for name, st in self.stats.items():
            values[f"opd/{name}/tokens_scored"] = float(st["tokens"])
            values[f"opd/{name}/failed_samples"] = float(st["failed_samples"])
            values[f"opd/{name}/score_time_s"] = st["time_s"]
            if st["tokens"]:
                values[f"opd/{name}/sampled_reverse_kl"] = st["kl_sum"] / st["tokens"]
            values |= cross_metrics(name, st)
        self.metrics.publish(values)
