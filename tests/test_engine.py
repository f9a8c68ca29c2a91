"""engine/ + actors/inference.py: SGLang API conformity of a running InferenceWorker, log-prob
alignment with algos.logprobs, batching, weight updates, pause/abort, release/resume, errors."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from contextlib import asynccontextmanager

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from actors.inference import InferenceWorker
from algos.logprobs import token_logprobs
from engine.client import ROUTING_HEADER, SglangClient
from engine.errors import EngineHTTPError, EngineUnavailable
from engine.session import HttpSession
from engine.weight_sync import make_weight_sync
from models.load import save_checkpoint
from models.tiny import build_tiny
from runtime.actor import Status
from tests.helpers import context, running
from transport.http import stop_http

PROMPT = [5, 6, 41, 7, 44]  # "12+3="


@asynccontextmanager
async def serve(ipc, **cfg):
    """A running InferenceWorker and a client of its HTTP server."""
    worker = InferenceWorker(context("inf", ipc), InferenceWorker.Config(**cfg))
    async with running(worker, timeout_s=30):
        client = SglangClient(worker.bound.http, timeout_s=30)
        try:
            yield worker, client
        finally:
            await client.close()


async def post(client: SglangClient, path: str, body=None, data: bytes | None = None):
    """Raw POST (status, parsed body) for requests the client would not build."""
    session = client._get_session()
    kwargs = {"data": data} if data is not None else {"json": body}
    async with session.post(client.base_url + path, **kwargs) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw) if raw.strip() else None


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float):
    """Log-probs of `output` given `prompt` from one separate full forward (algos.logprobs)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=temperature)[0]
    return lp[len(prompt) - 1:]


def out_logprobs(resp: dict) -> list[float]:
    return [lp for lp, _, _ in resp["meta_info"]["output_token_logprobs"]]


# ----------------------------------------------------------------------------- API shapes
async def test_generate_response_shapes(ipc):
    async with serve(ipc) as (worker, client):
        sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        single = await client.generate(PROMPT, sp, rid="r-single")
        assert set(single) == {"text", "output_ids", "meta_info"}
        meta = single["meta_info"]
        assert meta["id"] == "r-single"
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 6)
        assert meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
        assert meta["total_retractions"] == 0
        assert len(single["output_ids"]) == 6
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == single["output_ids"]
        assert all(isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)
        # logprob_start_len -1 (the default) is SGLang's window of the last prompt token: null
        assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
        assert "output_top_logprobs" not in meta
        assert single["text"] == worker.scheduler.tokenizer.decode(single["output_ids"],
                                                                   skip_special_tokens=True)

        status, by_text = await post(client, "/generate", {"text": "12+3=", "sampling_params": sp})
        assert status == 200 and by_text["output_ids"] == single["output_ids"]
        assert "input_token_logprobs" not in by_text["meta_info"]  # return_logprob defaults off

        batch = await client.generate([PROMPT, [9, 10], PROMPT], sp, rid=["a", "b", "c"])
        assert isinstance(batch, list) and [r["meta_info"]["id"] for r in batch] == ["a", "b", "c"]
        assert batch[0]["output_ids"] == batch[2]["output_ids"] == single["output_ids"]
        assert batch[1]["meta_info"]["prompt_tokens"] == 2

        status, texts = await post(client, "/generate", {
            "text": ["12+3=", "ab"], "rid": "t",
            "sampling_params": [sp, {**sp, "max_new_tokens": 2}]})
        assert status == 200 and [r["meta_info"]["id"] for r in texts] == ["t_0", "t_1"]
        assert texts[0]["output_ids"] == single["output_ids"]
        assert texts[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


async def test_teacher_scoring_input_logprobs_and_top_logprobs(ipc):
    async with serve(ipc) as (worker, client):
        seq = PROMPT + [15, 9, 2]
        scored = await client.generate(seq, {"max_new_tokens": 0}, logprob_start_len=0)
        meta = scored["meta_info"]
        assert scored["output_ids"] == [] and meta["output_token_logprobs"] == []
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == seq and entries[0][0] is None
        ref = reference_logprobs(worker.scheduler.model, seq[:1], seq[1:], 1.0)
        assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), ref, atol=1e-5, rtol=0)

        tail = await client.generate(seq, {"max_new_tokens": 0}, logprob_start_len=3)
        assert [e[1] for e in tail["meta_info"]["input_token_logprobs"]] == seq[3:]
        # SGLang: null at the window's first token although it has context; the rest agree
        assert tail["meta_info"]["input_token_logprobs"][0] == [None, seq[3], None]
        assert tail["meta_info"]["input_token_logprobs"][1:] == entries[4:]
        default = await client.generate(seq, {"max_new_tokens": 0})  # -1 when scoring: none
        assert default["meta_info"]["input_token_logprobs"] == []

        top = await client.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0},
                                    logprob_start_len=0, top_logprobs_num=3)
        meta = top["meta_info"]
        assert len(meta["output_top_logprobs"]) == 4
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 5
        for chosen, tops in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
            values = [t[0] for t in tops]
            assert len(tops) == 3 and values == sorted(values, reverse=True)
            assert tops[0][1] == chosen[1] and tops[0][0] == pytest.approx(chosen[0])  # greedy


