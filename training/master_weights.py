"""fp32 master weights for a model trained in bfloat16 / float16 (mixed precision).

Role: the model's parameters stay in their low-precision dtype, so the trainer's forward (the
log-prob recompute and the training forward) is the function the inference workers run in that
dtype; the optimizer updates fp32 copies of them (the master weights, with fp32 optimizer state)
and after every step the model's parameters are set to the masters, rounded. Without masters an
update smaller than half a unit in the last place of the weight is rounded away: in bfloat16
(8 significant bits) a weight of 0.02 cannot move by less than about 6e-5, so AdamW at lr 1e-5
leaves most weights exactly where they were.

Flow of a step: backward fills the low-precision gradients -> `prepare_grads()` moves them to
fp32 gradients on the masters (what data-parallel ranks sum and what clipping measures, so both
happen in fp32) -> `step()` -> parameters = masters. Checkpoints hold the masters, so a resumed
run continues in full precision. Invariant: between steps every parameter equals its master
rounded to the parameter's dtype.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


class MasterWeightOptimizer:
    """An optimizer over fp32 masters of low-precision parameters (the torch optimizer API the
    trainer uses: zero_grad, step, state, state_dict, load_state_dict)."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.params = [p for p in params if p.requires_grad]
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                       for p in self.params]
        self.optimizer = make_optimizer(self.master)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.master:
            p.grad = None

    def prepare_grads(self) -> list[torch.nn.Parameter]:
        """The parameters' gradients as fp32 gradients of the masters (which are returned)."""
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                m.grad = p.grad.to(device=m.device, dtype=torch.float32)
                p.grad = None
        return self.master

    def step(self) -> None:
        self.prepare_grads()  # a no-op when the caller already did (to reduce or clip them)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def to(self, device: str | torch.device) -> None:
        """Masters and optimizer state to `device` (colocated mode moves them off the GPU)."""
        for m in self.master:
            m.data = m.data.to(device)
            if m.grad is not None:
                m.grad = m.grad.to(device)
        move_optimizer(self.optimizer, device)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "master": [m.detach().cpu() for m in self.master]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if "master" not in saved:
            raise ValueError("this checkpoint's optimizer state has no fp32 master weights (it "
                             "was written with master_weights = false); resume it with "
                             "master_weights = false")
        if [tuple(t.shape) for t in saved["master"]] != [tuple(m.shape) for m in self.master]:
            raise ValueError("the checkpoint's master weights do not match the model's "
                             "parameters")
        with torch.no_grad():
            for m, t in zip(self.master, saved["master"]):
                m.copy_(t)
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        self.optimizer.load_state_dict(saved["optimizer"])


def move_optimizer(optimizer: Any, device: str | torch.device) -> None:
    """An optimizer's state tensors (and masters, for a MasterWeightOptimizer) to `device`."""
    if isinstance(optimizer, MasterWeightOptimizer):
        optimizer.to(device)
        return
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                st[k] = v.to(device)


def make_optimizer(params: Iterable[torch.nn.Parameter], dtype: torch.dtype, master: bool | None,
                   lr: float, weight_decay: float = 0.0) -> Any:
    """AdamW over `params`, through fp32 masters when `master` (None: when `dtype` is a 16-bit
    float)."""
    params = list(params)
    if master is None:
        master = dtype in (torch.bfloat16, torch.float16)

    def adamw(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay)

    return MasterWeightOptimizer(params, adamw) if master else adamw(params)
