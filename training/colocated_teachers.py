"""Distillation inside the trainer: colocated teachers on weight memory, and the OPD inputs.

`ColocatedTeachers` holds every teacher as a weight set of `memory.WeightMemory` (tags
`teacher:<name>`): the device tier has `gpu_slots` fixed slots (fewer than teachers forces
switching), the host tier a byte budget, the rest waits on NVMe (loaded within that budget from
the start, by training/teacher_weights.py: a teacher the host cannot hold goes from its
checkpoint straight to NVMe, its checkpoint registered as its source). A teacher computes through a
skeleton of its architecture whose parameters live on the meta device: `torch.func.functional_call`
runs it on the tensors of whatever slot holds that teacher, so teachers of another size or
architecture than the student work.

Streaming (`OpdSignals`, one per step): the teacher forward of a micro-batch runs inside the
policy pass, in that micro-batch's loss callback, just before its OPD terms are built, and its
logits are dropped once they are (the loss-term functions keep gathered values or the gradient,
never the teacher's logits): no teacher output of the step ever exists for more than one
micro-batch at a time. The micro-batches run in teacher order (`micro_batch_order`: teachers
already in a slot first, then first appearance; a micro-batch holding two teachers between
them), so each teacher is switched in once per step in the common case, and that switch order is
declared to the planner before the pass (Belady eviction, the next teacher prefetched while the
current one computes; the buffer's hint of the next step's teachers, put in the order that step
will run them, extends the plan across the step boundary). A teacher computes
only its own rows of a micro-batch, and only at response positions (its output head sees the
response positions' hidden states), in its own dtype.

`OpdSignals.inputs(j)` turns teacher outputs (colocated forwards, or the teacher pool's server
replies in `Sample.teacher_*`) and the rollout's recorded nuclei (`Sample.rollout_nucleus_*`)
into micro-batch j's `OpdInputs`. With `top_p_replay` a colocated `sampled` teacher's log-prob
of each token is renormalised over that token's recorded nucleus, as the student's is
(algos/opd.py, top-p replay); a server's reply is the whole-vocabulary log-prob, so r_t then
pairs it with the student's whole-vocabulary one. A policy token whose record is empty (its
nucleus held more tokens than the rollout's top log-probs: engine/session.py) has no nucleus: it
takes the fallback of a sample without a record, and is counted (`nucleus_fallback_tokens`).
Invariant: a sample with no teacher signal (unrouted, or its teacher failed) contributes nothing
to any OPD term.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from algos.cross_tokenizer import repeated_entries
from algos.logprobs import gather_logprobs, logits_to_logprobs
from algos.loss_head import head_token_scores
from algos.opd import nucleus_logprobs, sampled_log_ratio, token_logprobs_chunked
from logic.teachers import (
    CrossVocab,
    ScoreError,
    TeacherSpec,
    cross_vocab,
    opd_configs,
    teacher_order,
    tokenizer_source,
)
from memory.config import TeacherMemoryConfig
from memory.manager import WeightMemory
from models.tokenizer_load import load_tokenizer
from training.batching import MicroBatch, token_batch
from training.config import TrainConfig
from training.heads import (
    ResponseHead,
    head_response_logprobs,
    response_head,
    response_logits,
    response_tokens,
)
from training.teacher_weights import (  # noqa: F401 - meta_skeleton re-exported
    RowShard,
    load_teachers,
    meta_skeleton,
)


@dataclass
class OpdInputs:
    """Per micro-batch inputs of the OPD terms."""

    mask: torch.Tensor  # [B, R] policy tokens of samples with a teacher signal
    coef: torch.Tensor  # [B] the teacher's coefficient per sample
    configs: list[Any]  # [B] each sample's OpdConfig (its teacher's, else the run's)
    teacher_logp: torch.Tensor | None = None  # [B, R] (sampled)
    teacher_logits: torch.Tensor | None = None  # [B, R, V] (colocated loss terms), its dtype
    # or, when the student gives its head (training/heads.py), each colocated loss-term
    # teacher's head over its rows of the micro-batch: [(rows, ResponseHead of those rows)]
    teacher_heads: list[tuple[list[int], ResponseHead]] | None = None
    # a teacher's own top-k, as student ids (teacher servers, and colocated teachers of
    # another vocabulary: mapped by token text), for the rows in topk_rows [B]
    topk_ids: torch.Tensor | None = None  # [B, R, k]
    topk_logp: torch.Tensor | None = None  # [B, R, k], -inf: not in the set
    topk_rows: torch.Tensor | None = None  # [B] bool
    # the sorted-probability term (opd uld_coef, teachers of another vocabulary): the positions
    # that have one [B, R] bool, and the teacher's top-k log-probs there [B, R, k]
    sorted_pos: torch.Tensor | None = None
    sorted_logp: torch.Tensor | None = None
    # the nucleus the rollout sampled each token from (top_p, top_p_replay): ids [B, R, K] and
    # which are real [B, R, K]; the samples that have a record [B]; the tokens that have a
    # nucleus [B, R]; log of its rollout mass [B, R]
    nucleus_ids: torch.Tensor | None = None
    nucleus_valid: torch.Tensor | None = None
    nucleus_rows: torch.Tensor | None = None
    nucleus_tokens: torch.Tensor | None = None
    nucleus_logmass: torch.Tensor | None = None
    # [B, R] tokens whose teacher_logp is renormalised over their nucleus (top-p replay with a
    # colocated sampled teacher): r_t pairs them with the student's replayed log-probs
    teacher_replayed: torch.Tensor | None = None


@dataclass
class CrossOutput:
    """A colocated teacher of another vocabulary's scores of its rows, on the student's tokens
    (`CrossVocab.onto_student`, as the teacher pool does with a server's reply)."""

    logp: torch.Tensor  # [b, R] float32 per-student-token teacher values
    valid: torch.Tensor  # [b] bool: rows that could be scored (else no signal)
    topk_ids: torch.Tensor | None = None  # [b, R, k] student ids (top_k mode)
    topk_logp: torch.Tensor | None = None  # [b, R, k], -inf: padding
    sorted_pos: torch.Tensor | None = None  # [b, R] bool (opd uld_coef)
    sorted_logp: torch.Tensor | None = None  # [b, R, k]


def student_pass(model: Any, mb: MicroBatch, temperature: float, heads: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | ResponseHead]:
    """(log-probs [B, R], entropies [B, R], logits [B, R, V]) from one forward, the same
    formulas as algos.logprobs (used when an OPD loss term needs the student's distribution);
    the output head runs on the response positions only (`response_logits`). With `heads` (a
    model with a plain output head, training/heads.py), the head (hidden states and weight)
    instead of the logits, which are never made."""
    head = response_head(model, mb) if heads else None
    if head is not None:
        return *head_response_logprobs(head, mb, temperature), head
    logits = response_logits(model, mb)
    logprobs = logits_to_logprobs(logits, temperature)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return gather_logprobs(logprobs, response_tokens(mb)), entropy, logits


def sub_batch(mb: MicroBatch, rows: list[int]) -> MicroBatch:
    """The micro-batch's rows `rows` (same padding and response columns)."""
    if rows == list(range(len(mb.samples))):
        return mb
    idx = torch.tensor(rows, device=mb.input_ids.device)
    return MicroBatch([mb.samples[r] for r in rows], *(t[idx] for t in (
        mb.input_ids, mb.attention_mask, mb.prompt_lens, mb.mask, mb.rollout_logp,
        mb.rewards)), token_bounds=mb.token_bounds)


def micro_batch_order(mbs: list[MicroBatch], teachers: list[str]) -> list[int]:
    """Micro-batch indices in teacher order: by the rank (in `teachers`) of the first and the
    last teacher they hold, so that a micro-batch of teachers a and b sits between a's and b's;
    micro-batches without teachers last; stable otherwise."""
    rank = {t: i for i, t in enumerate(teachers)}

    def key(j: int) -> tuple[int, int]:
        held = [rank[s.teacher] for s in mbs[j].samples if s.teacher in rank]
        return (min(held), max(held)) if held else (len(rank), len(rank))

    return sorted(range(len(mbs)), key=key)


class TeacherStream:
    """A step's colocated teacher forwards, one micro-batch at a time, in a switch order
    declared to the weight memory's planner up front (`ColocatedTeachers.stream`)."""

    def __init__(self, owner: ColocatedTeachers, mbs: list[MicroBatch], order: list[int],
                 temperature: float, logit_teachers: set[str], next_teachers: list[str] = (),
                 replay_teachers: set[str] = frozenset(), heads: bool = False,
                 cross: dict[str, Any] | None = None):
        self.owner, self.mbs, self.temperature, self.heads = owner, mbs, temperature, heads
        self.logit_teachers, self.replay_teachers = logit_teachers, set(replay_teachers)
        self.cross = dict(cross or {})  # teacher of another vocabulary -> its OpdConfig
        # per teacher of another vocabulary: `CrossVocab.onto_student`'s counts, and
        # failed_samples (a sample its tokenizer cannot convert: no signal)
        self.cross_stats: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        rank = {t: i for i, t in enumerate(owner.teacher_order(mbs))}
        self.order = list(order)
        self.plan: dict[int, list[str]] = {}  # micro-batch -> its teachers, in compute order
        switches: list[str] = []
        current = None
        for j in self.order:
            names = sorted({s.teacher for s in mbs[j].samples if s.teacher in rank},
                           key=lambda t: (t != current, rank[t]))
            self.plan[j] = names
            for name in names:
                if name != current:
                    switches.append(name)
                    current = name
        self.switches = switches
        memory = owner.memory
        # the next step runs the teachers this one leaves in the slots first (teacher_order):
        # its hint is put in that order, so the plan prefetches what that step loads
        left = list(dict.fromkeys(reversed(switches)))[:len(memory.slots)]
        hint = [f"teacher:{t}" for t in sorted(next_teachers, key=lambda t: t not in left)
                if t in owner.specs]
        plan = memory.plan([f"teacher:{t}" for t in switches] + hint[:memory.lookahead])
        self._steps = iter(plan.steps[:len(switches)])
        self._next = 0  # position in self.order
        self._current: tuple[str, dict[str, torch.Tensor]] | None = None
        self.time_s = 0.0  # teacher forwards and the waits for their weights

    def get(self, j: int, nucleus: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> dict[str, tuple[list[int], torch.Tensor]]:
        """{teacher: (its rows of micro-batch j, [b, R, V] logits in the teacher's dtype (with
        `heads`: its ResponseHead instead), or [b, R] float32 log-probs of the response tokens
        for teachers not in logit_teachers)};
        micro-batches must be asked for in `order`. `nucleus`: micro-batch j's recorded nuclei
        (ids, valid), both [B, R, K]: the log-probs of teachers in `replay_teachers` are
        renormalised over them where a token has one."""
        if self._next >= len(self.order) or self.order[self._next] != j:
            expected = self.order[self._next] if self._next < len(self.order) else None
            raise RuntimeError(f"teacher outputs of micro-batch {j} asked for out of the "
                               f"declared order (next: {expected}); the runner must call the "
                               f"loss of micro-batches in the order it was given them")
        self._next += 1
        t0 = time.perf_counter()
        out = {}
        mb = self.mbs[j]
        for name in self.plan[j]:
            params = self._switch_to(name)
            rows = [b for b, s in enumerate(mb.samples) if s.teacher == name]
            part = sub_batch(mb, rows)
            out[name] = (rows, self._output(name, part, rows, params, nucleus))
        self.time_s += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def _output(self, name: str, part: MicroBatch, rows: list[int], params: dict,
                nucleus: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        """One teacher's output for its rows: its head (`heads`), its logits, or its token
        log-probs, from its head when it has a plain one and no nucleus is replayed (no
        logits made)."""
        skeleton = self.owner.skeletons[name]
        if name in self.owner.cross:
            return self._cross_output(name, part, params)
        if name in self.logit_teachers:
            if not self.heads:
                return response_logits(skeleton, part, params)
            head = response_head(skeleton, part, params)
            if head is None:
                raise RuntimeError(f"teacher {name!r}: its output layer is no plain linear head "
                                   f"(training/heads.py), so the student's head cannot be "
                                   f"compared with it")
            return head
        replayed = nucleus if name in self.replay_teachers else None
        head = None if replayed is not None else response_head(skeleton, part, params)
        if head is not None:
            return head_response_logprobs(head, part, self.temperature, False)[0]
        return self._token_logprobs(part, rows, response_logits(skeleton, part, params),
                                    replayed)

    def _cross_output(self, name: str, part: MicroBatch, params: dict) -> CrossOutput:
        """A teacher of another vocabulary: its rows re-tokenized for it, scored in its own
        tokens (log-probs, and the top-k its top_k mode or `span_credit = "prefix"` reads),
        moved onto the student's tokens by aligned spans, as the teacher pool does."""
        cross, spec = self.owner.cross[name], self.owner.specs[name]
        config = self.cross[name]
        run_k = config.top_k if config.mode == "top_k" else 0
        sorted_term = bool(run_k and config.uld_coef > 0)
        prefix = spec.span_credit == "prefix"
        k = max(run_k, spec.prefix_top_k) if prefix else run_k
        stats = self.cross_stats[name]
        retok: list[Any] = []
        for s in part.samples:
            try:
                retok.append(cross.retokenize(s.prompt_ids, s.response_ids, s.loss_mask))
            except ScoreError:
                retok.append(None)
                stats["failed_samples"] += 1
        # built on the host, moved to the device once
        B, R = part.mask.shape
        logp = torch.zeros(B, R)
        topk_ids = torch.zeros(B, R, run_k, dtype=torch.long) if run_k else None
        topk_logp = torch.full((B, R, run_k), -math.inf) if run_k else None
        sorted_pos = torch.zeros(B, R, dtype=torch.bool) if sorted_term else None
        sorted_logp = torch.full((B, R, run_k), -math.inf) if sorted_term else None
        scored = [i for i, r in enumerate(retok) if r is not None]
        if scored:
            lp, ids, top = self._own_scores(name, [retok[i] for i in scored], params, k,
                                            part.mask.device)
            for row, i in enumerate(scored):
                s, r = part.samples[i], retok[i]
                n_t, n_s = len(r.response_ids), len(s.response_ids)
                got = cross.onto_student(
                    r, s.rollout_logprobs, s.response_ids, s.loss_mask, lp[row, :n_t],
                    ids[row, :n_t] if k else None, top[row, :n_t] if k else None, run_k,
                    prefix, stats, sorted_term, spec.topk_map)
                logp[i, :n_s] = torch.from_numpy(got.values)
                if got.topk is not None:  # k columns, fewer for a teacher of fewer tokens
                    w = got.topk.ids.shape[1]
                    topk_ids[i, :n_s, :w] = torch.from_numpy(got.topk.ids)
                    topk_logp[i, :n_s, :w] = torch.from_numpy(got.topk.logprobs)
                if got.sorted_positions is not None and len(got.sorted_positions):
                    pos = torch.from_numpy(got.sorted_positions)
                    sorted_pos[i, pos] = True
                    sorted_logp[i, pos, :got.sorted_logprobs.shape[1]] = \
                        torch.from_numpy(got.sorted_logprobs).float()
        if topk_ids is not None:
            topk_logp.masked_fill_(repeated_entries(topk_ids), -math.inf)
        dev = part.mask.device
        return CrossOutput(logp.to(dev), torch.tensor([r is not None for r in retok], device=dev),
                           *(None if t is None else t.to(dev)
                             for t in (topk_ids, topk_logp, sorted_pos, sorted_logp)))

    def _own_scores(self, name: str, retok: list[Any], params: dict, k: int, dev: Any
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([b, Rt] log-probs of the teacher's own response tokens, [b, Rt, k] its top-k ids
        and log-probs), float64 on the host, at the run's temperature: from its head, chunked,
        when it has a plain one, else from its response logits."""
        skeleton = self.owner.skeletons[name]
        pad = getattr(self.owner.cross[name].teacher, "pad_token_id", None) or 0
        tmb = token_batch([r.prompt_ids for r in retok], [r.response_ids for r in retok],
                          pad).to(dev)
        tokens = response_tokens(tmb)
        b, rt = tokens.shape
        head = response_head(skeleton, tmb, params)
        if head is not None:
            lp, ids, top = head_token_scores(head.hidden.reshape(b * rt, -1), head.weight,
                                             tokens.reshape(-1), self.temperature, k)
        else:
            z = logits_to_logprobs(response_logits(skeleton, tmb, params), self.temperature)
            z = z.reshape(b * rt, -1)
            lp = z.gather(-1, tokens.reshape(-1, 1))[:, 0]
            best = z.topk(min(k, z.shape[-1]), dim=-1)
            ids, top = best.indices, best.values
        return (lp.view(b, rt).double().cpu().numpy(), ids.view(b, rt, -1).cpu().numpy(),
                top.view(b, rt, -1).double().cpu().numpy())

    def _token_logprobs(self, part: MicroBatch, rows: list[int], logits: torch.Tensor,
                        nucleus: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """[b, R] log-probs of the response tokens; with `nucleus`, renormalised over each
        token's recorded nucleus (top-p replay), plain where a token has none."""
        tokens = response_tokens(part)
        plain = token_logprobs_chunked(logits, tokens, self.temperature)
        if nucleus is None:
            return plain
        ids, valid = (t[rows] for t in nucleus)
        has = valid.any(-1)
        renorm = nucleus_logprobs(logits, tokens, ids, valid, has, self.temperature)
        return torch.where(has, renorm.to(plain.dtype), plain)

    def _switch_to(self, name: str) -> dict[str, torch.Tensor]:
        if self._current is not None and self._current[0] == name:
            return self._current[1]
        self._release()
        memory = self.owner.memory
        step = next(self._steps)
        if step.tag != f"teacher:{name}":
            raise RuntimeError(f"planned switch to {step.tag}, asked for teacher:{name}")
        for action in step.demand:
            _apply(memory, action)
        tensors = memory.acquire(step.tag)
        for action in step.prefetch:  # issued now: they overlap this teacher's compute
            _apply(memory, action)
        self._current = (name, tensors)
        return tensors

    def _release(self) -> None:
        if self._current is not None:
            self.owner.memory.release(f"teacher:{self._current[0]}")
            self._current = None

    def close(self) -> None:
        """Release the teacher in use (its slot may be reused once its compute is done)."""
        self._release()


def _apply(memory: WeightMemory, action: Any) -> None:
    """One planned move (memory.planner.Action) through the memory's public operations."""
    if action.op == "evict":
        memory.evict(action.tag, action.tier)
        return
    done = memory.prefetch(action.tag, action.tier)
    if action.tier == "gpu" and not action.prefetch:
        done.result()


class ColocatedTeachers:
    """Teachers as weight sets of a WeightMemory on the trainer's device."""

    def __init__(self, memory: Any, skeletons: dict[str, torch.nn.Module],
                 specs: list[TeacherSpec], cross: dict[str, CrossVocab] | None = None):
        """`memory`: a WeightMemory holding `teacher:<name>` sets; `skeletons`: name -> a meta
        skeleton of that teacher's architecture (teachers of one architecture share one);
        `cross`: the teachers of another vocabulary than the student's, scored across it."""
        self.memory, self.skeletons = memory, skeletons
        self.specs = {t.name: t for t in specs}
        self.cross = dict(cross or {})

    @classmethod
    def load(cls, specs: list[TeacherSpec], device: str, dtype: torch.dtype,
             cfg: TeacherMemoryConfig, run_dir: str, seed: int = 0,
             shard: RowShard | None = None, student_tokenizer: Any = None
             ) -> ColocatedTeachers:
        """Teachers from their checkpoints, within the host budget from the start: those the
        budget holds on the pinned host, the others streamed from their checkpoints straight to
        NVMe, each registered with its checkpoint as its source (training/teacher_weights.py);
        `shard`: this tensor rank's rows of each teacher's linear layers. With the student's
        tokenizer, a teacher whose own differs is scored across vocabularies (ValueError for
        one declared with the student's: logic/teachers.py `cross_vocab`)."""
        cross = {}
        if student_tokenizer is not None:
            for t in specs:
                c = cross_vocab(student_tokenizer, load_tokenizer(tokenizer_source(t)), t)
                if c is not None:
                    cross[t.name] = c
        memory, skeletons = load_teachers(specs, device, dtype, cfg, run_dir, seed, shard=shard)
        return cls(memory, skeletons, specs, cross)

    def teacher_order(self, mbs: list[MicroBatch]) -> list[str]:
        """The step's teachers: those already in a slot first (so the one a step ends with is
        not swapped out and back in by the next step), then by first appearance."""
        on_gpu = set(self.memory.residency()["gpu"])
        return sorted((t for t in teacher_order([s.teacher for mb in mbs for s in mb.samples])
                       if t in self.specs), key=lambda t: f"teacher:{t}" not in on_gpu)

    def stream(self, mbs: list[MicroBatch], order: list[int], temperature: float,
               logit_teachers: set[str], next_teachers: list[str] = (),
               replay_teachers: set[str] = frozenset(), heads: bool = False,
               cross: dict[str, Any] | None = None) -> TeacherStream:
        """Teacher outputs of `mbs`, computed when asked for, micro-batch by micro-batch in
        `order` (`TeacherStream.get`); `heads`: logit teachers give their ResponseHead;
        `cross`: the OpdConfig of each teacher of another vocabulary."""
        return TeacherStream(self, mbs, order, temperature, logit_teachers, next_teachers,
                             replay_teachers, heads, cross)

    def outputs(self, mbs: list[MicroBatch], temperature: float, logits: bool | set[str],
                next_teachers: list[str] = ()) -> dict[tuple[str, int], torch.Tensor]:
        """{(teacher, micro-batch index): its rows' [b, R] log-probs, or [b, R, V] logits for the
        teachers in `logits` (True = all), at temperature} for every micro-batch holding samples
        of that teacher, one switch per teacher (all at once: for tests and tools; the train
        step streams them)."""
        names = set(self.specs) if logits is True else set(logits or ())
        order = micro_batch_order(mbs, self.teacher_order(mbs))
        stream = self.stream(mbs, order, temperature, names, next_teachers)
        try:
            return {(name, j): out for j in order
                    for name, (_, out) in stream.get(j).items()}
        finally:
            stream.close()

    def close(self) -> None:
        self.memory.close()


# --- the step's OPD inputs, one micro-batch at a time -------------------------------------------

def wants_teacher_logits(config: Any) -> bool:
    """A colocated teacher gives logits to every loss-term mode (top-k ids from either side's
    logits, the nucleus or the whole vocabulary), log-probs to `sampled`."""
    return config.mode != "sampled"


class OpdSignals:
    """The step's OPD inputs, built for one micro-batch at a time (`inputs(j)`), in `order`:
    with colocated teachers each call runs that micro-batch's teacher forwards (streaming);
    server replies are read from the samples. `close()` after the pass."""

    def __init__(self, mbs: list[MicroBatch], cfg: TrainConfig, temperature: float,
                 teachers: ColocatedTeachers | None, order: list[int] | None = None,
                 next_teachers: list[str] = (), heads: bool = False):
        self.mbs, self.cfg, self.teachers = mbs, cfg, teachers
        self.configs = opd_configs(cfg.teachers, cfg.opd)
        self.coefs = {t.name: t.coef for t in cfg.teachers}
        self.order = list(range(len(mbs))) if order is None else list(order)
        self.counts: collections.Counter = collections.Counter()
        self.stream = None
        self._server_s = 0.0
        if teachers is not None:
            own = {n: c for n, c in self.configs.items() if n not in teachers.cross}
            logit_teachers = {n for n, c in own.items() if wants_teacher_logits(c)}
            replay = {n for n, c in own.items() if c.mode == "sampled" and c.top_p_replay}
            cross = {n: self.configs.get(n, cfg.opd) for n in teachers.cross}
            self.stream = teachers.stream(mbs, self.order, temperature, logit_teachers,
                                          next_teachers, replay, heads, cross)

    @property
    def cross_stats(self) -> dict[str, collections.Counter]:
        """Per colocated teacher of another vocabulary, its alignment counts this step."""
        return self.stream.cross_stats if self.stream is not None else {}

    @property
    def time_s(self) -> float:
        """Seconds spent getting teacher outputs (forwards and weight waits)."""
        return self.stream.time_s if self.stream is not None else self._server_s

    def inputs(self, j: int) -> OpdInputs:
        t0 = time.perf_counter()
        mb = self.mbs[j]
        dev = mb.mask.device
        row_cfgs = [self.configs.get(s.teacher, self.cfg.opd) for s in mb.samples]
        has = torch.tensor([_has_signal(s, self.teachers, c.mode)
                            for s, c in zip(mb.samples, row_cfgs)], device=dev)
        # the trainer's own teacher list, else the pool's (server mode: the trainer has none)
        coef = torch.tensor([self.coefs.get(s.teacher, s.teacher_coef) for s in mb.samples],
                            device=dev)
        inp = OpdInputs(mask=mb.mask * has[:, None], coef=coef, configs=row_cfgs)
        if any(c.mode == "top_p" or c.top_p_replay for c in row_cfgs):
            _fill_nucleus(inp, mb, self.counts)
        if self.stream is not None:
            nucleus = None if inp.nucleus_ids is None else (inp.nucleus_ids, inp.nucleus_valid)
            _fill_colocated(inp, mb, self.stream.get(j, nucleus))
            if nucleus is not None:
                inp.teacher_replayed = _replayed_tokens(inp)
        else:
            _fill_server(inp, mb, self.cfg.opd.mode)
            self._server_s += time.perf_counter() - t0
        return inp

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def prepare_opd(mbs: list[MicroBatch], student_logp: list[torch.Tensor], cfg: TrainConfig,
                teachers: ColocatedTeachers | None, next_teachers: list[str] = (),
                temperature: float = 1.0) -> list[OpdInputs]:
    """Every micro-batch's OPD inputs at once (for tests and tools; the train step streams them
    with `OpdSignals`, which never holds more than one micro-batch's teacher outputs)."""
    order = None if teachers is None else micro_batch_order(mbs, teachers.teacher_order(mbs))
    signals = OpdSignals(mbs, cfg, temperature, teachers, order, next_teachers)
    try:
        out = {j: signals.inputs(j) for j in signals.order}
    finally:
        signals.close()
    return [out[j] for j in range(len(mbs))]


def _has_signal(s: Any, teachers: ColocatedTeachers | None, mode: str) -> bool:
    if not s.teacher:
        return False
    if teachers is not None:
        return s.teacher in teachers.specs
    return s.teacher_topk_ids is not None if mode == "top_k" else bool(s.teacher_logprobs)


def _fill_colocated(inp: OpdInputs, mb: MicroBatch,
                    outs: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    """Teacher log-probs [B, R] and/or logits [B, R, V] (the teacher's dtype), rows of samples
    without them zero, or heads (each with its rows). A micro-batch of one logit teacher uses
    its output as it is."""
    B = len(mb.samples)
    for rows, out in outs.values():
        if isinstance(out, CrossOutput):
            if inp.teacher_logp is None:
                inp.teacher_logp = out.logp.new_zeros((B,) + tuple(out.logp.shape[1:]))
            inp.teacher_logp[rows] = out.logp
            inp.mask[rows] = inp.mask[rows] * out.valid[:, None]
            if out.topk_ids is not None:
                _put_topk(inp, rows, out.topk_ids, out.topk_logp)
            if out.sorted_pos is not None:
                _put_sorted(inp, rows, out.sorted_pos, out.sorted_logp)
        elif isinstance(out, ResponseHead):
            inp.teacher_heads = (inp.teacher_heads or []) + [(rows, out)]
        elif out.dim() == 2:
            if inp.teacher_logp is None:
                inp.teacher_logp = out.new_zeros((B,) + tuple(out.shape[1:]))
            inp.teacher_logp[rows] = out
        elif len(rows) == B:
            inp.teacher_logits = out
        else:
            if inp.teacher_logits is None:
                inp.teacher_logits = out.new_zeros((B,) + tuple(out.shape[1:]))
            inp.teacher_logits[rows] = out


def _put_topk(inp: OpdInputs, rows: list[int], ids: torch.Tensor, logp: torch.Tensor) -> None:
    """Rows `rows` of the micro-batch's top-k sets (student ids [b, R, k], log-probs, -inf off
    the set); sets of several widths are padded with id 0 at -inf."""
    B, R = inp.mask.shape
    k = max(ids.shape[-1], 0 if inp.topk_ids is None else inp.topk_ids.shape[-1])
    if inp.topk_ids is None or inp.topk_ids.shape[-1] < k:
        old = (inp.topk_ids, inp.topk_logp)
        inp.topk_ids = torch.zeros(B, R, k, dtype=torch.long, device=ids.device)
        inp.topk_logp = torch.full((B, R, k), -math.inf, device=ids.device)
        if old[0] is not None:
            inp.topk_ids[..., :old[0].shape[-1]], inp.topk_logp[..., :old[0].shape[-1]] = old
        if inp.topk_rows is None:
            inp.topk_rows = torch.zeros(B, dtype=torch.bool, device=ids.device)
    width = ids.shape[-1]
    inp.topk_ids[rows, :, :width] = ids
    inp.topk_logp[rows, :, :width] = logp.to(inp.topk_logp.dtype)
    inp.topk_rows[rows] = True


def _put_sorted(inp: OpdInputs, rows: list[int], pos: torch.Tensor, logp: torch.Tensor
                ) -> None:
    """Rows `rows` of the sorted-probability term: its positions [b, R] and the teacher's
    top-k log-probs there [b, R, k] (-inf elsewhere); widths padded with -inf."""
    B, R = inp.mask.shape
    k = max(logp.shape[-1], 0 if inp.sorted_logp is None else inp.sorted_logp.shape[-1])
    if inp.sorted_logp is None or inp.sorted_logp.shape[-1] < k:
        old = inp.sorted_logp
        inp.sorted_logp = torch.full((B, R, k), -math.inf, device=logp.device)
        if old is not None:
            inp.sorted_logp[..., :old.shape[-1]] = old
        if inp.sorted_pos is None:
            inp.sorted_pos = torch.zeros(B, R, dtype=torch.bool, device=logp.device)
    inp.sorted_pos[rows] = pos
    inp.sorted_logp[rows, :, :logp.shape[-1]] = logp.to(inp.sorted_logp.dtype)


def _fill_server(inp: OpdInputs, mb: MicroBatch, mode: str) -> None:
    B, R = mb.mask.shape
    dev = mb.mask.device
    if mode == "top_k":
        # each sample's [n, k] arrays into rows of [B, R, k] (built on the host, one copy to
        # the device); positions past a row's end: id 0, log-prob -inf (off the mask); an id
        # repeated within a row is padding (a teacher of another vocabulary's rows, mapped to
        # student ids: algos/cross_tokenizer.py `map_topk`), out of the set too
        rows = [(b, s) for b, s in enumerate(mb.samples) if s.teacher_topk_ids is not None]
        k = max((s.teacher_topk_ids.shape[1] for _, s in rows), default=1)
        ids = torch.zeros(B, R, k, dtype=torch.long)
        lps = torch.full((B, R, k), -math.inf)
        ids_np, lps_np = ids.numpy(), lps.numpy()  # views: numpy copies and casts the rows
        for b, s in rows:
            n, width = s.teacher_topk_ids.shape
            ids_np[b, :n, :width] = s.teacher_topk_ids
            lps_np[b, :n, :width] = s.teacher_topk_logprobs
        lps.masked_fill_(repeated_entries(ids), -math.inf)
        inp.topk_ids, inp.topk_logp = ids.to(dev), lps.to(dev)
        inp.topk_rows = torch.zeros(B, dtype=torch.bool, device=dev)
        inp.topk_rows[[b for b, _ in rows]] = True
        sorted_rows = [(b, s) for b, s in rows if s.teacher_sorted_positions is not None]
        for b, s in sorted_rows:
            n, width = s.teacher_sorted_logprobs.shape
            pos = torch.zeros(1, R, dtype=torch.bool)
            pos[0, torch.from_numpy(s.teacher_sorted_positions.astype(np.int64))] = True
            lp = torch.full((1, R, width), -math.inf)
            lp[0, pos[0]] = torch.from_numpy(s.teacher_sorted_logprobs).float()
            _put_sorted(inp, [b], pos.to(dev), lp.to(dev))
        return
    lp = torch.zeros(B, R, device=dev)
    for b, s in enumerate(mb.samples):
        if s.teacher_logprobs:
            lp[b, :len(s.teacher_logprobs)] = torch.tensor(s.teacher_logprobs)
    inp.teacher_logp = lp


def nucleus_arrays(s: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ids, offsets, logmass) of the nucleus the rollout recorded for a sample, checked
    (engine/session.py writes them; transport/schema.py `Sample.rollout_nucleus_*`), or None.
    ValueError naming the sample for arrays that are not one nucleus per response token
    holding its policy token; an empty range on a policy token is a token without a nucleus
    (its nucleus held more tokens than the rollout's top log-probs)."""
    ids, offsets, logmass = (s.rollout_nucleus_ids, s.rollout_nucleus_offsets,
                             s.rollout_nucleus_logmass)
    if ids is None and offsets is None and logmass is None:
        return None
    where = f"sample {s.group_id}/{s.index}"
    n = len(s.response_ids)
    if any(a is None for a in (ids, offsets, logmass)):
        raise ValueError(f"{where}: rollout_nucleus_ids, _offsets and _logmass come together")
    offsets = np.asarray(offsets, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    logmass = np.asarray(logmass, dtype=np.float64)
    if offsets.shape != (n + 1,) or logmass.shape != (n,) or ids.ndim != 1 or \
            offsets[0] != 0 or offsets[-1] != ids.size or (np.diff(offsets) < 0).any():
        raise ValueError(f"{where}: the rollout nucleus must be ids [m], offsets [{n + 1}] "
                         f"(0 .. m, non-decreasing) and logmass [{n}]; got {ids.shape}, "
                         f"{offsets.shape}, {logmass.shape}")
    if not np.isfinite(logmass).all() or (logmass > 1e-4).any() or (ids < 0).any():
        raise ValueError(f"{where}: nucleus log-masses must be finite and <= 0, ids >= 0")
    sizes = np.diff(offsets)
    policy = np.asarray(s.loss_mask, dtype=bool) & (sizes > 0)
    owner = np.repeat(np.arange(n), sizes)
    hit = np.zeros(n, dtype=bool)
    hit[owner[ids == np.asarray(s.response_ids, dtype=np.int64)[owner]]] = True
    if not hit[policy].all():
        j = int(np.flatnonzero(policy & ~hit)[0])
        raise ValueError(f"{where}: response token {j} ({s.response_ids[j]}) is not in the "
                         f"nucleus the rollout recorded for it")
    return ids, offsets, logmass


def _fill_nucleus(inp: OpdInputs, mb: MicroBatch, counts: collections.Counter) -> None:
    """[B, R, K] ids / valid of the recorded nuclei, [B] which rows have a record, [B, R]
    which tokens have a nucleus and its log-mass; policy tokens of a record without a nucleus
    are counted in `nucleus_fallback_tokens`."""
    B, R = mb.mask.shape
    arrays = [nucleus_arrays(s) for s in mb.samples]
    rows = [b for b, a in enumerate(arrays) if a is not None]
    counts["rollout_nucleus_samples"] += len(rows)
    if not rows:
        return
    K = max(int(np.diff(arrays[b][1]).max(initial=1)) for b in rows)
    ids = np.zeros((B, R, K), dtype=np.int64)
    valid = np.zeros((B, R, K), dtype=bool)
    logmass = np.zeros((B, R), dtype=np.float32)
    for b in rows:
        flat, offsets, mass = arrays[b]
        sizes = np.diff(offsets)
        pos = np.repeat(np.arange(len(sizes)), sizes)
        within = np.arange(flat.size) - np.repeat(offsets[:-1], sizes)
        ids[b, pos, within] = flat
        valid[b, pos, within] = True
        logmass[b, :len(mass)] = mass
    dev = mb.mask.device
    inp.nucleus_ids = torch.from_numpy(ids).to(dev)
    inp.nucleus_valid = torch.from_numpy(valid).to(dev)
    inp.nucleus_logmass = torch.from_numpy(logmass).to(dev)
    has = torch.zeros(B, dtype=torch.bool)
    has[rows] = True
    inp.nucleus_rows = has.to(dev)
    inp.nucleus_tokens = inp.nucleus_valid.any(-1)
    missing = (mb.mask > 0) & inp.nucleus_rows[:, None] & ~inp.nucleus_tokens
    counts["nucleus_fallback_tokens"] += int(missing.sum())


def _replayed_tokens(inp: OpdInputs) -> torch.Tensor:
    """[B, R] the policy tokens with a nucleus of samples whose config is sampled + replay."""
    rows = torch.tensor([c.mode == "sampled" and c.top_p_replay for c in inp.configs],
                        device=inp.mask.device)
    return rows[:, None] & inp.nucleus_tokens & (inp.mask > 0)


def rows_with(inp: OpdInputs, config: Any) -> torch.Tensor:
    """[B] 1.0 for the samples whose OPD config is `config`."""
    return torch.tensor([float(c is config) for c in inp.configs], device=inp.mask.device)


def sampled_ratio(student_logp: torch.Tensor, inp: OpdInputs) -> torch.Tensor:
    """r_t per token for the samples in "sampled" mode (0 elsewhere and without a signal)."""
    rows = torch.tensor([float(c.mode == "sampled") for c in inp.configs],
                        device=inp.mask.device)
    if inp.teacher_logp is None or not rows.any():
        return torch.zeros_like(student_logp)
    return sampled_log_ratio(student_logp, inp.teacher_logp, inp.mask * rows[:, None])


def kl_coefs(inp: OpdInputs) -> torch.Tensor:
    """[B] kl_coef of each sample's OPD config times its teacher's coefficient."""
    return inp.coef * torch.tensor([c.kl_coef for c in inp.configs], device=inp.coef.device)
