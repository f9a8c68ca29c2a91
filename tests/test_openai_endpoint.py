"""The OpenAI-compatible endpoint of agent episodes (envs/openai_api.py, engine/session.py,
engine/chat_template.py): the `openai` client against it, token-exact capture across turns with
a tool call, drift detection, isolation of concurrent episodes, OpenAI error bodies, and the
rollout playing the calculator agent on the tiny model."""

from __future__ import annotations

import asyncio
import json
import re
import string

import aiohttp
import openai
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from actors.inference import InferenceWorker
from actors.rollout import RolloutActor, RolloutConfig
from engine.chat_template import chat_format
from engine.client import SglangClient
from engine.session import AgentLink, HttpSession
from envs.base import Environment, Task
from envs.builtin.agent_calc import CALC_TOOL, AgentCalcEnv
from envs.contract import check_env_async
from envs.loader import EnvMix
from envs.openai_api import AgentEndpoint, parse_tool_calls
from models.load import load_model
from models.tokenizer import build_char_tokenizer
from runtime.facts import RunFacts
from tests.helpers import context, running
from training.batching import make_micro_batch
from training.step import TrainState, forward

TOOLS = [CALC_TOOL]


def wide_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer over printable ASCII plus ChatML's special tokens, and a few
    words as single tokens: "408" encodes to one token, but a policy may sample "4", "0", "8"
    (as `spell` does), so re-encoding sampled text would change its tokens."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(specials)
    core.add_tokens(["408", "calc", "It"])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                   eos_token="<|im_end|>", unk_token="<unk>")


def spell(tok, text: str) -> list[int]:
    """`text` as one token per character (special tokens kept whole)."""
    ids = []
    for part in re.split(r"(<\|im_end\|>|<eos>)", text):
        if part in ("<|im_end|>", "<eos>"):
            ids += tok.encode(part, add_special_tokens=False)
        else:
            ids += tok.convert_tokens_to_ids(list(part))
    return ids


