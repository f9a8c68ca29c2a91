"""Colocated teachers sharded over tensor-parallel ranks (training/teacher_weights.py `RowShard`),
on two gloo ranks: each rank's weight memory holds its rows of every linear layer (read from the
checkpoint, to the host tier and through NVMe), the embeddings and norms whole; the teachers'
logits and log-probs equal the whole teachers' on every rank; a tp the layers do not divide is
refused naming the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import two_gloo_ranks



def worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from logic.teachers import TeacherSpec
    from models.load import load_model
    from tests.test_mopd import TEACHERS, samples
    from training.batching import make_micro_batch
    from training.colocated_teachers import ColocatedTeachers, RowShard
    from memory.config import TeacherMemoryConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    batch = samples(tok)
    mbs = [make_micro_batch(batch[i:i + 3], tok.pad_token_id or 0) for i in range(0, 8, 3)]
    tmp = Path(out).parent
    whole = ColocatedTeachers.load(TEACHERS, "cpu", torch.float32, TeacherMemoryConfig(
        gpu_slots=2, nvme_dir=str(tmp / f"whole{rank}")), str(tmp))
    # a host budget under both shards: both streamed to NVMe from their checkpoints' rows
    shard = RowShard(rank, 2, dist.group.WORLD)
    sharded = ColocatedTeachers.load(TEACHERS, "cpu", torch.float32, TeacherMemoryConfig(
        gpu_slots=1, host_budget_bytes=300_000, nvme_dir=str(tmp / f"sharded{rank}")),
        str(tmp), shard=shard)
    at_load = sharded.memory.residency()
    report = {"bytes_whole": {t: whole.memory.sets[f"teacher:{t}"].layout.total_bytes
                              for t in ("arith", "reverse")},
              "bytes_sharded": {t: sharded.memory.sets[f"teacher:{t}"].layout.total_bytes
                                for t in ("arith", "reverse")},
              "at_load": {k: sorted(v) for k, v in at_load.items()}}
    for logits in (False, True):
        a, b = whole.outputs(mbs, 1.0, logits), sharded.outputs(mbs, 1.0, logits)
        report[f"keys_{logits}"] = a.keys() == b.keys() and len(a) == 4
        report[f"max_abs_{logits}"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    # this rank's rows of a projection, as read from the checkpoint
    q = sharded.memory.acquire("teacher:arith")["model.layers.0.self_attn.q_proj.weight"]
    ref, _ = load_model("examples/teacher-arith", "cpu", torch.float32)
    full = ref.model.layers[0].self_attn.q_proj.weight.detach()
    report["q_rows"] = torch.equal(q, full.chunk(2)[rank])
    sharded.memory.release("teacher:arith")
    try:
        ColocatedTeachers.load([TeacherSpec(name="arith", model="examples/teacher-arith",
                                            domains=["math"])], "cpu", torch.float32,
                               TeacherMemoryConfig(nvme_dir=str(tmp / f"bad{rank}")), str(tmp),
                               shard=RowShard(rank, 3, dist.group.WORLD))
        report["refused"] = ""
    except ValueError as e:
        report["refused"] = str(e)
    whole.close()
    sharded.close()
    torch.save(report, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_tensor_ranks_hold_half_of_each_teacher_and_compute_its_exact_outputs(tmp_path):
    for got in two_gloo_ranks("tests.test_teachers_sharded", tmp_path):
        for logits in (False, True):
            assert got[f"keys_{logits}"]
            # each output element is the same dot product: equal up to the matmul's blocking
            assert got[f"max_abs_{logits}"] < 1e-5, got
        assert got["q_rows"]
        # a budget below both shards: each streamed from its checkpoint's rows to NVMe, then
        # read back from there for every forward
        assert got["at_load"]["nvme"] == ["teacher:arith", "teacher:reverse"], got["at_load"]
        for t, whole in got["bytes_whole"].items():  # embeddings and norms whole, layers halved
            assert 0.5 * whole < got["bytes_sharded"][t] < 0.75 * whole, got
        assert "do not divide over tensor-parallel size 3" in got["refused"]


@pytest.mark.parametrize("rows", ["::rows=2/2", "::rows=x"])
def test_a_malformed_row_source_is_refused(rows):
    from memory.sources import split_source

    with pytest.raises(ValueError, match="rows="):
        split_source("ckpt" + rows)
