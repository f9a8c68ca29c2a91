"""The models the trainer holds besides the policy: the reference, the old actors and the critic,
each a tagged weight set of the weight store (memory/store.py `WeightStore`, pinned host copies)
restored into a module only while it computes.

- `ResidentModule`: one module that weight sets are restored into for a forward ("one resident
  model"): on the CPU its tensors view the set's pinned host copy (no copy at all); on a GPU the
  set is copied in (one H2D per tensor from pinned memory, nothing when it already holds that
  set) and, with `offload`, its device memory is released after the use. The reference and the
  old actors share one when their layouts match (setup.py), so switching between them costs a
  restore, never a rebuild.
- `AuxModel`: a frozen weight set with its tag (`ref`, `old_actor:v<N>`) on a resident module.
  `AuxModel.logprobs`: the response-aligned log-probs of a micro-batch, computed with
  `algos.logprobs` exactly as the policy's (same temperature, positions, padding). The reference
  may follow the policy (`kl.ref_update_interval = N`): every N optimizer steps it becomes a copy
  of the actor's weights (a backup into its tag, no module built), caught up before its next use
  and before a checkpoint.
- `OldActors`: the policy's weights by version as tags `old_actor:v<N>`, the proximal policies of
  decoupled PPO; at most `keep`, the oldest tag's host region recycled for the newest.
- `CriticModel`: a value model (a causal-LM backbone with a scalar head `Linear(hidden, 1)`) with
  its own AdamW optimizer; it keeps its own module (it trains). With `offload` (on a GPU) its
  weights and its optimizer state (fp32 masters, Adam moments) live in host weight sets between
  uses: restored when `resident()` starts, backed up (nothing copied when a use left the weights
  unchanged) and released when it ends; the optimizer state only moves for `step()`. The value of
  response token j is read at position P - 1 + j (the state before the token is generated), the
  same column the token's log-prob comes from.
Invariant: a frozen set changes only through `load_state` / a reference update; the critic
changes only in `step` (or `restore`); an old-actor set holds exactly the policy's weights of its
version.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from algos.logprobs import position_ids_from_mask, response_slice, token_logprobs_and_entropy
from memory.layout import FlatLayout
from memory.store import WeightStore, weight_tensors
from models.invariant import decoder_for, is_enabled
from training.batching import MicroBatch
from training.config import CriticConfig
from training.heads import head_response_logprobs, response_head
from training.master_weights import make_optimizer
from training.moe import rows_only
from training.packing import packed_logprobs
from training.weight_sets import hollow_copy, optimizer_tensors


def micro_batch_logprobs(model: Any, mb: MicroBatch, temperature: float, by_length: bool = False,
                         with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-aligned [B, R] (log-probs, entropies) of a micro-batch under `model`.

    by_length: one unpadded forward per distinct sequence length instead of one padded forward
    (see training.step: padding changes the fp32 reduction order of attention).
    A model marked by `models.invariant.enable` (true on-policy mode) runs the batch-invariant
    forward instead: one padded forward whose values do not depend on the padding, the batch
    or the micro-batch size (so `by_length` changes nothing there). Otherwise a model with a
    plain output head computes them from the response positions' hidden states chunk by chunk
    (training/heads.py: no logits held), others from their logits. A micro-batch with packed
    rows (`mb.packed`, `micro_batches.pack`) runs one packed forward (training/packing.py),
    `by_length` ignored, except under the invariant forward, which runs the padded rows.
    """
    packed = mb.packed is not None and not is_enabled(model)
    head = None if is_enabled(model) or (by_length and not packed) else response_head(model, mb)
    if head is not None:
        return head_response_logprobs(head, mb, temperature, with_entropy)
    if packed:
        return packed_logprobs(model, mb.packed, temperature, with_entropy)
    if is_enabled(model):
        logp, ent = decoder_for(model).token_logprobs(mb.input_ids, mb.attention_mask,
                                                      temperature, with_entropy)
    elif not by_length:
        logp, ent = token_logprobs_and_entropy(model, mb.input_ids, mb.attention_mask,
                                               temperature, with_entropy)
    else:
        lengths = mb.attention_mask.sum(dim=1)
        shape = (mb.input_ids.shape[0], mb.input_ids.shape[1] - 1)
        logp = ent = None
        for length in sorted(set(lengths.tolist())):
            rows = torch.nonzero(lengths == length).squeeze(1)
            ids = mb.input_ids[rows, :length]
            with rows_only(model, rows, length):  # a MoE policy: these rows' routes
                lp, en = token_logprobs_and_entropy(model, ids, torch.ones_like(ids),
                                                    temperature, with_entropy)
            if logp is None:
                logp = lp.new_zeros(shape)
                ent = lp.new_zeros(shape) if with_entropy else None
            logp[rows, :length - 1] = lp
            if with_entropy:
                ent[rows, :length - 1] = en
    cols = mb.num_response_cols
    return (response_slice(logp, mb.prompt_lens, cols),
            response_slice(ent, mb.prompt_lens, cols) if with_entropy else None)


