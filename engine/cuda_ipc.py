"""CUDA IPC weight payloads in SGLang's `/update_weights_from_tensor` format: written by the
trainer (`encode_bucket`), read by the embedded worker (`decode`) through an allowlist.

Role: the same-GPU weight path. A payload carries no tensor bytes, only CUDA IPC handles of the
trainer's device memory: the worker maps them (`cudaIpcOpenMemHandle`, through torch's own
`rebuild_cuda_tensor`) and copies from them into its weights, GPU to GPU.

Format, as read in the public sources of sgl-project/sglang (main branch, 2025-2026, v0.5.x era;
no SGLang server was run): `python/sglang/srt/entrypoints/http_server.py` (commit 0025436e)
`/update_weights_from_tensor` takes `UpdateWeightsFromTensorReqInput` {serialized_named_tensors:
one entry per TP rank, load_format, flush_cache, abort_all_requests, weight_version} and answers
{"success", "message"} (200 or 400); `python/sglang/srt/utils/common.py` (commit 004f0c7a)
`MultiprocessingSerializer`: an entry is base64 of `ForkingPickler(buf).dump(obj)`, read back by
`SafeUnpickler` (module-prefix allowlist: torch., sglang.srt.utils., sglang.srt.weight_sync
.tensor_bucket., ...); `python/sglang/srt/utils/patch_torch.py` (commit 04643955): CUDA tensors
reduce to torch's `rebuild_cuda_tensor` arguments with the device index (argument 6) replaced by
the GPU's UUID, rebuilt by `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`
(pytorch#149248: device indices differ between processes with different CUDA_VISIBLE_DEVICES);
`python/sglang/srt/weight_sync/tensor_bucket.py` (commit 07e90009) and `model_runner.py`
`update_weights_from_tensor`: with load_format "flattened_bucket" an entry is
{"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel)]}, each weight being flattened_tensor[start_idx:end_idx] reshaped
(and converted when its dtype differs); with load_format null, a list of (name, tensor).

Invariants:
- `encode_bucket` writes exactly that stream (the pickle names SGLang's rebuild function and
  metadata class, importable or not here), so a real SGLang server reads it; the trainer needs
  no sglang install. Nothing global is patched (no torch reduction is replaced).
- `decode` never unpickles arbitrary objects: its unpickler resolves only the names in
  `_ALLOWED` (the rebuild functions, mapped to `rebuild_checked`; torch's tensor, storage and
  Size classes and dtypes; the metadata class, mapped to `FlatMeta`); any other global is a
  `BadRequest` (engine/errors.py; a payload that is not SGLang's CUDA IPC format, or names
  something not allowed), and so is every argument or field of the wrong type or out of range.
- CUDA only: a CPU tensor cannot be sent (`encode_bucket` raises ValueError) and a CPU worker
  refuses IPC payloads before unpickling anything (engine/weight_endpoints.py). CPU tensors over
  torch's reductions need a file-descriptor or /dev/shm handover between related processes,
  which an HTTP request between unrelated ones does not give; the CPU path is base64 safetensors.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing import reductions

from engine.errors import BadRequest

SGLANG_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format of one flat tensor + metadata
DEVICE_ARG = 6  # index of the device among rebuild_cuda_tensor's arguments
NUM_REBUILD_ARGS = 15
MAX_TENSORS = 1 << 16  # weights in one payload
PICKLE_PROTOCOL = 4
_TORCH_REBUILD = reductions.rebuild_cuda_tensor  # torch's own, bound before anyone patches it


@dataclasses.dataclass
class FlatMeta:
    """SGLang's FlattenedTensorMetadata (same fields, same order)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# ----------------------------------------------------------------------------- writing
