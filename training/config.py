"""The trainer's settings, one typed struct per component (`[actors.trainer.config]` in hosts.toml).

Role: every option the training library reads, declared once with its units or choices, and
checked when the config is loaded: each component checks itself in `__post_init__`, and
`TrainConfig.__post_init__` checks the pairs that span components, so an incompatible pair fails
at load with a message naming both options and what to change. The trainer actor's own settings
(its peers, the number of steps, checkpoints, weight sync) extend `TrainConfig` in
`actors/trainer.py`. hosts.toml shape:

    [actors.trainer.config]
    model = "..."
    optimizer = { lr = 1e-4, grad_clip = 1.0 }
    micro_batches = { size = 16 }
    loss = { advantage_estimator = "grpo", eps_clip = 0.2 }
    kl = { coef = 0.1, use_kl_loss = true }
    parallel = { dp = 2 }  # or, with the model-parallel backend: { tp = 2, pp = 1, dp = 2 }
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from algos.estimators import KL_ESTIMATORS, TOKEN_REWARDS, check_estimator, estimator_spec
from algos.mismatch_config import MismatchConfig
from algos.opd_config import OpdConfig, check_placement, is_loss_term
from logic.teachers import TeacherSpec, route_table
from memory.config import TeacherMemoryConfig
from models.lora import LORA_TARGETS, LoraConfig  # noqa: F401 - the trainer's `lora` table

MP = "megatron"  # the model-parallel backend (training/backends.py registers it)


def options_of(cfg: TrainConfig) -> dict[str, Any]:
    """The model-parallel backend's option table (the TrainConfig field named MP)."""
    return cfg.megatron


class OptimizerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The policy's optimizer (AdamW)."""

    lr: float = 1e-4  # learning rate
    weight_decay: float = 0.0  # decoupled weight decay
    grad_clip: float = 1.0  # max global gradient norm (0 = no clipping)
    # fp32 master weights and optimizer state behind 16-bit parameters (training/master_weights.py);
    # None = on for bfloat16/float16, false = pure 16-bit updates
    master_weights: bool | None = None

    def __post_init__(self) -> None:
        if self.lr < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"optimizer needs lr >= 0, weight_decay >= 0, grad_clip >= 0 "
                             f"(0 = no clipping); got lr = {self.lr}, weight_decay = "
                             f"{self.weight_decay}, grad_clip = {self.grad_clip}")


class MicroBatchConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How a step's samples are split into forward/backward passes."""

    size: int = 16  # samples per micro-batch (when max_tokens = 0)
    max_tokens: int = 0  # token cap per micro-batch, first-fit-decreasing packing (0 = off)
    forward_by_length: bool | None = None  # unpadded forward per length; None = fp32 on CPU only
    # float32 logits the loss head makes at once (algos/loss_head.py: a chunk of tokens x V);
    # 256 MiB is 441 tokens at V = 151,936
    head_chunk_mib: int = 256
    # the loss head's per-chunk passes over the logits (log-sum-exp, entropy, their gradient)
    # through torch.compile on CUDA: one fused read of each chunk's logits instead of several
    # float32 passes (compiled once per process, a few seconds); no effect on the CPU
    head_compile: bool = True
    # the model passes of the step (recompute, policy forward+backward, reference, old actors)
    # run on packed rows: each micro-batch's samples end to end in rows of <= max_tokens tokens
    # (no cap: one row), positions restarting per sample, attention kept per sample
    # (training/packing.py), instead of right-padded rows; same values, fewer tokens. Torch
    # backend, plain output head; true_on_policy, OPD top_p_replay, the megatron backend and
    # other heads run padded (logged); forward_by_length = true is refused (docs/training.md)
    pack: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or self.max_tokens < 0:
            raise ValueError(f"micro_batches needs size >= 1 and max_tokens >= 0 (0 = no cap); "
                             f"got size = {self.size}, max_tokens = {self.max_tokens}")
        if self.pack and self.forward_by_length:
            raise ValueError("micro_batches.pack = true and forward_by_length = true conflict: "
                             "packed rows are already unpadded (one forward per micro-batch, "
                             "attention per sample); drop forward_by_length")
        if self.head_chunk_mib < 1:
            raise ValueError(f"micro_batches.head_chunk_mib must be >= 1 (MiB of float32 logits "
                             f"per loss-head chunk), got {self.head_chunk_mib}")


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Advantages and the policy loss (PPO-clip)."""

    # grpo | dr_grpo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo (GAE + critic)
    # | none (A = 0: pure distillation, needs opd)
    advantage_estimator: str = "grpo"
    std_normalization: bool = True  # grpo only: false = Dr.GRPO (same as estimator "dr_grpo")
    gamma: float = 1.0  # per-token discount (reinforce_plus_plus, ppo)
    gae_lambda: float = 0.95  # GAE lambda (ppo)
    eps_clip: float = 0.2  # PPO clip: ratio bounded below by 1 - eps_clip
    eps_clip_high: float | None = None  # upper bound 1 + eps_clip_high (None = eps_clip)
    dual_clip_c: float | None = None  # > 1: cap the loss of negative-advantage tokens at -c*A
    entropy_coef: float = 0.0  # entropy bonus weight

    def __post_init__(self) -> None:
        check_estimator(self.advantage_estimator)
        est = self.advantage_estimator
        if not self.std_normalization and est not in ("grpo", "dr_grpo"):
            raise ValueError(f"std_normalization = false and advantage_estimator = {est!r} "
                             "conflict: std_normalization only applies to grpo; remove it")
        if not (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1):
            raise ValueError(f"need 0 < gamma <= 1 and 0 <= gae_lambda <= 1, got gamma = "
                             f"{self.gamma}, gae_lambda = {self.gae_lambda}")

    @property
    def estimator(self) -> str:
        """The advantage estimator in effect (grpo with std_normalization = false is dr_grpo)."""
        if self.advantage_estimator == "grpo" and not self.std_normalization:
            return "dr_grpo"
        return self.advantage_estimator


class KlConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A KL(policy || reference) to a frozen reference policy (algos/kl.py)."""

    coef: float = 0.0  # weight of the KL; 0 = no reference model
    estimator: str = "k3"  # k1 | k2 | k3
    use_kl_loss: bool = False  # the KL as a loss term: + coef * sample-mean KL
    in_reward: bool = False  # the KL as reward shaping: token reward -coef * KL_t
    ref_model: str = ""  # reference checkpoint ("" = a frozen copy of `model`'s initial weights)
    # every N optimizer steps the reference becomes a copy of the actor's current weights (a
    # host weight-set copy, no model built; kept in checkpoints); 0 = never (a frozen reference)
    ref_update_interval: int = 0

    def __post_init__(self) -> None:
        if self.ref_update_interval < 0:
            raise ValueError(f"ref_update_interval must be >= 0 (0 = a frozen reference), got "
                             f"{self.ref_update_interval}")
        if self.ref_update_interval and self.coef == 0:
            raise ValueError(f"ref_update_interval = {self.ref_update_interval} is unused with "
                             f"coef = 0 (no reference model); set coef (and use_kl_loss or "
                             f"in_reward) or remove ref_update_interval")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"estimator = {self.estimator!r}; use one of {KL_ESTIMATORS}")
        if self.use_kl_loss and self.in_reward:
            raise ValueError("use_kl_loss = true and in_reward = true conflict: the KL is either "
                             "a loss term or reward shaping; set one of them false")
        if self.coef < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")
        if self.coef > 0 and not (self.use_kl_loss or self.in_reward):
            raise ValueError(f"coef = {self.coef} needs use_kl_loss = true or in_reward = true "
                             "(how the KL enters the update)")
        if (self.use_kl_loss or self.in_reward) and self.coef == 0:
            which = "use_kl_loss" if self.use_kl_loss else "in_reward"
            raise ValueError(f"{which} = true and coef = 0 conflict: set coef > 0 or {which} "
                             "= false")
        if self.ref_model and self.coef == 0:
            raise ValueError(f"ref_model = {self.ref_model!r} is unused with coef = 0; set coef "
                             "(and use_kl_loss or in_reward) or remove ref_model")


class CheckpointConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """When the trainer writes checkpoints (model, optimizer, step, version)."""

    save_every: int = 0  # steps between checkpoints (0 = only at the end)

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0 (0 = only at the end), got "
                             f"{self.save_every}")