async def test_finish_reasons(ipc):
    async with serve(ipc) as (worker, client):
        tok = worker.scheduler.tokenizer
        greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        base = await client.generate(PROMPT, greedy)
        ids = base["output_ids"]

        stop_id = await client.generate(PROMPT, {**greedy, "stop_token_ids": [ids[2]]})
        first = ids.index(ids[2])
        assert stop_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
        assert stop_id["output_ids"] == ids[:first + 1]
        assert stop_id["text"] == tok.decode(ids[:first], skip_special_tokens=True)

        visible = tok.decode(ids, skip_special_tokens=True)
        stop_str = visible[2:4]
        by_str = await client.generate(PROMPT, {**greedy, "stop": [stop_str, "never!"]})
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert stop_str not in by_str["text"] and visible.startswith(by_str["text"])
        kept = await client.generate(PROMPT, {**greedy, "stop": stop_str, "no_stop_trim": True})
        assert kept["text"].endswith(stop_str)

        # eos: near-uniform sampling over 54 tokens hits <eos> (id 2) in some of 24 seeded runs
        hot = [{"max_new_tokens": 100, "temperature": 50.0, "sampling_seed": s} for s in range(24)]
        runs = await client.generate([PROMPT] * 24, hot)
        eos_runs = [r for r in runs if r["meta_info"]["finish_reason"]["type"] == "stop"]
        assert eos_runs, "no run sampled <eos>"
        for r in eos_runs:
            assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
            assert r["output_ids"][-1] == 2 and 2 not in r["output_ids"][:-1]
        seed = hot[runs.index(eos_runs[0])]["sampling_seed"]
        on = await client.generate(PROMPT, {**hot[seed], "ignore_eos": True})
        n = len(eos_runs[0]["output_ids"])
        assert on["output_ids"][:n] == eos_runs[0]["output_ids"] and len(on["output_ids"]) > n


@pytest.mark.parametrize("temperature,extra", [(1.0, {}), (0.7, {"top_p": 0.9, "top_k": 20})])
async def test_logprob_alignment_with_training_forward(ipc, temperature, extra):
    async with serve(ipc) as (worker, client):
        sp = {"max_new_tokens": 24, "temperature": temperature, "sampling_seed": 11, **extra}
        prompts = [PROMPT, [12, 13, 40, 9, 41], [30]]
        results = await client.generate(prompts, sp)
        for prompt, r in zip(prompts, results):
            ref = reference_logprobs(worker.scheduler.model, prompt, r["output_ids"], temperature)
            got = torch.tensor(out_logprobs(r))
            assert len(got) == len(r["output_ids"]) > 0
            assert torch.allclose(got, ref, atol=1e-5, rtol=0)
            assert abs(got.sum().item() - ref.sum().item()) < 1e-5 * max(1, len(got))


