"""`[rl]`: one RL / distillation run described once; the launcher writes every actor's table.

    [rl]
    model = "base-tiny"                 # the policy (workers, rollout tokenizer, trainer)
    workers = 2
    group_size = 8
    groups_per_batch = 16
    num_steps = 200
    envs = [{ cls = "envs.builtin.arith:ArithEnv" }]

becomes `[actors.worker0]` .. `[actors.worker<N-1>]`, `[actors.router]`, `[actors.buffer]`,
`[actors.rollout]`, `[actors.trainer]` (primary) and, with `teachers`, `[actors.teachers]` (the
teacher pool, the rollout's sink) and, for colocated teachers, `[actors.prefetcher]`. Each fact of
the run (runtime/facts.py) is written once, into the table of the actor that decides it: the
model, dtype, mode and true_on_policy to the trainer (the model to the workers too: what they
serve), group_size, groups_per_batch, temperature and top_p to the rollout, max_staleness to the
buffer; every other actor reads them from its context (launch/plan.py derives them at load).
Embedded workers on CUDA get the trainer's `weight_sync.path = "auto"` (CUDA IPC on its GPU,
NCCL to the others; disk stays the default elsewhere); the teachers and `opd` go to the pool and
the trainer (with opd mode "top_p" or `top_p_replay`, the rollout records each token's nucleus:
`nucleus_top_logprobs`); the worker names to the trainer. With `moe` (a mixture-of-experts
policy) the trainer gets the table and, with embedded workers, the workers answer with each
token's routed experts and the rollout keeps them in the samples.

Per-actor tables stay the way to change anything else or to lay out a custom cluster: a table
`[actors.<name>]` the file also has is merged over the derived one (tables key by key, any other
value replaced), and an actor of another name is added as written. `[[hosts]]` may be left out
(one local host). `python -m launch.cluster hosts.toml --dry-run` prints the result, and the run's
config.json records it.

Invariant: `expand` is a pure function of the document: a resumed run (same file, same `--set`
overrides) derives the same actors.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import msgspec

from models.lora import LoraConfig


class RLConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The run-level table `[rl]` (launch/rl.py derives the actors from it)."""

    # the policy: an HF checkpoint directory (next to this file, in the working directory or
    # the packaged examples), a tiny name, or a hub id org/name[@revision] (models/hub.py)
    model: str
    envs: list[dict[str, Any]]  # the task mix: { cls, weight, options, domain } per environment
    engine: Literal["embedded", "sglang"] = "embedded"  # inference workers: embedded or SGLang
    workers: int = 2  # inference worker actors, named worker0 .. worker<N-1>
    device: str = "cpu"  # the trainer's and embedded workers' torch device (per actor: override)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # trainer and embedded workers
    threads: int = 1  # OMP_NUM_THREADS of the workers and the trainer (0 = leave it unset)
    # bitwise-equal log-probs in workers and trainer (models/invariant, docs/training.md)
    true_on_policy: bool = False
    mode: Literal["decoupled", "colocated"] = "decoupled"  # colocated: train and generate in turn
    # weight versions the rollout may run ahead of the trainer (None: 1 decoupled, 0 colocated)
    max_staleness: int | None = None
    group_size: int = 8  # samples per prompt (GRPO group)
    groups_per_batch: int = 16  # prompts per training batch
    temperature: float = 1.0  # sampling temperature (the trainer's loss and teachers use it too)
    top_p: float = 1.0  # sampling top-p
    max_new_tokens: int = 32  # per turn, unless the environment sets its own
    num_steps: int = 100  # optimizer steps; the run completes after the last one
    algorithm: str = "grpo"  # the trainer's loss.advantage_estimator (grpo, dr_grpo, ppo, none..)
    lr: float = 1e-4  # AdamW learning rate
    micro_batch_size: int = 16  # samples per forward/backward micro-batch
    kl_coef: float = 0.0  # KL to the frozen initial policy as a loss term (0 = no reference)
    save_every: int = 0  # steps between checkpoints (0 = only at the end)
    eval_every: int = 0  # greedy evaluation every this many batches (0 = only the final one)
    eval_tasks: int = 64  # eval tasks per domain
    seed: int = 0  # task order, trainer seed; worker i is seeded seed + i
    # distillation teachers, as in the teacher pool: { name, model, domains, coef, worker, url }
    teachers: list[dict[str, Any]] = []
    teacher_mode: Literal["colocated", "server"] = "colocated"  # in the trainer, or served
    opd: dict[str, Any] = {}  # the teachers' signal (algos/opd.py OpdConfig; {} = its defaults)
    teacher_memory: dict[str, Any] = {}  # colocated teachers' tiers (TeacherMemoryConfig)
    # a LoRA student: { rank, alpha, target_modules, dropout, merge_export } (training/config.py
    # LoraConfig; {} = its defaults); absent = full fine-tuning. Pushes send the adapter only
    lora: dict[str, Any] | None = None
    # a mixture-of-experts policy's training: { routing_replay = "off" | "rollout",
    # aux_loss_coef } (training/config.py MoeConfig; {} = its defaults). Present, with embedded
    # workers: they return each token's experts with every answer, the rollout puts them in the
    # samples and the trainer measures (and replays) them. SGLang workers cannot (sglang-router
    # 0.3.2 drops the request field): routing_replay = "rollout" is refused with them
    moe: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers = {self.workers}: at least one inference worker")
        for name, value in (("group_size", self.group_size),
                            ("groups_per_batch", self.groups_per_batch)):
            if value < 1:
                raise ValueError(f"{name} = {value}: use 1 or more")
        if self.threads < 0:
            raise ValueError(f"threads = {self.threads}: use 0 (unset) or a positive count")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness = {self.max_staleness}: use 0 or more")
        if self.mode == "colocated" and self.max_staleness:
            raise ValueError(f"mode = 'colocated' trains and generates in turn, so the rollout "
                             f"cannot run ahead: max_staleness must be 0 (or left out), not "
                             f"{self.max_staleness}")
        if self.moe and self.moe.get("routing_replay") == "rollout" and self.engine != "embedded":
            raise ValueError("moe.routing_replay = 'rollout' needs each token's experts from the "
                             "workers, but sglang-router 0.3.2 (in front of SGLang workers) drops "
                             "/generate's return_routed_experts field, so SGLang cannot be asked "
                             "for them through it; use engine = 'embedded' or routing_replay = "
                             "'off'")
        if (self.opd or self.teacher_memory or self.teacher_mode != "colocated") \
                and not self.teachers:
            raise ValueError("opd / teacher_memory / teacher_mode are set but teachers is "
                             "empty: list the teachers ({ name, model, domains }) or remove them")


