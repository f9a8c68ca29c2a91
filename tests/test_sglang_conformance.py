"""SGLang /generate conformance against tests/fixtures/sglang/ (answers built from SGLang's source;
its README names the version and the rules): every client of /generate in the project reads the
fixtures right (the teacher pool's `logic.teachers.parse_scores`, the rollout's
`engine.session.HttpSession`), the embedded engine answers the fixtures' requests in the same
shapes (keys, types, null positions) and, for the same model, the same tokens and log-probs, and
so does the stand-in `sglang.launch_server` (tests/fake_sglang_server.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from engine.client import SglangClient
from engine.session import HttpSession, SessionFailed
from logic.teachers import ScoreError, parse_scores, score_request
from models.load import load_model
from tests.fake_sglang_server import install
from tests.test_engine import Gate, post, serve
from tests.test_mopd import pool_for
from transport.schema import Sample

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "sglang"
TEACHER = "examples/teacher-arith"  # the model the fixtures' log-prob values come from
GENERATE = ["generate_stop_token.json", "generate_length_text.json", "generate_stop_str.json"]
SCORE = ["score_logprob_start_len.json", "score_batch_top_logprobs.json"]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def shape(x):
    """The JSON type structure of an answer: objects by key, lists as (first entry, the set of
    the other entries' shapes), so a null first entry and numbers after it stay visible."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        if not x:
            return "[]"
        rest = sorted({json.dumps(shape(e), sort_keys=True) for e in x[1:]})
        return {"first": shape(x[0]), "rest": rest}
    if x is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(x)]


def split(request: dict, i: int | None = None) -> tuple[list[int], list[int]]:
    """(prompt, response) of a scoring request: the window starts at the prompt's last token."""
    ids, start = request["input_ids"], request["logprob_start_len"]
    if i is not None:
        ids, start = ids[i], start[i]
    return ids[:start + 1], ids[start + 1:]


def scoring_sample(prompt: list[int], response: list[int], index: int) -> Sample:
    return Sample(group_id="g", index=index, domain="math", prompt_ids=prompt,
                  response_ids=response, loss_mask=[1] * len(response),
                  rollout_logprobs=[-1.0] * len(response), reward=0.0)