def new_store(device: str | torch.device) -> WeightStore:
    """Weight sets for models computing on `device` (pinned host memory when it is a GPU)."""
    return WeightStore(pin=torch.device(device).type == "cuda")


class ResidentModule:
    """A module that weight sets are restored into for a use (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, device: str | torch.device, store: WeightStore,
                 offload: bool = True):
        self.module, self.store = module, store
        self.device = torch.device(device)
        self.offload = offload and self.device.type != "cpu"
        self.tag: str | None = None  # the set it was last given

    def load(self, tag: str) -> torch.nn.Module:
        """The module holding the set `tag` (restored unless it already holds it)."""
        self.store.restore(tag, self.module, bind_cpu=True)
        self.tag = tag
        return self.module

    @contextlib.contextmanager
    def use(self, tag: str):
        module = self.load(tag)
        try:
            yield module
        finally:
            if self.offload:
                self.store.release(tag, module)


class AuxModel:
    """A frozen weight set (`tag` in `store`) computed with on a resident module."""

    def __init__(self, tag: str, resident: ResidentModule, update_interval: int = 0):
        self.tag, self.resident_module, self.store = tag, resident, resident.store
        self.update_interval = update_interval  # reference: copy the actor every N steps
        self.synced_updates = 0  # optimizer steps at the last copy of the actor, // interval
        self.updates = 0  # copies of the actor taken so far
        self._policy: Any = None
        self._optimizer: Any = None

    @classmethod
    def frozen_copy(cls, model: torch.nn.Module, device, offload: bool = True,
                    store: WeightStore | None = None, tag: str = "ref",
                    resident: ResidentModule | None = None, update_interval: int = 0
                    ) -> AuxModel:
        """`model`'s current weights as the set `tag` (the reference = the policy's initial
        weights); its resident module is `resident`, or a hollow copy of `model` (no weights of
        its own until a set is restored into it)."""
        store = store or new_store(device)
        store.backup(tag, model)
        if resident is None:
            resident = ResidentModule(hollow_copy(model, device).eval().requires_grad_(False),
                                      device, store, offload)
        return cls(tag, resident, update_interval)

    @property
    def device(self) -> torch.device:
        return self.resident_module.device

    @property
    def module(self) -> torch.nn.Module:
        """The resident module holding this set (it stays there until another set is loaded)."""
        self.catch_up()
        return self.resident_module.load(self.tag)

    def state(self) -> dict[str, torch.Tensor]:
        """The weights by name (views of the host copy: clone to keep them)."""
        self.catch_up()
        return self.store.host_tensors(self.tag)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` in (into the host copy); names and shapes must match (a tied alias
        may be present or not)."""
        layout = self.store.layout(self.tag)
        check_names(layout, tensors, self.resident_module.module)
        with torch.no_grad():
            self.store.backup(self.tag, {s.name: tensors[s.name].detach().to(
                s.torch_dtype).cpu().reshape(s.shape) for s in layout.specs})

    # ---- the reference following the policy ----------------------------------------------
    def follow(self, policy: Any, optimizer: Any) -> None:
        """Copy `policy`'s weights every `update_interval` steps of `optimizer` (counted by the
        optimizer itself, so a resumed run and every data-parallel rank agree)."""
        self._policy, self._optimizer = policy, optimizer
        if self.update_interval:
            self.synced_updates = optimizer.steps_taken() // self.update_interval

    def catch_up(self) -> bool:
        """The copy of the actor due since the last one, if any (True when taken)."""
        if not self.update_interval or self._policy is None:
            return False
        due = self._optimizer.steps_taken() // self.update_interval
        if due <= self.synced_updates:
            return False
        hf = getattr(self._policy, "hf_state_dict", None)  # a sharded backend: HF names, converted
        if hf is None:
            self.store.backup(self.tag, self._policy)
        else:
            named, layout = hf(), self.store.layout(self.tag)
            check_names(layout, {n: named[n] for n in named if n in layout._by_name}, None)
            self.store.backup(self.tag, {s.name: named[s.name].detach().to(s.torch_dtype)
                                         for s in layout.specs})
        self.synced_updates, self.updates = due, self.updates + 1
        return True

    @contextlib.contextmanager
    def resident(self):
        """The module holding this set on the compute device for the block."""
        self.catch_up()
        with self.resident_module.use(self.tag) as module:
            yield module

    def logprobs(self, mb: MicroBatch, temperature: float, by_length: bool = False
                 ) -> torch.Tensor:
        """Response-aligned [B, R] log-probs of the micro-batch's tokens (no gradient)."""
        with torch.no_grad(), self.resident() as module:
            return micro_batch_logprobs(module, mb, temperature, by_length, False)[0]