# ----------------------------------------------------------------------------- batching
async def test_concurrent_requests_share_waves_and_match_sequential(ipc):
    async with serve(ipc, batch_wait_ms=50.0) as (worker, client):
        prompts = [PROMPT[: 1 + i % 5] + [10 + i] for i in range(8)]
        sps = [{"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 100 + i}
               for i in range(8)]
        together = await asyncio.gather(*(client.generate(p, sp) for p, sp in zip(prompts, sps)))
        sizes = list(worker.scheduler.wave_sizes)
        assert len(sizes) < 8 and max(sizes) > 1 and sum(sizes) == 8
        for p, sp, batched in zip(prompts, sps, together):
            alone = await client.generate(p, sp)
            assert alone["output_ids"] == batched["output_ids"]
            assert alone["meta_info"]["finish_reason"] == batched["meta_info"]["finish_reason"]
            assert torch.allclose(torch.tensor(out_logprobs(alone)),
                                  torch.tensor(out_logprobs(batched)), atol=1e-5, rtol=0)
        assert worker.scheduler.wave_sizes[len(sizes):] == [1] * 8


# ----------------------------------------------------------------------------- weights
async def test_update_weights_from_disk(ipc, tmp_path):
    async with serve(ipc) as (_worker, client):
        greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        before = await client.generate(PROMPT, greedy)
        model, tok = build_tiny("tiny-qwen2", seed=0)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(7)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        save_checkpoint(model, tok, str(tmp_path))
        reply = await client.update_weights_from_disk(str(tmp_path), weight_version="7")
        assert reply["success"] is True and "7" in reply["message"]
        assert reply["num_paused_requests"] == 0
        after = await client.generate(PROMPT, greedy)
        assert after["meta_info"]["weight_version"] == "7"
        assert await client.get_weight_version() == "7"
        assert (await client.model_info())["weight_version"] == "7"
        assert after["output_ids"] != before["output_ids"] or out_logprobs(after) != pytest.approx(
            out_logprobs(before), abs=1e-3)
        ref = reference_logprobs(model, PROMPT, after["output_ids"], 1.0)
        assert torch.allclose(torch.tensor(out_logprobs(after)), ref, atol=1e-5, rtol=0)

        with pytest.raises(EngineHTTPError) as err:
            await client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="8")
        assert err.value.status == 400 and "missing" in err.value.message
        assert await client.get_weight_version() == "7"
        bad = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
        for change, expected in ((dict(bad, **{"model.norm.weight": torch.ones(3)}),
                                  "shape of model.norm.weight"),
                                 (dict(bad, extra=torch.ones(1)), "unexpected ['extra']"),
                                 ({"model.norm.weight": bad["model.norm.weight"]}, "missing [")):
            (tmp_path / "bad").mkdir(exist_ok=True)
            save_file(change, str(tmp_path / "bad" / "model.safetensors"))
            with pytest.raises(EngineHTTPError) as err:
                await client.update_weights_from_disk(str(tmp_path / "bad"), weight_version="9")
            assert err.value.status == 400 and expected in err.value.message
        assert await client.get_weight_version() == "7"
        assert torch.allclose(torch.tensor(out_logprobs(await client.generate(PROMPT, greedy))),
                              ref, atol=1e-5, rtol=0)  # refused checkpoints changed nothing


async def test_release_and_resume_memory(ipc, tmp_path):
    async with serve(ipc) as (worker, client):
        greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        before = await client.generate(PROMPT, greedy)
        await client.release_memory_occupation()
        assert all(p.untyped_storage().nbytes() == 0 for p in worker.scheduler.model.parameters())
        with pytest.raises(EngineHTTPError) as err:
            await client.generate(PROMPT, greedy)
        assert err.value.status == 503 and "released" in err.value.message
        await client.resume_memory_occupation()
        again = await client.generate(PROMPT, greedy)
        assert again["output_ids"] == before["output_ids"]
        assert out_logprobs(again) == pytest.approx(out_logprobs(before), abs=1e-6)
        await client.release_memory_occupation(tags=["kv_cache"])
        with pytest.raises(EngineHTTPError):
            await client.generate(PROMPT, greedy)
        await client.resume_memory_occupation(tags=["kv_cache"])
        assert (await client.generate(PROMPT, greedy))["output_ids"] == before["output_ids"]


