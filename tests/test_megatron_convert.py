"""HF <-> megatron state-dict conversion: bit-exact round trips at TP=1 and TP=2, pipeline
stages, the fused layouts checked against hand-built rows, and refusals of unsupported configs.
Pure tensor code: runs without megatron-core."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from backends.megatron.convert import (
    Layout,
    hf_to_megatron,
    layout_from_hf,
    megatron_to_hf,
    pack_qkv,
)
from models.tiny import tiny_config


def hf_config(name: str):
    """Tiny configs of every supported family: tied/untied Qwen2, Qwen3 (q/k norm), Llama."""
    if name == "llama":
        base = tiny_config("tiny-qwen2").to_dict()
        keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "max_position_embeddings")
        return LlamaConfig(**{k: base[k] for k in keep}, tie_word_embeddings=False,
                           rope_theta=500000.0)
    config = tiny_config("tiny-qwen3" if name == "qwen3" else "tiny-qwen2")
    config.tie_word_embeddings = name != "qwen2-untied"
    return config


def hf_model(name: str, seed: int = 0):
    """A random model of `hf_config(name)` whose biases and norms are non-trivial too."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                p.normal_(1.0 if "norm" in key else 0.0, 0.1)
    return model


def hf_tensors(model) -> dict[str, torch.Tensor]:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


NAMES = ["qwen2", "qwen2-untied", "qwen3", "llama"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(name, tp):
    hf = hf_tensors(hf_model(name))
    layout = layout_from_hf(hf_config(name))
    shards = [hf_to_megatron(hf, layout, rank, tp) for rank in range(tp)]
    back = megatron_to_hf(shards, layout)
    assert sorted(back) == sorted(hf)
    for key in hf:
        assert back[key].dtype == hf[key].dtype and torch.equal(back[key], hf[key]), key
    assert ("output_layer.weight" in shards[0]) == (not layout.tied_embeddings)


def test_pipeline_stages_round_trip_and_split_the_layers():
    hf = hf_tensors(hf_model("qwen2"))
    layout = layout_from_hf(hf_config("qwen2"))
    first = hf_to_megatron(hf, layout, 0, 2, range(0, 1), first=True, last=False)
    last = hf_to_megatron(hf, layout, 0, 2, range(1, 2), first=False, last=True)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    # tied embeddings: the last stage holds its own copy of the (vocab-sharded) embedding
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"][:27])
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       hf["model.layers.1.input_layernorm.weight"])
    stages = [megatron_to_hf([hf_to_megatron(hf, layout, r, 2, layers, f, lst) for r in (0, 1)],
                             layout, layers, f, lst)
              for layers, f, lst in ((range(0, 1), True, False), (range(1, 2), False, True))]
    merged = stages[0] | stages[1]
    assert sorted(merged) == sorted(hf) and all(torch.equal(merged[k], hf[k]) for k in hf)


def test_fused_layouts_match_hand_built_rows():
    # 4 heads in 2 groups, head_dim 1: rank r holds groups [r], each group [q, q, k, v]
    layout = Layout(1, 4, 2, 1, 4, 2, 8, True, True, False)
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    assert pack_qkv(q, k, v, layout, 0, 1).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert pack_qkv(q, k, v, layout, 1, 2).tolist() == [2, 3, 11, 21]
    hf = hf_tensors(hf_model("qwen2"))
    layout = layout_from_hf(hf_config("qwen2"))
    fc1 = hf_to_megatron(hf, layout, 1, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate[64:], up[64:]]))


def test_unsupported_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
        layout_from_hf(MistralConfig())
    sliding = copy.deepcopy(hf_config("qwen2"))
    sliding.use_sliding_window = True
    with pytest.raises(ValueError, match="sliding-window"):
        layout_from_hf(sliding)
    yarn = LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE scaling"):
        layout_from_hf(yarn)


def test_indivisible_tensor_parallel_and_unconverted_tensors_are_refused():
    hf = hf_tensors(hf_model("qwen2"))
    layout = layout_from_hf(hf_config("qwen2"))
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by the tensor "
                                         "parallel size 4"):
        hf_to_megatron(hf, layout, 0, 4)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.extra.weight"):
        hf_to_megatron(hf | {"model.layers.0.self_attn.extra.weight": torch.zeros(1)}, layout)


def test_unsupported_checkpoint_is_refused_before_loading_weights(tmp_path):
    from backends.megatron.convert import check_model_reference

    MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'mistral'.*supported: Qwen2ForCausalLM"):
        check_model_reference(str(tmp_path))  # no weights in the directory: config only
    check_model_reference("tiny-qwen3")
    hf_config("llama").save_pretrained(tmp_path)
    check_model_reference(str(tmp_path))
