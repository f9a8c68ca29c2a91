"""Test-only: the `torch.cuda` stream calls megatron-core's all-to-all token dispatcher makes
(a device-to-host copy stream, its events), as CPU no-ops, on top of
backends/megatron/cpu_shim.py (which has the calls the dense model makes).

Role: lets the mixture-of-experts GPTModel (MoEAlltoAllTokenDispatcher) build and run on a
CPU-only torch. One stream object stands for every stream, so the dispatcher never thinks it is
on a side stream. Its device-to-host step (`maybe_move_tensor_to_cpu`) turns split sizes into
host lists only for CUDA tensors: on the CPU they would stay tensors, which
`all_to_all_single` refuses, so that step is replaced by one that always does.
Invariant: `install` is idempotent and `uninstall` restores what it patched.
"""

from __future__ import annotations

import contextlib

import torch

_saved: dict[tuple[object, str], object] = {}


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


class _Stream:
    _one: "_Stream | None" = None

    def __new__(cls, *args, **kwargs):  # one stream stands for all
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, other) -> None:
        return None

    def record_event(self, event=None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        return None


_STREAM = _Stream()


def install() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    patches = {(torch.cuda, "Stream"): _Stream,
               (torch.cuda, "current_stream"): lambda device=None: _STREAM,
               (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
               (torch.cuda, "Event"): _Event,
               (token_dispatcher, "maybe_move_tensor_to_cpu"): _to_host}
    for (owner, name), value in patches.items():
        _saved.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, value)


def uninstall() -> None:
    for (owner, name), value in _saved.items():
        setattr(owner, name, value)
    _saved.clear()