# ----------------------------------------------------------------------------- pause / abort
class Gate:
    """A scheduler step hook that holds the loop at step `at` until released."""

    def __init__(self, at: int):
        self.at, self.reached, self.go = at, asyncio.Event(), asyncio.Event()

    async def __call__(self, step: int) -> None:
        if step == self.at:
            self.reached.set()
            await self.go.wait()


async def until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


async def _held_request(worker, client, sp, at=3, rid=None):
    gate = Gate(worker.scheduler.decode_steps + at)
    worker.scheduler.step_hooks.append(gate)
    task = asyncio.ensure_future(client.generate(PROMPT, sp, rid=rid))
    await asyncio.wait_for(gate.reached.wait(), 10)
    return task, gate


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_holds_and_continue_resumes_unchanged(ipc, mode):
    async with serve(ipc) as (worker, client):
        sp = {"max_new_tokens": 20, "temperature": 0.8, "sampling_seed": 5, "ignore_eos": True}
        reference = await client.generate(PROMPT, sp)
        task, gate = await _held_request(worker, client, sp)
        pausing = asyncio.ensure_future(client.pause_generation(mode))
        await until(lambda: worker.scheduler.paused == mode)
        gate.go.set()
        assert (await pausing)["status"] == "ok"
        steps = worker.scheduler.decode_steps
        late = asyncio.ensure_future(client.generate([9, 10], {"max_new_tokens": 3}))
        await asyncio.sleep(0.2)
        assert worker.scheduler.decode_steps == steps and not task.done() and not late.done()
        assert worker.scheduler.stats()["running"] == 1
        await client.continue_generation()
        result, late_result = await asyncio.wait_for(asyncio.gather(task, late), 10)
        assert result["output_ids"] == reference["output_ids"]
        assert torch.allclose(torch.tensor(out_logprobs(result)),
                              torch.tensor(out_logprobs(reference)), atol=1e-5, rtol=0)
        assert late_result["meta_info"]["finish_reason"]["type"] == "length"
        assert result["meta_info"]["total_retractions"] == (mode == "retract")


