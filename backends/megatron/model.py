"""A megatron-core GPTModel built from a Hugging Face config, behind the trainer's model contract.

Role: `build_model` turns an HF config (Qwen2/Qwen3/Llama, Qwen3-MoE) plus the user's
`megatron` option table into a GPTModel on the tensor/pipeline parallel layout of
`megatron.core.parallel_state`, and
`MegatronCausalLM` wraps it so `algos.logprobs` and `training.step` use it unchanged:
forward(input_ids, attention_mask=..., position_ids=...) returns `.logits` [B, T, V] gathered
over the tensor-parallel ranks. Native pass-through: every key of the option table that is a
TransformerConfig field or a GPTModel keyword is passed as given; keys describing the model's
shape (they come from the HF config) or unknown keys are refused.
A mixture-of-experts config (Qwen3-MoE) gives a MoE GPTModel: SequentialMLP experts behind
megatron's all-to-all token dispatcher, split over `expert_model_parallel_size` (parallel.ep)
and, as megatron defaults it, the tensor ranks; megatron's own load-balancing loss is off (it
runs in training mode only, the step runs eval mode): `MegatronRouting` (the train step's
routing object: replay, route metrics, the load-balancing loss of models/moe.py) wraps the
routers.
At context_parallel_size > 1 (parallel.cp) every core attention is context_parallel.py's
ContextParallelAttention (`cp_layer_spec`; megatron's own computation at cp = 1, torch's fused
kernel on CUDA) and the forward runs each CP rank's load-balanced chunks at their global
positions, their final hidden states gathered back to [B, T, H] in global order before the
output layer (`_cp_forward`).
The output layer is `lm_head` (VocabParallelHead): the trainer's loss head (training/heads.py)
hooks it and computes from the hidden states and this tensor rank's rows, never the logits.

Invariant: on the same weights and batch the wrapper's logits equal the transformers model's to
float precision. Megatron applies RoPE at positions 0..T-1 of the padded row; scores depend only
on position differences and padding keys are masked, so for left- or right-padded rows this is
the same function as HF's position_ids = cumsum(mask) - 1.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from algos.logprobs import segment_causal, segments
from backends.megatron import rope
from backends.megatron.checkpoint import save_hf
from backends.megatron.context_parallel import (
    AttnMaskType,
    ContextParallelAttention,
    cp_layer_spec,
    flex_applies,
    flex_block_mask,
    gather_from_cp,
    split_batch,
    swap_modules,
)
from backends.megatron.context_parallel import positions as cp_positions
from backends.megatron.convert import (
    Layout,
    check_expert_parallel,
    check_model_reference,
    check_tensor_parallel,
    hf_to_megatron,
    layout_from_hf,
    rope_parameters,
    rope_scaling_factor,
)
from backends.megatron.mcore import (
    Float16Module,
    GPTModel,
    RowParallelLinear,
    TransformerConfig,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_transformer_layer_offset,
    parallel_state,
    tensor_parallel,
)
from backends.megatron.parallel import clip_grad_norm as clip_global_grad_norm
from backends.megatron.parallel import hf_tensors_on_rank0, iter_hf_tensors
from memory.safetensors_io import DEFAULT_SHARD_BYTES
from models.load import load_model as load_hf
from models.moe import NO_ROUTE, RowSelect, checkpoint_tensors, in_backward, moe_shape
from transport.dtypes import torch_dtype

# TransformerConfig fields read from the HF config: setting them would break weight conversion
SHAPE_FIELDS = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "normalization", "layernorm_epsilon", "add_bias_linear", "add_qkv_bias",
    "gated_linear_unit", "activation_func", "qk_layernorm", "num_moe_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_topk_scaling_factor", "moe_grouped_gemm", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
    "moe_layer_freq"})
# TransformerConfig fields the parallel layout sets (parallel.ep; the expert tensor split is
# megatron's default, tp)
LAYOUT_FIELDS = frozenset({"expert_model_parallel_size", "expert_tensor_parallel_size"})
# GPTModel keywords the backend owns (shape, RoPE, stage role, spec)
OWNED_MODEL_KWARGS = frozenset({
    "config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
    "post_process", "share_embeddings_and_output_weights", "position_embedding_type",
    "rotary_base", "rope_scaling", "rope_scaling_factor", "pg_collection", "vp_stage",
    "mtp_block_spec", "rotary_percent"})
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TransformerConfig))
MODEL_KWARGS = frozenset(inspect.signature(GPTModel.__init__).parameters) - {"self"}
# declared types, to turn command-line strings into values
CONFIG_TYPES = typing.get_type_hints(TransformerConfig)
MODEL_TYPES = typing.get_type_hints(GPTModel.__init__)
# defaults chosen for running on any device without fused kernels; each can be overridden.
# Initialization stays on: only megatron's init marks the tensor-parallel weights
# (`tensor_model_parallel`), which gradient norms and optimizers rely on.
PORTABLE_DEFAULTS = dict(
    bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
    use_cpu_initialization=True,
    cuda_graph_scope=[])  # the default "full" is deprecated (and warns) in megatron-core 0.16


@dataclass
class CausalLMOutput:
    """What the trainer reads from a forward: the logits [B, T, V]."""

    logits: torch.Tensor


# megatron option names the trainer itself reads: use_distributed_optimizer is
# parallel.distributed_optimizer (training/distributed_optimizer.py)
TRAINER_OPTIONS = frozenset({"use_distributed_optimizer"})


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `megatron` option table -> (TransformerConfig kwargs, GPTModel kwargs); ValueError for
    keys that are owned by the backend or unknown (with the closest known names)."""
    config_kw, model_kw = {}, {}
    for key, value in options.items():
        if key in TRAINER_OPTIONS:  # read by the trainer (training/config.py), not the model
            continue
        if key in SHAPE_FIELDS or key in OWNED_MODEL_KWARGS or key in LAYOUT_FIELDS:
            raise ValueError(f"megatron option {key!r} is set from the HF config / parallel "
                             f"layout by the backend; remove it from the megatron table")
        if key in CONFIG_FIELDS:
            config_kw[key] = _coerce(key, value, CONFIG_TYPES.get(key))
        elif key in MODEL_KWARGS:
            model_kw[key] = _coerce(key, value, MODEL_TYPES.get(key))
        else:
            close = difflib.get_close_matches(key, sorted(CONFIG_FIELDS | MODEL_KWARGS), n=5)
            raise ValueError(f"unknown megatron option {key!r}: not a TransformerConfig field "
                             f"nor a GPTModel argument; did you mean one of {close}?")
    return config_kw, model_kw


