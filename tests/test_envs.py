"""Built-in environments, the loader and EnvMix, the scripted session and the contract checker."""

from __future__ import annotations

import itertools
import math
import sys
import textwrap

import pytest

from envs.base import Environment, SingleTurnEnv, Task
from envs.builtin import MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, VOCAB, leading_answer
from envs.builtin.arith import ArithEnv
from envs.builtin.calc_tool import CalcToolEnv, calculate
from envs.builtin.reverse import ReverseEnv
from envs.contract import check_env, check_env_async, main
from envs.loader import load_env, load_envs
from envs.scripted import ScriptedSession

ARITH = "envs.builtin.arith:ArithEnv"
REVERSE = "envs.builtin.reverse:ReverseEnv"
CALC = "envs.builtin.calc_tool:CalcToolEnv"


def take(env: Environment, n: int, split: str = "train", seed: int = 0) -> list[Task]:
    return list(itertools.islice(env.tasks(split, seed), n))


async def play(env: Environment, task: Task, *responses: str) -> tuple[float, ScriptedSession]:
    session = ScriptedSession(task.prompt, responses)
    return await env.episode(task, session), session


# ----------------------------------------------------------------------------- built-ins
BUILTIN_ENVS = [ArithEnv(), ReverseEnv(), ReverseEnv(partial=True), CalcToolEnv(),
                ArithEnv(max_operand=49_999_999, num_eval_tasks=5),
                ReverseEnv(min_len=8, max_len=8), CalcToolEnv(max_operand=9999, ops="*")]


@pytest.mark.parametrize("env", BUILTIN_ENVS[:4], ids=lambda e: f"{type(e).__name__}")
def test_builtins_pass_the_contract(env):
    report = check_env(env, num_tasks=10)
    assert report.ok, report.format()
    assert report.problems == []
    assert report.check("reward_order").ok  # every built-in has reference_response


@pytest.mark.parametrize("env", BUILTIN_ENVS, ids=lambda e: f"{type(e).__name__}")
def test_builtin_text_fits_the_vocabulary_and_lengths(env):
    for task in take(env, 200) + list(env.tasks("eval")):
        assert set(task.prompt) <= VOCAB and len(task.prompt) <= MAX_PROMPT_CHARS, task
        assert set(task.answer) <= VOCAB and len(task.answer) <= MAX_ANSWER_CHARS, task
        if isinstance(env, CalcToolEnv):  # the call fits turn 1, the answer and <eos> turn 2
            assert len(f"calc({task.prompt[:-1]})") <= env.max_new_tokens, task
            assert len(task.answer) + 1 <= env.answer_tokens, task
        else:  # the answer and <eos>
            assert len(task.answer) + 1 <= env.max_new_tokens, task


@pytest.mark.parametrize("cls", [ArithEnv, ReverseEnv, CalcToolEnv])
def test_builtin_tasks_are_deterministic_per_seed_and_eval_is_fixed(cls):
    env = cls(num_eval_tasks=30)
    assert take(env, 50, seed=3) == take(cls(num_eval_tasks=30), 50, seed=3)
    assert take(env, 50, seed=3) != take(env, 50, seed=4)
    evals = list(env.tasks("eval", 0))
    assert len(evals) == 30 and evals == list(env.tasks("eval", 7))
    assert len({t.prompt for t in evals}) == 30  # distinct prompts
    assert not {t.id for t in evals} & {t.id for t in take(env, 200)}
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.tasks("test")


def test_arith_reward_cases():
    env, task = ArithEnv(), Task(id="t", prompt="12+7=", answer="19")
    cases = {"19": 1.0, " 19 ": 1.0, "19<": 1.0, "19x7": 1.0, "19 20": 1.0, "190": 0.0,
             "18": 0.0, "": 0.0, "-19": 0.0, "1 9": 0.0, "x19": 0.0}
    for response, reward in cases.items():
        assert env.reward(task, response) == reward, response
    assert env.max_new_tokens == 4 and env.stop is None and env.domain == "math"
    assert leading_answer(" -3+4") == "-3" and leading_answer("abc") == ""


async def test_arith_episode_uses_its_budget():
    env = ArithEnv()
    task = take(env, 1)[0]
    reward, session = await play(env, task, task.answer)
    assert reward == 1.0 and session.calls == [(4, None)]
    assert session.segments == [(task.answer, True)]


