"""Distillation inside the trainer: colocated teachers on weight memory, and the OPD terms.

`ColocatedTeachers` holds every teacher as a weight set of `memory.WeightMemory` (tags
`teacher:<name>`): the device tier has `gpu_slots` fixed slots (fewer than teachers forces
switching), the host tier a byte budget, the rest waits on NVMe. A teacher computes through a
skeleton of its architecture whose parameters live on the meta device: `torch.func.functional_call`
runs it on the tensors of whatever slot holds that teacher, so teachers of another size or
architecture than the student work. The step's micro-batches are grouped by teacher and the
switch order is declared to the planner before the step (Belady eviction, the next teacher
prefetched while the current one computes; the buffer's hint loads the next step's first teacher).

`prepare_opd` turns teacher outputs (colocated forwards, or the teacher pool's server replies in
`Sample.teacher_*`) into per micro-batch inputs of the OPD terms (`algos/opd.py`): shaped
advantages for "sampled", teacher logits / top-k for the loss-term modes. Invariant: a sample
with no teacher signal (unrouted, or its teacher failed) contributes nothing to any OPD term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from algos.logprobs import (
    gather_logprobs,
    logits_to_logprobs,
    position_ids_from_mask,
    response_logprobs,
    response_slice,
)
from algos.opd import needs_teacher_logits, sampled_log_ratio
from logic.teachers import TeacherSpec, opd_configs, teacher_order
from memory.layout import FlatLayout, module_tensors
from memory.manager import WeightMemory
from models.load import load_model
from training.batching import MicroBatch
from training.config import TeacherMemoryConfig, TrainConfig


@dataclass
class OpdInputs:
    """Per micro-batch inputs of the OPD terms."""

    mask: torch.Tensor  # [B, R] policy tokens of samples with a teacher signal
    coef: torch.Tensor  # [B] the teacher's coefficient per sample
    configs: list[Any]  # [B] each sample's OpdConfig (its teacher's, else the run's)
    teacher_logp: torch.Tensor | None = None  # [B, R] (sampled)
    teacher_logits: torch.Tensor | None = None  # [B, R, V] (full, top_p)
    topk_ids: torch.Tensor | None = None  # [B, R, k] (top_k)
    topk_logp: torch.Tensor | None = None  # [B, R, k]


def forward_logits(model: Any, mb: MicroBatch, params: dict | None = None) -> torch.Tensor:
    """Next-token logits [B, L-1, V] of a micro-batch (optionally on `params` of a skeleton)."""
    kwargs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask,
              "position_ids": position_ids_from_mask(mb.attention_mask), "use_cache": False}
    if params is None:
        out = model(**kwargs)
    else:
        out = torch.func.functional_call(model, params, args=(), kwargs=kwargs)
    return out.logits[:, :-1]


def student_pass(model: Any, mb: MicroBatch, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs [B, R], entropies [B, R], logits [B, R, V]) from one forward, the same
    formulas as algos.logprobs (used when an OPD loss term needs the student's logits)."""
    return response_logprobs(forward_logits(model, mb), mb.input_ids, mb.prompt_lens,
                             mb.num_response_cols, temperature)


