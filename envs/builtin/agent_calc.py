"""A calculator agent written against the OpenAI chat API (domain "agent_calc").

The episode is an ordinary `openai`-client agent loop, pointed at the episode's endpoint
(`session.base_url`, docs/agents.md): the task is the user message, the model may call the one
tool, `calc`, whose result goes back as a tool message, and the first answer without a tool
call is the final one. The same code runs against any OpenAI-compatible server.

    user          "12*34="
    assistant     a tool call calc(expression="12*34"), or the answer "408"
    tool          "408" (or "err" when the expression is not `a op b`)
    assistant     the answer "408"

On the tiny character-level policy the rollout's "plain" chat template renders that episode as
`<bos>12*34=calc(12*34)<eos>=408 408<eos>` (engine/chat_template.py), the policy's own tokens
trained on, the tool result not. A model with a ChatML template sees Qwen-style `<tool_call>`
tags instead; nothing here changes.

Invariant: at most `max_turns` completion requests per episode; the reward is 1.0 exactly when
the final answer (stripped, cut at its first character that is not a digit or "-") equals the
task's answer, else 0.0 (also when the turns run out while the model still calls the tool).
Using the tool costs nothing. Needs the `openai` package (`pip install -e '.[agent]'`).
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

import openai

from envs.base import Environment, Session, Task
from envs.builtin import MAX_EVAL_TASKS, check_int, leading_answer, split_tasks
from envs.builtin.calc_tool import _OPS, calculate

CALC_TOOL = {"type": "function", "function": {
    "name": "calc",
    "description": "Evaluate `a op b` for integers a and b and op one of + - *",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string",
                                                 "description": "for example 12*34"}},
                   "required": ["expression"]}}}


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer to one call: the value, or "err" (unknown tool, bad arguments)."""
    if name != "calc":
        return "err"
    try:
        args = json.loads(arguments)
    except ValueError:
        return "err"
    expression = args.get("expression") if isinstance(args, dict) else None
    return calculate(expression) if isinstance(expression, str) else "err"


class AgentCalcEnv(Environment):
    """`a op b=` answered by an OpenAI-client agent with a calculator tool. Options:
    max_operand, ops, max_turns, num_eval_tasks."""

    domain = "agent_calc"

    def __init__(self, *, max_operand: int = 99, ops: str = "+-*", max_turns: int = 3,
                 num_eval_tasks: int = 200):
        name = type(self).__name__
        check_int(name, "max_operand", max_operand, 1, 9999)
        check_int(name, "max_turns", max_turns, 1, 16)
        check_int(name, "num_eval_tasks", num_eval_tasks, 0, MAX_EVAL_TASKS)
        if not isinstance(ops, str) or not ops or set(ops) - set(_OPS) or len(set(ops)) < len(ops):
            raise ValueError(f"{name}: option ops must be distinct characters of '+-*', "
                             f"got {ops!r}")
        super().__init__(max_operand=max_operand, ops=ops, max_turns=max_turns,
                         num_eval_tasks=num_eval_tasks)
        self.max_operand, self.ops, self.max_turns = max_operand, ops, max_turns
        self.num_eval_tasks = num_eval_tasks
        digits = len(str(max_operand))
        self.max_new_tokens = len("calc()") + 2 * digits + 2  # a call or an answer, and <eos>

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        return split_tasks("agentcalc", split, seed, self._make, self.num_eval_tasks)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        return f"{a}{op}{b}=", calculate(f"{a}{op}{b}")

    async def episode(self, task: Task, session: Session) -> float:
        # the endpoint is plain http on 127.0.0.1: no proxy from the environment, no TLS setup
        # (which costs ~30 ms per client); a client without DefaultAsyncHttpxClient uses its own
        http_client = getattr(openai, "DefaultAsyncHttpxClient", None)
        http = http_client(trust_env=False, verify=False) if http_client else None
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused",
                                      max_retries=0, http_client=http) as client:
            answer = await self.agent(client, task.prompt)
        return self.reward(task, answer)

    async def agent(self, client: Any, question: str) -> str:
        """The agent loop: the final answer's text ("" when the turns ran out)."""
        messages: list[Any] = [{"role": "user", "content": question}]
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC_TOOL],
                max_tokens=self.max_new_tokens)
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call.function.name,
                                                     call.function.arguments)})
        return ""

    def reward(self, task: Task, answer: str) -> float:
        return 1.0 if leading_answer(answer) == task.answer else 0.0

    def reference_response(self, task: Task) -> str:
        """A first-turn response that earns full reward without the tool."""
        return task.answer
