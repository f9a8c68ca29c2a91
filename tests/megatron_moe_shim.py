"""Test-only: the `torch.cuda` stream calls megatron-core's all-to-all token dispatcher makes
(a device-to-host copy stream, its events), as CPU no-ops, on top of
backends/megatron/cpu_shim.py (which has the calls the dense model makes).

Role: lets the mixture-of-experts GPTModel (MoEAlltoAllTokenDispatcher) build and run on a
CPU-only torch. One stream object stands for every stream, so the dispatcher never thinks it is
on a side stream. Invariant: `install` is idempotent and `uninstall` restores what it patched.
"""

from __future__ import annotations

import contextlib

import torch

_saved: dict[str, object] = {}


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
    patches = {"Stream": _Stream, "current_stream": lambda device=None: _STREAM,
               "stream": lambda stream=None: contextlib.nullcontext(), "Event": _Event}
    for name, value in patches.items():
        _saved.setdefault(name, getattr(torch.cuda, name))
        setattr(torch.cuda, name, value)


def uninstall() -> None:
    for name, value in _saved.items():
        setattr(torch.cuda, name, value)
    _saved.clear()
