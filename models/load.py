"""Loading and saving models: built-in tiny names or local Hugging Face checkpoint directories
(a hub id is fetched into a local folder by the launcher before this runs: models/hub.py).

Role: the one place that turns a model reference (a string in a config) into (model, tokenizer),
and writes checkpoints the same loader (and SGLang's /update_weights_from_disk) can read back.
Invariant: `load_model` returns a model in eval mode on the requested device and dtype, or raises
ValueError naming the reference and what was expected; it never downloads anything.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

# what needs no model (no torch): also read from here
from models.names import check_model_path, is_checkpoint_dir  # noqa: F401
from models.tiny import TINY, build_tiny
from models.tokenizer_load import load_tokenizer, tokenizer_from_dir  # noqa: F401


@contextlib.contextmanager
def quiet_progress():
    """Suppress transformers' progress bars (tqdm would start a monitor thread that never ends)."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, tokenizer) for a tiny model name (built from `seed`) or a local HF checkpoint dir."""
    if path in TINY:
        model, tokenizer = build_tiny(path, seed)
    else:
        check_model_path(path)
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = tokenizer_from_dir(path)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def save_checkpoint(model, tokenizer, directory: str) -> None:
    """Write `model` (safetensors) and `tokenizer` as a Hugging Face checkpoint directory."""
    os.makedirs(directory, exist_ok=True)
    with quiet_progress():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
