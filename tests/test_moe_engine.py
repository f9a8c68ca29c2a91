"""Routed experts from the embedded engine to the Sample (SGLang's `return_routed_experts`).

The engine's recorded routes equal those of one unbatched forward of prompt + output through the
transformers model, for concurrent requests of different lengths (left-padded prefill, batched
decode, rows dropped as they finish), after an abort of another request, and across a retract
pause; the answer has SGLang's format (tests/fixtures/sglang/ROUTED_EXPERTS.md); a dense model or
routes switched off answer as SGLang does; the rollout's HttpSession turns the answers into
Sample.routed_experts and fails the episode (never the rollout) on a malformed field.
"""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.client import SglangClient
from engine.errors import SessionFailed
from engine.scheduler import GenRequest, SamplingParams, Scheduler
from engine.server import EngineServer, start_server
from engine.session import (
    HttpSession,
    checkpoint_expert_layout,
    decode_routed_experts,
    tokenizer_expert_layout,
)
from engine.standalone import parser as standalone_parser
from models.load import load_model, save_checkpoint, tokenizer_from_dir
from models.moe import MoeShape, Routing, routes_array
from models.tiny import build_tiny
from models.tokenizer import build_char_tokenizer
from tests.test_engine import Gate, post, serve, until
from transport.http import stop_http
from transport.schema import routed_experts_dtype

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sglang"
ROUTED = ["generate_routed_experts.json", "generate_routed_experts_batch.json",
          "generate_routed_experts_not_enabled.json"]
LAYOUT = MoeShape(num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2)  # tiny-qwen3-moe


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A saved tiny-qwen3-moe checkpoint directory (what a real run serves)."""
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    model, tokenizer = build_tiny("tiny-qwen3-moe", seed=3)
    save_checkpoint(model, tokenizer, str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The checkpoint's model loaded on its own: the plain forward the routes are checked by."""
    return load_model(checkpoint)[0]


def plain_routes(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1, layers, k] routes of one unbatched forward of every token but the last."""
    routing = Routing(model)
    routing.record = True
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:-1]]))
        return routes_array(routing.recorded, routing.shape)
    finally:
        routing.close()


def decoded(answer: dict, layout: MoeShape = LAYOUT) -> np.ndarray:
    rows = answer["meta_info"]["prompt_tokens"] + len(answer["output_ids"]) - 1
    return decode_routed_experts(answer["meta_info"]["routed_experts"], rows, layout)


@asynccontextmanager
async def running(source: str, **kw):
    """A Scheduler over `source` with its loop running."""
    scheduler = await Scheduler.create(source, **kw)
    loop = asyncio.ensure_future(scheduler.run())
    try:
        yield scheduler
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await scheduler.close()


@asynccontextmanager
async def served(source: str, **kw):
    """The embedded engine's HTTP server over `source`; yields (scheduler, client)."""
    async with running(source, **kw) as scheduler:
        server = EngineServer(scheduler, {"model_path": source})
        runner, port = await start_server(server, "127.0.0.1", 0)
        client = SglangClient(f"http://127.0.0.1:{port}", timeout_s=60)
        try:
            yield scheduler, client
        finally:
            await client.close()
            await stop_http(runner)
            await server.weights.close()


def request(rid: str, prompt: list[int], n: int, seed: int, routes: bool = True
            ) -> GenRequest:
    return GenRequest(rid=rid, input_ids=prompt, return_routed_experts=routes,
                            params=SamplingParams(max_new_tokens=n, temperature=1.0,
                                                  ignore_eos=True, sampling_seed=seed))


PROMPTS = [[1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 20], [1, 30, 31, 32, 33]]


def check_routes(reference, results) -> None:
    for r in results:
        tokens = r.prompt_ids + r.output_ids
        assert r.routed_experts is not None, r.rid
        assert r.routed_experts.dtype == torch.int32
        assert r.routed_experts.shape == (len(tokens) - 1, 2, 2), r.rid
        assert torch.equal(r.routed_experts, plain_routes(reference, tokens)), r.rid