@asynccontextmanager
async def fixture_server(response):
    """An HTTP server answering every POST /generate with `response`; yields (url, bodies)."""
    bodies: list = []

    async def generate(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response(response)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", bodies
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------- the fixtures
@pytest.mark.parametrize("name", GENERATE + SCORE + ["generate_abort.json"])
def test_fixtures_follow_sglangs_window_rule(name):
    """The fixtures themselves: one input entry per token of input_ids[logprob_start_len:] (-1:
    the last token, or none when scoring), its logprob null at the first entry only."""
    fx = fixture(name)
    requests, responses = fx["request"], fx["response"]
    if isinstance(responses, dict):
        requests, responses = {**requests, "input_ids": [requests["input_ids"]]}, [responses]
    for i, resp in enumerate(responses):
        ids = requests["input_ids"][i]
        meta = resp["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(resp["output_ids"])
        if not requests.get("return_logprob"):
            assert not any("logprobs" in k for k in meta)
            continue
        start = requests.get("logprob_start_len", -1)
        start = start[i] if isinstance(start, list) else start
        if start == -1:
            start = len(ids) - (requests["sampling_params"]["max_new_tokens"] > 0)
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:]
        assert [e[0] is None for e in entries] == [True] + [False] * (len(entries) - 1)
        assert [e[1] for e in meta["output_token_logprobs"]] == resp["output_ids"]
        if requests.get("top_logprobs_num"):
            tops = meta["input_top_logprobs"]
            assert len(tops) == len(entries) and tops[0] is None
            assert all(len(t) == requests["top_logprobs_num"] for t in tops[1:])


# ----------------------------------------------------------------------------- clients
def test_teacher_request_and_parse_match_the_scoring_fixture():
    fx = fixture("score_logprob_start_len.json")
    prompt, response = split(fx["request"])
    assert score_request(prompt, response, 1.0) == fx["request"]
    lps, top_ids, top_lps = parse_scores(fx["response"], prompt, response)
    # the first response token is scored (SGLang's null is on the last prompt token)
    assert lps == [-0.116509, -0.000445] and top_ids is None and top_lps is None


async def test_teacher_pool_sends_and_reads_the_batch_fixture(ipc):
    """The teacher pool's whole scoring path (request building, SglangClient over HTTP, parsing)
    against the batched top-k fixture: it sends exactly the fixture's request and each sample
    gets the fixture's values, the first response token included."""
    fx = fixture("score_batch_top_logprobs.json")
    batch = [scoring_sample(*split(fx["request"], i), index=i) for i in range(2)]
    async with fixture_server(fx["response"]) as (url, bodies):
        pool = pool_for(ipc, url, {"arith": SglangClient(url, retries=0)}, top_k=3)
        try:
            await pool._score("arith", batch)
        finally:
            await pool.clients["arith"].close()
            pool.factory.close()
    assert bodies == [fx["request"]]
    assert pool.stats["arith"]["failed_samples"] == 0
    assert batch[0].teacher_logprobs == [-0.116509, -0.000445]
    assert batch[1].teacher_logprobs == [-0.006681, -0.181992, -0.000564]
    assert batch[0].teacher_topk_ids.dtype == np.int32
    assert batch[0].teacher_topk_ids.tolist() == [[11, 12, 10], [2, 13, 9]]
    assert batch[1].teacher_topk_logprobs.dtype == np.float32
    assert batch[1].teacher_topk_logprobs.shape == (3, 3)
    assert batch[1].teacher_topk_logprobs[0].tolist() == \
        np.float32([-0.006681, -6.059062, -6.492903]).tolist()


def _mutated(change) -> dict:
    reply = copy.deepcopy(fixture("score_batch_top_logprobs.json")["response"][1])
    change(reply["meta_info"])
    return reply


@pytest.mark.parametrize("change, message", [
    (lambda m: m["input_token_logprobs"][2].__setitem__(0, None),
     ("input_token_logprobs has null at window position 2 .response token 1.; SGLang puts null "
      "only at the window's first position")),
    (lambda m: m["input_token_logprobs"][1].__setitem__(0, "-0.5"),
     "input_token_logprobs at window position 1 is '-0.5', not a finite log-prob"),
    (lambda m: m["input_token_logprobs"].pop(0),
     "3 input log-probs for a window of 4 tokens .* logprob_start_len = len.prompt. - 1 = 4"),
    (lambda m: m["input_token_logprobs"][0].__setitem__(1, 43),
     ("scored other tokens than the sample.s: window position 0 is .None, 43, None., "
      "expected token 44")),
    (lambda m: m["input_top_logprobs"][3].__setitem__(0, [None, 2, None]),
     "input_top_logprobs has null at window position 3"),
    (lambda m: m["input_top_logprobs"].__setitem__(2, None),
     "input_top_logprobs at window position 2 must be 1 to 3"),
    (lambda m: m.pop("input_token_logprobs"), "the reply has no meta_info.input_token_logprobs"),
    # top-k become [response, k] int32 / float32 arrays: rows of one width, values that fit
    (lambda m: m["input_top_logprobs"][2].pop(),
     "input_top_logprobs holds 3 entries at window position 1 but 2 at position 2"),
    (lambda m: m["input_top_logprobs"][1][0].__setitem__(1, -5),
     "input_top_logprobs at window position 1 must be 1 to 3 .*.token ids in \\[0, 2147483648\\)"),
    (lambda m: m["input_top_logprobs"][3][2].__setitem__(0, -1e39),
     "input_top_logprobs holds log-probs beyond float32's range"),
], ids=["null-inside", "not-a-number", "window-from-len-prompt", "other-token", "null-in-top-k",
        "missing-top-k", "no-logprobs", "ragged-top-k", "negative-top-k-id", "top-k-past-float32"])
def test_parse_scores_refuses_what_sglang_never_sends(change, message):
    prompt, response = split(fixture("score_batch_top_logprobs.json")["request"], 1)
    where = "teacher 'arith', sample g7/2"
    with pytest.raises(ScoreError, match=f"^{where}: {message}"):
        parse_scores(_mutated(change), prompt, response, 3, where)


def test_parse_scores_ignores_a_number_at_the_windows_first_position():
    """A server that reports a value where SGLang puts null (the last prompt token's log-prob)
    is read the same: that position is not part of the response."""
    prompt, response = split(fixture("score_batch_top_logprobs.json")["request"], 1)
    reply = _mutated(lambda m: m["input_token_logprobs"][0].__setitem__(0, -3.5))
    assert parse_scores(reply, prompt, response)[0] == [-0.006681, -0.181992, -0.000564]


class FixtureClient:
    """What HttpSession calls on its client: `generate`, answered from a fixture."""

    def __init__(self, response: dict):
        self.response, self.calls = response, []

    async def generate(self, input_ids, sampling_params, **extra):
        self.calls.append((input_ids, sampling_params, extra))
        return copy.deepcopy(self.response)


def session_for(response: dict, retries: int = 3) -> tuple[HttpSession, FixtureClient]:
    _, tok = load_model(TEACHER)
    client = FixtureClient(response)
    return HttpSession(client, tok, "3+4=", {"temperature": 0.0}, "key", 8, retries), client


async def test_rollout_session_reads_a_generate_fixture():
    session, client = session_for(fixture("generate_length_text.json")["response"])
    assert await session.generate() == "7"
    assert session.prompt_ids == fixture("generate_length_text.json")["request"]["input_ids"]
    assert client.calls[0][0] == session.prompt_ids and client.calls[0][2]["return_logprob"]
    assert (session.response_ids, session.logprobs, session.loss_mask) == ([11], [-0.116509], [1])
    assert session.versions == [12]


async def test_rollout_session_retries_an_aborted_fixture():
    session, client = session_for(fixture("generate_abort.json")["response"], retries=1)
    with pytest.raises(SessionFailed, match="aborted: .*'type': 'abort'"):
        await session.generate()
    assert len(client.calls) == 2 and session.response_ids == []


async def test_rollout_session_reads_a_fresh_servers_weight_version():
    """A fresh SGLang server reports the string 'default' (ServerArgs.weight_version) until its
    first weight update: the weights it started from, version 0."""
    reply = fixture("generate_stop_token.json")["response"]
    assert reply["meta_info"]["weight_version"] == "default"
    session, _ = session_for(reply)
    await session.generate()
    assert session.response_ids == [11, 2] and session.versions == [0]


# ----------------------------------------------------------------------------- servers
def assert_like(got, want, logprob_atol: float = 1e-4) -> None:
    """Same shape as the fixture answer; the same tokens, texts and finish reasons; log-probs
    within `logprob_atol` of the fixture's (a float64 forward of the same model)."""
    assert shape(got) == shape(want)
    for g, w in zip(got if isinstance(got, list) else [got],
                    want if isinstance(want, list) else [want]):
        assert (g["text"], g["output_ids"]) == (w["text"], w["output_ids"])
        gm, wm = g["meta_info"], w["meta_info"]
        for key in ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
            assert gm[key] == wm[key], key
        for key in [k for k in wm if k.endswith("_logprobs")]:
            flat_g, flat_w = _flatten(gm[key]), _flatten(wm[key])
            assert [type(v) for v in flat_g] == [type(v) for v in flat_w], key
            for a, b in zip(flat_g, flat_w):
                if isinstance(b, float):
                    assert math.isclose(a, b, abs_tol=logprob_atol), (key, a, b)
                else:
                    assert a == b, (key, a, b)


def _flatten(x) -> list:
    if isinstance(x, list):
        return [v for e in x for v in _flatten(e)]
    return [x]


@pytest.mark.parametrize("name", GENERATE + SCORE)
async def test_embedded_engine_answers_like_the_fixtures(ipc, name):
    fx = fixture(name)
    async with serve(ipc, model=TEACHER) as (_, client):
        status, got = await post(client, "/generate", fx["request"])
    assert status == 200
    assert_like(got, fx["response"])


async def test_embedded_engine_abort_answers_like_the_fixture(ipc):
    fx = fixture("generate_abort.json")
    async with serve(ipc, model=TEACHER) as (worker, client):
        gate = Gate(worker.scheduler.decode_steps + 3)
        worker.scheduler.step_hooks.append(gate)
        task = asyncio.ensure_future(post(client, "/generate", fx["request"]))
        await asyncio.wait_for(gate.reached.wait(), 10)
        assert (await post(client, "/abort_request", {"rid": "rollout-7"}))[0] == 200
        gate.go.set()
        status, got = await asyncio.wait_for(task, 10)
    assert status == 200
    want = copy.deepcopy(fx["response"])
    want["meta_info"]["finish_reason"]["message"] = "Abort by user"  # SGLang: "Aborted"
    assert_like(got, want)


async def test_fake_sglang_server_answers_like_the_fixtures(tmp_path):
    """The stand-in `python -m sglang.launch_server` (tests/fake_sglang_server.py) serves the
    scoring fixture's request with SGLang's null first and the fixture's values."""
    fx = fixture("score_batch_top_logprobs.json")
    env = {**os.environ, "PYTHONPATH": f"{install(tmp_path / 'fake')}:{ROOT}",
           "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sglang.launch_server", "--model-path", TEACHER, "--port", "0",
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    client = None
    try:
        async with asyncio.timeout(120):
            line = b""
            while b"serving" not in line:
                line = await proc.stdout.readline()
                assert line, "the fake server exited before serving"
        client = SglangClient(line.decode().split(" on ")[-1].strip(), timeout_s=60)
        status, got = await post(client, "/generate", fx["request"])
    finally:
        if client is not None:
            await client.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    assert status == 200
    assert_like(got, fx["response"])
    assert [m["meta_info"]["input_token_logprobs"][0][0] for m in got] == [None, None]


def test_fixture_values_are_the_teachers_float64_scores():
    """The fixtures' numbers are the teacher's (so the engine comparisons above check values):
    the scoring fixture's first response token against a float64 forward of the model."""
    fx = fixture("score_logprob_start_len.json")
    model, _ = load_model(TEACHER)
    ids = fx["request"]["input_ids"]
    with torch.no_grad():
        logits = model.double()(input_ids=torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    start = fx["request"]["logprob_start_len"]
    want = [lp[p, ids[p + 1]].item() for p in range(start, len(ids) - 1)]
    got = [e[0] for e in fx["response"]["meta_info"]["input_token_logprobs"][1:]]
    assert got == pytest.approx(want, abs=1e-6)


async def test_embedded_engine_lora_endpoints_answer_like_the_fixture(ipc, tmp_path):
    """SGLang's LoRA endpoints in the fixture's order: the same statuses, answer shapes and
    loaded_adapters bookkeeping; a request naming an unloaded adapter is refused with SGLang's
    message."""
    from models import lora
    from tests.test_engine import post, serve
    from training.config import LoraConfig

    spec = LoraConfig(rank=4, alpha=8)
    model, _ = load_model(TEACHER, "cpu", torch.float32, 0)
    lora.attach(model, spec)
    lora.save_adapter(model, spec, tmp_path / "adapter", TEACHER)
    exchanges = json.loads(json.dumps(fixture("lora_adapters.json")["exchanges"]).replace(
        "{adapter_dir}", str(tmp_path / "adapter")))
    async with serve(ipc, model=TEACHER) as (_, client):
        for ex in exchanges:
            status, got = await post(client, ex["path"], ex["request"])
            assert status == ex["status"], (ex["path"], got)
            if "response_keys" in ex:
                assert set(ex["response_keys"]) <= set(got)
            elif "message_starts" in ex:
                assert got["error"]["message"].startswith(ex["message_starts"])
            else:
                assert shape(got) == shape(ex["response"]), ex["path"]
                assert {n: {k: v for k, v in r.items() if k != "lora_id"}
                        for n, r in got["loaded_adapters"].items()} == \
                    {n: {k: v for k, v in r.items() if k != "lora_id"}
                     for n, r in ex["response"]["loaded_adapters"].items()}
