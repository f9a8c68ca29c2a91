"""The megatron-core trainer backend (optional extra `megatron`).

Role: `convert` (HF <-> megatron tensors, pure), `model` (GPTModel from an HF config behind the
trainer's forward contract, native option pass-through), `parallel` (gathers and gradient norms
over the TP/PP groups), `pipeline` (a pipeline-parallel step through megatron's schedules),
`checkpoint` (distributed checkpoints and HF export for weight sync), `lora` (tensor-parallel
LoRA adapters under PEFT's names, and a LoRA student's checkpoints).
Invariant: importing this package does not import megatron-core; the submodules other than
`convert` do.
"""