# ----------------------------------------------------------------------------- the engine
async def test_routes_of_concurrent_requests_equal_one_plain_forward_each(checkpoint, reference):
    """Four prompts of different lengths in one wave (left padding), finishing at different
    steps (rows dropped from the batch and its KV cache), one not asking for routes, one with
    max_new_tokens = 0 (its prefill only): every asked route is the plain forward's."""
    async with running(checkpoint, batch_wait_ms=0) as s:
        reqs = [request(f"r{i}", p, n, seed=i) for i, (p, n) in
                enumerate(zip(PROMPTS, [3, 9, 6, 1]))]
        reqs.append(request("none", [1, 40, 41], 4, seed=9, routes=False))
        reqs.append(request("prefill-only", [1, 42, 43, 44], 0, seed=9))
        results = await s.generate(reqs)
        assert s.wave_sizes == [6]
    check_routes(reference, [r for r in results if r.rid != "none"])
    assert results[4].routed_experts is None
    assert results[5].routed_experts.shape == (3, 2, 2)  # 4 prompt tokens, none generated


async def test_routes_stay_right_after_another_request_is_aborted(checkpoint, reference):
    """An abort mid-wave drops that row from the batch and the KV cache: the other rows' routes
    still equal the plain forward's; the aborted request's cover what it fed (tokens - 1)."""
    async with running(checkpoint, batch_wait_ms=0) as s:
        gate = Gate(3)
        s.step_hooks.append(gate)
        reqs = [request(f"a{i}", p, 8, seed=10 + i) for i, p in enumerate(PROMPTS)]
        task = asyncio.ensure_future(s.generate(reqs))
        await asyncio.wait_for(gate.reached.wait(), 30)
        assert s.abort(rid="a1") == 1
        gate.go.set()
        results = await asyncio.wait_for(task, 60)
    assert results[1].finish_reason["type"] == "abort"
    assert len(results[1].output_ids) == 3
    check_routes(reference, results)


async def test_a_retracted_wave_is_prefilled_again_and_its_routes_are_the_new_prefills(
        checkpoint, reference):
    """pause(retract) drops the KV cache; on continue every sequence (prompt + tokens so far) is
    prefilled again and its routes restart from that prefill (SGLang reads them from the KV
    slots of the last computation): still the plain forward's."""
    async with running(checkpoint, batch_wait_ms=0) as s:
        gate = Gate(2)
        s.step_hooks.append(gate)
        task = asyncio.ensure_future(s.generate(
            [request(f"p{i}", p, 6, seed=20 + i) for i, p in enumerate(PROMPTS[:3])]))
        await asyncio.wait_for(gate.reached.wait(), 30)
        await s.pause("retract")
        gate.go.set()
        await until(lambda: s._active and all(q.retractions == 1 for q in s._active))
        assert s.decode_steps == 2
        await s.continue_generation()
        results = await asyncio.wait_for(task, 60)
    assert all(r.retractions == 1 for r in results)
    check_routes(reference, results)


async def test_a_moe_model_with_true_on_policy_is_refused_at_load(checkpoint):
    with pytest.raises(ValueError, match="mixture-of-experts.*true_on_policy = false"):
        await Scheduler.create(checkpoint, true_on_policy=True)


async def test_a_dense_model_with_the_flag_is_refused_at_load():
    """SGLang's capturer reads num_experts_per_tok from the config at start: a dense model with
    --enable-return-routed-experts does not start; here it is refused with a reason."""
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        await Scheduler.create("tiny-qwen3", routed_experts=True)
    args = standalone_parser().parse_args(["--model-path", "m", "--enable-return-routed-experts"])
    assert args.enable_return_routed_experts is True
    assert standalone_parser().parse_args(["--model-path", "m"]).enable_return_routed_experts \
        is False


async def test_routers_that_cannot_be_hooked_turn_routes_off_unless_they_were_required(
        checkpoint, monkeypatch):
    """A MoE model whose routers Routing cannot find (another transformers layout) is still
    served, without routes; with the flag it is refused, saying why."""
    def refuse(model, shape=None):
        raise ValueError("no routers found")

    monkeypatch.setattr("engine.scheduler.Routing", refuse)
    async with running(checkpoint) as s:
        assert s.routing is None
        result, = await s.generate([request("x", PROMPTS[0], 2, seed=1)])
        assert result.routed_experts is None and len(result.output_ids) == 2
    with pytest.raises(ValueError, match="--enable-return-routed-experts: no routers found"):
        await Scheduler.create(checkpoint, routed_experts=True)