def test_reverse_reward_cases():
    task = Task(id="t", prompt="rev abc=", answer="cba")
    exact, partial = ReverseEnv(), ReverseEnv(partial=True)
    assert [exact.reward(task, r) for r in ("cba", " cba ", "cb", "abc", "cbaa")] == \
        [1.0, 1.0, 0.0, 0.0, 0.0]
    assert partial.reward(task, "cba") == 1.0
    assert partial.reward(task, "cbx") == pytest.approx(2 / 3)
    assert partial.reward(task, "cbaa") == pytest.approx(3 / 4)  # extra characters cost
    assert partial.reward(task, "") == 0.0
    assert all(2 <= len(t.answer) <= 5 for t in take(exact, 100))


@pytest.mark.parametrize("cls, options, message", [
    (ArithEnv, {"max_operand": 0}, "max_operand must be in"),
    (ArithEnv, {"max_operand": 2.5}, "max_operand must be an integer"),
    (ReverseEnv, {"min_len": 4, "max_len": 3}, "max_len must be in \\[4, 8\\]"),
    (ReverseEnv, {"partial": "yes"}, "partial must be true or false"),
    (CalcToolEnv, {"ops": "/"}, "ops must be distinct characters"),
    (CalcToolEnv, {"max_operand": 10_000}, "max_operand must be in"),
])
def test_builtin_options_are_checked(cls, options, message):
    with pytest.raises(ValueError, match=message):
        cls(**options)


# ----------------------------------------------------------------------------- calc tool
CALC_TASK = Task(id="c", prompt="12*34=", answer="408")


async def test_calc_tool_episode_marks_the_observation_as_not_policy():
    env = CalcToolEnv()
    reward, session = await play(env, CALC_TASK, "calc(12*34)", "408")
    assert reward == 1.0
    assert session.segments == [("calc(12*34)", True), ("=408 ", False), ("408", True)]
    assert session.transcript == "12*34=calc(12*34)=408 408"
    assert session.policy_text == "calc(12*34)408"
    assert session.calls == [(env.max_new_tokens, [")"]), (env.answer_tokens, None)]
    assert set(session.transcript) <= VOCAB


async def test_calc_tool_protocol_edges():
    env = CalcToolEnv()
    assert (await play(env, CALC_TASK, "408"))[0] == 1.0  # answered directly: one turn
    reward, session = await play(env, CALC_TASK, "calc(12*34)junk", "408")
    assert reward == 1.0 and session.segments[0] == ("calc(12*34)", True)  # cut at the stop
    reward, session = await play(env, CALC_TASK, "calc(12*34", "408")  # stop string trimmed
    assert reward == 1.0 and session.segments[1] == ("=408 ", False)
    reward, session = await play(env, CALC_TASK, "calc(zz)", "407")
    assert reward == 0.0 and session.segments[1] == ("=err ", False)
    reward, session = await play(env, CALC_TASK, "calc(1+1)", "calc(12*34)", "408")
    assert reward == 0.0 and len(session.calls) == 2  # at most two turns
    assert calculate("-5*-3") == "15" and calculate("123456789+1") == "err"


def test_scripted_session_runs_out_to_empty_text():
    import asyncio

    session = ScriptedSession("p=", ["ab)cd"])
    first = asyncio.run(session.generate(stop=[")", "b"]))
    assert first == "ab" and asyncio.run(session.generate()) == ""
    session.observe("x")
    assert session.transcript == "p=abx"
    with pytest.raises(TypeError, match="takes text"):
        session.observe(3)


# ----------------------------------------------------------------------------- loader
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into a fresh sys.path entry; removes it from sys.modules after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


def test_load_env_builds_builtins_with_options():
    env = load_env(ARITH, {"max_operand": 9})
    assert isinstance(env, ArithEnv) and env.options == {"max_operand": 9, "num_eval_tasks": 200}
    assert all(int(t.answer) <= 18 for t in take(env, 50))


def test_load_env_user_module(user_module):
    user_module("rlx_user_env_ok", """
        from envs.base import SingleTurnEnv, Task
        class Echo(SingleTurnEnv):
            domain = "echo"
            def tasks(self, split="train", seed=0):
                return iter([Task(id=f"{seed}-{i}", prompt=f"say {seed}{i}=") for i in range(3)])
            def reward(self, task, response):
                return float(response == task.prompt)
    """)
    env = load_env("rlx_user_env_ok:Echo", {})
    assert env.domain == "echo" and [t.id for t in env.tasks()] == ["0-0", "0-1", "0-2"]