class ColocatedTeachers:
    """Teachers as weight sets of a WeightMemory on the trainer's device."""

    def __init__(self, memory: Any, skeletons: dict[str, torch.nn.Module],
                 specs: list[TeacherSpec]):
        """`memory`: a WeightMemory holding `teacher:<name>` sets; `skeletons`: name -> a meta
        skeleton of that teacher's architecture (teachers of one architecture share one)."""
        self.memory, self.skeletons = memory, skeletons
        self.specs = {t.name: t for t in specs}

    @classmethod
    def load(cls, specs: list[TeacherSpec], device: str, dtype: torch.dtype,
             cfg: TeacherMemoryConfig, run_dir: str, seed: int = 0) -> ColocatedTeachers:
        """Teachers from their checkpoints: the host keeps what its budget holds, the rest is
        written to NVMe (a teacher evicted from the host later is written on its first eviction)."""

        by_arch: dict[str, torch.nn.Module] = {}
        skeletons, loaded = {}, {}
        for t in specs:
            model, _ = load_model(t.model, "cpu", dtype, seed)
            loaded[t.name] = module_tensors(model)
            key = model.config.to_json_string()
            if key not in by_arch:
                by_arch[key] = meta_skeleton(model, device)
            skeletons[t.name] = by_arch[key]
            missing = set(dict(skeletons[t.name].named_parameters())) - set(loaded[t.name])
            if missing:  # a parameter left on the meta device would compute garbage
                raise ValueError(f"teacher {t.name!r}: weights missing for {sorted(missing)[:3]}")
        sizes = [FlatLayout.from_state_dict(s).total_bytes for s in loaded.values()]
        host = cfg.host_budget_bytes or sum(sizes)
        memory = WeightMemory(device, gpu_slots=cfg.gpu_slots, slot_bytes=max(sizes),
                              host_budget_bytes=host, lookahead=cfg.lookahead,
                              nvme_dir=cfg.nvme_dir or str(Path(run_dir) / "teachers-nvme"))
        for name, tensors in loaded.items():  # staged one at a time; what the host budget
            tag = f"teacher:{name}"              # cannot keep goes to NVMe (evict spills)
            memory.load_tensors(tag, tensors)
            if not memory.arena.fits(max(sizes)):
                memory.evict(tag, "host")
        return cls(memory, skeletons, specs)

    def outputs(self, mbs: list[MicroBatch], temperature: float, logits: bool | set[str],
                next_teachers: list[str] = ()) -> dict[tuple[str, int], torch.Tensor]:
        """{(teacher, micro-batch index): [B, R] log-probs, or [B, R, V] logits for the teachers
        in `logits` (True = all), at temperature} for every micro-batch holding samples of that
        teacher, one switch per teacher."""
        # teachers already in a slot go first, so the one a step ends with is not swapped out
        # and back in by the next step
        on_gpu = set(self.memory.residency()["gpu"])
        order = sorted(teacher_order([s.teacher for mb in mbs for s in mb.samples]),
                       key=lambda t: f"teacher:{t}" not in on_gpu)
        wanted = {t: [i for i, mb in enumerate(mbs) if any(s.teacher == t for s in mb.samples)]
                  for t in order if t in self.specs}
        out: dict[tuple[str, int], torch.Tensor] = {}

        def compute(tag: str, params: dict[str, torch.Tensor]) -> None:
            name = tag.removeprefix("teacher:")
            skeleton = self.skeletons[name]
            with torch.no_grad():
                for i in wanted[name]:
                    lg = forward_logits(skeleton, mbs[i], params)
                    cols = mbs[i].num_response_cols
                    if logits is True or (logits and name in logits):
                        out[(name, i)] = response_slice(lg, mbs[i].prompt_lens, cols).float()
                    else:
                        lp = gather_logprobs(logits_to_logprobs(lg, temperature),
                                             mbs[i].input_ids[:, 1:])
                        out[(name, i)] = response_slice(lp, mbs[i].prompt_lens, cols)

        hint = [f"teacher:{t}" for t in next_teachers if t in self.specs]
        self.memory.run([f"teacher:{t}" for t in wanted], compute, next_order=hint)
        return out

    def close(self) -> None:
        self.memory.close()