class _Name:
    """A global written by its (module, name), whether or not that module exists here."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # callable, as pickle wants of a reduce function
        raise TypeError(f"{self.module}.{self.name} is only a name to write into a pickle")


_REBUILD_NAME = _Name(*SGLANG_REBUILD)
_METADATA_NAME = _Name(*SGLANG_METADATA)


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, writing CUDA tensors and FlatMeta as SGLang's names."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, reduce: Callable[[torch.Tensor], tuple]):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self.reduce = reduce

    def save_name(self, obj: _Name) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch[_Name] = save_name

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _REBUILD_NAME, self.reduce(obj)
        if isinstance(obj, FlatMeta):
            return _METADATA_NAME, (obj.name, obj.shape, obj.dtype, obj.start_idx, obj.end_idx,
                                    obj.numel)
        return NotImplemented


_uuids: dict[int, str] = {}


def device_uuid(index: int) -> str:
    """The GPU's UUID as SGLang writes it (str of torch's device property)."""
    if index not in _uuids:
        _uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
    return _uuids[index]


def device_index(device: int | str) -> int:
    """This process's index of the GPU a payload names (SGLang's UUID, or a plain index)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if not isinstance(device, str):
        raise BadRequest(f"a tensor's device must be a GPU UUID or index, got {device!r}")
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == device:
            return i
    raise BadRequest(f"GPU {device} is not visible to this worker (CUDA IPC needs the "
                     f"trainer's GPU among this process's devices)")


def reduce_cuda(t: torch.Tensor) -> tuple:
    """torch's IPC reduction of a CUDA tensor, the device as its UUID (SGLang's patch)."""
    if not t.is_cuda:
        raise ValueError(f"CUDA IPC sends CUDA tensors only; got one on {t.device}")
    fn, args = reductions.reduce_tensor(t.detach())
    args = list(args)
    if isinstance(args[DEVICE_ARG], int):
        args[DEVICE_ARG] = device_uuid(args[DEVICE_ARG])
    return tuple(args)


def encode_bucket(flat: torch.Tensor, metadata: list[FlatMeta],
                  reduce: Callable[[torch.Tensor], tuple] = reduce_cuda) -> str:
    """One `serialized_named_tensors` entry for load_format "flattened_bucket": base64 of the
    pickle of {"flattened_tensor": flat, "metadata": metadata}."""
    return _encode({"flattened_tensor": flat, "metadata": metadata}, reduce)


def encode_named(named: list[tuple[str, torch.Tensor]],
                 reduce: Callable[[torch.Tensor], tuple] = reduce_cuda) -> str:
    """One entry for load_format null: base64 of the pickle of [(name, tensor), ...]."""
    return _encode([(n, t) for n, t in named], reduce)


def _encode(obj: Any, reduce: Callable[[torch.Tensor], tuple]) -> str:
    buf = io.BytesIO()
    _Pickler(buf, reduce).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flatten_metadata(named: list[tuple[str, torch.Tensor]]) -> tuple[list[FlatMeta], int]:
    """Metadata of `named` laid end to end in one flat tensor (one dtype), and its numel."""
    metadata, start = [], 0
    for name, t in named:
        metadata.append(FlatMeta(name, t.shape, t.dtype, start, start + t.numel(), t.numel()))
        start += t.numel()
    return metadata, start