async def test_pause_abort_mode_and_abort_request(ipc):
    async with serve(ipc) as (worker, client):
        sp = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        task, gate = await _held_request(worker, client, sp)
        pausing = asyncio.ensure_future(client.pause_generation())  # SGLang's default: abort
        await until(lambda: worker.scheduler.paused == "abort")
        gate.go.set()
        await asyncio.wait_for(pausing, 10)
        aborted = await asyncio.wait_for(task, 10)
        reason = aborted["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["message"]
        assert len(aborted["output_ids"]) == 3  # aborted at the boundary after step 3
        assert len(out_logprobs(aborted)) == len(aborted["output_ids"])
        waiting = asyncio.ensure_future(client.generate(PROMPT, {**sp, "max_new_tokens": 2}))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # new requests wait while paused
        await client.continue_generation()
        assert (await asyncio.wait_for(waiting, 10))["meta_info"]["completion_tokens"] == 2

        task, gate = await _held_request(worker, client, sp, rid="victim")
        await client.abort_request("victim")
        gate.go.set()  # the abort is registered: the request ends at the next step boundary
        victim = await asyncio.wait_for(task, 10)
        assert victim["meta_info"]["id"] == "victim"
        assert victim["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(victim["output_ids"]) == 3
        ok = await client.generate(PROMPT, {**sp, "max_new_tokens": 3})
        assert ok["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_weight_update_while_paused_applies_before_continue(ipc, tmp_path):
    async with serve(ipc) as (worker, client):
        model, tok = build_tiny("tiny-qwen2", seed=1)
        save_checkpoint(model, tok, str(tmp_path))
        sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        task, gate = await _held_request(worker, client, sp)
        pausing = asyncio.ensure_future(client.pause_generation("retract"))
        await until(lambda: worker.scheduler.paused == "retract")
        gate.go.set()
        await pausing
        reply = await client.update_weights_from_disk(str(tmp_path), weight_version="2")
        assert reply["success"] and reply["num_paused_requests"] == 1
        await client.continue_generation()
        result = await asyncio.wait_for(task, 10)
        assert result["meta_info"]["weight_version"] == "2"
        ids = result["output_ids"]  # tokens after the retraction were computed with new weights
        ref = reference_logprobs(model, PROMPT + ids[:3], ids[3:], 1.0)
        assert torch.allclose(torch.tensor(out_logprobs(result)[3:]), ref, atol=1e-5, rtol=0)


async def test_client_disconnect_aborts_and_stop_fails_in_flight_requests(ipc):
    async with serve(ipc) as (worker, client):
        s = worker.scheduler
        sp = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        gate = Gate(s.decode_steps + 2)
        s.step_hooks.append(gate)
        impatient = SglangClient(worker.bound.http, timeout_s=0.3)
        try:
            with pytest.raises(TimeoutError):
                await impatient.generate(PROMPT, sp)
        finally:
            await impatient.close()
        await until(lambda: s._active[0].abort_message is not None)  # the server saw it go
        steps = s.decode_steps
        gate.go.set()
        await until(lambda: s.stats()["running"] == 0)
        assert s.decode_steps == steps  # dropped at the next boundary, no further step

        task, gate = await _held_request(worker, client, sp)
        worker.stop("test stops the worker mid-request")
        with pytest.raises(EngineHTTPError) as err:
            await asyncio.wait_for(task, 10)
        assert err.value.status == 503 and "stopped" in err.value.message


# ----------------------------------------------------------------------------- errors
async def test_malformed_requests_get_400_and_server_keeps_serving(ipc):
    async with serve(ipc) as (_worker, client):
        bad = [
            (None, b"{not json"),
            ({"sampling_params": {"max_new_tokens": 2}}, None),
            ({"text": "12", "input_ids": [5]}, None),
            ({"input_ids": "12+3"}, None),
            ({"input_ids": [5, 999]}, None),
            ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, None),
            ({"input_ids": [5], "sampling_params": {"temperature": "hot"}}, None),
            ({"input_ids": [5], "sampling_params": {"top_p": 0}}, None),
            ({"input_ids": [5], "sampling_params": {"bogus": 1}}, None),
            ({"input_ids": [5], "bogus_field": True}, None),
            ({"input_ids": [5], "stream": True}, None),
            ({"input_ids": [5], "return_logprob": True, "logprob_start_len": 7}, None),
            ({"input_ids": list(range(5, 50)) * 3}, None),
            ([1, 2, 3], None),
        ]
        for body, data in bad:
            status, reply = await post(client, "/generate", body, data)
            assert status == 400, body
            assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
        status, reply = await post(client, "/generate", {
            "input_ids": [5], "sampling_params": {"max_new_tokens": -1}})
        assert "max_new_tokens must be at least 0" in reply["error"]["message"]
        status, reply = await post(client, "/pause_generation", {"mode": "sideways"})
        assert status == 400 and "sideways" in reply["error"]["message"]
        with pytest.raises(EngineHTTPError) as err:
            await client.generate([5], {"max_new_tokens": "many"})
        assert err.value.status == 400 and "max_new_tokens" in err.value.message
        good = await client.generate(PROMPT, {"max_new_tokens": 2})
        assert good["meta_info"]["completion_tokens"] == 2


async def test_control_endpoints(ipc):
    async with serve(ipc) as (_worker, client):
        assert await client.health()
        session = client._get_session()
        for path in ("/health_generate", "/get_server_info", "/get_model_info", "/model_info"):
            async with session.get(client.base_url + path) as resp:
                assert resp.status == 200, path
        info = await client.server_info()
        assert info["model_path"] == "tiny-qwen2" and info["version"]
        assert isinstance(info["internal_states"], list)
        await client.flush_cache()
        assert (await client.continue_generation())["status"] == "ok"


async def test_missing_checkpoint_fails_start(ipc, tmp_path):
    path = str(tmp_path / "nowhere")
    worker = InferenceWorker(context("inf", ipc), InferenceWorker.Config(model=path))
    assert await asyncio.wait_for(worker.serve(), 30) == 1
    assert worker.status == Status.FAILED
    assert "ValueError" in worker._stop_reason and path in worker._stop_reason


async def test_client_errors_and_routing_header():
    seen = []

    async def generate(request):
        seen.append(request.headers.get(ROUTING_HEADER))
        return web.json_response({"error": {"message": "engine says no"}}, status=400)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = SglangClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01)
    try:
        with pytest.raises(EngineHTTPError) as err:
            await client.generate([1, 2], {"max_new_tokens": 1}, routing_key="session-9")
        assert err.value.status == 400 and err.value.message == "engine says no"
        assert seen == ["session-9"]
    finally:
        await client.close()
        await runner.cleanup()
    dead = SglangClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
    try:
        with pytest.raises(EngineUnavailable, match="3 attempts"):
            await dead.generate([1], {"max_new_tokens": 1})
        assert not await dead.health()
    finally:
        await dead.close()


def test_cache_keyword_follows_the_installed_transformers_signature():
    """transformers renamed forward(past_key_values=) to forward(cache=) within 5.x; a wrong
    name is swallowed by **kwargs and silently disables the KV cache."""
    from engine.scheduler import cache_kwarg

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            pass

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs):
            pass

    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(New()) == "cache"


