"""engine/cuda_ipc.py and the cuda_ipc weight-sync path, on CPU: the payload is SGLang's
(the names its pickle references, the request fields), it decodes back to the same weights
through the allowlist, anything else is refused, and the path refuses a CPU trainer (a CPU
worker's refusal: tests/test_weight_sync.py). The CUDA IPC handles themselves are stood in for
by a registry (a CPU tensor has none); the GPU run, across processes, is `python -m
bench.weight_sync --paths cuda_ipc` (docs/engines.md)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import os
import pickle
import pickletools
import sys
import types

import pytest
import torch

from engine import cuda_ipc
from engine.cuda_ipc import FLATTENED_BUCKET, FlatMeta
from engine.errors import BadRequest
from engine.weight_endpoints import load_named_tensors
from engine.weight_sync import SyncError, TensorSync, make_weight_sync, plan_paths
from models.tiny import build_tiny
from tests.test_weight_sync import named, trained

# SGLang's SafeUnpickler (python/sglang/srt/utils/common.py, commit 004f0c7a) loads a global
# when (module + ".") starts with one of these; the payload must name nothing else
SGLANG_ALLOWED_PREFIXES = ("builtins.", "collections.", "torch.", "sglang.srt.utils.",
                           "sglang.srt.weight_sync.tensor_bucket.",
                           "sglang.srt.model_executor.model_runner.")
SGLANG_TENSOR_REQ_FIELDS = {"serialized_named_tensors", "load_format", "flush_cache",
                            "abort_all_requests", "weight_version"}  # io_struct.py


class Handles:
    """Stand-in for CUDA IPC: `reduce` files a tensor's storage under a fresh handle and gives
    torch's 15 rebuild arguments; `rebuild` maps a handle back (what cudaIpcOpenMemHandle does
    across processes)."""

    def __init__(self):
        self.storages: dict[bytes, torch.Tensor] = {}

    def reduce(self, t: torch.Tensor) -> tuple:
        handle = os.urandom(64)
        self.storages[handle] = t.untyped_storage()
        return (type(t), t.size(), t.stride(), t.storage_offset(), torch.TypedStorage, t.dtype,
                "GPU-test-uuid", handle, t.untyped_storage().nbytes(), 0, False, b"ref", 0,
                b"event", True)

    def rebuild(self, cls, size, stride, offset, storage_cls, dtype, device, handle, *rest):
        assert device == 0  # the UUID was resolved to this process's index
        base = torch.empty(0, dtype=dtype).set_(self.storages[handle])
        return torch.as_strided(base, size, stride, offset)


@pytest.fixture
def handles(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "_uuids", {0: "GPU-test-uuid"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return Handles()


def decode(handles: Handles, payload: str, load_format=FLATTENED_BUCKET):
    rebuild = functools.partial(cuda_ipc.rebuild_checked, rebuild=handles.rebuild)
    return cuda_ipc.decode(base64.b64decode(payload), load_format, rebuild)


def globals_named(payload: str) -> set[str]:
    """`module.name` of every global a pickle references (each call stood in for)."""
    seen: set[str] = set()

    class Names(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return lambda *args: None

    Names(io.BytesIO(base64.b64decode(payload))).load()
    return seen


def test_flattened_bucket_payload_is_sglangs_and_decodes_to_the_same_weights(handles):
    model, _ = build_tiny("tiny-qwen2", seed=3)
    bucket = named(model)[:5]
    metadata, numel = cuda_ipc.flatten_metadata(bucket)
    flat = torch.cat([t.reshape(-1) for _, t in bucket])
    assert flat.numel() == numel
    payload = cuda_ipc.encode_bucket(flat, metadata, handles.reduce)
    refs = globals_named(payload)
    assert "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified" in refs
    assert "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata" in refs
    assert all(any((r.rpartition(".")[0] + ".").startswith(p) for p in SGLANG_ALLOWED_PREFIXES)
               for r in refs), refs
    got = decode(handles, payload)
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(got, bucket):
        assert torch.equal(a, b) and a.shape == b.shape
    # load_format null: [(name, tensor)], one handle per tensor
    plain = decode(handles, cuda_ipc.encode_named(bucket, handles.reduce), None)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, bucket))


def test_decoder_reads_sglang_written_metadata_and_refuses_everything_else(handles,
                                                                          monkeypatch):
    # SGLang's FlattenedTensorMetadata is a dataclass: it pickles as NEWOBJ of the class, then
    # its __dict__ (not the positional call encode_bucket writes); a stand-in module lets the
    # pickler name it as SGLang's process does
    module_name, class_name = cuda_ipc.SGLANG_METADATA
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]),
                            types.ModuleType(".".join(parts[:i])))
    sglang_meta = dataclasses.make_dataclass(class_name, [
        f.name for f in dataclasses.fields(FlatMeta)])
    sglang_meta.__module__ = module_name
    setattr(sys.modules[module_name], class_name, sglang_meta)
    flat = torch.arange(6, dtype=torch.float32)

    def dump(obj) -> str:
        buf = io.BytesIO()
        cuda_ipc._Pickler(buf, handles.reduce).dump(obj)
        return base64.b64encode(buf.getvalue()).decode()

    meta = sglang_meta("w", torch.Size([2, 3]), torch.float32, 0, 6, 6)
    payload = dump({"flattened_tensor": flat, "metadata": [meta]})
    assert any(op.name == "NEWOBJ" for op, _, _ in pickletools.genops(base64.b64decode(payload)))
    [(name, w)] = decode(handles, payload)
    assert name == "w" and torch.equal(w, flat.view(2, 3))

    evil = base64.b64encode(pickle.dumps(os.system)).decode()  # any other name: refused
    with pytest.raises(BadRequest, match="posix.system is not allowed"):
        decode(handles, evil)
    cpu = base64.b64encode(pickle.dumps([("w", torch.ones(2))])).decode()  # CPU tensors too
    with pytest.raises(BadRequest, match="not allowed"):
        decode(handles, cpu, None)
    bad = FlatMeta("w", torch.Size([4, 4]), torch.float32, 0, 16, 16)  # past the flat tensor
    with pytest.raises(BadRequest, match="inconsistent metadata for w"):
        decode(handles, dump({"flattened_tensor": flat, "metadata": [bad]}))
    with pytest.raises(BadRequest, match="load_format 'direct'"):
        decode(handles, dump([("w", flat)]), "direct")


class Recorder:
    """A worker stand-in that records every /update_weights_from_tensor body and loads the
    payload into its model through the decoder (what the embedded endpoint does on CUDA)."""

    def __init__(self, handles: Handles):
        self.base_url, self.handles, self.bodies = "http://recorder", handles, []
        self.model, _ = build_tiny("tiny-qwen2", seed=0)
        self.version = "0"

    async def update_weights_from_tensor(self, serialized_named_tensors, weight_version=None,
                                         flush_cache=True, **extra):
        body = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache,
                **extra, **({"weight_version": weight_version} if weight_version else {})}
        self.bodies.append(body)
        tensors = dict(decode(self.handles, serialized_named_tensors[0], extra["load_format"]))
        load_named_tensors(self.model, tensors)
        self.version = weight_version or self.version
        return {"success": True, "message": "ok"}

    async def pause_generation(self, mode):
        return {}

    async def continue_generation(self):
        return {}

    async def get_weight_version(self):
        return self.version


async def test_cuda_ipc_push_sends_sglang_bodies_in_dtype_buckets(handles):
    model, _ = trained(5)
    weights = named(model)
    weights[-1] = (weights[-1][0], weights[-1][1].to(torch.bfloat16))  # a second dtype
    worker = Recorder(handles)
    sync = TensorSync([worker], bucket_bytes=40 << 10)
    sync.serializer, sync.load_format, sync.reduce = "cuda_ipc", FLATTENED_BUCKET, handles.reduce
    await sync.push(weights, "4")
    assert len(worker.bodies) > 2 and all(set(b) <= SGLANG_TENSOR_REQ_FIELDS
                                          for b in worker.bodies)
    assert all(b["load_format"] == FLATTENED_BUCKET for b in worker.bodies)
    assert [b.get("weight_version") for b in worker.bodies][-1] == "4"
    assert [b["flush_cache"] for b in worker.bodies] == [False] * (len(worker.bodies) - 1) + [True]
    # one staging buffer, kept for the next push (a dropped one would never be freed: every
    # worker releases every bucket of one export); the next push reuses it
    staging = sync._staging
    assert staging is not None and 0 < staging.numel() <= 40 << 10
    await sync.push(weights, "5")
    assert sync._staging is staging and sync._outgrown == []
    got = dict(worker.model.named_parameters())
    for name, t in weights:
        assert torch.equal(got[name], t.to(got[name].dtype)), name


async def test_cuda_ipc_refuses_a_cpu_trainer_and_auto_picks_paths_by_placement():
    with pytest.raises(SyncError, match="this trainer runs on cpu"):
        await make_weight_sync("cuda_ipc", [], "cpu", 1 << 20)
    assert plan_paths([["local/gpu0"], ["local/gpu1"]], ["local/gpu0"], "cuda:0", 2) == [
        "cuda_ipc", "distributed"]  # a CPU worker never gets here: cuda_ipc refuses it
    assert plan_paths([[]], [], "cpu", 1) == ["distributed"]
    assert plan_paths(None, ["local/gpu0"], "cuda:0", 2) == ["distributed"] * 2