def _coerce(key: str, value: Any, declared: Any) -> Any:
    """A string (a command-line value) becomes the option's declared type when that is a torch
    dtype, bool, int or float (or Optional of one); anything else passes as given."""
    kinds = [t for t in typing.get_args(declared) if t is not type(None)] or [declared]
    kind = kinds[0] if len(kinds) == 1 else None
    if not isinstance(value, str) or kind not in (torch.dtype, bool, int, float):
        return value
    if kind is torch.dtype:
        try:
            return torch_dtype(value)
        except ValueError as e:
            raise ValueError(f"megatron option {key}={value!r}: {e}") from None
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise ValueError(f"megatron option {key}={value!r}: expected true or false")
        return value.lower() == "true"
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"megatron option {key}={value!r}: expected {kind.__name__}") from None


def transformer_config(hf_config, options: dict[str, Any], dtype: torch.dtype
                       ) -> TransformerConfig:
    """The TransformerConfig of `hf_config` on the current parallel layout, options applied."""
    layout = layout_from_hf(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    check_tensor_parallel(layout, tp)
    check_expert_parallel(layout, ep)
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                      ("context_parallel_size", cp)):
        if key in options and options[key] != size:
            raise ValueError(f"megatron option {key}={options[key]} differs from the "
                             f"initialized parallel state ({size}); initialize_parallel sets it")
    shape = dict(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads, num_query_groups=layout.num_query_groups,
        ffn_hidden_size=layout.ffn_hidden_size, kv_channels=layout.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=layout.qkv_bias, gated_linear_unit=True,
        activation_func=F.silu, qk_layernorm=layout.qk_norm)
    precision = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16,
                     fp16=dtype == torch.float16, pipeline_dtype=dtype,
                     hidden_dropout=0.0,
                     attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)))
    config_kw, _ = split_options(options)
    moe: dict[str, Any] = {}
    if layout.moe:
        shape |= moe_fields(layout)
        # megatron-core refuses tp > 1 without sequence parallelism in training mode only (a
        # speed check: the all-to-all dispatcher is exact either way, each tensor rank routing
        # the whole sequence); the step runs the model in eval mode, and the local spec's torch
        # norms refuse sequence_parallel without Apex. It stays an option.
        moe = dict(moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                   moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=tp)
        if config_kw.get("moe_router_load_balancing_type", "none") != "none" \
                or config_kw.get("moe_aux_loss_coeff", 0.0):
            raise ValueError("the router's load-balancing loss is moe.aux_loss_coef (the train "
                             "step's; megatron's own runs in training mode only, and the step "
                             "runs the model in eval mode): remove moe_router_load_balancing_type "
                             "/ moe_aux_loss_coeff from the megatron table")
    return TransformerConfig(**(PORTABLE_DEFAULTS | precision | moe | config_kw | shape),
                             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             context_parallel_size=cp)


def moe_fields(layout: Layout) -> dict[str, Any]:
    """The TransformerConfig fields of a MoE layout, SequentialMLP experts: Qwen3-MoE's softmax
    routing over every expert (the top k renormalized when norm_topk_prob); GLM-4.5's sigmoid
    scores with a score correction bias choosing the experts, group-limited routing, scaled
    weights, shared experts; dense layers where the model has them (moe_layer_freq)."""
    fields = dict(num_moe_experts=layout.num_experts, moe_router_topk=layout.top_k,
                  moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
                  moe_router_score_function=layout.score_function,
                  # pre-softmax: weights are the softmax over all experts (no renormalization);
                  # else the softmax over the top k logits, which is softmax-then-renormalize
                  moe_router_pre_softmax=not layout.norm_topk_prob, moe_grouped_gemm=False,
                  moe_router_enable_expert_bias=layout.expert_bias,
                  moe_router_topk_scaling_factor=(layout.scaling_factor
                                                  if layout.scaling_factor != 1.0 else None),
                  moe_layer_freq=[int(i in layout.moe_layers)
                                  for i in range(layout.num_layers)])
    if layout.num_groups > 1:
        fields |= dict(moe_router_num_groups=layout.num_groups,
                       moe_router_group_topk=layout.group_topk)
    if layout.shared_ffn_hidden_size:
        fields["moe_shared_expert_intermediate_size"] = layout.shared_ffn_hidden_size
    return fields


class GroupedRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear, its matmul told its tensor-parallel group. megatron-core
    0.16.1's forward passes `tp_group=None` to the matmul, which then warns (a deprecation, on
    rank 0, every call); torch.compile cannot trace the warning, so each such linear split a
    compiled decoder layer (`compile_layers`) into several graphs, the code between them not
    fused. The group is not otherwise used there (no gradient all-reduce, no sequence
    parallelism in a row-parallel matmul): same values."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def build_gpt(hf_config, options: dict[str, Any], dtype: torch.dtype) -> GPTModel:
    """The GPTModel stage of this rank, randomly initialized by megatron (load weights after)."""
    config = transformer_config(hf_config, options, dtype)
    layout = layout_from_hf(hf_config)
    _, model_kw = split_options(options)
    factor = rope_scaling_factor(hf_config)
    if layout.moe:  # per layer: experts or a dense MLP (moe_layer_freq), this stage's layers
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm")
    # the core attention that also runs at context_parallel_size > 1 (megatron's own at cp = 1)
    spec, _ = swap_modules(cp_layer_spec(spec), {RowParallelLinear: GroupedRowParallelLinear})
    gpt = GPTModel(
        config, spec, vocab_size=layout.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_parameters(hf_config)["rope_theta"],
        rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
        rotary_percent=layout.rotary_percent, **model_kw)
    rope.table_rope(gpt)  # RoPE's cos and sin once per forward, not in every layer
    return gpt