ROUTER_DEFAULTS = {"log_level": "warn"}  # health checks: the router actor's HEALTH_DEFAULTS
# on_start limits of derived actors that load real models: an SGLang server (above its own
# 600 s health wait), and an embedded worker or the trainer on a GPU or on the CPU (a model read
# and built there: a tiny model's worker took over 30 s, the actor default, on a 2-core machine
# running four busy processes); the launcher waits for READY at least this + 30 s
# (launch/supervisor.py `ready_limit`). Elsewhere the actor default (30 s) holds.
SGLANG_START_TIMEOUT_S = 900.0
GPU_START_TIMEOUT_S = 600.0
CPU_MODEL_START_TIMEOUT_S = 120.0


def model_start_timeout(device: str) -> float:
    """on_start limit of a derived actor that loads a model onto `device`."""
    return GPU_START_TIMEOUT_S if device.startswith("cuda") else CPU_MODEL_START_TIMEOUT_S
NUCLEUS_TOP_LOGPROBS = 64  # top log-probs per token for the recorded nucleus (opd top_p / replay)


def derive(rl: RLConfig) -> dict[str, dict[str, Any]]:
    """The actor tables `[rl]` stands for (ActorEntry-shaped dicts, in start order)."""
    env = {"OMP_NUM_THREADS": str(rl.threads)} if rl.threads else {}
    workers = [f"worker{i}" for i in range(rl.workers)]
    teachers = [dict(t) for t in rl.teachers]
    actors: dict[str, dict[str, Any]] = {}
    if rl.engine == "embedded":
        for i, name in enumerate(workers):
            cfg: dict[str, Any] = {"model": rl.model, "seed": rl.seed + i}
            cfg.update(_unless_default(device=(rl.device, "cpu"), dtype=(rl.dtype, "float32"),
                                       true_on_policy=(rl.true_on_policy, False)))
            if rl.moe is not None:  # routes in every answer: the router drops the request flag
                cfg["return_routed_experts"] = True
            actors[name] = {"cls": "actors.inference:InferenceWorker", "env": dict(env),
                            "config": cfg, "start_timeout_s": model_start_timeout(rl.device)}
        actors["router"] = {"cls": "actors.router:RouterActor", "after": list(workers),
                            "config": {"router": dict(ROUTER_DEFAULTS)}}
    else:  # SGLang servers register with the router, so it starts first
        actors["router"] = {"cls": "actors.router:RouterActor",
                            "config": {"dynamic_workers": True, "router": dict(ROUTER_DEFAULTS)}}
        for name in workers:
            # a server loads its model and captures CUDA graphs first (its own health wait
            # is 600 s): the actor's on_start, and so the launcher, waits past that
            actors[name] = {"cls": "actors.sglang_worker:SglangWorker", "after": ["router"],
                            "start_timeout_s": SGLANG_START_TIMEOUT_S,
                            "config": {"model_path": rl.model, "register_with": "router"}}
            if rl.lora is not None:  # SGLang serves adapters only when started for them
                actors[name]["config"]["sglang"] = _sglang_lora(rl.lora)
    staleness = rl.max_staleness if rl.max_staleness is not None else (
        0 if rl.mode == "colocated" else 1)
    actors["buffer"] = {"cls": "actors.buffer:BufferActor",
                        "config": {"max_staleness": staleness}}
    rollout_after = ["router", "buffer"]
    if teachers:
        pool: dict[str, Any] = {"mode": rl.teacher_mode, "teachers": copy.deepcopy(teachers)}
        if rl.opd:
            pool["opd"] = dict(rl.opd)
        served = [t["worker"] for t in teachers if t.get("worker")]
        actors["teachers"] = {"cls": "actors.teacher_pool:TeacherPool",
                              "after": ["buffer", *served], "config": pool}
        if rl.teacher_mode == "colocated":
            actors["prefetcher"] = {"cls": "actors.prefetcher:PrefetcherActor"}
        rollout_after.append("teachers")
    rollout: dict[str, Any] = {}
    if teachers:
        rollout["sink"] = "teachers"
    rollout.update({"group_size": rl.group_size, "groups_per_batch": rl.groups_per_batch})
    rollout.update(_unless_default(temperature=(rl.temperature, 1.0), top_p=(rl.top_p, 1.0),
                                   max_new_tokens=(rl.max_new_tokens, 32), seed=(rl.seed, 0)))
    if teachers and (rl.opd.get("mode") == "top_p" or rl.opd.get("top_p_replay")):
        # the nucleus each token was sampled from, recorded for the trainer (docs/mopd.md)
        rollout["nucleus_top_logprobs"] = NUCLEUS_TOP_LOGPROBS
    if rl.moe is not None and rl.engine == "embedded":  # each token's experts, for the
        rollout["routed_experts"] = True  # trainer's routing replay and metrics
    rollout.update({"eval_every": rl.eval_every, "eval_tasks": rl.eval_tasks,
                    "envs": copy.deepcopy(rl.envs)})
    actors["rollout"] = {"cls": "actors.rollout:RolloutActor", "after": rollout_after,
                         "config": rollout}
    trainer: dict[str, Any] = {"model": rl.model, "workers": list(workers),
                               "rollout": "rollout", "num_steps": rl.num_steps}
    trainer.update(_unless_default(device=(rl.device, "cpu"), dtype=(rl.dtype, "float32"),
                                   seed=(rl.seed, 0), mode=(rl.mode, "decoupled"),
                                   true_on_policy=(rl.true_on_policy, False)))
    trainer["optimizer"] = {"lr": rl.lr}
    trainer["micro_batches"] = {"size": rl.micro_batch_size}
    if rl.save_every:
        trainer["checkpoint"] = {"save_every": rl.save_every}
    loss = _unless_default(advantage_estimator=(rl.algorithm, "grpo"))
    if loss:
        trainer["loss"] = loss
    if rl.kl_coef:
        trainer["kl"] = {"coef": rl.kl_coef, "use_kl_loss": True}
    if rl.engine == "embedded" and rl.device.startswith("cuda"):
        # on GPUs: CUDA IPC to a worker on the trainer's GPU, NCCL to the others (measured on
        # H200s against disk: docs/benchmarks.md); any [actors.trainer.config] weight_sync wins
        trainer["weight_sync"] = {"path": "auto"}
    if rl.lora is not None:
        trainer["lora"] = dict(rl.lora)
        # embedded workers: the adapter in the request body (CUDA IPC to a worker on the
        # trainer's GPU); SGLang reads its own pickled tensors in a body, so its workers load
        # the PEFT directory from disk
        path = "disk" if rl.engine != "embedded" else (
            "auto" if rl.device.startswith("cuda") else "tensor")
        trainer["weight_sync"] = {"path": path}
    if rl.moe is not None:
        trainer["moe"] = dict(rl.moe)
    trainer_after = [*workers, "buffer", "rollout"]
    if teachers:
        trainer["opd"] = dict(rl.opd)
        if rl.teacher_mode == "colocated":
            trainer["teachers"] = copy.deepcopy(teachers)
            if rl.teacher_memory:
                trainer["teacher_memory"] = dict(rl.teacher_memory)
            trainer["prefetcher"] = "prefetcher"
            trainer_after.append("prefetcher")
    # a real model, its optimizer state and teachers loaded
    actors["trainer"] = {"cls": "actors.trainer:TrainerActor", "after": trainer_after,
                         "primary": True, "env": dict(env), "config": trainer,
                         "start_timeout_s": model_start_timeout(rl.device)}
    return actors