# ----------------------------------------------------------------------------- HTTP, fixtures
def test_the_fixtures_hold_sglangs_shape_and_the_plain_forwards_routes():
    """[prompt_tokens + completion_tokens - 1, layers, top_k] int32 in base64 per answer, the
    routes of tiny-qwen3-moe (seed 0) for the fixture's tokens; none without the flag."""
    model = build_tiny("tiny-qwen3-moe", seed=0)[0]
    for name in ROUTED:
        fx = fixture(name)
        layout = fx["layout"]
        assert (layout["num_hidden_layers"], layout["num_experts_per_tok"],
                layout["num_experts"]) == (LAYOUT.num_layers, LAYOUT.top_k, LAYOUT.num_experts)
        answers = fx["response"] if isinstance(fx["response"], list) else [fx["response"]]
        prompts = fx["request"]["input_ids"]
        prompts = prompts if isinstance(prompts[0], list) else [prompts]
        assert isinstance(fx["request"]["return_routed_experts"], bool)
        for prompt, answer in zip(prompts, answers, strict=True):
            meta = answer["meta_info"]
            if not fx["server_args"]["enable_return_routed_experts"]:
                assert "routed_experts" not in meta
                continue
            rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
            raw = base64.b64decode(meta["routed_experts"], validate=True)
            assert len(raw) == 4 * rows * LAYOUT.num_layers * LAYOUT.top_k
            flat = np.frombuffer(raw, dtype="<i4")
            assert np.array_equal(flat.reshape(rows, 2, 2),
                                  plain_routes(model, prompt + answer["output_ids"]).numpy())


@pytest.mark.parametrize("name", ROUTED)
async def test_the_engine_answers_the_fixtures_requests_alike(name):
    """The embedded engine (tiny-qwen3-moe, seed 0; routes off for the not-enabled fixture)
    answers each fixture's request with the same keys, tokens and routes."""
    fx = fixture(name)
    enabled = fx["server_args"]["enable_return_routed_experts"]
    async with served("tiny-qwen3-moe", routed_experts=enabled) as (s, client):
        status, body = await post(client, "/generate", fx["request"])
        info = await client.server_info()
    assert status == 200, body
    assert info["enable_return_routed_experts"] is enabled
    want = fx["response"] if isinstance(fx["response"], list) else [fx["response"]]
    got = body if isinstance(body, list) else [body]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g["meta_info"]) >= set(w["meta_info"]) - {"routed_experts"}
        assert ("routed_experts" in g["meta_info"]) == ("routed_experts" in w["meta_info"])
        assert g["output_ids"] == w["output_ids"]
        if "routed_experts" in w["meta_info"]:
            assert g["meta_info"]["routed_experts"] == w["meta_info"]["routed_experts"]
        for e_got, e_want in zip(g["meta_info"].get("output_token_logprobs", []),
                                 w["meta_info"].get("output_token_logprobs", []), strict=True):
            assert e_got[1] == e_want[1] and e_got[0] == pytest.approx(e_want[0], abs=1e-5)


async def test_a_dense_model_answers_a_request_for_routes_without_them():
    """SGLang without the flag (its no-op capturer): HTTP 200, no routed_experts key; the flag
    must be one bool for the whole request (GenerateReqInput's type)."""
    fx = fixture("generate_routed_experts.json")
    async with served("tiny-qwen3") as (s, client):
        status, body = await post(client, "/generate", fx["request"])
        assert status == 200 and "routed_experts" not in body["meta_info"]
        info = await client.server_info()
        assert info["enable_return_routed_experts"] is False
        status, body = await post(client, "/generate", {**fx["request"],
                                                        "return_routed_experts": [True]})
        assert status == 400 and "return_routed_experts" in body["error"]["message"]
        status, body = await post(client, "/generate", {**fx["request"],
                                                        "routed_experts_start_len": 2})
        assert status == 400 and "routed_experts_start_len" in body["error"]["message"]