def meta_skeleton(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The model with its parameters and persistent buffers on the meta device (they come from
    a weight slot at call time); non-persistent buffers (rotary tables) stay real, on device."""
    persistent = set(model.state_dict())
    metas: dict[int, torch.nn.Parameter] = {}  # tied weights stay tied (functional_call ties)
    for mod_name, mod in model.named_modules():
        for p_name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in metas:
                metas[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                  requires_grad=False)
            mod._parameters[p_name] = metas[id(p)]
        for b_name, buf in list(mod.named_buffers(recurse=False)):
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            mod._buffers[b_name] = (torch.empty_like(buf, device="meta") if full in persistent
                                    else buf.to(device))
    return model.eval()


def prepare_opd(mbs: list[MicroBatch], student_logp: list[torch.Tensor], cfg: TrainConfig,
                teachers: ColocatedTeachers | None, next_teachers: list[str] = ()
                ) -> list[OpdInputs]:
    """OPD inputs per micro-batch, from colocated teachers or from server replies."""
    configs = opd_configs(cfg.teachers, cfg.opd)
    coefs = {t.name: t.coef for t in cfg.teachers}
    logit_teachers = {n for n, c in configs.items() if needs_teacher_logits(c.mode)}
    colocated = (teachers.outputs(mbs, cfg.loss.temperature, logit_teachers, next_teachers)
                 if teachers is not None else {})
    out = []
    for i, mb in enumerate(mbs):
        row_cfgs = [configs.get(s.teacher, cfg.opd) for s in mb.samples]
        has = torch.tensor([_has_signal(s, teachers, c.mode) for s, c in zip(mb.samples, row_cfgs)],
                           device=mb.mask.device)
        coef = torch.tensor([coefs.get(s.teacher, 1.0) for s in mb.samples],
                            device=mb.mask.device)
        inp = OpdInputs(mask=mb.mask * has[:, None], coef=coef, configs=row_cfgs)
        if teachers is not None:
            _fill_colocated(inp, mb, i, colocated, logit_teachers)
        else:
            _fill_server(inp, mb, cfg.opd.mode)
        out.append(inp)
    return out


def _has_signal(s: Any, teachers: ColocatedTeachers | None, mode: str) -> bool:
    if not s.teacher:
        return False
    if teachers is not None:
        return s.teacher in teachers.specs
    return s.teacher_topk_ids is not None if mode == "top_k" else bool(s.teacher_logprobs)


def _fill_colocated(inp: OpdInputs, mb: MicroBatch, i: int, outs: dict,
                    logit_teachers: set[str]) -> None:
    """Teacher log-probs [B, R] and/or logits [B, R, V], rows of samples without them zero."""
    for want_logits in (False, True):
        rows = {b: outs[(s.teacher, i)][b] for b, s in enumerate(mb.samples)
                if (s.teacher, i) in outs and (s.teacher in logit_teachers) == want_logits}
        if not rows:
            continue
        first = next(iter(rows.values()))
        full = first.new_zeros((len(mb.samples),) + tuple(first.shape))
        for b, row in rows.items():
            full[b] = row
        if want_logits:
            inp.teacher_logits = full
        else:
            inp.teacher_logp = full


def _fill_server(inp: OpdInputs, mb: MicroBatch, mode: str) -> None:
    B, R = mb.mask.shape
    dev = mb.mask.device
    if mode == "top_k":
        # each sample's [n, k] arrays into rows of [B, R, k] (built on the host, one copy to
        # the device); positions past a row's end: id 0, log-prob -inf (off the mask)
        rows = [(b, s) for b, s in enumerate(mb.samples) if s.teacher_topk_ids is not None]
        k = max((s.teacher_topk_ids.shape[1] for _, s in rows), default=1)
        ids = torch.zeros(B, R, k, dtype=torch.long)
        lps = torch.full((B, R, k), -math.inf)
        ids_np, lps_np = ids.numpy(), lps.numpy()  # views: numpy copies and casts the rows
        for b, s in rows:
            n, width = s.teacher_topk_ids.shape
            ids_np[b, :n, :width] = s.teacher_topk_ids
            lps_np[b, :n, :width] = s.teacher_topk_logprobs
        inp.topk_ids, inp.topk_logp = ids.to(dev), lps.to(dev)
        return
    lp = torch.zeros(B, R, device=dev)
    for b, s in enumerate(mb.samples):
        if s.teacher_logprobs:
            lp[b, :len(s.teacher_logprobs)] = torch.tensor(s.teacher_logprobs)
    inp.teacher_logp = lp


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
