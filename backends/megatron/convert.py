"""Hugging Face <-> megatron-core state dicts for the Qwen2, Qwen3, Qwen3-MoE and Llama families.

Role: pure tensor re-layout, no torch.distributed and no megatron import, so every rule is tested
on one CPU process. `hf_to_megatron` gives the state dict of one (tensor rank, pipeline stage)
shard of a megatron GPTModel built with the local layer spec; `megatron_to_hf` merges the tensor
shards of one stage back. Invariant: converting HF -> megatron (any TP size, any stage split) and
back returns bit-identical tensors under the original HF names (`lm_head.weight` is omitted when
the embeddings are tied, as `save_pretrained` does), and any HF tensor no rule consumes is refused
rather than dropped.

Megatron layouts, per tensor rank r of tp:
- linear_qkv: rows grouped by query group g: [q of the heads of g; k of g; v of g], the groups
  split contiguously over ranks (num_query_groups / tp groups each); same for its bias.
- linear_fc1: [gate rows of rank r; up rows of rank r] (gate and up each split in tp chunks).
- linear_proj, linear_fc2: split along the input (column) dim; embeddings and output_layer along
  the vocabulary (row) dim; layer norms (and q/k norms) are replicated.
- mixture of experts (Qwen3-MoE; GLM-4.5 without its MTP layer; SequentialMLP experts): the
  router (`mlp.router.weight` <- HF `mlp.gate.weight`, GLM's `mlp.router.expert_bias` <-
  `mlp.gate.e_score_correction_bias`) is replicated, GLM's shared experts
  (`mlp.shared_experts.linear_fc1/fc2` <- `mlp.shared_experts.{gate,up,down}_proj`) split like a
  dense MLP, and a dense layer (GLM's first_k_dense_replace, Qwen3-MoE's mlp_only_layers) is a
  dense MLP; expert e of E lives on expert-parallel rank
  e // (E / ep) as `mlp.experts.local_experts.<e mod E/ep>`, its linear_fc1 / linear_fc2 split
  over the expert tensor-parallel ranks (etp, megatron's default: tp) like a dense MLP's. HF
  names are the per-expert checkpoint names (`mlp.experts.<e>.gate_proj.weight`, `up_proj`,
  `down_proj`; models/moe.py `checkpoint_tensors` turns transformers' fused tensors into them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.moe_shape import moe_shape
from models.names import check_model_path
from models.tiny import TINY, tiny_config

SUPPORTED_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                           "glm4_moe": "Glm4MoeForCausalLM"}
# the mixture-of-experts families converted
MOE_ARCHITECTURES = frozenset({"qwen3_moe", "glm4_moe"})
# megatron's llama3 RoPE scaling has fixed low/high frequency factors and original context
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Layout:
    """The shape facts the conversion needs, read from an HF config."""

    num_layers: int  # transformer layers in the whole model
    num_heads: int  # query heads
    num_query_groups: int  # key/value heads
    head_dim: int  # channels per head
    hidden_size: int  # model width
    ffn_hidden_size: int  # MLP intermediate width (each of gate and up)
    vocab_size: int  # rows of the embedding and of the output layer
    tied_embeddings: bool  # output layer shares the input embedding
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)
    num_experts: int = 0  # routed experts per layer (0: a dense model)
    top_k: int = 0  # experts routed per token
    moe_ffn_hidden_size: int = 0  # one expert's MLP width (each of gate and up)
    norm_topk_prob: bool = True  # the k routed weights renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers with experts (the others are dense)
    score_function: str = "softmax"  # router scores: softmax, or sigmoid (GLM-4.5)
    expert_bias: bool = False  # a score correction bias chooses the experts (GLM-4.5)
    num_groups: int = 1  # expert groups of group-limited routing (1: none)
    group_topk: int = 1  # groups each token may route into
    scaling_factor: float = 1.0  # routed weights scaled by it
    shared_ffn_hidden_size: int = 0  # the shared experts' MLP width (0: none)
    rotary_percent: float = 1.0  # the share of each head's channels RoPE rotates

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def check_supported(hf_config) -> None:
    """ValueError unless the HF config is of a supported family and uses only converted features."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"the megatron backend cannot convert model_type {kind!r} "
                         f"(architectures {getattr(hf_config, 'architectures', None)}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES.values())}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; expected 'silu'")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron backend; "
                         "set use_sliding_window=false or use the torch backend")
    moe = moe_shape(hf_config)
    if moe is not None and kind not in MOE_ARCHITECTURES:
        raise ValueError(f"model_type {kind!r} has routed experts ({moe.num_experts}), but the "
                         f"megatron backend converts the experts of "
                         f"{', '.join(SUPPORTED_ARCHITECTURES[k] for k in MOE_ARCHITECTURES)} "
                         f"only; use the torch backend")
    if kind == "glm4_moe":
        _check_glm(hf_config)
    if kind == "llama" and (getattr(hf_config, "attention_bias", False)
                            or getattr(hf_config, "mlp_bias", False)):
        raise ValueError("Llama configs with attention_bias or mlp_bias are not supported")
    rope_scaling_factor(hf_config)


