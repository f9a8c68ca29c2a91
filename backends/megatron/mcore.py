"""Every megatron-core name the backend uses, imported in one place.

Role: the backend's one import of the optional dependency: megatron-core warns at import that
Apex and Transformer Engine are absent (it falls back to torch), which is expected here and would
otherwise be raised as an error under `-W error`; a missing install gets one clear message.
Without Transformer Engine, megatron-core 0.16.1's router gating (moe_utils
RouterGatingLinearFunction) reads a `te_general_gemm` its module defines only when TE imports:
it is set to None here, the value megatron's own checks mean for "absent" (plain matmul).
"""

from __future__ import annotations

import warnings

try:
    with warnings.catch_warnings():  # megatron warns at import that Apex/TE are absent
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from megatron.core.models.common.embeddings import rotary_pos_embedding
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_local_spec,
        )
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import (
            RowParallelLinear,
            param_is_not_tensor_parallel_duplicate,
        )
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer import attention as megatron_attention
        from megatron.core.transformer.module import Float16Module, param_is_not_shared
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the megatron backend needs megatron-core: pip install 'rlx[megatron]'"
                      ) from exc

if not hasattr(moe_utils, "te_general_gemm"):  # no Transformer Engine: the torch matmul path
    moe_utils.te_general_gemm = None

__all__ = ["Float16Module", "GPTModel", "RowParallelLinear", "TransformerConfig",
           "dist_checkpointing", "get_forward_backward_func", "get_gpt_decoder_block_spec",
           "get_gpt_layer_local_spec", "get_transformer_layer_offset", "megatron_attention",
           "param_is_not_shared", "param_is_not_tensor_parallel_duplicate", "parallel_state",
           "rotary_pos_embedding", "tensor_parallel"]