async def test_an_http2_probe_is_refused_quietly(ipc, caplog):
    """An HTTP/2 prior-knowledge preface gets no ERROR traceback in the worker's log; HTTP/1.1
    requests keep working."""
    from urllib.parse import urlparse

    async with serve(ipc, model="tiny-qwen2") as (_, client):
        url = urlparse(client.base_url)
        with caplog.at_level(logging.DEBUG):
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            await writer.drain()
            await reader.read()  # the server answers 400 and closes
            writer.close()
            await writer.wait_closed()
            assert await client.health()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        assert any("HTTP/2 prior-knowledge probe" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- weight pushes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_disk_update_loads_into_the_live_parameters(ipc, tmp_path, dtype):
    """/update_weights_from_disk reads the safetensors into the parameters' own storage: the
    same tensors (data_ptr), the file's values (cast to the engine's dtype), no new model."""
    async with serve(ipc, dtype=dtype) as (worker, client):
        live = worker.scheduler.model
        params = dict(live.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in params.items()}
        model, tok = build_tiny("tiny-qwen2", seed=3)
        save_checkpoint(model, tok, str(tmp_path))
        assert (await client.update_weights_from_disk(str(tmp_path), weight_version="1"))[
            "success"]
        assert worker.scheduler.model is live
        assert {n: p.data_ptr() for n, p in live.named_parameters()} == ptrs
        want = model.state_dict()
        for name, p in params.items():
            assert torch.equal(p.detach(), want[name].to(p.dtype)), name


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pushes_that_pause_in_place_or_retract_discard_nothing(ipc, tmp_path, mode):
    """A rollout-like client generates long responses while the trainer's disk sync pushes
    three versions: no request is aborted or retried, every response runs to its length, and
    each records where the version changed (the sample takes the oldest)."""
    length = 90
    async with serve(ipc) as (worker, client):
        s = worker.scheduler
        for v in (1, 2, 3):
            model, tok = build_tiny("tiny-qwen2", seed=v)
            save_checkpoint(model, tok, str(tmp_path / f"v{v}"))
        sync = await make_weight_sync("disk", [client], "cpu", 1 << 20, pause_mode=mode)
        assert sync.pause_mode == mode
        sampling = {"temperature": 1.0, "ignore_eos": True}
        sessions = [HttpSession(client, s.tokenizer, "12+3=", sampling, f"episode-{i}",
                                max_new_tokens=length, retries=0) for i in range(3)]
        start = s.decode_steps
        raw = asyncio.ensure_future(client.generate(PROMPT, {**sampling,
                                                            "max_new_tokens": length}))
        episodes = [asyncio.ensure_future(x.generate()) for x in sessions]
        pushed = []  # (tokens before the push started, tokens after it returned)
        for v in (1, 2, 3):
            steps = s.decode_steps
            await until(lambda: s.decode_steps >= steps + 6, 30)
            assert s.stats()["running"] == 4  # the responses are mid-generation
            before = s.decode_steps - start
            await sync.push(str(tmp_path / f"v{v}"), str(v))
            pushed.append((before, s.decode_steps - start))
        await asyncio.wait_for(asyncio.gather(*episodes), 60)
        reply = await asyncio.wait_for(raw, 60)
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": length}
    assert meta["weight_version"] == "3" and meta["total_retractions"] == (
        3 if mode == "retract" else 0)
    spans = meta["weight_version_spans"]
    assert [v for _, v in spans] == ["0", "1", "2", "3"]
    assert spans[0][0] == 0 and all(lo <= i <= hi for (i, _), (lo, hi) in zip(spans[1:], pushed))
    assert len(reply["output_ids"]) == len(meta["output_token_logprobs"]) == length
    for x in sessions:
        sample = x.to_sample("g", 0, "math", 1.0)
        assert x.retried == 0 and sample.status == "ok"
        assert len(sample.response_ids) == len(sample.rollout_logprobs) == length
        assert sample.weight_version == 0  # the oldest version that produced its tokens


async def test_stopping_closes_a_connection_made_while_shutdown_waits_on_a_request():
    """A client that connects while the graceful shutdown waits on an in-flight request: aiohttp
    forgets that connection when it clears its table afterwards, so `stop_http` closes every
    connection made once stopping began (its peer reads end-of-file)."""
    ours, peer = socket.socketpair()
    started, release, shutting_down = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        started.set()
        await release.wait()
        return web.Response(text="done")

    async def on_shutdown(app: web.Application) -> None:
        shutting_down.set()

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.on_shutdown.append(on_shutdown)
    runner = web.AppRunner(app, shutdown_timeout=10.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as client:
            request = asyncio.ensure_future(client.get(f"http://127.0.0.1:{port}/slow"))
            await started.wait()
            stopping = asyncio.ensure_future(stop_http(runner))
            await shutting_down.wait()
            await asyncio.sleep(0)  # the server's shutdown now waits on the slow request
            await asyncio.get_running_loop().connect_accepted_socket(runner.server, ours)
            release.set()
            async with await request as reply:
                assert await reply.text() == "done"
            await stopping
        peer.settimeout(10)
        assert await asyncio.to_thread(peer.recv, 1) == b""
    finally:
        ours.close()
        peer.close()


async def test_stopping_closes_a_connection_accepted_during_the_cleanup():
    """A client that connects as the server stops (a router's retry or health check) can be
    accepted after aiohttp's cleanup swept the open connections: `stop_http` closes it (its
    peer reads end-of-file), where it was left open to be finalised by the garbage collector."""
    ours, peer = socket.socketpair()

    class LateAccept(web.AppRunner):
        async def cleanup(self) -> None:
            server = self.server
            await super().cleanup()
            await asyncio.get_running_loop().connect_accepted_socket(server, ours)

    runner = LateAccept(web.Application())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        await stop_http(runner)
        peer.settimeout(10)
        assert await asyncio.to_thread(peer.recv, 1) == b""
    finally:
        ours.close()
        peer.close()


async def test_a_connection_the_server_forgot_is_kept_until_stop_http_closes_it():
    """aiohttp's shutdown clears its table of connections, so a connection it accepted as it
    stopped is reachable from nothing (its reading paused): the garbage collector, run by any
    thread, would take it unclosed (a ResourceWarning, an error here) before `stop_http`
    closed it. `start_http` holds every accepted connection until `stop_http`."""
    import gc

    from aiohttp import web

    from transport.http import _TRANSPORTS, start_http

    runner, port = await start_http(web.Application(), "127.0.0.1", 0)
    _, gone = await asyncio.open_connection("127.0.0.1", port)
    while not _TRANSPORTS[runner]:
        await asyncio.sleep(0.01)
    gone.close()  # a connection the client ends is let go of: the table does not grow
    await gone.wait_closed()
    while _TRANSPORTS[runner]:
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not runner.server._connections:
            await asyncio.sleep(0.01)
        handler, transport = next(iter(runner.server._connections.items()))
        transport.pause_reading()  # not in the selector: nothing else refers to it
        if handler._keepalive_handle is not None:  # nor the loop's timers (shutting down)
            handler._keepalive_handle.cancel()
        runner.server._connections.clear()  # what aiohttp's shutdown does
        del handler, transport
        gc.collect()  # an unreachable transport would be collected here, unclosed
        await stop_http(runner)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by stop_http
    finally:
        writer.close()
        await writer.wait_closed()
