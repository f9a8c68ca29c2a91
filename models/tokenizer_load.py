"""A model reference's tokenizer alone: the rollout's, and what the launcher compares teachers'
vocabularies with (transformers' tokenizer classes, no torch).

Role: models/load.py loads models (torch); a process that needs only the tokenizer (the
launcher's checks, the rollout) loads it here and never imports torch. transformers (~1.5 s of
CPU) is imported when a tokenizer is loaded, not with this module: the launcher of a plan whose
checks load none stays free of it (tests/test_import_cost.py). models/load.py re-exports these.
"""

from __future__ import annotations

import json
import os

from models.names import TINY_NAMES, check_model_path


def load_tokenizer(path: str):
    """The tokenizer alone (the rollout needs no model weights)."""
    check_model_path(path)
    if path in TINY_NAMES:
        from models.tokenizer import build_char_tokenizer  # transformers at its top

        return build_char_tokenizer()
    return tokenizer_from_dir(path)


def tokenizer_from_dir(path: str):
    """The checkpoint's own tokenizer. A plain tokenizers-library tokenizer (ours) is loaded as
    such: AutoTokenizer would pick the model family's class (Qwen2Tokenizer), whose
    pre-tokenizer silently drops the spaces our character tokenizer encodes."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = os.path.join(path, "tokenizer_config.json")
    cls = ""
    if os.path.isfile(config_path):
        with open(config_path) as f:
            cls = json.load(f).get("tokenizer_class", "")
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