class ScriptedWorker:
    """Answers /generate (SglangClient.generate's signature) from a script of texts, each
    spelled to the "sampled" ids, with a distinct log-prob per token; records every call."""

    def __init__(self, tokenizer, texts=(), answer=None, delay_s: float = 0.0):
        self.tok, self.texts, self.answer, self.delay_s = tokenizer, list(texts), answer, delay_s
        self.calls: list[tuple[list[int], dict, str]] = []
        self.outputs: list[tuple[list[int], list[float]]] = []

    async def generate(self, input_ids, params, return_logprob=True, routing_key=None):
        self.calls.append((list(input_ids), dict(params), routing_key))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.answer(input_ids, routing_key) if self.answer else self.texts.pop(0)
        ids = spell(self.tok, text)
        lps = [-(len(self.outputs) + 1) - i / 100 for i in range(len(ids))]
        self.outputs.append((ids, lps))
        finish = {"type": "stop", "matched": ids[-1]} if ids[-1] == self.tok.eos_token_id \
            else {"type": "length", "length": len(ids)}
        return {"output_ids": ids, "meta_info": {
            "finish_reason": finish, "weight_version": "4",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}


@pytest.fixture
async def endpoint():
    ep = AgentEndpoint()
    await ep.start()
    yield ep
    await ep.close()


def session_for(worker, tok, endpoint, spec="auto", drift="split", key="ep-0", **kw):
    link = AgentLink(endpoint, chat_format(tok, spec), model_id="policy", drift=drift)
    return HttpSession(worker, tok, "unused", {"temperature": 1.0}, key, 64, agent=link, **kw)


def policy_tokens(sample) -> list[int]:
    return [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]


def segments(sample) -> list[tuple[int, list[int]]]:
    """The response as runs of equal mask: [(mask, ids), ...]."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(sample.response_ids, sample.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


# ----------------------------------------------------------------------------- token-exact
TOOL_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>'


async def test_three_turns_with_a_tool_call_train_on_exactly_the_sampled_tokens(endpoint):
    tok = wide_tokenizer()
    worker = ScriptedWorker(tok, [TOOL_CALL + "<|im_end|>", "It is 408.<|im_end|>",
                                  "4<|im_end|>"])
    s = session_for(worker, tok, endpoint)
    fmt = s.agent.chat
    messages: list = [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "12*34?"}]
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "calc"
        assert json.loads(call.function.arguments) == {"expression": "12*34"}
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "It is 408."
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "and 2+2?"}]
        third = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                     logprobs=True)
    assert third.choices[0].message.content == "4"
    sample = s.to_sample("g", 0, "agent", 1.0)

    # what was sampled is what is trained on: same ids, same log-probs, in order
    sampled = [t for ids, _ in worker.outputs for t in ids]
    assert policy_tokens(sample) == sampled
    assert tok.encode(tok.decode(sampled), add_special_tokens=False) != sampled  # not canonical
    assert [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask) if m] == [
        lp for _, lps in worker.outputs for lp in lps]
    assert [e.logprob for e in third.choices[0].logprobs.content] == worker.outputs[2][1]
    # each turn was generated from the trajectory itself: the model saw exactly these tokens
    cuts = [i for i in range(1, len(sample.loss_mask))
            if sample.loss_mask[i] == 1 and sample.loss_mask[i - 1] == 0]
    assert [c[0] for c in worker.calls] == [
        sample.prompt_ids, sample.prompt_ids + sample.response_ids[:cuts[0]],
        sample.prompt_ids + sample.response_ids[:cuts[1]]]
    assert all(c[2] == "ep-0" for c in worker.calls)
    # the prompt is the first request rendered; observations are template glue + new messages
    assert sample.prompt_ids == tok.encode(fmt.render(tok, messages[:2], TOOLS, True),
                                           add_special_tokens=False)
    runs = segments(sample)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assert tok.decode(runs[1][1]) == ("\n<|im_start|>user\n<tool_response>\n408\n"
                                      "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(runs[3][1]) == ("\n<|im_start|>user\nand 2+2?<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    # here the template renders the sampled turns exactly as sampled: the whole trajectory is
    # the final conversation rendered (the last turn's closing newline aside)
    final = messages + [{"role": "assistant", "content": "4"}]
    rendered = fmt.render(tok, [_plain(m) for m in final], TOOLS, False)
    assert tok.decode(sample.prompt_ids + sample.response_ids) + "\n" == rendered
    assert sample.weight_version == 4 and sample.status == "ok"
    assert s.drifts == [] and s.agent_stats["requests"] == 3 and s.agent_stats["tool_calls"] == 1


def _plain(m):
    if isinstance(m, dict):
        return m
    return {"role": m.role, "content": m.content, "tool_calls": [
        {"type": "function", "function": {"name": c.function.name,
                                          "arguments": json.loads(c.function.arguments)}}
        for c in m.tool_calls or []]}


async def test_sampled_tokens_are_kept_when_the_template_rewrites_the_call(endpoint):
    """The model wrote compact JSON; the template re-renders it with spaces. The trajectory
    keeps the sampled tokens and appends only the turn's closing newline and the tool turn."""
    tok = wide_tokenizer()
    compact = '<tool_call>{"name":"calc","arguments":{"expression":"1+2"}}</tool_call><|im_end|>'
    worker = ScriptedWorker(tok, [compact, "3<|im_end|>"])
    s = session_for(worker, tok, endpoint)
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
        messages: list = [{"role": "user", "content": "1+2?"}]
        stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                      stream=True)
        chunks = [c async for c in stream]
        (delta,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert (delta.function.name, json.loads(delta.function.arguments)) == (
            "calc", {"expression": "1+2"})
        call = {"id": delta.id, "type": "function", "function": {
            "name": delta.function.name, "arguments": delta.function.arguments}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": delta.id, "content": "3"}]
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    sample = s.to_sample("g", 0, "agent", 1.0)
    assert policy_tokens(sample) == [t for ids, _ in worker.outputs for t in ids]
    assert tok.decode(segments(sample)[1][1]).startswith("\n<|im_start|>user\n<tool_response>")
    assert s.drifts == []


QWEN3_LIKE = """\
{%- set ns = namespace(last=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}\
{% endfor %}
{%- for m in messages %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and loop.index0 < ns.last %}{{ m.content.split('</think>')[-1] }}\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.mark.parametrize("rule", ["split", "fail"])
async def test_a_template_that_rerenders_history_is_a_drift(endpoint, tmp_path, rule):
    """Like Qwen3's template, this one drops the reasoning of assistant turns before the last
    user message: the second request does not extend the first one's tokens."""
    path = tmp_path / "template.jinja"
    path.write_text(QWEN3_LIKE)
    tok = wide_tokenizer()
    worker = ScriptedWorker(tok, ["<think>sum</think>3<|im_end|>", "7<|im_end|>"])
    s = session_for(worker, tok, endpoint, spec=str(path), drift=rule)
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
        messages: list = [{"role": "user", "content": "1+2?"}]
        r = await client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message, {"role": "user", "content": "3+4?"}]
        r2 = await client.chat.completions.create(model="m", messages=messages)
    assert r2.choices[0].message.content == "7"
    assert s.agent_stats["drift_splits"] == 1
    assert s.agent_stats["dropped_tokens"] == len(worker.outputs[0][0])
    assert "renders" in s.drifts[0]
    sample = s.to_sample("g", 0, "agent", 1.0)
    # the sample is the last segment: the second request as rendered, then its completion
    expected_prompt = tok.encode(s.agent.chat.render(tok, [_plain(m) for m in messages], None,
                                                     True), add_special_tokens=False)
    assert sample.prompt_ids == expected_prompt == worker.calls[1][0]
    assert "sum" not in tok.decode(sample.prompt_ids)
    assert sample.response_ids == worker.outputs[1][0] and sample.loss_mask == [1] * 2
    assert (sample.status, bool(sample.error)) == (("ok", False) if rule == "split"
                                                   else ("failed", True))


async def test_edited_history_and_edited_assistant_turns_are_drifts(endpoint):
    tok = wide_tokenizer()
    worker = ScriptedWorker(tok, ["a<|im_end|>", "b<|im_end|>", "c<|im_end|>", "d<|im_end|>"])
    s = session_for(worker, tok, endpoint)
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
        msgs: list = [{"role": "user", "content": "x"}]
        await client.chat.completions.create(model="m", messages=msgs)
        # the agent rewrites the model's answer
        msgs += [{"role": "assistant", "content": "A"}, {"role": "user", "content": "y"}]
        await client.chat.completions.create(model="m", messages=msgs)
        # the agent edits the first user message
        msgs = [{"role": "user", "content": "X"}, *msgs[1:], {"role": "assistant", "content": "b"},
                {"role": "user", "content": "z"}]
        await client.chat.completions.create(model="m", messages=msgs)
        # a faithful continuation extends again
        msgs += [{"role": "assistant", "content": "c"}, {"role": "user", "content": "w"}]
        await client.chat.completions.create(model="m", messages=msgs)
    assert s.agent_stats["drift_splits"] == 2
    assert "is not the assistant message" in s.drifts[0]
    assert "renders differently than in the previous request" in s.drifts[1]
    sample = s.to_sample("g", 0, "agent", 1.0)
    assert policy_tokens(sample) == worker.outputs[2][0] + worker.outputs[3][0]


# ----------------------------------------------------------------------------- completions
async def test_text_completions_extend_by_text_and_by_tokens(endpoint):
    tok = build_char_tokenizer()
    worker = ScriptedWorker(tok, ["19<eos>", "7", "ok<eos>"])
    s = session_for(worker, tok, endpoint)
    async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
        r = await client.completions.create(model="m", prompt="12+7=", max_tokens=4, logprobs=0)
        assert r.choices[0].text == "19" and r.choices[0].finish_reason == "stop"
        assert r.choices[0].logprobs.token_logprobs == worker.outputs[0][1]
        stream = await client.completions.create(model="m", prompt="12+7=19 3+4=", stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "7"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 1
        so_far = s.prompt_ids + s.response_ids
        space = tok.encode(" ", add_special_tokens=False)
        await client.completions.create(model="m", prompt=so_far + space)
    sample = s.to_sample("g", 0, "text", 1.0)
    assert tok.decode(sample.prompt_ids + sample.response_ids) == \
        "<bos>12+7=19<eos> 3+4=7 ok<eos>"
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1]
    assert s.drifts == []


# ----------------------------------------------------------------------------- isolation
async def test_concurrent_episodes_are_isolated_by_routing_key(endpoint):
    tok = wide_tokenizer()
    # each answer names the routing key the request carried and the question it was asked
    worker = ScriptedWorker(tok, answer=lambda ids, key: f"{key}:"
                            f"{re.findall('q[0-9]{3}', tok.decode(ids))[-1]}<|im_end|>",
                            delay_s=0.01)
    sessions = [session_for(worker, tok, endpoint, key=f"ep-{i}") for i in range(6)]

    async def agent(i: int, s: HttpSession) -> list[str]:
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused") as client:
            msgs: list = [{"role": "user", "content": f"q{i:03d}"}]
            out = []
            for turn in range(2):
                r = await client.chat.completions.create(model="m", messages=msgs)
                out.append(r.choices[0].message.content)
                msgs += [r.choices[0].message, {"role": "user", "content": f"q{i:03d}"}]
            return out

    answers = await asyncio.gather(*(agent(i, s) for i, s in enumerate(sessions)))
    assert len({s.base_url for s in sessions}) == 6 and endpoint.episodes == 6
    for i, (s, got) in enumerate(zip(sessions, answers)):
        assert got == [f"ep-{i}:q{i:03d}"] * 2
        mine = [c for c in worker.calls if c[2] == f"ep-{i}"]
        assert len(mine) == 2 and all(c[0][:len(s.prompt_ids)] == s.prompt_ids for c in mine)
        text = tok.decode(s.prompt_ids + s.response_ids)
        assert re.findall("q[0-9]{3}", text) == [f"q{i:03d}"] * 4  # 2 questions, 2 answers
        assert re.findall("ep-[0-9]", text) == [f"ep-{i}"] * 2
        assert s.drifts == []
    url = sessions[0].base_url
    for s in sessions:
        s.close()
    assert endpoint.episodes == 0
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "episode_not_found"


# ----------------------------------------------------------------------------- errors
async def test_bad_requests_get_openai_error_bodies(endpoint):
    tok = wide_tokenizer()
    worker = ScriptedWorker(tok, ["ok<|im_end|>"])
    s = session_for(worker, tok, endpoint)
    base, hi = s.base_url, [{"role": "user", "content": "hi"}]
    cases = [  # (method, path, body, status, param)
        ("POST", "/chat/completions", {"model": "m", "messages": hi, "n": 2}, 400, "n"),
        ("POST", "/chat/completions", {"model": "m"}, 400, "messages"),
        ("POST", "/chat/completions", {"model": "m", "messages": [{"role": "bot",
                                                                  "content": "x"}]},
         400, "messages[0].role"),
        ("POST", "/chat/completions", {"model": "m", "messages": hi, "temperature": 3},
         400, "temperature"),
        ("POST", "/chat/completions", {"model": "m", "messages": hi, "tool_choice": "required",
                                       "tools": TOOLS}, 400, "tool_choice"),
        ("POST", "/chat/completions", {"model": "m", "messages": hi, "frobnicate": 1},
         400, "frobnicate"),
        ("POST", "/chat/completions", b"{not json", 400, None),
        ("POST", "/completions", {"model": "m", "prompt": "", "max_tokens": 2}, 400, "prompt"),
        ("GET", "/chat/completions", None, 405, None),
        ("POST", "/embeddings", {"model": "m", "input": "x"}, 404, None),
    ]
    async with aiohttp.ClientSession() as http:
        for method, path, body, status, param in cases:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with http.request(method, base + path, **kw) as resp:
                got = await resp.json()
                assert resp.status == status, (path, body, got)
                assert set(got["error"]) == {"message", "type", "param", "code"}
                assert got["error"]["param"] == param and got["error"]["message"]
        async with http.get(base.replace(base.split("/")[-2], "nope") + "/models") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=hi, n=3)
        assert e.value.body["param"] == "n" and "n = 3" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other")
        assert (await client.models.retrieve("policy")).id == "policy"
        ok = await client.chat.completions.create(model="m", messages=hi)
    assert ok.choices[0].message.content == "ok"
    assert len(worker.calls) == 1  # no refused request reached the worker
    # refused: the 8 requests that reached the episode, and n = 3 (not the 404 / 405 routes)
    assert s.agent_stats["refused"] == 9 and s.agent_stats["requests"] == 1
    small = AgentEndpoint(max_body_bytes=512)
    await small.start()
    try:
        url = small.base_url(small.register(s)) + "/chat/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"model": "m", "messages": [
                    {"role": "user", "content": "x" * 1000}]}) as resp:
                assert resp.status == 413
                assert "larger than 512 bytes" in (await resp.json())["error"]["message"]
    finally:
        await small.close()


