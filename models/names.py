"""What a model reference may name, known without loading anything (no torch, no transformers).

Role: the launcher checks every model field of a plan before anything starts (the actors' plan
classes, models/hub.py); it needs only the built-in tiny names and the shape of a checkpoint
directory, not the models. Invariant: `TINY_NAMES` are exactly the keys of models/tiny.py
`TINY` (tested), so a name accepted here builds there.
"""

from __future__ import annotations

import json
import os

# the built-in tiny models (models/tiny.py TINY builds them)
TINY_NAMES = ("tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "qwen2-0.5b-shape")


def is_checkpoint_dir(path: str) -> bool:
    """A directory holding a Hugging Face config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def check_model_path(path: str) -> None:
    """ValueError (naming the path and what is expected) unless `path` can be loaded."""
    if path not in TINY_NAMES and not is_checkpoint_dir(path):
        raise ValueError(f"cannot load model {path!r}: expected a built-in tiny model name "
                         f"({', '.join(sorted(TINY_NAMES))}), a Hugging Face checkpoint "
                         f"directory containing config.json (absolute, or relative to the hosts "
                         f"file's folder, the working directory or the packaged examples/), or a "
                         f"hub id org/name (models/hub.py)")


def checkpoint_text_config(path: str) -> dict | None:
    """The language model's fields of a checkpoint directory's config.json, read as JSON (no
    model library): its `text_config` for a multimodal one, else the whole file; None when
    there is none to read."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def checkpoint_vocab_size(path: str) -> int:
    """The vocabulary size in a checkpoint directory's config.json (`checkpoint_text_config`);
    0 when there is none to read (a tiny name, no such file)."""
    size = (checkpoint_text_config(path) or {}).get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0