def initialize_parallel(tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1, seed: int = 0,
                        timeout_s: float = 1800.0, expert_model_parallel_size: int = 1,
                        context_parallel_size: int = 1) -> None:
    """Megatron's parallel state and RNG tracker on the already-initialized default group (the
    data-parallel size is what the world leaves after tp x pp x cp; the expert-parallel ranks
    are taken from the data-parallel x context-parallel ones, the experts split over
    expert_model_parallel_size ranks and, as megatron defaults it, over the tensor ranks); its
    groups' collectives fail after `timeout_s`."""
    if not torch.distributed.is_initialized():
        raise ValueError("torch.distributed must be initialized before the megatron backend "
                         "(torchrun, or init_process_group with a store)")
    tp, pp, ep, cp = (tensor_model_parallel_size, pipeline_model_parallel_size,
                      expert_model_parallel_size, context_parallel_size)
    world = torch.distributed.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"{world} ranks cannot hold tp * pp * cp = {tp} * {pp} * {cp} "
                         f"model-parallel ranks per replica")
    dp = world // (tp * pp * cp)
    if ep > 1 and (dp * cp) % ep:
        raise ValueError(f"expert parallelism ep = {ep} must divide dp * cp = world / (tp * pp) "
                         f"= {world} / ({tp} * {pp}): megatron takes the expert-parallel ranks "
                         f"from the data-parallel x context-parallel ones")
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                             context_parallel_size=cp,
                                             distributed_timeout_minutes=timeout_s / 60,
                                             create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(hf_config, options: dict[str, Any] | None = None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> "MegatronCausalLM":
    """A MegatronCausalLM for this rank's stage on `device` (random weights), in eval mode (the
    train step's: no dropout; megatron-core's MoE layer refuses tp > 1 without sequence
    parallelism in training mode)."""
    options = dict(options or {})
    gpt = build_gpt(hf_config, options, dtype).to(device).eval()
    module = gpt if dtype == torch.float32 else Float16Module(gpt.config, gpt)
    return MegatronCausalLM(module, hf_config)


def from_hf_model(hf_model, options: dict[str, Any] | None = None,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                  ) -> "MegatronCausalLM":
    """Build the megatron model of `hf_model`'s config and load its weights."""
    model = build_model(hf_model.config, options, dtype, device)
    model.load_hf_state_dict(hf_model.state_dict())
    return model.eval()


def load_model(path: str, options: dict[str, Any] | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0):
    """(MegatronCausalLM, tokenizer) for what `models.load.load_model` accepts (a tiny name or an
    HF checkpoint directory); the architecture is checked before any weight is read."""
    check_model_reference(path)
    hf, tokenizer = load_hf(path, "cpu", torch.float32, seed)
    return from_hf_model(hf, options, dtype, device), tokenizer


class MegatronCausalLM(torch.nn.Module):
    """A GPTModel stage (optionally in Float16Module) with the transformers-style forward."""

    def __init__(self, module: torch.nn.Module, hf_config):
        super().__init__()
        self.module = module
        self.config = hf_config  # the HF config: written next to converted weights
        self.layout: Layout = layout_from_hf(hf_config)
        self.routing: MegatronRouting | None = None  # a MoE model's, once made
        config = self.core.config
        if self.layout.moe and config.tensor_model_parallel_size > 1 \
                and not config.sequence_parallel:
            # every tensor rank holds the whole sequence, and the dispatcher gathers the tokens
            # of all of them to each expert shard: an expert's weights see each token tp times
            # (outputs and input gradients come out exact: the combine's reduce-scatter gives
            # each rank its own copy's sum); their gradients are scaled back to one
            scale = 1.0 / config.tensor_model_parallel_size
            for name, param in self.core.named_parameters():
                if ".mlp.experts." in name:
                    param.register_hook(lambda grad, scale=scale: grad * scale)

        self.lm_head = VocabParallelHead(self)

    @property
    def core(self) -> GPTModel:
        """The GPTModel itself (unwrapped from Float16Module)."""
        return self.module.module if isinstance(self.module, Float16Module) else self.module

    @property
    def layers(self) -> range:
        """Global indices of the transformer layers this stage holds."""
        offset = get_transformer_layer_offset(self.core.config)
        return range(offset, offset + len(self.core.decoder.layers))

    # how training/packing.py keeps attention per sample on packed rows: an explicit 4D mask
    # packed rows come as position ids restarting at each sample, no mask (`forward`)
    packed_attention = "position_ids"

    @property
    def whole_forward(self) -> bool:
        """This rank runs the model's whole forward through `lm_head` (one pipeline stage)."""
        return self.core.pre_process and self.core.post_process

    def get_output_embeddings(self) -> "VocabParallelHead | None":
        """The output layer as transformers models give it (training/heads.py hooks it to take
        the final hidden states and this rank's vocabulary rows); None where the forward does
        not go through it (`whole_forward`)."""
        return self.lm_head if self.whole_forward else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False
                ) -> CausalLMOutput:
        """Logits [B, T, V] (all tensor ranks' vocabulary shards gathered). RoPE runs at
        0..T-1, the same function for rows whose real tokens are contiguous (module
        docstring); `position_ids` matter only without `attention_mask`: packed rows, a new
        sample wherever they restart at 0 (training/packing.py), attending only within it
        (values as of each sample alone, like the 4D mask's); `use_cache` must stay False.
        `attention_mask`: [B, T] (1 = token), or a 4D [B, 1, T, T] mask (additive, 0 where a
        query may attend; or bool, True where it may), e.g. training/packing.py's block-causal
        mask of packed rows: RoPE's scores depend only on position differences, and a sample's
        tokens attend only within it, so its values are those of the sample alone.
        The final hidden states go through `lm_head` (the output layer): a pre-hook there sees
        them [B, T, H] and this rank's vocabulary rows, as on a transformers model."""
        if use_cache:
            raise ValueError("the megatron backend has no KV cache (use_cache=True)")
        if not (self.core.pre_process and self.core.post_process):
            raise ValueError("with pipeline parallelism a stage has no whole forward: run it "
                             "through backends.megatron.pipeline.PipelineRunner")
        # packed rows (training/packing.py "position_ids"): no mask, positions restarting at
        # each sample; the samples' documents are read from them (no [T, T] mask is looked
        # through, nor made where FlexAttention runs)
        docs = (segments(position_ids).expand(input_ids.shape)
                if attention_mask is None and position_ids is not None else None)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        width = input_ids.shape[1]
        packed = docs is not None or attention_mask.dim() == 4
        if packed:
            blocked = None if docs is not None else (
                ~attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0)
            if self.core.config.context_parallel_size > 1 or self.core.config.sequence_parallel:
                raise ValueError("packed rows (a 4D attention mask, or position ids without "
                                 "a mask) run without context or sequence parallelism")
        elif self.core.config.context_parallel_size > 1:  # each CP rank its chunks
            return CausalLMOutput(logits=self._cp_forward(input_ids, attention_mask))
        else:
            input_ids, attention_mask = pad_to_split(self.core.config, input_ids,
                                                     attention_mask)
            blocked = blocked_attention(attention_mask)
        blocked = layer_mask(self.core, blocked, documents=packed, docs=docs)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = final_hidden(self.core, lambda: self.module(
            input_ids, positions.expand_as(input_ids), blocked, runtime_gather_output=True))
        logits = self.lm_head(hidden.transpose(0, 1)[:, :width])
        if isinstance(self.module, Float16Module):  # as megatron's wrapper returns them
            logits = logits.float()
        return CausalLMOutput(logits=logits)

    def _cp_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                    ) -> torch.Tensor:
        """Context parallelism: this CP rank runs its load-balanced chunks; their final hidden
        states, gathered into whole sequences [B, T, H] (`gather_from_cp`: each rank's backward
        its own positions), go through `lm_head`, so a pre-hook there sees the whole sequence's
        hidden states, as at cp = 1, and the logits are made only where asked. Every CP rank
        computes the head over every position: the weight's gradient is scaled by 1 / cp there
        (`VocabParallelHead.weight`), so its sum over the CP group is the cp = 1 one."""
        batch = split_batch(input_ids, attention_mask)
        local = final_hidden(self.core, lambda: self.module(
            batch.input_ids, batch.position_ids, batch.attention_mask,
            runtime_gather_output=True))
        hidden = gather_from_cp(local.transpose(0, 1), 1, batch.length)
        logits = self.lm_head(hidden)
        return logits.float() if isinstance(self.module, Float16Module) else logits

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Load HF-named full tensors: this rank keeps its tensor shard of its stage."""
        if self.layout.moe:  # transformers' fused experts under their per-expert names
            hf = dict(checkpoint_tensors(hf.items()))
        own = hf_to_megatron(hf, self.layout, parallel_state.get_tensor_model_parallel_rank(),
                             parallel_state.get_tensor_model_parallel_world_size(), self.layers,
                             self.core.pre_process, self.core.post_process,
                             parallel_state.get_expert_model_parallel_rank(),
                             parallel_state.get_expert_model_parallel_world_size(),
                             parallel_state.get_expert_tensor_parallel_rank(),
                             parallel_state.get_expert_tensor_parallel_world_size())
        missing, unexpected = self.core.load_state_dict(own, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"converted weights do not fit the megatron model: missing "
                             f"{missing}, unexpected {unexpected}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's HF tensors (CPU) on global rank 0, {} on the other ranks.
        Collective: every rank calls it (backends.megatron.parallel.hf_tensors_on_rank0)."""
        return hf_tensors_on_rank0(self)

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`hf_state_dict` streamed piece by piece (what a push sends: one piece in host
        memory at a time). Collective: every rank runs it to its end."""
        return iter_hf_tensors(self)

    def save_pretrained(self, directory: str, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        """HF checkpoint directory (safetensors + config.json), written by global rank 0 as
        the pieces arrive; collective like `hf_state_dict`."""
        save_hf(self, directory, shard_bytes)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip to a global gradient norm over all tensor/pipeline shards; returns the norm."""
        return clip_global_grad_norm(self, max_norm)


