"""True on-policy mode: a batch-invariant forward shared by the inference worker and the trainer.

With `true_on_policy = true` on both sides (training.config.TrainConfig.true_on_policy and
actors.inference.InferenceWorkerConfig.true_on_policy), the worker's sampling pass (prefill and
cached decode, engine/scheduler.py) and the trainer's log-prob passes (the no-grad recompute and
the forward whose gradient trains, training/aux_models.py) run `InvariantDecoder`, the project's
own forward of the model, on operators whose per-row result does not depend on the batch, the
padding, the KV-cache position or the micro-batch size: for the same weights and tokens the two
sides produce bitwise the same log-probs.

- `decoder.py`: the forward (Qwen2/Qwen3/Llama), its KV cache, the trainer/worker entry points;
- `ops.py`: the operators with their gradients (backward by ordinary torch ops);
- `cpu.py`: the CPU kernels (exact integer-valued float64 matmul, fixed-tree sums, chunked
  transcendentals);
- `gpu.py`: the Triton kernels (fixed-tile matmul without split-K, one-program-per-row norms and
  log-softmax, fixed-block attention).
Worker and trainer must run on the same kind of device (both CPU, or both CUDA GPUs of one
architecture): the two kernel sets are each invariant, not equal to each other.
"""

from models.invariant.decoder import (
    SUPPORTED,
    InvariantDecoder,
    KVCache,
    check_supported,
    decoder_for,
    enable,
    is_enabled,
)
from models.invariant.ops import kernels, log_softmax

__all__ = ["SUPPORTED", "InvariantDecoder", "KVCache", "check_supported", "decoder_for", "enable",
           "is_enabled", "kernels", "log_softmax"]