@pytest.mark.parametrize("dotted, options, parts", [
    ("no_such_pkg_rlx.mod:Env", {}, ["no_such_pkg_rlx.mod:Env", "not found",
                                     "no module named 'no_such_pkg_rlx'"]),
    ("envs.builtin.arith:NoSuch", {}, ["envs.builtin.arith:NoSuch", "no attribute 'NoSuch'",
                                       "ArithEnv"]),
    ("envs.scripted:ScriptedSession", {}, ["envs.scripted:ScriptedSession",
                                           "not a subclass of envs.base.Environment"]),
    ("envs.builtin:VOCAB", {}, ["envs.builtin:VOCAB", "a frozenset", "not a subclass"]),
    ("envs.base:SingleTurnEnv", {}, ["is abstract", "implement reward, tasks"]),
    (ARITH, {"max_operand": 9, "bogus": 1}, [ARITH, "rejected options ['bogus', 'max_operand']",
                                             "unexpected keyword argument 'bogus'"]),
    (ARITH, {"max_operand": -1}, [ARITH, "rejected options ['max_operand']",
                                  "max_operand must be in [1, 49999999], got -1"]),
    ("envs.builtin.arith.ArithEnv", {}, ["must look like 'package.module:ClassName'"]),
    ("arith", {}, ["did you mean 'envs.builtin.arith:ArithEnv'"]),
])
def test_load_env_errors_say_what_is_wrong(dotted, options, parts):
    with pytest.raises(ValueError) as err:
        load_env(dotted, options)
    for part in parts:
        assert part in str(err.value)


def test_load_env_errors_from_the_users_module(user_module):
    user_module("rlx_user_env_dep", "import no_such_dependency_rlx\n")
    with pytest.raises(ValueError, match="imports the missing module 'no_such_dependency_rlx'"):
        load_env("rlx_user_env_dep:Env", {})
    user_module("rlx_user_env_boom", "raise RuntimeError('bad config file')\n")
    with pytest.raises(ValueError, match="raised RuntimeError: bad config file"):
        load_env("rlx_user_env_boom:Env", {})


# ----------------------------------------------------------------------------- EnvMix
def test_env_mix_interleaves_by_weight_deterministically():
    mix = load_envs([{"cls": ARITH, "weight": 3.0}, {"cls": REVERSE, "weight": 1.0},
                     {"cls": CALC, "weight": 2.0, "options": {"ops": "*"}}])
    tasks = take(mix, 60)
    domains = [t.domain for t in tasks]
    # smooth weighted round robin, worked by hand: credits += (3, 1, 2), the top one pays 6
    assert domains[:6] == ["math", "tool", "math", "reverse", "tool", "math"]
    for n in range(1, 61):  # every prefix is within one task of its share
        for domain, share in (("math", 3 / 6), ("reverse", 1 / 6), ("tool", 2 / 6)):
            assert abs(domains[:n].count(domain) - share * n) <= 1, (n, domain)
    assert tasks == take(mix, 60) and take(mix, 60, seed=1) != tasks
    assert [t.id for t in tasks if t.domain == "math"] == [t.id for t in take(mix.envs[0], 30)]
    for task in tasks:
        assert mix.env_for(task) is {"math": mix.envs[0], "reverse": mix.envs[1],
                                     "tool": mix.envs[2]}[task.domain]


async def test_env_mix_routes_episodes_and_runs_out_finite_splits():
    mix = load_envs([{"cls": ARITH, "options": {"num_eval_tasks": 5}},
                     {"cls": REVERSE, "weight": 4, "options": {"num_eval_tasks": 3}}])
    evals = list(mix.tasks("eval"))
    assert sorted(t.domain for t in evals) == ["math"] * 5 + ["reverse"] * 3
    for task in evals:
        reward, _ = await play(mix, task, task.answer)
        assert reward == 1.0
    with pytest.raises(ValueError, match="no environment of this mix owns"):
        mix.env_for(Task(id="x", prompt="1+1=", domain="other"))


def test_env_mix_passes_the_contract():
    mix = load_envs([{"cls": ARITH}, {"cls": CALC}])
    report = check_env(mix, num_tasks=6)
    assert report.ok, report.format()