def _sglang_lora(table: dict[str, Any]) -> dict[str, Any]:
    """SGLang's launch options for the adapters the trainer will push (the trainer's LoRA
    table, with LoraConfig's defaults): --enable-lora, their rank and target modules."""
    cfg = msgspec.convert(table, LoraConfig)
    return {"enable_lora": True, "max_lora_rank": cfg.rank,
            "lora_target_modules": list(cfg.target_modules)}


def _unless_default(**pairs: tuple[Any, Any]) -> dict[str, Any]:
    """The (value, default) pairs whose value is not the default: the derived tables hold only
    what [rl] decides, so the actors' own defaults stay visible as defaults."""
    return {k: v for k, (v, default) in pairs.items() if v != default}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: tables merged key by key (recursively), anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand(raw: dict[str, Any]) -> set[str]:
    """In place: the document's `[rl]` turned into actor tables, the file's own `[actors.*]`
    merged over them, and one local host when `[[hosts]]` is missing. Returns the names of the
    derived actors (empty without `[rl]`). Raises msgspec.ValidationError / ValueError for a bad
    `[rl]` (the caller names the file)."""
    if "rl" not in raw:
        return set()
    rl = msgspec.convert(raw["rl"], RLConfig)
    derived = derive(rl)
    own = raw.get("actors", {})
    if not isinstance(own, dict):
        raise ValueError("`actors` must be a table of [actors.<name>] tables")
    actors = {name: merge(entry, own[name]) if isinstance(own.get(name), dict) else entry
              for name, entry in derived.items()}
    for name, entry in own.items():
        if name not in derived:
            actors[name] = entry
        elif not isinstance(entry, dict):
            actors[name] = entry  # reported by the schema check, naming the table
    raw["actors"] = actors
    raw.setdefault("hosts", [{"name": "local"}])
    return set(derived)
