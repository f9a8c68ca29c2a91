"""Loading and saving models: built-in tiny names or local Hugging Face checkpoint directories
(a hub id is fetched into a local folder by the launcher before this runs: models/hub.py).

Role: the one place that turns a model reference (a string in a config) into (model, tokenizer),
and writes checkpoints the same loader (and SGLang's /update_weights_from_disk) can read back.
Invariant: `load_model` returns a model in eval mode on the requested device and dtype, or raises
ValueError naming the reference and what was expected; it never downloads anything.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from models.tiny import TINY, build_tiny
from models.tokenizer import build_char_tokenizer


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding a Hugging Face config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


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


def check_model_path(path: str) -> None:
    """ValueError (naming the path and what is expected) unless `path` can be loaded."""
    if path not in TINY and not is_checkpoint_dir(path):
        raise ValueError(f"cannot load model {path!r}: expected a built-in tiny model name "
                         f"({', '.join(sorted(TINY))}), a Hugging Face checkpoint directory "
                         f"containing config.json (absolute, or relative to the hosts file's "
                         f"folder, the working directory or the packaged examples/), or a hub "
                         f"id org/name (models/hub.py)")


def load_tokenizer(path: str):
    """The tokenizer alone (the rollout needs no model weights)."""
    check_model_path(path)
    if path in TINY:
        return build_char_tokenizer()
    return tokenizer_from_dir(path)


def tokenizer_from_dir(path: str):
    """The checkpoint's own tokenizer. A plain tokenizers-library tokenizer (ours) is loaded as
    such: AutoTokenizer would pick the model family's class (Qwen2Tokenizer), whose
    pre-tokenizer silently drops the spaces our character tokenizer encodes."""
    config_path = os.path.join(path, "tokenizer_config.json")
    cls = ""
    if os.path.isfile(config_path):
        with open(config_path) as f:
            cls = json.load(f).get("tokenizer_class", "")
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


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