class AdaptersOffReference:
    """A LoRA student's reference: the policy itself with its adapters off (the base weights,
    frozen), no copy of any weight; `logprobs` as `AuxModel.logprobs` (a policy with a whole
    forward: the torch backend, megatron at pp = 1). `runner_logprobs` runs the same pass
    through a model runner (training/runner.py), for pipeline stages, where every stage must
    take part in it."""

    update_interval = 0  # it never follows the actor (refused at load: training/config.py)

    def __init__(self, policy: Any, adapters_off: Any):
        self.policy, self._off = policy, adapters_off  # adapters_off(model): a context

    @contextlib.contextmanager
    def _base(self):
        training = self.policy.training
        self.policy.eval()  # no adapter dropout in a reference
        try:
            with torch.no_grad(), self._off(self.policy):
                yield
        finally:
            self.policy.train(training)

    def logprobs(self, mb: MicroBatch, temperature: float, by_length: bool = False
                 ) -> torch.Tensor:
        with self._base():
            return micro_batch_logprobs(self.policy, mb, temperature, by_length, False)[0]

    def runner_logprobs(self, runner: Any, mbs: list[MicroBatch], temperature: float,
                        by_length: bool = False) -> list[torch.Tensor] | None:
        """Every micro-batch's reference log-probs through `runner` (a ModelRunner over this
        policy): called on every stage of a pipeline, the last gets them, the others None."""
        with self._base():
            return runner.logprobs(mbs, temperature, by_length)