def test_env_mix_domains_and_spec_errors():
    with pytest.raises(ValueError, match="2 environments of the mix have domain 'math'"):
        load_envs([{"cls": ARITH}, {"cls": ARITH}])
    mix = load_envs([{"cls": ARITH}, {"cls": ARITH, "domain": "math2", "options": {
        "max_operand": 5}}])
    assert {t.domain for t in take(mix, 10)} == {"math", "math2"}
    bad = [([], "non-empty list"), ([{"weight": 1}], "with a 'cls' key"),
           ([{"cls": ARITH, "weight": 0}], "weight must be a finite number > 0"),
           ([{"cls": ARITH, "weight": "1"}], "weight must be a number"),
           ([{"cls": ARITH, "opts": {}}], "unknown keys \\['opts'\\]"),
           ([{"cls": ARITH, "options": {"x": 1}}], "rejected options \\['x'\\]")]
    for specs, message in bad:
        with pytest.raises(ValueError, match=message):
            load_envs(specs)


# ----------------------------------------------------------------------------- contract
class BrokenEnv(Environment):
    """Breaks the contract on purpose: repeated ids, ignores the seed, raises, returns an int."""

    domain = "broken"

    def tasks(self, split="train", seed=0):
        if split == "eval":
            return iter([Task(id="e", prompt="x="), Task(id="e", prompt="y=")])
        return iter([Task(id=f"t{i % 3}", prompt=f"{i}=") for i in range(6)])

    async def episode(self, task, session):
        await session.generate(4)
        if task.prompt == "1=":
            raise RuntimeError("boom")
        return 1


def test_contract_reports_a_broken_env():
    report = check_env(BrokenEnv(), num_tasks=6)
    assert not report.ok
    text = "\n".join(report.problems)
    assert "train_tasks: task id 't0' repeats in tasks('train', 0)" in text
    assert "train_determinism: tasks('train', 1) gave the same tasks as seed 0" in text
    assert "eval_tasks: task id 'e' repeats" in text
    assert "episode_garbage: task 't1': episode raised RuntimeError: boom (at " in text
    assert "in episode)" in text
    assert "episode_empty: task 't0': episode returned 1 (int); return a float" in text
    assert not report.check("train_tasks").ok and report.check("domain").ok
    assert "reward_order" not in [c.name for c in report.checks]  # no reference_response
    assert "FAIL" in report.format()


class OddEnv(SingleTurnEnv):
    """Each task breaks a different episode rule."""

    domain = ""

    def tasks(self, split="train", seed=0):
        if split == "eval":
            return itertools.count()
        return iter([Task(id=f"{seed}-{k}", prompt=k) for k in ("nan", "inv", "hang", "")]
                    + ["not a task", Task(id=["x"], prompt="x")])

    async def episode(self, task, session):
        if task.prompt == "hang":
            import asyncio

            await asyncio.sleep(60)
        if task.prompt == "":
            return 0.0  # never generates
        return await super().episode(task, session)

    def reward(self, task, response):
        return math.nan if task.prompt == "nan" else float(response != "ok")

    def reference_response(self, task):
        return "ok"


async def test_contract_reports_each_episode_rule():
    report = await check_env_async(OddEnv(), num_tasks=6, timeout_s=0.05)
    text = "\n".join(report.problems)
    assert "domain: domain must be a non-empty str, got ''" in text
    assert "train_tasks: tasks('train', 0) item 4 is a str; yield envs.base.Task" in text
    assert "train_tasks: task '0-': prompt must be a non-empty str" in text
    assert "train_tasks: tasks('train', 0) item 5: id must be a non-empty str, got ['x']" in text
    assert "eval_tasks: tasks('eval', 0) yielded more than" in text
    assert "task '0-nan': episode returned nan; return a finite float" in text
    assert "task '0-hang': episode did not finish within 0.05s" in text
    assert "task '0-': episode never called session.generate()" in text
    assert "reward_order: task '0-inv': the reference response earned 0.0, less than garbage" \
        in text
    with pytest.raises(RuntimeError, match="check_env_async"):
        check_env(OddEnv())


def test_contract_command_line(capsys):
    assert main([ARITH, "--num-tasks", "3"]) == 0
    assert "ArithEnv: PASS" in capsys.readouterr().out
    assert main([ARITH, "--options", '{"bogus": 1}']) == 2
    assert "rejected options ['bogus']" in capsys.readouterr().err
    assert main(["tests.test_envs:BrokenEnv", "--num-tasks", "4"]) == 1
    assert "BrokenEnv: FAIL" in capsys.readouterr().out