def _check_glm(hf_config) -> None:
    """ValueError for GLM-4.5 routing megatron computes otherwise: megatron's sigmoid router
    always renormalizes the k weights, and scores a group by its top (k / group_topk) experts
    where GLM / DeepSeek-V3 take the top 2."""
    if not getattr(hf_config, "norm_topk_prob", True):
        raise ValueError("norm_topk_prob = false with sigmoid routing is not supported by the "
                         "megatron backend (megatron renormalizes the routed weights)")
    groups, top = hf_config.n_group or 1, hf_config.topk_group or 1
    if groups > 1 and hf_config.num_experts_per_tok // top != 2:
        raise ValueError(f"group-limited routing with n_group = {groups}, topk_group = {top}, "
                         f"num_experts_per_tok = {hf_config.num_experts_per_tok}: megatron "
                         f"scores a group by its top num_experts_per_tok / topk_group experts, "
                         f"the model by its top 2; supported when they agree")


def check_model_reference(path: str) -> None:
    """ValueError unless the model a trainer config names (a tiny name or an HF checkpoint
    directory) is of a supported architecture: reads config.json only, no weights, no megatron."""

    check_supported(_hf_config(path))


def _hf_config(path: str):
    check_model_path(path)
    if path in TINY:
        return tiny_config(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def is_moe(path: str) -> bool:
    """Whether the model at `path` (a tiny name or an HF directory) has routed experts
    (config.json only)."""
    return moe_shape(_hf_config(path)) is not None


def check_parallel_layout(path: str, tp: int, pp: int, ep: int = 1) -> None:
    """ValueError unless the model at `path` splits over `tp` tensor ranks, `pp` pipeline
    stages and `ep` expert-parallel ranks (config.json only): heads, groups, MLP width and
    vocabulary divisible by tp, the layers by pp, the experts by ep."""
    layout = layout_from_hf(_hf_config(path))
    try:
        check_expert_parallel(layout, ep)
    except ValueError as e:
        raise ValueError(f"parallel.ep = {ep} does not fit {path}: {e}") from None
    try:
        check_tensor_parallel(layout, tp)
    except ValueError as e:
        raise ValueError(f"parallel.tp = {tp} does not fit {path}: {e}") from None
    if layout.num_layers % pp:
        raise ValueError(f"parallel.pp = {pp} does not fit {path}: its {layout.num_layers} "
                         f"layers do not split evenly into {pp} pipeline stages; choose a pp "
                         f"dividing {layout.num_layers}")


def rope_parameters(hf_config) -> dict:
    """HF RoPE parameters as one dict (transformers 5 `rope_parameters`, older `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and "rope_type" not in params:
        params.update(legacy)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_scaling_factor(hf_config) -> float | None:
    """None for plain RoPE, the factor for llama3 scaling; ValueError for other scalings."""
    params = rope_parameters(hf_config)
    kind = params["rope_type"]
    if kind == "default":
        return None
    fixed_ok = all(float(params.get(k, v)) == v for k, v in _LLAMA3_FIXED.items())
    if kind == "llama3" and fixed_ok:
        return float(params["factor"])
    raise ValueError(f"RoPE scaling {params} is not supported by the megatron backend; supported: "
                     f"none, or llama3 with {_LLAMA3_FIXED}")


def layout_from_hf(hf_config) -> Layout:
    check_supported(hf_config)
    heads = hf_config.num_attention_heads
    moe = moe_shape(hf_config)
    glm = hf_config.model_type == "glm4_moe"
    experts = {} if moe is None else dict(
        num_experts=moe.num_experts, top_k=moe.top_k,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        moe_layers=tuple(moe.moe_layers))
    if glm:
        experts |= dict(score_function="sigmoid", expert_bias=True,
                        num_groups=hf_config.n_group or 1, group_topk=hf_config.topk_group or 1,
                        scaling_factor=float(hf_config.routed_scaling_factor),
                        shared_ffn_hidden_size=(hf_config.n_shared_experts or 0)
                        * hf_config.moe_intermediate_size)
    rotary = float(rope_parameters(hf_config).get("partial_rotary_factor",
                                                  getattr(hf_config, "partial_rotary_factor",
                                                          1.0)))
    return Layout(
        num_layers=hf_config.num_hidden_layers, num_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        hidden_size=hf_config.hidden_size, ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size, tied_embeddings=bool(hf_config.tie_word_embeddings),
        qkv_bias=hf_config.model_type == "qwen2" or (glm and bool(hf_config.attention_bias)),
        qk_norm=hf_config.model_type in ("qwen3", "qwen3_moe")
        or (glm and bool(hf_config.use_qk_norm)), rotary_percent=rotary, **experts)


def check_tensor_parallel(layout: Layout, tp: int) -> None:
    """ValueError unless heads, groups, MLP width and vocabulary divide evenly over tp ranks."""
    sizes = [("num_heads", layout.num_heads), ("num_query_groups", layout.num_query_groups),
             ("vocab_size", layout.vocab_size)]
    if not layout.moe or len(layout.moe_layers) < layout.num_layers:
        sizes.append(("ffn_hidden_size", layout.ffn_hidden_size))
    if layout.moe:
        sizes.append(("moe_ffn_hidden_size", layout.moe_ffn_hidden_size))
    if layout.shared_ffn_hidden_size:
        sizes.append(("shared experts' ffn_hidden_size", layout.shared_ffn_hidden_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by the tensor "
                             f"parallel size {tp}; choose a tensor_model_parallel_size dividing it")


def check_expert_parallel(layout: Layout, ep: int) -> None:
    """ValueError unless the experts divide evenly over `ep` expert-parallel ranks (ep = 1 for
    a dense model)."""
    if ep > 1 and not layout.moe:
        raise ValueError(f"expert parallelism (ep = {ep}) needs a mixture-of-experts model; "
                         f"this one is dense: set ep = 1")
    if layout.moe and layout.num_experts % ep:
        raise ValueError(f"its {layout.num_experts} experts per layer do not split evenly over "
                         f"ep = {ep} expert-parallel ranks; choose an ep dividing "
                         f"{layout.num_experts}")


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rank: int,
             tp: int) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> rank's rows of megatron's linear_qkv."""
    g, d = layout.num_query_groups, layout.head_dim
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, d, *rest),
                         v.reshape(g, d, *rest)], dim=1)
    return grouped.chunk(tp)[rank].reshape(-1, *rest).clone()


