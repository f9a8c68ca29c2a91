"""Trainer backends other than plain torch + transformers.

Role: each subpackage adapts one training framework to the trainer's model contract (an
nn.Module whose forward(input_ids, attention_mask=..., position_ids=...) returns `.logits`
[B, T, V]), so the losses and log-prob code stay the same for every backend.
Invariant: importing this package imports no optional framework; subpackages do that lazily.
"""
