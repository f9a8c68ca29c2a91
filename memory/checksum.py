"""Checksums of device tensors for the no-copy mode (a single tag kept only on the device).

Per tensor, two 64-bit sums over its bytes read as int32 words (or bytes, when the size is not a
multiple of 4): the plain sum and a position-weighted sum, computed on the tensor's own device
with no host copy of the data. Any single changed word changes the plain sum; swapping words
changes the weighted one. It guards against accidental writes, not against an adversary.
"""

from __future__ import annotations

import torch


class ChecksumMismatch(RuntimeError):
    @staticmethod
    def check(tag: str, expected: dict[str, tuple[int, int]],
              actual: dict[str, tuple[int, int]]) -> None:
        changed = sorted(n for n in expected if actual.get(n) != expected[n])
        if changed:
            raise ChecksumMismatch(f"weight set {tag!r} was modified since its no-copy backup: "
                                   f"{changed[:5]}{' ...' if len(changed) > 5 else ''}")


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    out = {}
    for name, t in tensors.items():
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
        w = words.to(torch.int64)
        pos = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64) % 65521 + 1
        out[name] = (int(w.sum()), int((w * pos).sum()))
    return out
