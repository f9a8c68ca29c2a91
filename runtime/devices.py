"""Which physical GPUs an actor computes on, as strings that compare equal across processes.

Role: NCCL allows one rank per GPU in a communicator, so whoever forms a group (the trainer's
weight sync, the launcher's config checks) must know when two processes share a GPU although
each names it differently: `cuda:0` under `CUDA_VISIBLE_DEVICES=1` and `cuda:1` with no mask are
the same device. `gpu_ids` maps a torch device string through the process's
`CUDA_VISIBLE_DEVICES` to the physical index (or UUID, when the mask lists UUIDs), prefixed with
the host, so ids from different hosts never collide. CPU devices have no id: any number of
processes share a CPU (gloo groups have no such rule).
"""

from __future__ import annotations

import os
import socket
from typing import Mapping


def gpu_ids(devices: list[str], env: Mapping[str, str] | None = None,
            host: str | None = None) -> list[str]:
    """`["cuda:1", "cpu", ...]` -> `["<host>/gpu<physical>", ...]` for the CUDA ones; `env`
    defaults to this process's environment, `host` to this machine's name."""
    env = os.environ if env is None else env
    host = socket.gethostname() if host is None else host
    mask = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] \
        if "CUDA_VISIBLE_DEVICES" in env else None
    out = []
    for device in devices:
        kind, _, index = device.partition(":")
        if kind != "cuda":
            continue
        i = int(index or 0)
        if mask is not None:
            if i >= len(mask):
                raise ValueError(f"device {device!r} but CUDA_VISIBLE_DEVICES={','.join(mask)!r}"
                                 f" shows only {len(mask)} device(s)")
            physical = mask[i]
        else:
            physical = str(i)
        out.append(f"{host}/gpu{physical}")
    return out
