"""The colocated teachers' memory settings (`teacher_memory` of the trainer's config) and the
weight memory they build (memory/manager.py, imported by `build`: the launcher reads the table
without torch, tests/test_import_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from memory.manager import WeightMemory


class TeacherMemoryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where colocated teachers live between uses."""

    gpu_slots: int = 1  # device slots for teachers (the student stays resident apart)
    host_budget_bytes: int = 0  # pinned host budget for teachers, bytes (0 = all of them)
    nvme_dir: str = ""  # teachers beyond the host budget ("" = <run_dir>/teachers-nvme)
    lookahead: int = 1  # switches prefetched ahead
    # NVMe -> device slot reads through cuFile (GPUDirect Storage, memory/gds.py): "auto" when
    # the device is CUDA and cuFile opens (else, and if a read fails, through pinned host
    # memory; the choice is logged), "off" never
    gds: Literal["auto", "off"] = "auto"

    def host_budget(self, sizes: dict[str, int]) -> int:
        """The host tier's bytes for teachers of `sizes` bytes (all of them when unset)."""
        return self.host_budget_bytes or sum(sizes.values())

    def nvme_path(self, run_dir: str) -> str:
        return self.nvme_dir or str(Path(run_dir) / "teachers-nvme")

    def build(self, device: str, sizes: dict[str, int], run_dir: str,
              chunk_bytes: int = 16 << 20) -> WeightMemory:
        """An empty weight memory for teachers of `sizes` bytes (name -> bytes) on `device`:
        slots of the largest, this host budget, NVMe under `nvme_path(run_dir)`."""
        from memory.manager import WeightMemory

        return WeightMemory(device, gpu_slots=self.gpu_slots, slot_bytes=max(sizes.values()),
                            host_budget_bytes=self.host_budget(sizes), lookahead=self.lookahead,
                            nvme_dir=self.nvme_path(run_dir), chunk_bytes=chunk_bytes,
                            gds=self.gds)