async def test_the_inference_worker_actor_serves_routes_of_a_moe_model(ipc, checkpoint,
                                                                          reference):
    """The embedded worker of the actors (no SGLang flags) returns routes for a MoE model, one
    per answer of a batch, each the plain forward's."""
    async with serve(ipc, model=checkpoint) as (worker, client):
        prompts = [PROMPTS[0], PROMPTS[1]]
        sp = {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 4, "ignore_eos": True}
        answers = await client.generate(prompts, sp, return_routed_experts=True)
        plain = await client.generate(prompts[0], sp)
    assert "routed_experts" not in plain["meta_info"]
    for prompt, a in zip(prompts, answers, strict=True):
        got = decoded(a)
        assert got.shape == (len(prompt) + 2, 2, 2)
        assert np.array_equal(got, plain_routes(reference, prompt + a["output_ids"]).numpy())


async def test_a_server_with_routes_always_answers_requests_that_did_not_ask(checkpoint,
                                                                             reference):
    """sglang-router 0.3.2 drops the request's return_routed_experts: a worker started with
    return_routed_experts = true answers with routes anyway; a dense model cannot."""
    async with running(checkpoint) as scheduler:
        server = EngineServer(scheduler, {"model_path": checkpoint}, routes_always=True)
        runner, port = await start_server(server, "127.0.0.1", 0)
        client = SglangClient(f"http://127.0.0.1:{port}", timeout_s=60)
        try:
            sp = {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 4,
                  "ignore_eos": True}
            a = await client.generate(PROMPTS[2], sp)  # no flag in the request
        finally:
            await client.close()
            await stop_http(runner)
            await server.weights.close()
    got = decoded(a)
    assert np.array_equal(got, plain_routes(reference, PROMPTS[2] + a["output_ids"]).numpy())
    async with running("tiny-qwen2") as dense:
        with pytest.raises(ValueError, match="no routed experts"):
            EngineServer(dense, {"model_path": "tiny-qwen2"}, routes_always=True)


# ----------------------------------------------------------------------------- the session
class Stub:
    """A /generate client answering from a list; keeps the requests' keyword arguments."""

    def __init__(self, answers: list[dict]):
        self.answers, self.calls = list(answers), []

    async def generate(self, input_ids, params, **kw):
        self.calls.append({"input_ids": list(input_ids), **kw})
        return self.answers.pop(0)


def answer(prompt_len: int, output: list[int], routes: np.ndarray | None) -> dict:
    meta = {"finish_reason": {"type": "length", "length": len(output)},
            "prompt_tokens": prompt_len, "weight_version": "default",
            "output_token_logprobs": [[-0.5, t, None] for t in output]}
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    return {"text": "", "output_ids": output, "meta_info": meta}


def rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n, 2, 4)), axis=-1)[..., :2].astype(np.int32)


def session(client, **kw) -> HttpSession:
    return HttpSession(client, build_char_tokenizer(), "ab", {"temperature": 1.0},
                       routing_key="g-0", max_new_tokens=4, retries=0, routed_experts=True,
                       moe=LAYOUT, **kw)


async def test_the_session_puts_the_last_answers_routes_into_the_sample():
    """Two turns with an observation between them, then a final observation: the second answer
    covers the whole sequence up to its last generated token; the final observation's tokens
    have no row (n < tokens - 1)."""
    first, second = rows(3 + 2 - 1, seed=1), rows(3 + 2 + 2 + 3 - 1, seed=2)
    stub = Stub([answer(3, [40, 41], first), answer(7, [42, 43, 44], second)])
    s = session(stub)
    assert len(s.prompt_ids) == 3  # <bos> a b
    await s.generate()
    assert stub.calls[0]["return_routed_experts"] is True
    assert np.array_equal(s.routes, first)
    s.observe("cd")
    await s.generate()
    s.observe("e")
    sample = s.to_sample("g", 0, "math", 1.0)
    assert sample.routed_experts.dtype == routed_experts_dtype(4) == np.uint8
    assert sample.routed_experts.shape == (9, 2, 2)
    assert np.array_equal(sample.routed_experts, second)
    assert len(sample.prompt_ids) + len(sample.response_ids) - 1 == 10


