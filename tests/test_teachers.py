"""The committed MOPD demo teachers: the student's tokenizer and config, and strong on their domain.

Loads `examples/teacher-arith` and `examples/teacher-reverse` (written by
`python -m scripts.train_teachers`) and measures them with the project's own greedy evaluation.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.load import load_model
from scripts.train_base import accuracy, greedy
from scripts.train_teachers import (
    BASE_DIR,
    BPE_MERGES,
    CROSS_VOCAB_TEACHERS,
    TEACHERS,
    demo_envs,
    sample,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_TASKS = 50


def _dir(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


def _json(directory: str, name: str) -> dict:
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def base():
    return load_model(_dir(os.path.basename(BASE_DIR)))


@pytest.mark.parametrize("spec", TEACHERS, ids=lambda s: s.name)
def test_teacher_shares_student_vocab_and_config(spec, base):
    _, base_tok = base
    model, tok = load_model(_dir(spec.name))
    assert tok.get_vocab() == base_tok.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == \
        (base_tok.bos_token_id, base_tok.eos_token_id, base_tok.pad_token_id)
    assert tok.encode("rev abc= 12+7=") == base_tok.encode("rev abc= 12+7=")
    assert _json(_dir(spec.name), "config.json") == _json(_dir("base-tiny"), "config.json")
    assert model.get_input_embeddings().weight.shape[0] == len(base_tok.get_vocab())


@pytest.mark.parametrize("spec", CROSS_VOCAB_TEACHERS, ids=lambda s: s.name)
def test_cross_vocab_teacher_has_its_own_vocabulary(spec, base):
    """The same characters at other ids, the merges as single tokens, the same special roles."""
    _, base_tok = base
    model, tok = load_model(_dir(spec.name))
    vocab, base_vocab = tok.get_vocab(), base_tok.get_vocab()
    assert vocab != base_vocab and set(base_vocab) < set(vocab)
    assert sum(vocab[t] != base_vocab[t] for t in base_vocab) > len(base_vocab) // 2
    assert tok.encode("9+9=18", add_special_tokens=False) == [
        vocab[t] for t in ("9", "+", "9", "=", "18")]
    assert {a + b for a, b in BPE_MERGES} <= set(vocab)
    assert (tok.bos_token_id, tok.eos_token_id) == (vocab["<bos>"], vocab["<eos>"])
    assert model.get_input_embeddings().weight.shape[0] == len(vocab)


@pytest.mark.parametrize("spec", TEACHERS + CROSS_VOCAB_TEACHERS, ids=lambda s: s.name)
def test_teacher_beats_base_on_its_domain(spec, base):
    env = demo_envs()[spec.domain]
    base_model, base_tok = base
    model, tok = load_model(_dir(spec.name))
    teacher_acc = accuracy(model, tok, env, NUM_TASKS)
    base_acc = accuracy(base_model, base_tok, env, NUM_TASKS)
    assert teacher_acc >= 0.85, (spec.name, teacher_acc)
    assert teacher_acc > base_acc + 0.2, (spec.name, teacher_acc, base_acc)
    weights_differ = any(not torch.equal(a, b) for a, b in
                         zip(model.state_dict().values(), base_model.state_dict().values()))
    assert weights_differ
    recorded = _json(_dir(spec.name), "eval.json")
    assert recorded["domain"] == spec.domain
    assert recorded["teacher"][spec.domain]["greedy"] >= 0.9


def test_sampling_near_zero_temperature_is_greedy(base):
    """The sampled evaluation's decoder agrees with greedy decoding when the softmax is sharp."""
    spec = TEACHERS[1]
    env = demo_envs()[spec.domain]
    model, tok = load_model(_dir(spec.name))
    prompts = [t.prompt for t in list(env.tasks("eval", 0))[:20]]
    gen = torch.Generator().manual_seed(0)
    sampled = sample(model, tok, prompts, 1e-4, 6, gen)
    assert sampled == greedy(model, tok, prompts)
    hot = sample(model, tok, prompts, 50.0, 6, torch.Generator().manual_seed(0))
    assert hot != sampled  # at a high temperature the samples leave the argmax