# ----------------------------------------------------------------------------- reading
def rebuild_checked(*args: Any, rebuild: Callable[..., torch.Tensor] = _TORCH_REBUILD
                    ) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` after checking every argument's type (the device may be a
    UUID, as SGLang sends it); `rebuild` is torch's (a stand-in in CPU tests)."""
    if len(args) != NUM_REBUILD_ARGS:
        raise BadRequest(f"a CUDA tensor takes {NUM_REBUILD_ARGS} arguments, got {len(args)}")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
     storage_offset, requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    _check(tensor_cls in (torch.Tensor, torch.nn.Parameter), "tensor class", tensor_cls)
    _check(storage_cls in (torch.TypedStorage, torch.UntypedStorage), "storage class",
           storage_cls)
    _check(isinstance(dtype, torch.dtype), "dtype", dtype)
    for what, value in (("size", size), ("stride", stride)):
        _check(isinstance(value, tuple) and all(_is_index(v) for v in value), what, value)
    for what, value in (("offset", offset), ("storage size", storage_bytes),
                        ("storage offset", storage_offset), ("ref-counter offset", ref_offset)):
        _check(_is_index(value), what, value)
    for what, value in (("handle", handle), ("ref-counter handle", ref_handle),
                        ("event handle", event_handle)):
        _check(value is None or isinstance(value, bytes), what, value)
    _check(isinstance(requires_grad, bool) and isinstance(event_sync, bool), "flags",
           (requires_grad, event_sync))
    return rebuild(torch.Tensor, size, stride, offset, storage_cls, dtype, device_index(device),
                   handle, storage_bytes, storage_offset, False, ref_handle, ref_offset,
                   event_handle, event_sync)


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def _check(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise BadRequest(f"bad {what} in a CUDA tensor: {str(value)[:80]}")


_DTYPES = {name: getattr(torch, name) for name in dir(torch)
           if isinstance(getattr(torch, name, None), torch.dtype)}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, rebuild: Callable[..., torch.Tensor]):
        super().__init__(file)
        self.rebuild = rebuild

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REBUILD_NAMES:
            return self.rebuild
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        found = _ALLOWED.get((module, name))
        if found is None:
            raise BadRequest(f"{module}.{name} is not allowed in a weight payload (only "
                             f"CUDA tensors, their metadata and torch dtypes are)")
        return found


_REBUILD_NAMES = {SGLANG_REBUILD, ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"),
                  ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")}
_ALLOWED = {("torch", "Size"): torch.Size, ("torch", "Tensor"): torch.Tensor,
            ("torch._tensor", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch.storage", "TypedStorage"): torch.TypedStorage,
            ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
            ("torch", "UntypedStorage"): torch.UntypedStorage,
            SGLANG_METADATA: FlatMeta}


def is_pickle(raw: bytes) -> bool:
    """Whether decoded bytes start like a pickle (protocol 2 or later)."""
    return len(raw) >= 2 and raw[0] == 0x80


def b64decode(payload: Any) -> bytes:
    if not isinstance(payload, str):
        raise BadRequest("serialized_named_tensors entries must be base64 text")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("serialized_named_tensors[0] is not valid base64") from None


def decode(raw: bytes, load_format: str | None,
           rebuild: Callable[..., torch.Tensor] = rebuild_checked
           ) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one entry (pickle bytes), tensors viewing the sender's
    device memory; BadRequest for anything else."""
    try:
        obj = _Unpickler(io.BytesIO(raw), rebuild).load()
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or malformed streams, bad handles
        raise BadRequest(f"cannot read the CUDA IPC payload: {e}") from None
    if load_format == FLATTENED_BUCKET:
        return _unflatten(obj)
    if load_format is not None:
        raise BadRequest(f"load_format {load_format!r} is not supported here (null or "
                         f"{FLATTENED_BUCKET!r})")
    if not isinstance(obj, list) or len(obj) > MAX_TENSORS or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], torch.Tensor) for p in obj):
        raise BadRequest("a load_format null payload is a list of (name, tensor) pairs")
    return obj


def _unflatten(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise BadRequest("a flattened_bucket payload is {flattened_tensor, metadata}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1):
        raise BadRequest("flattened_tensor must be a 1-D tensor")
    if not (isinstance(metadata, list) and len(metadata) <= MAX_TENSORS
            and all(isinstance(m, FlatMeta) for m in metadata)):
        raise BadRequest(f"metadata must be a list of at most {MAX_TENSORS} "
                         f"FlattenedTensorMetadata")
    out = []
    for m in metadata:
        _check_meta(m, flat.numel())
        t = flat[m.start_idx:m.end_idx].view(tuple(m.shape))
        out.append((m.name, t if t.dtype == m.dtype else t.to(m.dtype)))
    return out


def _check_meta(m: FlatMeta, total: int) -> None:
    fields = [f.name for f in dataclasses.fields(FlatMeta)]
    if not all(hasattr(m, f) for f in fields):
        raise BadRequest(f"metadata needs the fields {fields}")
    shape_ok = isinstance(m.shape, tuple) and all(_is_index(d) for d in m.shape)
    if not (isinstance(m.name, str) and shape_ok and isinstance(m.dtype, torch.dtype)
            and all(_is_index(v) for v in (m.start_idx, m.end_idx, m.numel))
            and m.start_idx <= m.end_idx <= total and m.end_idx - m.start_idx == m.numel
            and math.prod(m.shape) == m.numel):
        raise BadRequest(f"inconsistent metadata for {str(m.name)[:80]}: shape "
                         f"{str(m.shape)[:80]}, [{m.start_idx}, {m.end_idx}) of {total}")
