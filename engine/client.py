"""An asyncio client for SGLang's native HTTP API (real SGLang, sglang-router, or engine.server).

Role: the one way the rest of the system talks to inference servers. Invariant: it only uses
request/response shapes that real SGLang serves (see engine/server.py for the matched sources),
so it works unchanged against SGLang; where SGLang versions differ it falls back (e.g. the weight
version: `/get_weight_version`, then `/model_info`; server info: `/server_info`, then
`/get_server_info`).

Errors (engine/errors.py): a non-2xx answer raises `EngineHTTPError` (status, path, and the
server's message taken from `{"error": {"message"}}`, `{"message"}`, `{"detail"}` or the raw
text). Connection failures are retried with exponential backoff: refused/unreachable connections
on every call (nothing was sent), dropped connections only on GET calls (a POST such as
/generate may already have run); when retries run out, `EngineUnavailable`. A call that exceeds
`timeout_s` raises `TimeoutError` and is not retried.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from engine.errors import EngineError, EngineHTTPError, EngineUnavailable

ROUTING_HEADER = "X-SMG-Routing-Key"
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


def error_message(raw: bytes) -> str:
    """The server's error text out of an SGLang (or FastAPI/OpenAI-style) error body."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message", "detail", "error"):  # error_message: LoRA's
            if body.get(key):
                return str(body[key])
    return text


def _retryable(error: aiohttp.ClientError, method: str) -> bool:
    if isinstance(error, aiohttp.ClientConnectorError):
        return True
    return method == "GET" and isinstance(error, aiohttp.ClientConnectionError)


class SglangClient:
    """Async client of one SGLang-compatible server; create and use it inside the event loop."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, connect_timeout_s: float = 10.0,
                 retries: int = 3, backoff_s: float = 0.2):
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ API
    async def generate(self, input_ids: list[int] | list[list[int]],
                       sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                       return_logprob: bool = True, rid: str | list[str] | None = None,
                       routing_key: str | None = None, return_routed_experts: bool = False,
                       **extra: Any) -> Any:
        """POST /generate with token ids (a list of lists is a batch: the answer is a list).

        `return_routed_experts`: a mixture-of-experts server (SGLang started with
        --enable-return-routed-experts) answers with `meta_info.routed_experts`, base64 of the
        int32 expert ids [seqlen - 1, num_hidden_layers, top_k] (engine/session.py decodes
        them); one flag for every prompt of a batch. `extra` passes further GenerateReqInput
        fields (logprob_start_len, top_logprobs_num, ...).
        """
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params or {},
                                "return_logprob": return_logprob, **extra}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
        headers = {ROUTING_HEADER: routing_key} if routing_key is not None else None
        return await self._call("POST", "/generate", body, headers)

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None,
                                       **extra: Any) -> dict[str, Any]:
        """Load new weights from a checkpoint directory; returns {"success", "message", ...}."""
        body = {"model_path": path, **extra}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_disk", body)

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        """Make the server join a torch.distributed group (it blocks until rank 0 joins too)."""
        return await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None,
                                              flush_cache: bool = True,
                                              **extra: Any) -> dict[str, Any]:
        """Receive these tensors by broadcast from rank 0 of the group, in this order."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, **extra}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_distributed", body)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str],
                                         weight_version: str | None = None,
                                         flush_cache: bool = True,
                                         **extra: Any) -> dict[str, Any]:
        """Load serialized named tensors (one entry per TP rank; see engine/weight_sync.py)."""
        body = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache,
                **extra}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_tensor", body)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False
                                ) -> dict[str, Any]:
        """Load a PEFT adapter directory under `lora_name`; returns SGLang's LoRAUpdateOutput
        {"success", "error_message", "loaded_adapters"}."""
        return await self._call("POST", "/load_lora_adapter", {
            "lora_name": lora_name, "lora_path": lora_path, "pinned": pinned})

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict[str, Any],
                                             serialized_tensors: str, pinned: bool = False,
                                             load_format: str | None = None) -> dict[str, Any]:
        """Load an adapter sent in the body (`config_dict`: its adapter_config.json)."""
        return await self._call("POST", "/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config_dict,
            "serialized_tensors": serialized_tensors, "pinned": pinned,
            "load_format": load_format})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                           ) -> dict[str, Any]:
        return await self._call("POST", "/destroy_weights_update_group",
                                {"group_name": group_name})

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """Pause; mode "abort" (SGLang's default: requests in flight end with finish_reason
        abort), "retract" (held, their KV cache dropped and prefilled again on continue) or
        "in_place" (held with their KV cache). Held requests finish after
        `continue_generation`, with the weights loaded meanwhile."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; use one of {PAUSE_MODES}")
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._call("POST", "/continue_generation", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> None:
        """Flush the prefix cache; EngineHTTPError(400) when requests are running or queued."""
        await self._call("POST", "/flush_cache", None)

    async def get_weight_version(self) -> str:
        try:
            body = await self._call("GET", "/get_weight_version")
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            body = await self._call("GET", "/model_info")
        return body["weight_version"]

    async def health(self) -> bool:
        """True when GET /health answers 200; False on an error status or no connection."""
        try:
            await self._call("GET", "/health")
        except EngineError:  # an error status, or no connection
            return False
        return True

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    async def server_info(self) -> dict[str, Any]:
        try:
            return await self._call("GET", "/server_info")
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            return await self._call("GET", "/get_server_info")

    async def model_info(self) -> dict[str, Any]:
        try:
            return await self._call("GET", "/model_info")
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            return await self._call("GET", "/get_model_info")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "SglangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ transport
    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _call(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> Any:
        """One request with retries; the decoded JSON answer (None for an empty/non-JSON 2xx)."""
        url = self.base_url + path
        for attempt in range(self.retries + 1):
            try:
                return await self._once(method, url, path, body, headers)
            except TimeoutError:  # aiohttp's timeout errors are TimeoutErrors too: not retried
                raise
            except aiohttp.ClientError as e:
                if isinstance(e, aiohttp.ClientResponseError) or not _retryable(e, method):
                    raise EngineUnavailable(f"{method} {url} failed: {e}") from e
                if attempt == self.retries:
                    raise EngineUnavailable(f"{method} {url} failed after "
                                            f"{self.retries + 1} attempts: {e}") from e
                await asyncio.sleep(self.backoff_s * (2 ** attempt))
        raise AssertionError("unreachable")

    async def _once(self, method: str, url: str, path: str, body: Any,
                    headers: dict[str, str] | None) -> Any:
        kwargs: dict[str, Any] = {"headers": headers}
        if body is not None:
            kwargs["json"] = body
        async with self._get_session().request(method, url, **kwargs) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise EngineHTTPError(resp.status, path, error_message(raw))
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")


async def wait_for_health(url: str, exited, timeout_s: float, request_timeout_s: float = 5.0,
                          poll_s: float = 0.2) -> bool:
    """Poll `url`/health until it answers 200 (True) or `timeout_s` passes (False). `exited()`
    returns an error message once the server's process has died (raised as RuntimeError), else
    None: a dead server fails at once instead of at the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            message = exited()
            if message is not None:
                raise RuntimeError(message)
            try:
                async with session.get(f"{url}/health",
                                       timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(poll_s)
    return False
