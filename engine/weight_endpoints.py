"""SGLang's weight-update endpoints on the embedded engine: from disk, from a process group,
from serialized tensors; plus the group's init/destroy.

Role: `WeightEndpoints(scheduler).add_routes(app)` serves `/update_weights_from_disk`,
`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`
and `/update_weights_from_tensor` with SGLang's request fields (io_struct.py:
`UpdateWeightFromDiskReqInput`, `InitWeightsUpdateGroupReqInput` {master_address, master_port,
rank_offset, world_size, group_name = "weight_update_group", backend = "nccl"},
`UpdateWeightsFromDistributedReqInput` {names, dtypes, shapes, group_name, flush_cache,
abort_all_requests, weight_version, load_format}, `UpdateWeightsFromTensorReqInput`
{serialized_named_tensors, load_format, flush_cache, abort_all_requests, weight_version}: the
versions read are named in engine/cuda_ipc.py) and
its answers (`{"success", "message"}`, HTTP 200 or 400).

Invariants:
- A weight update is all or nothing: every tensor of a request is received and checked (name,
  shape) before any parameter changes; it runs at the scheduler's safe point (between waves, or
  at once while generation is paused) and `weight_version` changes only with a success.
- The group is joined with engine/dist_group.py (SGLang's way), this worker's rank being
  `rank_offset` (one rank: no tensor parallelism here); gloo receives on CPU, nccl on the GPU.
- Bodies are bounded before they are parsed (`read_body`, `parse_json`): 413 over the byte,
  array/object or value limits, 400 for malformed or too deeply nested JSON; never a 500.
- `/update_weights_from_tensor` reads both entry formats, told apart by their first bytes:
  base64 of a safetensors blob (name -> tensor; any device, the CPU included: what
  `TensorSync(serializer="safetensors")` sends), and SGLang's own payload of CUDA IPC handles
  (load_format null or "flattened_bucket", engine/cuda_ipc.py), read only by a worker on CUDA
  and only through engine/cuda_ipc.py's allowlist unpickler: a CPU worker refuses a pickle
  before reading it, and any name outside the allowlist is refused (never an arbitrary
  unpickle of what arrives over HTTP). Only the first entry is read (SGLang has one per TP
  rank; this engine has one rank); load_format "direct" is refused. An IPC update is
  synchronized before it answers, so the sender may reuse its buffer at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from aiohttp import web

from engine import cuda_ipc, dist_group
from engine.adapters import TENSOR_PATH
from engine.errors import BadRequest
from engine.scheduler import Scheduler
from models.lora import read_adapter
from models.moe import expert_views
from transport.dtypes import torch_dtype

MAX_BODY_BYTES = 64 << 20  # default limit of a request body (bytes; 413 above it)
MAX_TENSOR_BODY_BYTES = 256 << 20  # /update_weights_from_tensor bodies carry weights (bytes)
MAX_JSON_CONTAINERS = 1 << 18  # '[' and '{' bytes in a JSON body (count; 413 above it)
MAX_JSON_VALUES = 1 << 22  # ',' bytes in a JSON body (count; 413 above it)


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The request body; BadRequest(413) as soon as its Content-Length or the bytes received
    pass `max_bytes` (what is left is never read)."""
    size = request.content_length
    if size is not None and size > max_bytes:
        raise BadRequest(f"request body of {size} bytes, limit is {max_bytes}", 413)
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(f"request body over {max_bytes} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """JSON of a body, its parse time and memory bounded first: BadRequest(413) for more than
    MAX_JSON_CONTAINERS arrays/objects or MAX_JSON_VALUES values (counted as bracket and comma
    bytes, inside strings too: an over-count), BadRequest(400) if malformed or too deeply
    nested (deeper than the interpreter's recursion limit, ~1000 levels)."""
    containers, commas = raw.count(b"[") + raw.count(b"{"), raw.count(b",")
    if containers > MAX_JSON_CONTAINERS or commas > MAX_JSON_VALUES:
        raise BadRequest(f"JSON body with {containers} arrays/objects and {commas} commas; "
                         f"limits are {MAX_JSON_CONTAINERS} and {MAX_JSON_VALUES}", 413)
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("Invalid JSON in the request body: nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise BadRequest(f"Invalid JSON in the request body: {e}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def _common(body: dict) -> tuple[str | None, bool]:
    version, abort_all = body.get("weight_version"), body.get("abort_all_requests", False)
    _require(version is None or isinstance(version, str), "weight_version must be a string")
    _require(isinstance(abort_all, bool), "abort_all_requests must be true or false")
    _require(isinstance(body.get("flush_cache", True), bool), "flush_cache must be true or false")
    return version, abort_all


def parse_dtype(name: Any) -> torch.dtype:
    """A request's dtype name ("bfloat16", or SGLang's str(dtype) "torch.bfloat16")."""
    try:
        return torch_dtype(name)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def parse_init_group(body: Any) -> dict[str, Any]:
    _require(isinstance(body, dict), "the request body must be a JSON object")
    out = {"master_address": body.get("master_address"), "master_port": body.get("master_port"),
           "rank_offset": body.get("rank_offset"), "world_size": body.get("world_size"),
           "group_name": body.get("group_name", dist_group.DEFAULT_GROUP_NAME),
           "backend": body.get("backend", "nccl")}
    _require(isinstance(out["master_address"], str), "master_address (a host) is required")
    for key in ("master_port", "rank_offset", "world_size"):
        _require(isinstance(out[key], int) and not isinstance(out[key], bool),
                 f"{key} must be an integer")
    _require(0 < out["rank_offset"] < out["world_size"],
             "rank_offset must be in [1, world_size): rank 0 is the trainer")
    _require(isinstance(out["group_name"], str) and out["group_name"], "group_name is required")
    return out


def parse_update_distributed(body: Any) -> dict[str, Any]:
    _require(isinstance(body, dict), "the request body must be a JSON object")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    _require(isinstance(names, list) and all(isinstance(n, str) for n in names) and names,
             "names must be a non-empty list of parameter names")
    _require(isinstance(dtypes, list) and len(dtypes) == len(names),
             "dtypes must have one entry per name")
    _require(isinstance(shapes, list) and len(shapes) == len(names) and all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes),
        "shapes must have one list of non-negative integers per name")
    _require(body.get("load_format") is None, "load_format must be null on this engine")
    version, abort_all = _common(body)
    group_name = body.get("group_name", dist_group.DEFAULT_GROUP_NAME)
    _require(isinstance(group_name, str), "group_name must be a string")
    return {"names": names, "dtypes": [parse_dtype(d) for d in dtypes], "shapes": shapes,
            "group_name": group_name,
            "weight_version": version, "abort_all_requests": abort_all}


def decode_tensors(payload: Any, device: str = "cpu", load_format: str | None = None
                   ) -> dict[str, torch.Tensor]:
    """One serialized_named_tensors entry -> {name: tensor}: base64 safetensors, or (a worker on
    CUDA only) SGLang's CUDA IPC pickle through engine/cuda_ipc.py; anything else is refused."""
    from safetensors.torch import load

    raw = cuda_ipc.b64decode(payload)
    if cuda_ipc.is_pickle(raw):
        _require(str(device).startswith("cuda"),
                 f"serialized_named_tensors[0] is a pickle (SGLang's CUDA IPC format); this "
                 f"worker runs on {device} and reads those only on CUDA, through an allowlist "
                 f"(it never unpickles anything else): send base64(safetensors.torch.save("
                 f"named_tensors)) (weight_sync.path = 'tensor')")
        try:
            return dict(cuda_ipc.decode(raw, load_format))
        except BadRequest as e:
            raise BadRequest(f"serialized_named_tensors[0]: {e}") from None
    _require(load_format is None, f"load_format {load_format!r} goes with SGLang's CUDA IPC "
                                  f"payloads; a safetensors entry takes load_format null")
    header_len = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else -1
    _require(0 < header_len <= len(raw) - 8 and raw[8:9] == b"{",
             "serialized_named_tensors[0] is neither a safetensors blob nor SGLang's CUDA IPC "
             "payload: send base64(safetensors.torch.save(named_tensors))")
    try:
        return load(raw)
    except Exception as e:  # noqa: BLE001 - a corrupt blob is the caller's mistake
        raise BadRequest(f"serialized_named_tensors[0]: bad safetensors blob: {e}") \
            from None


def parse_update_tensor(body: Any, device: str = "cpu") -> dict[str, Any]:
    _require(isinstance(body, dict), "the request body must be a JSON object")
    entries = body.get("serialized_named_tensors")
    _require(isinstance(entries, list) and entries,
             "serialized_named_tensors must be a non-empty list (one entry per TP rank)")
    load_format = body.get("load_format")
    _require(load_format in (None, cuda_ipc.FLATTENED_BUCKET),
             f"load_format {load_format!r} is not supported here (null or "
             f"{cuda_ipc.FLATTENED_BUCKET!r})")
    version, abort_all = _common(body)
    return {"tensors": decode_tensors(entries[0], device, load_format), "weight_version": version,
            "abort_all_requests": abort_all}


def load_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters/buffers by name; checks every name and shape
    first, so a bad request changes nothing. Tied weights may be sent under either name, fused
    MoE experts under their checkpoint names (models/moe.py) or as the fused tensor."""
    targets = {**dict(model.named_buffers()),
               **dict(model.named_parameters(remove_duplicate=False))}
    targets = {n.replace(".base_layer.", "."): t for n, t in targets.items()  # LoRA layers'
               if ".lora_A." not in n and ".lora_B." not in n}  # base weights: HF names
    targets |= expert_views(targets)  # fused MoE experts: also by each expert's checkpoint name
    unknown = sorted(set(tensors) - set(targets))
    _require(not unknown, f"unknown parameter names {unknown[:5]}")
    for name, t in tensors.items():
        _require(tuple(t.shape) == tuple(targets[name].shape),
                 f"shape of {name}: model {tuple(targets[name].shape)}, sent {tuple(t.shape)}")
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name].copy_(t.to(dtype=targets[name].dtype, device=targets[name].device))


def load_and_let_go(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """`load_named_tensors`, then (CUDA) wait for the copies and drop the received tensors: for
    CUDA IPC ones this closes the sender's handles, so it may reuse or free its buffer."""
    try:
        load_named_tensors(model, tensors)
        cuda = {t.device for t in tensors.values() if t.is_cuda}
        cuda |= {p.device for p in model.parameters() if p.is_cuda}
        for device in cuda:
            torch.cuda.synchronize(device)
    finally:
        tensors.clear()


def _answer(ok: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": ok, "message": message, **extra},
                             status=200 if ok else 400)


async def _json(request: web.Request, max_bytes: int) -> Any:
    raw = await read_body(request, max_bytes)
    return parse_json(raw) if raw.strip() else {}


def _refused(e: BadRequest, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": str(e), **extra}, status=e.status)


class WeightEndpoints:
    """The weight-update HTTP handlers of one engine; `close()` leaves every group."""

    def __init__(self, scheduler: Scheduler, group_timeout_s: float = 600.0,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 max_tensor_body_bytes: int = MAX_TENSOR_BODY_BYTES):
        self.scheduler = scheduler
        self.max_body_bytes, self.max_tensor_body_bytes = max_body_bytes, max_tensor_body_bytes
        self.group_timeout_s = group_timeout_s  # rendezvous and each collective must finish
        # group name -> its process group, backend and thread: joins and receives block, so they
        # run in the group's own thread, off the event loop and the engine thread; a receive
        # stuck on a lost sender holds only that thread (until the group's timeout), never the
        # next group's join
        self.groups: dict[str, _JoinedGroup] = {}
        # decoding a tensor body copies every tensor: off the event loop too
        self._decode_pool = ThreadPoolExecutor(1, thread_name_prefix="weight-decode")

    def add_routes(self, app: web.Application) -> None:
        add = app.router.add_route
        add("POST", "/update_weights_from_disk", self.update_from_disk)
        add("POST", "/init_weights_update_group", self.init_group)
        add("POST", "/update_weights_from_distributed", self.update_from_distributed)
        add("POST", "/destroy_weights_update_group", self.destroy_group)
        add("POST", "/update_weights_from_tensor", self.update_from_tensor)
        add("POST", "/load_lora_adapter", self.load_lora)
        add("POST", "/load_lora_adapter_from_tensors", self.load_lora_from_tensors)
        add("POST", "/unload_lora_adapter", self.unload_lora)

    # ---- LoRA adapters (engine/adapters.py): SGLang's LoRAUpdateOutput answers -------------
    def _lora_answer(self, error: str = "") -> web.Response:
        return web.json_response({"success": not error, "error_message": error or None,
                                  "loaded_adapters": self.scheduler.adapters.loaded()},
                                 status=400 if error else 200)

    async def _load_lora(self, request: web.Request, max_bytes: int, read) -> web.Response:
        try:
            body = await _json(request, max_bytes)
            _require(isinstance(body, dict), "the request body must be a JSON object")
            name, pinned = body.get("lora_name"), body.get("pinned", False)
            _require(isinstance(name, str) and bool(name), "lora_name must be a non-empty string")
            _require(isinstance(pinned, bool), "pinned must be true or false")
            path, config, tensors = await asyncio.get_running_loop().run_in_executor(
                self._decode_pool, read, body, str(self.scheduler.device))
            try:
                await self.scheduler.load_adapter(name, path, config, tensors, pinned)
            finally:
                tensors.clear()  # CUDA IPC ones: the sender's handles close
        except BadRequest as e:
            return self._lora_answer(str(e))
        return self._lora_answer()

    async def load_lora(self, request: web.Request) -> web.Response:
        """`{lora_name, lora_path, pinned}`: a PEFT adapter directory."""
        return await self._load_lora(request, self.max_body_bytes, _adapter_from_disk)

    async def load_lora_from_tensors(self, request: web.Request) -> web.Response:
        """`{lora_name, config_dict, serialized_tensors, load_format, pinned}`."""
        return await self._load_lora(request, self.max_tensor_body_bytes, _adapter_from_body)

    async def unload_lora(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, self.max_body_bytes)
            _require(isinstance(body, dict) and isinstance(body.get("lora_name"), str),
                     "lora_name must be a string")
            self.scheduler.adapters.unload(body["lora_name"])
        except BadRequest as e:
            return self._lora_answer(str(e))
        return self._lora_answer()

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            path, version, abort_all = _disk_args(await _json(request, self.max_body_bytes))
        except BadRequest as e:
            return _refused(e, num_paused_requests=0)
        ok, message, held = await self.scheduler.update_weights_from_disk(path, version, abort_all)
        return _answer(ok, message, num_paused_requests=held)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            args = parse_init_group(await _json(request, self.max_body_bytes))
        except BadRequest as e:
            return _refused(e)
        name, backend = args["group_name"], args["backend"]
        if name in self.groups:
            return _answer(False, f"group {name!r} exists; call /destroy_weights_update_group "
                                  f"first")
        if backend == "nccl" and not str(self.scheduler.device).startswith("cuda"):
            return _answer(False, "backend nccl needs a CUDA device; this worker runs on "
                                  f"{self.scheduler.device}: use backend gloo")
        joined = _JoinedGroup(backend)
        self.groups[name] = joined  # taken now: a second join of the name is refused meanwhile
        try:
            joined.handle = await joined.run(
                dist_group.new_group, backend, args["master_address"], args["master_port"],
                args["rank_offset"], args["world_size"], name, self.group_timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            if self.groups.get(name) is joined:
                del self.groups[name]
            await joined.leave()
            return _answer(False, f"Failed to init the weight update group {name!r}: {e}")
        return _answer(True, "Succeeded to initialize custom process group.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            args = parse_update_distributed(await _json(request, self.max_body_bytes))
        except BadRequest as e:
            return _refused(e)
        if args["group_name"] not in self.groups:
            return _answer(False, f"no weight update group {args['group_name']!r}; call "
                                  f"/init_weights_update_group first")
        joined = self.groups[args["group_name"]]
        if joined.handle is None:
            return _answer(False, f"weight update group {args['group_name']!r} is still "
                                  f"being joined")
        device = self.scheduler.device if joined.backend == "nccl" else "cpu"
        try:  # receive everything first: the sender's broadcasts must always complete
            tensors = await joined.run(_receive, args, joined.handle, device)
        except Exception as e:  # noqa: BLE001 - a broken group is reported, the engine goes on
            return _answer(False, f"Failed to receive weights: {e}")
        ok, message, _ = await self.scheduler.update_weights(
            lambda: load_named_tensors(self.scheduler.model, tensors), None,
            args["weight_version"], args["abort_all_requests"], "distributed")
        return _answer(ok, message)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, self.max_tensor_body_bytes)
            args = await asyncio.get_running_loop().run_in_executor(
                self._decode_pool, parse_update_tensor, body, str(self.scheduler.device))
        except BadRequest as e:
            return _refused(e)
        ok, message, _ = await self.scheduler.update_weights(
            lambda: load_and_let_go(self.scheduler.model, args["tensors"]), None,
            args["weight_version"], args["abort_all_requests"], "tensor")
        args["tensors"].clear()  # also when the update was refused before loading
        return _answer(ok, message)

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, self.max_body_bytes)
        except BadRequest as e:
            return _refused(e)
        name = body.get("group_name", dist_group.DEFAULT_GROUP_NAME) \
            if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self.groups:
            return _answer(False, f"no weight update group {name!r}")
        await self.groups.pop(name).leave()
        return _answer(True, "Succeeded to destroy custom process group.")

    async def close(self) -> None:
        for joined in self.groups.values():
            await joined.leave()
        self.groups.clear()
        self._decode_pool.shutdown(wait=False)


class _JoinedGroup:
    """A weight-update group this engine joined. Its blocking calls (join, receives) run in
    threads of their own (engine.dist_group.in_thread): one stuck on a lost sender holds nothing
    else up."""

    def __init__(self, backend: str):
        self.backend, self.handle = backend, None
        self._job: asyncio.Future | None = None

    def run(self, fn, *args) -> asyncio.Future:
        self._job = dist_group.in_thread(fn, *args)
        return self._job

    async def leave(self) -> None:
        """An idle group is destroyed, a busy one (a receive waiting for a sender that is gone)
        aborted; waits at most 10 s for either."""
        handle, busy = self.handle, self._job is not None and not self._job.done()
        self.handle = None
        if handle is not None:
            with contextlib.suppress(Exception, TimeoutError):
                await asyncio.wait_for(dist_group.in_thread(
                    dist_group.abort if busy else dist_group.destroy, handle), 10.0)


def _receive(args: dict[str, Any], group, device: str) -> dict[str, torch.Tensor]:
    """Receive one bucket; its tensors are allocated on the current stream (the engine's
    copies from them are ordered after the receive's synchronize, see dist_group)."""
    tensors = [torch.empty(shape, dtype=dtype, device=device)
               for dtype, shape in zip(args["dtypes"], args["shapes"])]
    dist_group.receive_many(tensors, group)
    return dict(zip(args["names"], tensors))


def _adapter_from_disk(body: dict, device: str) -> tuple[str, dict, dict[str, torch.Tensor]]:
    path = body.get("lora_path")
    _require(isinstance(path, str) and bool(path), "lora_path (a PEFT adapter directory) is "
                                                   "required")
    try:
        config, tensors = read_adapter(path)
    except (OSError, ValueError) as e:
        raise BadRequest(f"cannot load the LoRA adapter at {path}: {e}") from None
    return path, config, tensors


def _adapter_from_body(body: dict, device: str) -> tuple[str, dict, dict[str, torch.Tensor]]:
    config, payload = body.get("config_dict"), body.get("serialized_tensors")
    _require(isinstance(config, dict), "config_dict (the adapter's adapter_config.json) must "
                                       "be a JSON object")
    _require(isinstance(payload, str) and bool(payload),
             "serialized_tensors must be a string: base64(safetensors.torch.save(tensors))")
    load_format = body.get("load_format")
    _require(load_format in (None, cuda_ipc.FLATTENED_BUCKET),
             f"load_format {load_format!r} is not supported here (null: base64 safetensors, or "
             f"{cuda_ipc.FLATTENED_BUCKET!r}: SGLang's CUDA IPC payload, on a CUDA worker)")
    try:
        return TENSOR_PATH, config, decode_tensors(payload, device, load_format)
    except BadRequest as e:  # its messages name the weight update's field
        raise BadRequest(str(e).replace("serialized_named_tensors[0]", "serialized_tensors")) \
            from None


def _disk_args(body: Any) -> tuple[str, str | None, bool]:
    _require(isinstance(body, dict), "the request body must be a JSON object")
    path, fmt = body.get("model_path"), body.get("load_format")
    _require(isinstance(path, str) and bool(path),
             "model_path (a checkpoint directory) is required")
    _require(fmt in (None, "auto", "safetensors"),
             f"load_format {fmt!r} is not supported (auto or safetensors)")
    version, abort_all = _common(body)
    return path, version, abort_all