def final_hidden(core: GPTModel, run: Any) -> torch.Tensor:
    """The final hidden states [S, B, H] a forward (`run()`, through the GPTModel `core` or its
    wrapper) hands its output layer, which then computes nothing (a pre-hook gives it an empty
    input): the caller applies the head itself, to the positions it needs."""
    seen: list[torch.Tensor] = []

    def take(_module, args, kwargs):
        seen.append(args[0])
        return (args[0][:0],) + tuple(args[1:]), kwargs

    handle = core.output_layer.register_forward_pre_hook(take, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


class VocabParallelHead(torch.nn.Module):
    """The GPTModel's output layer as a transformers model's `lm_head`: [B, T, H] final hidden
    states -> [B, T, V] logits (this rank's vocabulary rows computed, then gathered over the
    tensor ranks, megatron's ColumnParallelLinear). `weight` is this rank's rows [V / tp, H] of
    the output weight (the embedding's, when tied) and `group` the tensor-parallel group over
    which the rows are split (None at tp = 1): training/heads.py computes the log-probs,
    entropies and OPD terms from (hidden, weight) over that group (algos/loss_head.py), so the
    logits, whole or per rank, are never made. It holds no parameters of its own (the model's
    are read through it), so the model's state is unchanged."""

    vocab_parallel = True  # z = h W^T over the rows of `weight`, split over `group`

    def __init__(self, model: "MegatronCausalLM"):
        super().__init__()
        self._model = [model]  # a list: not a submodule (no parameters counted twice)

    @property
    def weight(self) -> torch.Tensor:
        core = self._model[0].core
        if core.share_embeddings_and_output_weights:
            weight = core.shared_embedding_or_output_weight()
        else:
            weight = core.output_layer.weight
        cp = core.config.context_parallel_size
        # at cp > 1 every CP rank applies the head to the whole gathered sequence
        # (MegatronCausalLM._cp_forward): 1 / cp of the gradient each, summed over the group
        return _ScaleGrad.apply(weight, 1.0 / cp) if cp > 1 else weight

    @property
    def group(self):
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return None
        return parallel_state.get_tensor_model_parallel_group()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, width = hidden.shape[:2]
        if not width:  # nothing asked (a pre-hook took the hidden states)
            vocab = self.weight.shape[0] * parallel_state.get_tensor_model_parallel_world_size()
            return hidden.new_empty(batch, 0, vocab)
        core = self._model[0].core
        explicit = core.share_embeddings_and_output_weights or core.config.context_parallel_size > 1
        logits, _ = core.output_layer(hidden.transpose(0, 1),
                                      weight=self.weight if explicit else None,
                                      runtime_gather_output=True)
        return logits.transpose(0, 1)


class _ScaleGrad(torch.autograd.Function):
    """Identity; the backward scales the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def pad_to_split(config: TransformerConfig, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """With sequence parallelism the sequence splits over the tensor ranks: rows padded on the
    right (masked tokens, which no real token attends to) to a multiple of the tensor size."""
    tp = config.tensor_model_parallel_size
    extra = -input_ids.shape[1] % tp if config.sequence_parallel else 0
    if not extra:
        return input_ids, attention_mask
    return F.pad(input_ids, (0, extra)), F.pad(attention_mask, (0, extra))


def layer_mask(module: torch.nn.Module, blocked: torch.Tensor | None, documents: bool,
               docs: torch.Tensor | None = None) -> torch.Tensor | Any:
    """The mask a forward hands `module`'s layers for `blocked` [B, 1, T, T] (True = may not
    attend), or for packed rows' documents `docs` [B, T] (`blocked` None): FlexAttention's
    block mask, made once here for every layer (`flex_block_mask`; `documents`: look for
    packed samples in `blocked`), where every layer's attention runs FlexAttention
    (`flex_applies`: CUDA, half precision, heads of >= 64 dimensions; causal, cp = 1, no
    dropout, softmax offset nor layer scaling), so a compiled layer traces attention into its
    graph; else the dense mask (`blocked`, or the documents' block-causal one)."""
    device = (docs if docs is not None else blocked).device
    attention = _attention_modules(module)
    flex = bool(attention) and flex_applies(device, next(module.parameters()).dtype,
                                            attention[0].config.kv_channels) and all(
        m.attn_mask_type == AttnMaskType.causal and m.cp_size == 1 and m._fused_ok()
        for m in attention)
    if flex:
        return flex_block_mask(blocked, documents, docs)
    return blocked if docs is None else ~segment_causal(docs)


# each model's attention cores, looked up once: a walk of all its modules (thousands at 28
# layers) took ~3 ms of host time in every forward
_ATTENTION: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _attention_modules(module: torch.nn.Module) -> list:
    """`module`'s ContextParallelAttention cores (found on the first call, then remembered:
    the backend builds them with the model and never adds or removes one)."""
    found = _ATTENTION.get(module)
    if found is None:
        found = _ATTENTION[module] = [m for m in module.modules()
                                      if isinstance(m, ContextParallelAttention)]
    return found


def blocked_attention(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 1 = token -> [B, 1, T, T] bool, True where a query may not attend: future keys and
    padding keys (megatron's mask convention)."""
    t = attention_mask.shape[1]
    future = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).triu(1)
    return future[None, None] | ~attention_mask.bool()[:, None, None, :]


# ---------------------------------------------------------------------------------------------
# Routing: the train step's routing protocol (models/moe.py `Routing`) on megatron's routers
# ---------------------------------------------------------------------------------------------

class _AttachLoss(torch.autograd.Function):
    """Identity on `activation`; its backward also gives `loss` the gradient 1, so a loss term
    computed inside the forward (the router's load-balancing loss) trains without reaching the
    step's loss (every pipeline stage adds its own layers')."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def replay_probs(config: TransformerConfig, logits: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
    """The weights megatron's top-k router gives experts `ids` [N, k] from its logits [N, E]:
    its own formula (topk_routing_with_score_function) with the given experts as the top k."""
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits).gather(1, ids)
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if ids.shape[1] > 1 else scores
    elif config.moe_router_pre_softmax:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, ids)
    else:
        probs = torch.softmax(logits.gather(1, ids), dim=-1, dtype=torch.float32).type_as(logits)
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs


class MegatronRouting(RowSelect):
    """The routing object of a megatron MoE policy (training/moe.py reads it; models/moe.py
    `Routing` is the transformers models' one, with the same protocol): `record`, `replay`,
    `keep_logits`, `set_batch(layouts)`, `clear()`, `select(rows, length)`, `take_stats()`,
    `aux_loss()`.

    Each router's `routing(logits)` is wrapped on this rank's stage. The router sees the tokens
    of its forward sequence-first ([S, B] flattened, S cut to this tensor rank's part under
    sequence parallelism, rows padded on the right to the split); the wrapper maps each of them
    to its (row, column) of the layout given in HF order ([rows, W]) and:
    - replays the given expert ids where a position has them (`replay`): the routing map is
      replaced and the weights recomputed from the router's logits for those experts
      (`replay_probs`), so the router still gets gradients; -1 keeps the router's choice;
    - compares the router's choice with them (route mismatch) and counts expert loads;
    - with `keep_logits` in a grad pass, adds the load-balancing loss of models/moe.py
      (num_experts * sum_e token fraction * mean router probability over real tokens, the
      layers averaged, weighted by the micro-batch's share of the step's tokens:
      `aux_per_token`, set by the step) to the backward inside the forward, so every pipeline
      stage trains its own routers; `aux_loss()` is therefore None.
    Statistics are summed over the pipeline stages (each holds its layers) and, under sequence
    or context parallelism, the tensor or context-parallel ranks (each holds part of the
    tokens: a CP rank its two load-balanced chunks, mapped by their global positions) in
    `take_stats`, which every rank of the model-parallel and CP groups calls.
    Megatron recomputes layers in training mode only; the step runs the model in eval mode.
    """

    def __init__(self, model: MegatronCausalLM):
        self.model = model
        self.shape = moe_shape(model.config)
        if self.shape is None:
            raise ValueError("MegatronRouting needs a mixture-of-experts model")
        model.routing = self  # the pipeline runner sets each micro-batch's layout through it
        self.config = model.core.config
        self.record = False  # keep each forward's expert ids in `recorded` (megatron order)
        self.recorded: dict[int, torch.Tensor] = {}
        self.replay = False
        self.keep_logits = False
        self.aux_per_token = 0.0  # the load-balancing loss's weight per token (the step sets it)
        self._layouts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        self._select: tuple[torch.Tensor, int] | None = None
        self._grids: list[torch.Tensor] = []  # per set_batch: [2, rows * W] (differs, has)
        self._grid: torch.Tensor | None = None
        self._zero_stats()
        self.routers = {}
        for i, layer in zip(model.layers, model.core.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if router is None:  # a dense layer
                continue
            router.routing = self._wrap(router, i)  # an instance attribute over the method
            self.routers[i] = router

    def close(self) -> None:
        for router in self.routers.values():
            del router.routing

    # ------------------------------------------------------------------ the trainer's side
    def set_batch(self, layouts: list[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
        """The next forwards' layouts (routes [rows, W, layers, k] or None, valid [rows, W])
        in HF row-major order; megatron runs the first (the padded micro-batch)."""
        self._close_grid()
        self._layouts = [(r, v.bool()) for r, v in layouts]
        if self._layouts:
            self._grid = torch.zeros(2, self._layouts[0][1].numel(), dtype=torch.uint8)

    def clear(self) -> None:
        self._close_grid()
        self._layouts, self._select = [], None

    def aux_loss(self) -> None:
        return None  # added inside the forward (class docstring)

    def take_stats(self) -> dict[str, float]:
        """Metrics since the last call (models/moe.py `Routing.take_stats`' keys, and
        moe/aux_loss), over the model-parallel group; then reset. Collective over it."""
        self._close_grid()
        grids = torch.cat(self._grids, dim=1) if self._grids else torch.zeros(2, 0,
                                                                             dtype=torch.uint8)
        counts = torch.zeros(self.shape.num_layers, self.shape.num_experts, dtype=torch.float64)
        for layer, c in self._counts.items():
            counts[layer] += c
        sums = torch.tensor([self._pairs, self._pairs_diff, self._aux_sum, self._aux_count],
                            dtype=torch.float64)
        # tensor ranks see parts of the sequence under sequence parallelism, else all of it;
        # context-parallel ranks each see their chunks of it
        split = self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1
        groups = [parallel_state.get_model_parallel_group() if split
                  else parallel_state.get_pipeline_model_parallel_group()]
        if self.config.context_parallel_size > 1:
            groups.append(parallel_state.get_context_parallel_group())
        for group in groups:
            if torch.distributed.get_world_size(group) == 1:
                continue
            for tensor, op in ((grids, torch.distributed.ReduceOp.MAX),
                               (counts, torch.distributed.ReduceOp.SUM),
                               (sums, torch.distributed.ReduceOp.SUM)):
                torch.distributed.all_reduce(tensor, op=op, group=group)
        self._grids = []
        self._zero_stats()
        out: dict[str, float] = {}
        pairs, pairs_diff, aux_sum, aux_count = sums.tolist()
        if pairs:
            tokens = max(1, int(grids[1].sum()))
            out["moe/route_mismatch"] = pairs_diff / pairs
            out["moe/route_mismatch_tokens"] = int((grids[0] & grids[1]).sum()) / tokens
        loads = [c for c in counts if c.sum() > 0]
        if loads:
            out["moe/expert_load_max_over_mean"] = max(float(c.max() / c.mean()) for c in loads)
            out["moe/expert_load_min_over_mean"] = min(float(c.min() / c.mean()) for c in loads)
        if aux_count:
            out["moe/aux_loss"] = aux_sum / aux_count
        return out

    # ------------------------------------------------------------------ the wrapper
    def _zero_stats(self) -> None:
        self._pairs = self._pairs_diff = 0
        self._aux_sum, self._aux_count = 0.0, 0
        self._counts: dict[int, torch.Tensor] = {}

    def _close_grid(self) -> None:
        if self._grid is not None:
            self._grids.append(self._grid)
        self._grid = None

    def _positions(self, seq: int, batch: int) -> tuple[torch.Tensor, int] | None:
        """For a router forward of [seq, batch] local tokens: each token's flat index into the
        first matching layout's [rows, W] grid (-1: padding past the row), and that layout's
        index; None without layouts. RuntimeError when no layout matches."""
        if not self._layouts:
            return None
        split = self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1
        tp = self.config.tensor_model_parallel_size if split else 1
        cp = self.config.context_parallel_size
        start = parallel_state.get_tensor_model_parallel_rank() * seq if split else 0
        full = seq * tp * cp
        # this rank's global columns: its part under sequence parallelism, its two
        # load-balanced chunks under context parallelism (context_parallel.py `positions`)
        cols = (cp_positions(full, cp, parallel_state.get_context_parallel_rank()) if cp > 1
                else torch.arange(start, start + seq))
        slack = 2 * cp if cp > 1 else tp  # the forward pads its length up to a multiple
        candidates: list[tuple[int, torch.Tensor, int]] = []
        if self._select is not None:
            rows, length = self._select
            candidates.append((0, torch.as_tensor(rows).reshape(-1).cpu(), length))
        for i, (_, valid) in enumerate(self._layouts):
            candidates.append((i, torch.arange(valid.shape[0]), valid.shape[1]))
        for i, rows, length in candidates:
            width = self._layouts[i][1].shape[1]
            if len(rows) != batch or not length <= full < length + slack:
                continue
            pos = rows[None, :] * width + cols[:, None]  # [seq, batch], megatron's order
            pos = torch.where(cols[:, None] < length, pos, torch.full_like(pos, -1))
            return pos.reshape(-1), i
        sizes = [tuple(v.shape) for _, v in self._layouts]
        raise RuntimeError(f"routing: a router saw [{full} positions x {batch} rows] of tokens, "
                           f"matching none of the batch's layouts {sizes}"
                           + ("" if self._select is None else f" nor the selected rows "
                              f"(length {self._select[1]})"))

    def _wrap(self, router: torch.nn.Module, layer: int):
        original = router.routing  # the bound method

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            probs, routing_map = original(logits, padding_mask=padding_mask)
            return self._after(router, layer, logits, probs, routing_map)

        return routing

    def _after(self, router, layer: int, logits: torch.Tensor, probs: torch.Tensor,
               routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, batch, experts = logits.shape
        flat = logits.reshape(-1, experts)
        k = self.shape.top_k
        if self.record:
            self.recorded[layer] = routing_map.int().topk(k, dim=-1).indices.detach()
        found = self._positions(seq, batch)
        if found is None:
            return probs, routing_map
        pos, index = found
        routes, valid_grid = self._layouts[index]
        real = pos >= 0
        safe = pos.clamp(min=0)
        valid = (valid_grid.reshape(-1)[safe] & real).to(logits.device)
        backward = in_backward()
        chosen = routing_map
        if routes is not None:
            given = routes[:, :, layer].reshape(-1, routes.shape[-1])[safe].to(logits.device,
                                                                               torch.long)
            has = (given[:, 0] != NO_ROUTE) & valid
            ids = torch.where(has[:, None], given, torch.zeros_like(given))
            given_map = torch.zeros_like(routing_map).scatter(1, ids, True)
            if not backward:
                self._compare(routing_map, given_map, has, pos, index)
            if self.replay:
                new = torch.zeros_like(probs).scatter(1, ids, replay_probs(self.config, flat,
                                                                           ids).to(probs.dtype))
                probs = torch.where(has[:, None], new, probs)
                chosen = routing_map = torch.where(has[:, None], given_map, routing_map)
        if not backward:
            self._count(layer, chosen, valid)
        if self.keep_logits and torch.is_grad_enabled() and self.aux_per_token:
            probs = self._with_aux(flat, chosen, valid, probs, count=not backward)
        return probs, routing_map

    def _compare(self, own: torch.Tensor, given: torch.Tensor, has: torch.Tensor,
                 pos: torch.Tensor, index: int) -> None:
        with torch.no_grad():
            differs = (own != given).any(-1) & has
            self._pairs += int(has.sum())
            self._pairs_diff += int(differs.sum())
            if index == 0 and self._grid is not None:  # per token: any MoE layer differs
                at = pos[has.cpu()]
                self._grid[1, at] = 1
                self._grid[0, pos[differs.cpu()]] = 1

    def _count(self, layer: int, chosen: torch.Tensor, valid: torch.Tensor) -> None:
        with torch.no_grad():
            counts = chosen[valid].sum(0).to("cpu", torch.float64)
            self._counts[layer] = self._counts.get(layer, 0) + counts

    def _with_aux(self, logits: torch.Tensor, chosen: torch.Tensor, valid: torch.Tensor,
                  probs: torch.Tensor, count: bool) -> torch.Tensor:
        """`probs` carrying this layer's share of the load-balancing loss (class docstring)."""
        e, k = self.shape.num_experts, self.shape.top_k
        mean_probs = F.softmax(logits, dtype=torch.float, dim=-1)
        local = mean_probs[valid].sum(0)  # this rank's tokens (with grad)
        with torch.no_grad():
            totals = torch.cat([chosen[valid].sum(0).float(), valid.sum().float()[None],
                                local.detach()])
            if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
                torch.distributed.all_reduce(
                    totals, group=parallel_state.get_tensor_model_parallel_group())
            if self.config.context_parallel_size > 1:  # each CP rank holds part of the tokens
                torch.distributed.all_reduce(
                    totals, group=parallel_state.get_context_parallel_group())
            counts, tokens, whole = totals[:e], totals[e].clamp(min=1), totals[e + 1:]
        fraction = counts / (tokens * k)
        loss = e * (fraction * local / tokens).sum()  # summed over tensor ranks: the loss
        if count:
            self._aux_sum += float(e * (fraction * whole / tokens).sum())
            self._aux_count += 1
        # this forward's real tokens (all of the micro-batch's, or the rows a `select` names)
        weight = self.aux_per_token * float(tokens) / len(self.shape.moe_layers)
        return _AttachLoss.apply(probs, loss * weight)