def test_tool_call_parsing_in_both_formats():
    text = f"Let me compute.\n{TOOL_CALL}\n<tool_call>\nnot json\n</tool_call>"
    content, calls = parse_tool_calls(text, "tags", TOOLS)
    assert content == "Let me compute.\n\n<tool_call>\nnot json\n</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"expression": "12*34"})]
    assert parse_tool_calls(text, "tags", None) == (text, [])  # no tools offered: plain text
    other = [{"type": "function", "function": {"name": "search"}}]
    assert parse_tool_calls(TOOL_CALL, "tags", other) == (TOOL_CALL, [])  # not a tool offered
    content, calls = parse_tool_calls("calc(12*34)=408", "plain", TOOLS)
    assert content == "=408" and json.loads(calls[0]["function"]["arguments"]) == {
        "expression": "12*34"}
    assert parse_tool_calls("xcalc(1)", "plain", TOOLS) == ("xcalc(1)", [])


# ----------------------------------------------------------------------------- environments
async def test_the_calculator_agent_on_the_plain_template_keeps_exact_tokens(endpoint):
    """A scripted tiny-model episode that uses the tool: `12*34=calc(12*34)<eos>=408 408<eos>`."""
    tok = build_char_tokenizer()
    worker = ScriptedWorker(tok, ["calc(12*34)<eos>", "408<eos>"])
    s = session_for(worker, tok, endpoint)
    assert s.agent.chat.name == "plain"
    env = AgentCalcEnv()
    reward = await env.episode(Task(id="t", prompt="12*34=", answer="408"), s)
    sample = s.to_sample("g", 0, env.domain, reward)
    assert reward == 1.0 and s.agent_stats["tool_calls"] == 1
    assert tok.decode(sample.prompt_ids + sample.response_ids) == \
        "<bos>12*34=calc(12*34)<eos>=408 408<eos>"
    assert sample.loss_mask == [1] * 12 + [0] * 5 + [1] * 4
    assert policy_tokens(sample) == worker.outputs[0][0] + worker.outputs[1][0]