def unpack_qkv(shards: list[torch.Tensor], layout: Layout) -> tuple[torch.Tensor, ...]:
    """Megatron linear_qkv shards of all ranks -> HF (q, k, v)."""
    g, d = layout.num_query_groups, layout.head_dim
    per_group = layout.num_heads // g * d
    full = torch.cat(shards)
    rest = full.shape[1:]
    grouped = full.reshape(g, per_group + 2 * d, *rest)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).clone() for t in (q, k, v))


def _layer_rules(layout: Layout) -> list[tuple[str, str, int | None]]:
    """(HF suffix, megatron suffix, split dim or None = replicated) for one-to-one tensors."""
    rules = [("input_layernorm.weight", "input_layernorm.weight", None),
             ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", None),
             ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", 1)]
    if layout.qk_norm:
        rules += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", None),
                  ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", None)]
    return rules


def _split(t: torch.Tensor, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    return t.clone() if dim is None else t.chunk(tp, dim=dim)[rank].clone()


def _fc1(gate: torch.Tensor, up: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()


def local_experts(layout: Layout, ep_rank: int, ep: int) -> range:
    """The global indices of the experts expert-parallel rank `ep_rank` holds."""
    per = layout.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def hf_to_megatron(hf: dict[str, torch.Tensor], layout: Layout, rank: int = 0, tp: int = 1,
                   layers: range | None = None, first: bool = True, last: bool = True,
                   ep_rank: int = 0, ep: int = 1, etp_rank: int | None = None,
                   etp: int | None = None) -> dict[str, torch.Tensor]:
    """State dict of tensor rank `rank` of the stage holding global `layers` (first/last: whether
    it holds the embedding / the final norm and output layer); a MoE layer's experts those of
    expert-parallel rank `ep_rank`, split over `etp` expert tensor ranks (default: tp)."""
    check_tensor_parallel(layout, tp)
    check_expert_parallel(layout, ep)
    etp, etp_rank = (tp, rank) if etp is None else (etp, etp_rank)
    layers = range(layout.num_layers) if layers is None else layers
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return hf[key]

    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = _split(take("model.embed_tokens.weight"), 0,
                                                         rank, tp)
    for local, i in enumerate(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        for hf_name, mg_name, dim in _layer_rules(layout):
            out[dst + mg_name] = _split(take(src + hf_name), dim, rank, tp)
        attn = src + "self_attn."
        for part in ("weight", "bias") if layout.qkv_bias else ("weight",):
            qkv = [take(f"{attn}{p}_proj.{part}") for p in "qkv"]
            out[f"{dst}self_attention.linear_qkv.{part}"] = pack_qkv(*qkv, layout, rank, tp)
        if i in layout.moe_layers:
            out[dst + "mlp.router.weight"] = take(src + "mlp.gate.weight").clone()
            if layout.expert_bias:
                out[dst + "mlp.router.expert_bias"] = take(
                    src + "mlp.gate.e_score_correction_bias").clone()
            if layout.shared_ffn_hidden_size:
                shared = src + "mlp.shared_experts."
                out[dst + "mlp.shared_experts.linear_fc1.weight"] = _fc1(
                    take(shared + "gate_proj.weight"), take(shared + "up_proj.weight"), rank, tp)
                out[dst + "mlp.shared_experts.linear_fc2.weight"] = _split(
                    take(shared + "down_proj.weight"), 1, rank, tp)
            mine = local_experts(layout, ep_rank, ep)
            for e in range(layout.num_experts):
                hf_e = f"{src}mlp.experts.{e}."
                gate, up = take(hf_e + "gate_proj.weight"), take(hf_e + "up_proj.weight")
                down = take(hf_e + "down_proj.weight")
                if e not in mine:  # another expert-parallel rank's
                    continue
                mg_e = f"{dst}mlp.experts.local_experts.{e - mine.start}."
                out[mg_e + "linear_fc1.weight"] = _fc1(gate, up, etp_rank, etp)
                out[mg_e + "linear_fc2.weight"] = _split(down, 1, etp_rank, etp)
            continue
        gate, up = take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")
        out[dst + "mlp.linear_fc1.weight"] = _fc1(gate, up, rank, tp)
        out[dst + "mlp.linear_fc2.weight"] = _split(take(src + "mlp.down_proj.weight"), 1, rank,
                                                    tp)
    if last:
        out["decoder.final_layernorm.weight"] = take("model.norm.weight").clone()
        head = "model.embed_tokens.weight" if layout.tied_embeddings else "lm_head.weight"
        if not (layout.tied_embeddings and first):  # a tied single stage reuses the embedding
            out["output_layer.weight"] = _split(take(head), 0, rank, tp)
    _refuse_unused(hf, used, layout, layers, first, last)
    return out


def _refuse_unused(hf: dict, used: set[str], layout: Layout, layers: range, first: bool,
                   last: bool) -> None:
    """ValueError naming an HF tensor of this stage that no rule converted."""
    mine = tuple(f"model.layers.{i}." for i in layers)
    top = {"model.embed_tokens.weight": first, "model.norm.weight": last,
           "lm_head.weight": last and not layout.tied_embeddings}
    for key in hf:
        if key in used:
            continue
        ours = top[key] if key in top else (
            key.startswith(mine) if key.startswith("model.layers.") else True)
        if ours:
            raise ValueError(f"HF tensor {key!r} has no megatron conversion rule")


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], layout: Layout,
                   layers: range | None = None, first: bool = True, last: bool = True,
                   expert_shards: list[list[dict[str, torch.Tensor]]] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Merge the tensor-rank state dicts (in rank order) of one stage into HF tensors. A MoE
    model's expert tensors come from `expert_shards[ep rank][expert tensor rank]` (None: ep = 1,
    the expert tensor ranks being `shards`)."""
    layers = range(layout.num_layers) if layers is None else layers
    expert_shards = [shards] if expert_shards is None else expert_shards
    out: dict[str, torch.Tensor] = {}

    def cat(key: str, dim: int | None) -> torch.Tensor:
        parts = [s[key] for s in shards]
        return parts[0].clone() if dim is None else torch.cat(parts, dim=dim)

    if first:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
    for local, i in enumerate(layers):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
        for hf_name, mg_name, dim in _layer_rules(layout):
            out[dst + hf_name] = cat(src + mg_name, dim)
        for part in ("weight", "bias") if layout.qkv_bias else ("weight",):
            qkv = unpack_qkv([s[f"{src}self_attention.linear_qkv.{part}"] for s in shards],
                             layout)
            for p, t in zip("qkv", qkv):
                out[f"{dst}self_attn.{p}_proj.{part}"] = t
        if i in layout.moe_layers:
            out[dst + "mlp.gate.weight"] = cat(src + "mlp.router.weight", None)
            if layout.expert_bias:
                out[dst + "mlp.gate.e_score_correction_bias"] = cat(
                    src + "mlp.router.expert_bias", None)
            if layout.shared_ffn_hidden_size:
                _mlp_to_hf(shards, src + "mlp.shared_experts.", dst + "mlp.shared_experts.", out)
            _experts_to_hf(expert_shards, layout, src, dst, out)
            continue
        _mlp_to_hf(shards, src + "mlp.", dst + "mlp.", out)
    if last:
        out["model.norm.weight"] = cat("decoder.final_layernorm.weight", None)
        if not layout.tied_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)
    return out


def _mlp_to_hf(shards: list[dict[str, torch.Tensor]], src: str, dst: str,
               out: dict[str, torch.Tensor]) -> None:
    """A tensor-parallel MLP's gate/up/down projections (megatron prefix `src`) under HF names
    (prefix `dst`)."""
    halves = [s[src + "linear_fc1.weight"].chunk(2) for s in shards]
    out[dst + "gate_proj.weight"] = torch.cat([h[0] for h in halves])
    out[dst + "up_proj.weight"] = torch.cat([h[1] for h in halves])
    out[dst + "down_proj.weight"] = torch.cat([s[src + "linear_fc2.weight"] for s in shards],
                                              dim=1)


def _experts_to_hf(expert_shards: list[list[dict[str, torch.Tensor]]], layout: Layout, src: str,
                   dst: str, out: dict[str, torch.Tensor]) -> None:
    """One layer's experts from every (expert-parallel rank, expert tensor rank) shard, under
    their per-expert HF names, in expert order."""
    ep = len(expert_shards)
    for ep_rank, shards in enumerate(expert_shards):
        mine = local_experts(layout, ep_rank, ep)
        for e in mine:
            mg_e = f"{src}mlp.experts.local_experts.{e - mine.start}."
            halves = [s[mg_e + "linear_fc1.weight"].chunk(2) for s in shards]
            hf_e = f"{dst}mlp.experts.{e}."
            out[hf_e + "gate_proj.weight"] = torch.cat([h[0] for h in halves])
            out[hf_e + "up_proj.weight"] = torch.cat([h[1] for h in halves])
            out[hf_e + "down_proj.weight"] = torch.cat([s[mg_e + "linear_fc2.weight"]
                                                        for s in shards], dim=1)