async def test_the_session_decodes_the_fixture():
    fx = fixture("generate_routed_experts.json")
    stub = Stub([fx["response"]])
    s = HttpSession(stub, build_char_tokenizer(), "", {"temperature": 0.0}, routing_key="g-0",
                    max_new_tokens=4, routed_experts=True, moe=LAYOUT)
    s.prompt_ids = fx["request"]["input_ids"]
    await s.generate()
    assert s.routes.shape == (8, 2, 2) and s.routes.dtype == np.uint8
    assert np.array_equal(s.routes, decoded(fx["response"]))


def _corrupt(routes: np.ndarray) -> list[tuple[object, str]]:
    good = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    high = routes.copy()
    high[0, 0, 0] = 4
    negative = routes.copy()
    negative[1, 1, 1] = -1
    short = base64.b64encode(routes[:-1].astype("<i4").tobytes()).decode()
    return [
        (None, "base64 string"),
        (["AAAA"], "base64 string"),
        (short, "base64 characters"),
        (good + "AAAA", "base64 characters"),
        ("!" + good[1:], "not valid base64"),
        (base64.b64encode(high.astype("<i4").tobytes()).decode(), r"outside \[0, 4\)"),
        (base64.b64encode(negative.astype("<i4").tobytes()).decode(), r"outside \[0, 4\)"),
        (base64.b64encode(routes.astype("<i2").tobytes() * 2).decode(), r"outside|routed"),
    ]


@pytest.mark.parametrize("case", range(8))
async def test_a_malformed_answer_fails_the_episode_naming_the_field(case):
    routes = rows(4)
    value, match = _corrupt(routes)[case]
    bad = answer(3, [40, 41], routes)
    bad["meta_info"]["routed_experts"] = value
    s = session(Stub([bad]))
    with pytest.raises(SessionFailed, match="routed_experts") as e:
        await s.generate()
    assert e.match(match)
    assert s.response_ids == [] and s.routes is None  # nothing of the turn was kept


async def test_an_answer_without_routes_fails_the_episode_with_the_reason():
    s = session(Stub([answer(3, [40, 41], None)]))
    with pytest.raises(SessionFailed, match="--enable-return-routed-experts"):
        await s.generate()


def test_the_layout_comes_from_the_tokenizers_checkpoint_or_must_be_given(checkpoint, tmp_path):
    assert tokenizer_expert_layout(tokenizer_from_dir(checkpoint)) == LAYOUT
    with pytest.raises(ValueError, match="pass moe="):
        HttpSession(Stub([]), build_char_tokenizer(), "ab", {}, routing_key="k",
                    max_new_tokens=1, routed_experts=True)
    dense = tmp_path / "dense"
    save_checkpoint(*build_tiny("tiny-qwen3"), str(dense))
    assert checkpoint_expert_layout(str(dense)) is None
    assert checkpoint_expert_layout(str(tmp_path / "nothing")) is None


async def test_rollout_session_against_the_engine_end_to_end(checkpoint, reference):
    """HttpSession over SglangClient and the embedded engine's HTTP server, two turns with an
    observation between: Sample.routed_experts equals the plain forward of the sequence up to
    its last generated token."""
    tokenizer = tokenizer_from_dir(checkpoint)
    async with served(checkpoint) as (s, client):
        sess = HttpSession(client, tokenizer, "12+3=", {"temperature": 1.0, "sampling_seed": 5},
                           routing_key="g-0", max_new_tokens=4, routed_experts=True)
        await sess.generate()
        sess.observe(" ok ")
        await sess.generate()
        sess.observe(" done")
    sample = sess.to_sample("g", 0, "math", 0.0)
    tokens = sample.prompt_ids + sample.response_ids
    n = len(tokens) - len(tokenizer.encode(" done", add_special_tokens=False)) - 1
    assert sample.routed_experts.shape == (n, 2, 2)
    assert sample.routed_experts.dtype == np.uint8
    expected = plain_routes(reference, tokens[:n + 1]).numpy()
    assert np.array_equal(sample.routed_experts.astype(np.int32), expected)