class NTwoAgent(Environment):
    """An agent that asks for n = 2 (refused inside an RL episode)."""

    domain = "ntwo"

    def tasks(self, split="train", seed=0):
        return iter([Task(id=f"{split}-{seed}-{i}", prompt=f"{seed}+{i}=") for i in range(3)])

    async def episode(self, task, session):
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused",
                                      max_retries=0) as client:
            try:
                await client.chat.completions.create(
                    model="m", n=2, messages=[{"role": "user", "content": task.prompt}])
            except openai.BadRequestError:
                pass
        return 0.0


async def test_the_contract_checks_agent_environments():
    report = await check_env_async(AgentCalcEnv(), num_tasks=4)
    assert report.ok, report.format()
    assert report.check("agent_requests").detail == "12 requests over 12 episodes, 0 refused"
    bad = await check_env_async(NTwoAgent(), num_tasks=2)
    assert not bad.ok
    assert any("agent_requests" in p and "n = 2" in p for p in bad.problems), bad.problems
    assert any("never called session.generate() nor asked" in p for p in bad.problems)


class RecordingClient(SglangClient):
    """The real client, keeping every /generate answer."""

    def __init__(self, url: str):
        super().__init__(url)
        self.outputs: list[dict] = []

    async def generate(self, input_ids, sampling_params=None, **kw):
        out = await super().generate(input_ids, sampling_params, **kw)
        self.outputs.append(out)
        return out


