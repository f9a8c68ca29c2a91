"""training/sleep.py and memory/device_usage.py `HostOffload`: the trainer's parameters, gradients
and optimizer state leave the device and come back in place (same tensor and storage objects,
same bytes), and a step after a wake is exactly the step without the sleep; the embedded
worker's weights come back from their host copy (or zeroed, without one)."""

from __future__ import annotations

import pytest
import torch

from memory.device_usage import HostOffload, storage_bytes
from models.tiny import build_tiny
from training.master_weights import MasterWeightOptimizer, make_optimizer
from training.sleep import TrainerSleep, iter_optimizer_tensors

IDS = torch.tensor([[5, 6, 41, 7, 44, 9, 3, 17]])
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
if CUDA:  # the CUDA context's descriptors and threads exist before the leak checks start
    torch.zeros(1, device="cuda")


def model_and_optimizer(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    model, _ = build_tiny("tiny-qwen2", seed=0)
    model.to(device=device, dtype=dtype)
    return model, make_optimizer(model.parameters(), dtype, None, lr=1e-2)


def step(model, optimizer, zero: bool = True) -> None:
    """One AdamW step on a fixed batch; `zero=False` leaves the gradients in place."""
    loss = model(input_ids=IDS.to(model.device)).logits.float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    if zero:
        optimizer.zero_grad()


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sleep_and_wake_keep_every_tensor_in_place(dtype, device):
    model, opt = model_and_optimizer(dtype, device)
    step(model, opt)
    step(model, opt, zero=False)  # gradients (and Adam's moments) present while asleep
    sleeper = TrainerSleep(model, opt)
    tensors = sleeper.tensors()
    names = {id(t) for t in iter_optimizer_tensors(opt)}
    assert any(k == "exp_avg_sq" for s in opt.state.values() for k in s)
    if dtype == torch.bfloat16:  # fp32 masters, their grads and their Adam state move too
        assert isinstance(opt, MasterWeightOptimizer)
        assert all(id(m) in names for m in opt.master)
    storages = [t.untyped_storage() for t in tensors]
    cdata = [s._cdata for s in storages]
    state = {k: v for s in opt.state.values() for k, v in s.items()}
    before = snapshot(tensors)
    total = storage_bytes(tensors)

    report = sleeper.sleep()
    assert sleeper.asleep and report.moved_bytes == total > 0
    assert storage_bytes(tensors) == 0  # nothing of them is left on the device
    if device == "cpu":
        assert report.nvml_before is None and report.nvml_after is None  # no NVML on CPU
    elif report.nvml_after is not None:
        assert report.nvml_after <= report.nvml_before  # what nvidia-smi shows
    with pytest.raises(RuntimeError):
        sleeper.sleep()

    report = sleeper.wake()
    assert not sleeper.asleep and report.moved_bytes == total
    assert all(a is b for a, b in zip(sleeper.tensors(), tensors))  # the same objects
    assert [t.untyped_storage()._cdata for t in tensors] == cdata  # same storage objects
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    again = {k: v for s in opt.state.values() for k, v in s.items()}
    assert all(again[k] is v for k, v in state.items())  # the optimizer's own tensor objects


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_after_wake_equals_a_step_without_sleep(device):
    awake, opt_a = model_and_optimizer(device=device)
    slept, opt_s = model_and_optimizer(device=device)
    step(awake, opt_a)
    step(slept, opt_s)
    sleeper = TrainerSleep(slept, opt_s)
    for _ in range(2):  # the host buffers are reused by the second sleep
        sleeper.sleep()
        host = sleeper.weights.host, sleeper.states.host
        sleeper.wake()
    assert sleeper.weights.host is host[0] and sleeper.states.host is host[1]
    # in two parts: the weights stay readable (a push) while the optimizer state is away
    weights = [p.detach().clone() for p in slept.parameters()]
    assert sleeper.sleep(keep_weights=True).moved_bytes > 0
    assert all(torch.equal(p, w) for p, w in zip(slept.parameters(), weights))
    assert storage_bytes(t for s in opt_s.state.values() for t in s.values()
                         if t.device == weights[0].device and t.dim() > 0) == 0
    assert sleeper.sleep().moved_bytes == storage_bytes(weights)
    assert storage_bytes(slept.parameters()) == 0
    sleeper.wake()
    step(awake, opt_a)
    step(slept, opt_s)
    for (name, a), b in zip(awake.named_parameters(), slept.parameters()):
        assert torch.equal(a, b), name
    for sa, sb in zip(opt_a.state.values(), opt_s.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_offload_keeps_views_and_tied_storages_once():
    base = torch.arange(12, dtype=torch.float32)
    view = base[4:8].view(2, 2)  # a view of the same storage: moved once, still a view after
    other = torch.ones(3)
    off = HostOffload(pin=False)
    assert off.offload([base, view, other]) == 12 * 4 + 3 * 4
    assert base.untyped_storage().nbytes() == 0 and view.shape == (2, 2)
    off.restore()
    assert torch.equal(view, torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    view.add_(100)
    assert base[4] == 104  # still the same storage


def test_offload_without_backup_gives_zeros_and_rehomes_fixed_storages():
    fixed = torch.frombuffer(bytearray(16), dtype=torch.float32)  # a storage that cannot resize
    fixed.fill_(3.0)
    off = HostOffload(backup=False, pin=False)
    off.offload([fixed])
    assert off.host is None  # nothing copied, nothing pinned
    assert fixed.untyped_storage().nbytes() == 0
    off.restore()
    assert torch.equal(fixed, torch.zeros(4))