def check_names(layout: FlatLayout, tensors: dict[str, torch.Tensor],
                module: torch.nn.Module | None = None) -> None:
    """ValueError unless `tensors` has every name of `layout` with its shape, and nothing else
    but tied aliases of `module`."""
    aliases = set(module.state_dict(keep_vars=True)) if module is not None else set()
    missing = sorted(set(layout.names) - set(tensors))
    unexpected = sorted(set(tensors) - set(layout.names) - aliases)
    if missing or unexpected:
        raise ValueError(f"weight set does not match: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for s in layout.specs:
        if tuple(tensors[s.name].shape) != s.shape:
            raise ValueError(f"shape of {s.name}: {s.shape} vs {tuple(tensors[s.name].shape)}")


class OldActors:
    """Snapshots of the policy by weight version: the proximal policies of decoupled PPO with
    `proximal = "rollout_version"`, tags `old_actor:v<N>` in `store`. At most `keep` sets; the
    oldest set's host region is recycled for the newest."""

    def __init__(self, keep: int, device, offload: bool = True, store: WeightStore | None = None,
                 resident: ResidentModule | None = None):
        self.keep, self.device, self.offload = keep, torch.device(device), offload
        self.store = store or new_store(device)
        self.resident = resident  # shared with the reference when their layouts match
        self.sets: dict[int, AuxModel] = {}

    def snapshot(self, model: torch.nn.Module, version: int) -> None:
        """Keep the live weights as `version` (no-op when already kept)."""
        if version in self.sets:
            return
        tag = f"old_actor:v{version}"
        if len(self.sets) >= self.keep:
            self.store.rename(self.sets.pop(min(self.sets)).tag, tag)
        self.store.backup(tag, model)
        if self.resident is None:
            self.resident = ResidentModule(hollow_copy(model, self.device).eval()
                                           .requires_grad_(False), self.device, self.store,
                                           self.offload)
        self.sets[version] = AuxModel(tag, self.resident)

    def get(self, version: int) -> AuxModel | None:
        return self.sets.get(version)


class ValueModel(torch.nn.Module):
    """Causal-LM backbone (its decoder, without the LM head when it has one) + scalar head."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(getattr(causal_lm, "model", causal_lm))
        hidden = int(causal_lm.config.hidden_size)
        dtype = next(causal_lm.parameters()).dtype
        self.head = torch.nn.Linear(hidden, 1, dtype=dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same head on every rank and every run
            torch.nn.init.normal_(self.head.weight, std=1.0 / hidden ** 0.5)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.head(hidden).squeeze(-1).float()


class CriticModel:
    """The value model: its own module and AdamW optimizer (and gradient clip); offloaded between
    uses through host weight sets (see the module docstring)."""

    def __init__(self, causal_lm: torch.nn.Module, device, cfg: CriticConfig,
                 offload: bool = True, store: WeightStore | None = None, tag: str = "critic"):
        self.device = torch.device(device)
        self.module = ValueModel(causal_lm).train(False).to(self.device)
        self.offload = offload and self.device.type != "cpu"
        self.cfg, self.tag, self.opt_tag = cfg, tag, f"{tag}.optimizer"
        self.store = store or new_store(device)
        dtype = next(self.module.parameters()).dtype
        self.optimizer = make_optimizer(self.module.parameters(), dtype, None, cfg.lr,
                                        cfg.weight_decay)  # fp32 masters for 16-bit weights
        self._live = self._opt_live = True  # module / optimizer state on the device
        if self.offload:
            self._sleep()

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """Response-aligned [B, R] values; call inside `resident()` when training."""
        v = self.module(mb.input_ids, mb.attention_mask)[:, :-1]
        return response_slice(v, mb.prompt_lens, mb.num_response_cols)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self, dp: Any = None) -> float:
        """Sum the gradients over the data-parallel ranks (`dp`, None: one rank), clip and
        apply; returns the norm."""
        self._wake_optimizer()
        norm = self.optimizer.step(self.cfg.grad_clip or float("inf"), dp)
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @contextlib.contextmanager
    def resident(self):
        """The module on the compute device for the block (its optimizer state follows when
        `step` is called)."""
        if self._live:
            yield self.module
            return
        self.store.restore(self.tag, self.module)
        self._live = True
        try:
            yield self.module
        finally:
            self._sleep()

    def _wake_optimizer(self) -> None:
        if self._opt_live:
            return
        if self.store.has(self.opt_tag):
            self.store.restore(self.opt_tag, optimizer_tensors(self.optimizer))
        self._opt_live = True

    def _sleep(self) -> None:
        """Weights (and optimizer state, when it moved) to their host sets; device memory
        released."""
        self.store.backup(self.tag, self.module)  # nothing copied when the use changed nothing
        self.store.release(self.tag, self.module)
        self._live = False
        if self._opt_live:
            state = optimizer_tensors(self.optimizer)
            if state:
                self.store.backup(self.opt_tag, state)
                self.store.release(self.opt_tag, state)
            self._opt_live = False

    def state(self) -> dict[str, torch.Tensor]:
        """The weights by name (the host copy's views while offloaded: clone to keep them)."""
        if self._live:
            return {k: v.detach() for k, v in self.module.state_dict().items()}
        return self.store.host_tensors(self.tag)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` in; names and shapes must match the module's."""
        with self.resident() as module:
            own = module.state_dict()
            check_names(FlatLayout.from_state_dict(weight_tensors(module)), tensors, module)
            with torch.no_grad():
                for name, t in own.items():
                    if name in tensors:  # a tied alias may be absent
                        t.copy_(tensors[name])

    def checkpoint(self) -> dict[str, Any]:
        with self.resident():
            self._wake_optimizer()
            return {"weights": {k: v.detach().cpu().clone()
                                for k, v in self.module.state_dict().items()},
                    "optimizer": _to_cpu(self.optimizer.state_dict())}

    def restore(self, saved: dict[str, Any]) -> None:
        with self.resident():
            self._wake_optimizer()
            self.load_state(saved["weights"])
            self.optimizer.load_state_dict(saved["optimizer"])


def _to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state dict with every tensor cloned to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