async def test_the_rollout_plays_the_agent_on_the_tiny_model_token_exactly(ipc):
    """The rollout's wiring on a real worker: agent episodes through the endpoint become samples
    whose policy tokens are the worker's, whose log-probs the trainer recomputes, and whose
    requests are counted in the rollout's metrics."""
    worker = InferenceWorker(context("w", ipc), InferenceWorker.Config(model="examples/base-tiny"))
    actor = RolloutActor(context("rollout", ipc, facts=RunFacts(model="examples/base-tiny")),
                         RolloutConfig(envs=[]))
    env = AgentCalcEnv(max_operand=9)
    actor.envs, actor.tokenizer = EnvMix([env], [1.0]), build_char_tokenizer()
    actor.gate = asyncio.Semaphore(8)
    async with running(worker, 30):
        actor.client = RecordingClient(worker.bound.http)
        try:
            await actor.start_agent_endpoint()
            tasks = [t for _, t in zip(range(8), actor.envs.tasks("train", 0))]
            samples = await asyncio.gather(*(
                actor.play(t, {"temperature": 1.0, "top_p": 1.0}, f"b0-g{i}", 0)
                for i, t in enumerate(tasks)))
            # the endpoint answers a prompt longer than the model's context with an OpenAI 400
            s = HttpSession(actor.client, actor.tokenizer, "x", {}, "long", 4, agent=actor.agent)
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused",
                                          max_retries=0) as client:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "1+" * 80}])
            assert e.value.body["code"] == "context_length_exceeded"
            s.close()
        finally:
            await actor.client.close()
            for close in actor._closers:
                await close()
            actor.factory.close()
    assert actor.agent.endpoint.episodes == 0 and not actor.agent.endpoint.started
    assert all(x.status == "ok" for x in samples), [x.error for x in samples]
    outputs = [o["output_ids"] for o in actor.client.outputs]
    for x in samples:
        mine = policy_tokens(x)
        assert mine and any(mine[:len(o)] == o for o in outputs)
        assert x.prompt_ids[:1] == [actor.tokenizer.bos_token_id]
    assert sorted(t for x in samples for t in policy_tokens(x)) == sorted(
        t for o in outputs for t in o)
    requests = actor.counters["agent/requests"]
    assert requests == len(outputs) and actor.counters["agent/episodes"] == 8
    assert actor.agent_batch["requests"] == requests
    # the trainer's recompute of the log-probs agrees with the rollout's
    model, tokenizer = load_model("examples/base-tiny")
    state = TrainState(model, tokenizer, torch.optim.AdamW(model.parameters()))
    mb = make_micro_batch(samples)
    with torch.no_grad():
        logp, _ = forward(state, mb, 1.0)
    assert float(((logp - mb.rollout_logp).abs() * mb.mask).sum() / mb.mask.sum()) < 1e-5
