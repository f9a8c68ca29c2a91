"""The rollout as the launcher sees it (actors/rollout.py is the actor): its settings and the
checks the launcher runs on a plan (runtime/loading.py `import_actor`, plan side)."""

from __future__ import annotations

import msgspec

from engine.chat_template import check_chat_template
from engine.drift import DRIFT_RULES
from envs.loader import check_at_load, load_envs
from models.names import check_model_path
from runtime.actor import Actor
from runtime.facts import RunFacts


class EnvSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One environment of the task mix."""

    cls: str  # "package.module:Class", a subclass of envs.base.Environment
    weight: float = 1.0  # share of tasks drawn from it
    options: dict = {}  # constructor keyword arguments


class RolloutConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Settings of the rollout actor."""

    envs: list[EnvSpec]
    router: str = "router"  # peer whose http endpoint serves /generate
    buffer: str = "buffer"  # peer that grants permits (and receives sample groups)
    sink: str = ""  # peer that receives sample groups instead ("teachers": the teacher pool)
    group_size: int = 8  # samples per task (GRPO group)
    groups_per_batch: int = 8  # tasks per training batch
    max_concurrency: int = 32  # episodes in flight at once
    temperature: float = 1.0  # sampling temperature (the trainer must use the same)
    top_p: float = 1.0
    # with top_p < 1: record the nucleus each token was sampled from (the workers' this many
    # top log-probs per output token), for opd top_p / top_p_replay; a token whose nucleus
    # holds more tokens keeps none (the episode goes on, the trainer trains it as a token without
    # a record; counted in nucleus_fallback_tokens); 0 = off (docs/mopd.md)
    nucleus_top_logprobs: int = 0
    # mixture-of-experts policies: ask the workers for the experts each token was routed to
    # (SGLang's return_routed_experts; an SGLang server needs --enable-return-routed-experts)
    # and send them with the samples (Sample.routed_experts) for the trainer's routing replay
    routed_experts: bool = False
    max_new_tokens: int = 32  # per turn, unless the environment sets its own
    seed: int = 0  # task order
    eval_every: int = 5  # score eval tasks every this many batches (0 = never)
    eval_tasks: int = 64  # eval tasks per domain
    num_batches: int = 0  # stop after this many batches (0 = until the run ends)
    retries: int = 3  # attempts per turn after the first
    # the run fails (exit 1) after this many consecutive batches in which every group failed
    # and the environment raised or the workers' answers were unusable (engine/errors.py
    # UnusableAnswer: asking again gets the same); workers that are down do not count; 0 = never
    max_failed_batches: int = 3
    # warn (naming the domain, with two responses) when every group of a domain scored the same
    # within the group, so GRPO has nothing to learn from it, this many batches in a row (0 = never)
    no_signal_batches: int = 3
    # episodes of each batch sent to the launcher as text with the batch's metrics (one per
    # domain in turn; the first failed episode of each domain comes on top): it writes them to
    # <run_dir>/samples/rollout.jsonl; 0 = none (an evaluation always sends all its responses)
    samples_per_batch: int = 4
    failure_notice_interval_s: float = 30.0  # failing episodes reach the console this often
    resend_batches: int = 4  # batches of groups kept to re-send to a restarted buffer
    request_timeout_s: float = 120.0
    # an episode's own time (its environment's code: reward(), tools, waits; generation is not
    # counted) may last this long, seconds; past it the episode is abandoned and counted as
    # failed, naming the environment and the task (reward() runs in a thread of its own, so a
    # hung one never stalls the rollout); 0 = no limit
    env_timeout_s: float = 60.0
    # a wait for the buffer's permit (the trainer's progress) longer than this ends the run with
    # a message (reported every [run] stall_report_s while it lasts), seconds
    permit_timeout_s: float = 3600.0
    # agent environments (session.base_url, docs/agents.md): the chat template of chat requests
    # ("auto", "chatml", "plain" or a Jinja template file), and what a request that does not
    # extend the episode's tokens does: "split" (the sample is the last segment) or "fail"
    chat_template: str = "auto"
    agent_drift: str = "split"


class RolloutActorPlan(Actor):
    """What the launcher checks of a rollout: its chat template, agent drift rule, sample and
    timeout settings and environments, the run's model, its peers."""

    Config = RolloutConfig
    role = "rollout"

    @classmethod
    def check_config(cls, config: RolloutConfig) -> list[str]:
        """The environments load and keep the contract on a sample of their tasks
        (envs.loader.check_at_load); its notes reach the console."""
        check_chat_template(config.chat_template)
        if config.agent_drift not in DRIFT_RULES:
            raise ValueError(f"agent_drift = {config.agent_drift!r}: use one of {DRIFT_RULES}")
        if config.samples_per_batch < 0:
            raise ValueError(f"samples_per_batch = {config.samples_per_batch}: give a count >= 0 "
                             f"(0 = no samples of the batches)")
        if not config.env_timeout_s >= 0:
            raise ValueError(f"env_timeout_s = {config.env_timeout_s}: give seconds >= 0 "
                             f"(0 = no limit)")
        mix = load_envs([msgspec.to_builtins(e) for e in config.envs])
        return check_at_load(mix, config.eval_tasks)

    @classmethod
    def check_facts(cls, config: RolloutConfig, facts: RunFacts) -> None:
        """The run's model (its tokenizer is the rollout's) exists."""
        if not facts.model:
            raise ValueError("no trainer on this rollout's buffer decides the run's model, whose "
                             "tokenizer the rollout uses: add a trainer with buffer = "
                             f"{config.buffer!r}")
        check_model_path(facts.model)

    @classmethod
    def peers(cls, config: RolloutConfig) -> dict[str, str]:
        return {"router": config.router, "buffer": config.buffer, "sink": config.sink}