class RankHost(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One host of `parallel.hosts` as the ranks see it (the launcher copies it from that
    [[hosts]] entry: launch/config.py HostConfig, and starts the ranks there)."""

    name: str
    address: str = "127.0.0.1"  # where the other ranks reach this host (rank 0's store, gloo)


class ParallelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The trainer's ranks (training/ranks.py): the actor is global rank 0; the launcher starts
    the other tp * pp * dp - 1 with it as processes of the run (actors/trainer_rank.py, one
    restart group), joined in one torch.distributed group (NCCL on CUDA, gloo on CPU). tp / pp are the tensor / pipeline sizes (the model-parallel backend
    only); dp replicas each take their share of the step's micro-batches. Rank r runs on
    `devices[r]`, or the r-th CUDA device counted from `device`. Colocated teachers: every rank
    holds its own (own slots, arena, NVMe dir <dir>-rank<r>); with tp > 1, its rows
    of each teacher's linear layers (training/teacher_weights.py)."""

    tp: int = 1  # tensor-parallel size (tensor_model_parallel_size)
    pp: int = 1  # pipeline-parallel size (pipeline_model_parallel_size)
    # data-parallel size; None = derived: len(devices) / (tp * pp * cp) with `devices`, else 1
    dp: int | None = None
    # context-parallel size (context_parallel_size, the megatron backend): each sequence split
    # over cp ranks of one replica (load-balanced chunks), keys and values all-gathered
    cp: int = 1
    # expert-parallel size (expert_model_parallel_size, the megatron backend with a
    # mixture-of-experts model): each MoE layer's experts split over ep ranks, tokens sent to
    # their experts all-to-all. It divides the data-parallel ranks (dp * cp), adding none
    ep: int = 1
    # one torch device per rank, global rank order ([] = from `device`: cuda:k -> cuda:k+r)
    devices: list[str] = []
    timeout_s: float = 600.0  # a collective waiting longer than this fails (a dead rank), seconds
    # the rank processes must have started and loaded their state within this, seconds
    start_timeout_s: float = 3600.0
    # rank 0's TCP store, host:port: written by the launcher at each start of the group (leave
    # it out)
    store: str = ""
    # backend "torch" with dp > 1: "none" = every rank holds the whole model (gradients summed
    # by all-reduce, DDP's math); "fsdp2" = parameters, gradients and optimizer state sharded
    # over the dp ranks (torch's fully_shard, per decoder layer; training/fsdp.py)
    shard: Literal["none", "fsdp2"] = "none"
    # the model-parallel backend: AdamW's moments and the fp32 main weights sharded over the dp
    # replicas, 1/dp each (use_distributed_optimizer, ZeRO-1;
    # training/distributed_optimizer.py): gradients reduce-scattered, the replicated update
    distributed_optimizer: bool = False
    # host names of [[hosts]] the ranks run on, `ranks_per_host` consecutive ranks each, in
    # global rank order ([] = every rank on the trainer actor's host); the first is the actor's
    # host (it is rank 0). Rank r's CUDA device is counted on its own host (cuda:<r mod n>)
    hosts: list[str] = []
    ranks_per_host: int = 0  # ranks on each host of `hosts` (0 = world size / len(hosts))
    # filled by the launcher from [[hosts]], one entry per name in `hosts`; leave it out
    placement: list[RankHost] = []

    def __post_init__(self) -> None:
        if self.ep < 1:
            raise ValueError(f"parallel.ep = {self.ep}: the expert-parallel size must be >= 1")
        if self.tp < 1 or self.pp < 1 or self.cp < 1 or min(self.timeout_s,
                                                            self.start_timeout_s) <= 0:
            raise ValueError(f"parallel needs tp, pp, cp >= 1 and timeout_s, start_timeout_s > "
                             f"0, got tp = {self.tp}, pp = {self.pp}, cp = {self.cp}, "
                             f"timeout_s = {self.timeout_s}, start_timeout_s = "
                             f"{self.start_timeout_s}")
        model = self.tp * self.pp * self.cp
        dp = self.dp
        if dp is None:
            if self.devices and len(self.devices) % model:
                raise ValueError(f"parallel.devices lists {len(self.devices)} devices, not a "
                                 f"multiple of tp * pp = {self.tp * self.pp} times cp = "
                                 f"{self.cp}; list tp * pp * dp * cp devices")
            dp = len(self.devices) // model if self.devices else 1
            msgspec.structs.force_setattr(self, "dp", dp)
        if dp < 1:
            raise ValueError(f"need dp >= 1 (data-parallel replicas; omit it to derive it), "
                             f"got dp = {dp}")
        if (dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep = {self.ep} must divide dp * cp = {dp} * {self.cp} = "
                             f"{dp * self.cp}: expert-parallel ranks are taken from the "
                             f"data-parallel ones; set dp to a multiple of ep")
        if self.devices and len(self.devices) != self.world_size:
            raise ValueError(f"parallel.devices lists {len(self.devices)} devices but tp * pp * "
                             f"dp * cp = {self.tp} * {self.pp} * {dp} * {self.cp} = "
                             f"{self.world_size} ranks; "
                             f"list one device per rank (or omit dp to derive it)")
        if len(set(self.devices)) != len(self.devices) and not self.hosts:
            raise ValueError(f"parallel.devices {self.devices} names a device twice: each rank "
                             f"needs its own")
        self._check_hosts()

    def _check_hosts(self) -> None:
        if not self.hosts:
            if self.ranks_per_host or self.placement:
                raise ValueError("parallel.ranks_per_host / placement need parallel.hosts (the "
                                 "hosts the ranks run on)")
            return
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"parallel.hosts {self.hosts} names a host twice: give each host "
                             f"once and its number of ranks in ranks_per_host")
        per_host = self.ranks_per_host or self.world_size // len(self.hosts)
        if per_host < 1 or per_host * len(self.hosts) != self.world_size:
            raise ValueError(f"parallel.hosts lists {len(self.hosts)} hosts with ranks_per_host "
                             f"= {self.ranks_per_host or 'derived'} but tp * pp * dp = "
                             f"{self.world_size} ranks: make ranks_per_host * len(hosts) equal "
                             f"the ranks")
        msgspec.structs.force_setattr(self, "ranks_per_host", per_host)
        if self.placement and [h.name for h in self.placement] != self.hosts:
            raise ValueError(f"parallel.placement names {[h.name for h in self.placement]}, not "
                             f"parallel.hosts {self.hosts}: leave placement out (the launcher "
                             f"fills it from [[hosts]])")

    def rank_host(self, rank: int) -> RankHost | None:
        """The host rank r runs on (None: the trainer's own host, no placement given)."""
        if not self.placement:
            return None
        return self.placement[rank // self.ranks_per_host]

    @property
    def world_size(self) -> int:
        """Ranks of the trainer: tp * pp * dp (the actor is one of them)."""
        return self.tp * self.pp * self.cp * (self.dp or 1)

    def device(self, default: str, rank: int) -> str:
        """Rank r's torch device: `devices[r]`, else the r-th CUDA device from `default` (a
        CPU `default` is every rank's)."""
        if self.devices:
            return self.devices[rank]
        if not default.startswith("cuda"):
            return default
        base = int(default.split(":")[1]) if ":" in default else 0
        local = rank % self.ranks_per_host if self.hosts else rank  # counted on its own host
        return f"cuda:{base + local}"


class CriticConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The value model of `loss.advantage_estimator = "ppo"`."""

    model: str = ""  # backbone checkpoint ("" = the policy's initial checkpoint); fresh value head
    lr: float = 1e-5  # critic AdamW learning rate
    weight_decay: float = 0.0  # critic AdamW weight decay
    value_clip: float = 0.2  # bound on |V - V_old| in the clipped value loss (0 = unclipped)
    grad_clip: float = 1.0  # max global gradient norm of the critic (0 = no clipping)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.value_clip < 0 or self.grad_clip < 0:
            raise ValueError(f"critic needs lr > 0, value_clip >= 0, grad_clip >= 0; got "
                             f"lr = {self.lr}, value_clip = {self.value_clip}, "
                             f"grad_clip = {self.grad_clip}")


class MoeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Mixture-of-experts training (a model whose config has routed experts; ignored by a dense
    model). docs/training.md, Mixture of experts."""

    # "rollout": the recompute and policy passes route each token to the experts the inference
    # engine chose for it (the sample's `routed_experts`), with the router's weights for those
    # experts recomputed so the router still trains; tokens without a record route themselves.
    # "off": the trainer routes every token itself
    routing_replay: Literal["off", "rollout"] = "off"
    # coefficient of the router's load-balancing loss (Switch-style: num_experts * sum over
    # experts of token fraction * mean router probability, averaged over MoE layers), added
    # to the policy loss; 0 = none
    aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if not (self.aux_loss_coef >= 0):
            raise ValueError(f"moe.aux_loss_coef = {self.aux_loss_coef}: must be >= 0 (0 = no "
                             f"load-balancing loss)")


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What the training library reads (training/*.py): the model, its components, the step's
    algorithm. Incompatible options fail at load, naming both."""

    model: str  # initial checkpoint: an HF directory or a built-in tiny model name
    device: str = "cpu"  # torch device of the policy (and of the reference/critic while in use)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and activations
    seed: int = 0  # torch seed (and the initialisation of built-in tiny models)
    # how the policy is built, stepped and saved (training/backends.py); the model-parallel one
    # is MP-core's GPTModel (GPU, backends/)
    backend: Literal["torch", "megatron"] = "torch"
    # its TransformerConfig/GPTModel options, passed through (the launcher's --<backend>-*)
    megatron: dict[str, Any] = {}
    optimizer: OptimizerConfig = OptimizerConfig()  # the policy's AdamW
    micro_batches: MicroBatchConfig = MicroBatchConfig()  # forward/backward split of a step
    loss: LossConfig = LossConfig()  # advantages and the PPO-clip policy loss
    kl: KlConfig = KlConfig()  # KL to a frozen reference (loss term or reward shaping)
    critic: CriticConfig | None = None  # the value model; required by (only by) "ppo"
    offload_aux_models: bool = True  # reference/critic weights on the CPU between uses (on GPU)
    mismatch: MismatchConfig = MismatchConfig()  # TIS / rejection / decoupled PPO / bypass
    # on-policy distillation (algos/opd.py): None = off. With `teachers` the teachers run here,
    # colocated on weight memory; without, their signal comes from the teacher pool's servers
    opd: OpdConfig | None = None
    teachers: list[TeacherSpec] = []  # colocated teachers (the same list as the teacher pool's)
    teacher_memory: TeacherMemoryConfig = TeacherMemoryConfig()  # their tiers and budgets
    parallel: ParallelConfig = ParallelConfig()  # the trainer's ranks: tp x pp x dp on this host
    # every policy log-prob (the no-grad recompute and the forward that trains) by the
    # batch-invariant forward (models/invariant): bitwise the log-probs of inference workers with
    # `true_on_policy = true` on the same kind of device (docs/training.md, True on-policy mode)
    true_on_policy: bool = False
    # recompute each decoder layer's activations in the backward instead of keeping them
    # (transformers' gradient checkpointing, non-reentrant): far less activation memory for
    # about one more forward of compute (transformers' own on the torch backend; each
    # megatron TransformerLayer under torch.utils.checkpoint on the megatron backend)
    activation_checkpointing: bool = False
    # torch.compile each decoder layer (dynamic shapes: micro-batch widths differ): fused
    # elementwise kernels around the matrix products; the first steps pay the compilation
    compile_layers: bool = False
    # one more no-grad forward after the update, for `train/policy_kl` (how far the step moved
    # the policy on its own samples): about a fifth of a step's compute; false skips it (and
    # the metric)
    measure_policy_kl: bool = True
    # LoRA adapters trained instead of the full weights (None = full fine-tuning); pushes and
    # checkpoints carry the adapter only (docs/training.md, LoRA)
    lora: LoraConfig | None = None
    moe: MoeConfig = MoeConfig()  # mixture-of-experts: routing replay, load-balancing loss

    def __post_init__(self) -> None:
        check_algorithm(self)


def check_algorithm(cfg: TrainConfig) -> None:
    """ValueError naming both options of any incompatible pair that spans components (each
    component checks its own fields)."""
    est = cfg.loss.advantage_estimator
    needs_critic = estimator_spec(est).needs_critic
    if needs_critic and cfg.critic is None:
        raise ValueError("loss.advantage_estimator = 'ppo' needs a critic: add critic = {} (a "
                         "value model from the policy's checkpoint) or critic = { model = ..., "
                         "lr = ... }")
    if not needs_critic and cfg.critic is not None:
        raise ValueError(f"critic is set but loss.advantage_estimator = {est!r} uses no value "
                         "model; use advantage_estimator = 'ppo' or remove critic")
    if cfg.kl.in_reward and not estimator_spec(est).token_rewards:
        raise ValueError(f"kl.in_reward = true and loss.advantage_estimator = {est!r} conflict: "
                         f"{est} ignores token rewards; use kl.use_kl_loss = true or one of "
                         f"{TOKEN_REWARDS}")
    _check_opd(cfg)
    _check_replay(cfg)
    if cfg.true_on_policy:
        _check_true_on_policy(cfg)
    _check_parallel(cfg)
    if cfg.activation_checkpointing and cfg.true_on_policy:
        raise ValueError("activation_checkpointing and true_on_policy conflict: the invariant "
                         "forward keeps its own activations; use one of them")
    if cfg.lora is not None:
        _check_lora(cfg)


def _check_lora(cfg: TrainConfig) -> None:
    """What a LoRA student does not cover fails at load, naming what to change."""
    why = {"true_on_policy = true (the invariant forward has no adapter path)":
           cfg.true_on_policy,
           "kl.ref_update_interval > 0 (the reference is the base with the adapter off)":
           cfg.kl.ref_update_interval > 0,
           "mismatch proximal = 'rollout_version' (old-weight copies of the whole model)":
           cfg.mismatch.proximal == "rollout_version",
           "parallel.shard = 'fsdp2' (frozen and trained tensors in one shard)":
           cfg.parallel.shard == "fsdp2"}
    for what, refused in why.items():
        if refused:
            raise ValueError(f"lora and {what} conflict: change it or remove lora")


def distributed_optimizer(cfg: TrainConfig) -> bool:
    """`parallel.distributed_optimizer`, or the backend's own name for it in its option table
    (`use_distributed_optimizer`)."""
    return bool(cfg.parallel.distributed_optimizer
                or options_of(cfg).get("use_distributed_optimizer", False))


def _check_parallel(cfg: TrainConfig) -> None:
    """The parallel layout against the backend, the device and the backend's option table."""
    par = cfg.parallel
    if cfg.backend == "torch" and par.ep > 1:
        raise ValueError(f"parallel.ep = {par.ep} needs backend = '{MP}' (the torch backend "
                         f"holds every expert on every rank); set backend = '{MP}' or ep = 1")
    if cfg.backend == "torch" and (par.tp > 1 or par.pp > 1):
        raise ValueError(f"parallel.tp = {par.tp}, pp = {par.pp} need backend = '{MP}' (the "
                         f"torch backend is data-parallel only); set backend = '{MP}' or "
                         f"tp = pp = 1")
    if cfg.backend == "torch" and par.cp > 1:
        raise ValueError(f"parallel.cp = {par.cp} needs backend = '{MP}' (context parallelism "
                         f"splits each sequence over megatron's context-parallel ranks; the "
                         f"torch backend runs whole sequences); set backend = '{MP}' or cp = 1")
    if distributed_optimizer(cfg) and cfg.backend != MP:
        raise ValueError(f"parallel.distributed_optimizer = true needs backend = '{MP}' "
                         "(the torch backend shards its optimizer state with shard = 'fsdp2')")
    if distributed_optimizer(cfg) and cfg.optimizer.master_weights is False \
            and cfg.dtype in ("bfloat16", "float16"):
        raise ValueError(f"parallel.distributed_optimizer keeps fp32 main weights; "
                         f"optimizer.master_weights = false with dtype = {cfg.dtype!r} asks "
                         f"for none: remove master_weights (or set it true)")
    if par.devices and par.devices[0] != cfg.device:
        raise ValueError(f"parallel.devices[0] = {par.devices[0]!r} but device = "
                         f"{cfg.device!r}: the actor is rank 0 and runs on `device`; make them "
                         f"the same")
    options = options_of(cfg)
    for key, size in (("tensor_model_parallel_size", par.tp),
                      ("pipeline_model_parallel_size", par.pp)):
        if key in options and options[key] != size:
            raise ValueError(f"{MP} option {key} = {options[key]} and parallel = "
                             f"{{ tp = {par.tp}, pp = {par.pp} }} conflict: the layout comes "
                             f"from `parallel`; remove {key} from the {MP} table")
    if "context_parallel_size" in options and options["context_parallel_size"] != par.cp:
        raise ValueError(f"{MP} option context_parallel_size = "
                         f"{options['context_parallel_size']} and parallel.cp = {par.cp} "
                         f"conflict: the layout comes from `parallel`; remove "
                         f"context_parallel_size from the {MP} table")
    if par.pp > 1 and cfg.mismatch.proximal == "rollout_version":
        raise ValueError(f"parallel.pp = {par.pp} and mismatch proximal = 'rollout_version' "
                         f"conflict: old-weight copies need a whole model on one rank; use "
                         f"proximal = 'current' or pp = 1")
    if par.shard == "fsdp2":
        _check_fsdp(cfg)
    if par.world_size > 1 and cfg.backend == MP and cfg.kl.ref_update_interval:
        raise ValueError(f"kl.ref_update_interval = {cfg.kl.ref_update_interval} and a "
                         f"multi-rank {MP} trainer conflict: the reference copy of the "
                         f"actor is taken from a whole model; use ref_update_interval = 0 or "
                         f"one rank")


def _check_fsdp(cfg: TrainConfig) -> None:
    """What parallel.shard = "fsdp2" does not cover fails at load, naming what to change
    (training/fsdp.py says why each is out)."""
    par = cfg.parallel
    if cfg.backend != "torch":
        raise ValueError(f"parallel.shard = 'fsdp2' shards the torch backend; {MP} shards "
                         f"with tp / pp and replicates over dp: use shard = 'none' with "
                         f"backend = '{MP}'")
    if par.world_size < 2:
        raise ValueError("parallel.shard = 'fsdp2' shards over the data-parallel ranks but dp "
                         "= 1; set dp >= 2 (or list the devices) or shard = 'none'")
    why = {"mismatch proximal = 'rollout_version'": cfg.mismatch.proximal == "rollout_version",
           "kl.ref_update_interval > 0": cfg.kl.ref_update_interval > 0,
           "true_on_policy = true": cfg.true_on_policy,
           "colocated teachers (`teachers`)": bool(cfg.teachers),
           "micro_batches.forward_by_length = true": bool(cfg.micro_batches.forward_by_length)}
    for what, refused in why.items():
        if refused:
            raise ValueError(f"parallel.shard = 'fsdp2' and {what} conflict: that path needs "
                             f"the whole model on one rank or a per-rank number of forwards; "
                             f"change it or use shard = 'none'")


def _check_replay(cfg: TrainConfig) -> None:
    """top_p_replay renormalises the proximal log-probs with the nucleus mass of the weights
    the policy pass runs (the proximal ones unless `rollout_version`), from the response logits
    of the transformers forward: refused at load where that does not hold."""
    if cfg.opd is None or not any(c.top_p_replay for c in
                                  [cfg.opd] + [t.opd for t in cfg.teachers if t.opd]):
        return
    if cfg.mismatch.proximal == "rollout_version":
        raise ValueError("opd top_p_replay renormalises the proximal log-probs over each token's "
                         "nucleus with the mass under the weights being trained; mismatch "
                         "proximal = 'rollout_version' takes them from older weights: use "
                         "proximal = 'current' or top_p_replay = false")
    if cfg.true_on_policy:
        raise ValueError("opd top_p_replay reads the response logits of the transformers "
                         "forward, not the invariant one: use true_on_policy = false or "
                         "top_p_replay = false")


def _check_true_on_policy(cfg: TrainConfig) -> None:
    """The passes true_on_policy does not cover fail at load, naming what to change."""
    if cfg.backend == MP:
        raise ValueError(f"true_on_policy = true and backend = '{MP}' conflict: {MP}-core's "
                         "kernels (Transformer Engine GEMMs and attention, fused norms) are not "
                         "batch-invariant and are not this project's; use backend = 'torch'")
    modes = [c.mode for c in [cfg.opd] + [t.opd for t in cfg.teachers] if c is not None]
    if any(is_loss_term(m) for m in modes):
        raise ValueError("true_on_policy = true and an OPD loss-term mode (top_p / top_k / full) "
                         "conflict: that pass takes the student's logits from the transformers "
                         "forward, not the invariant one; use opd mode 'sampled' or "
                         "true_on_policy = false")


def _check_opd(cfg: TrainConfig) -> None:
    if cfg.teachers and cfg.opd is None:
        raise ValueError("teachers are set but opd is not: add opd = { mode = ..., kl_coef = ... }"
                         " or remove teachers")
    if cfg.opd is None:
        if cfg.loss.advantage_estimator == "none":
            raise ValueError("loss.advantage_estimator = 'none' (A = 0) trains nothing without "
                             "opd; set opd = { ... } or choose an estimator")
        return
    route_table(cfg.teachers)
    if not cfg.teachers:  # the signal comes from teacher servers through the teacher pool
        check_placement(cfg.opd, "server")
