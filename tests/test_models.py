"""models/: the character tokenizer, tiny models, loading/saving, and the shared log-prob math."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from algos.logprobs import entropy_from_logits, logits_to_logprobs, token_logprobs
from models.load import load_model, save_checkpoint
from models.tiny import TINY, build_tiny
from models.tokenizer import CHARS, build_char_tokenizer


def test_char_tokenizer_one_token_per_char_and_round_trip(tmp_path):
    tok = build_char_tokenizer()
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert len(tok) == 4 + len(CHARS)
    ids = tok.encode("12+3=")
    assert ids == [4 + CHARS.index(c) for c in "12+3="]
    text = "what is (7*8)-2? 54, ok!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("A") == [3]  # not in the alphabet: <unk>
    assert tok.decode([5, 2, 6], skip_special_tokens=True) == "12"
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0


@pytest.mark.parametrize("name", sorted(n for n in TINY if n.startswith("tiny-")))
def test_build_tiny_is_deterministic_per_seed(name):
    a, tok = build_tiny(name, seed=0)
    b, _ = build_tiny(name, seed=0)
    c, _ = build_tiny(name, seed=1)
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    cfg = a.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (len(tok), 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 128)
    assert cfg.max_position_embeddings == 128 and cfg.tie_word_embeddings
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert TINY[name].num_hidden_layers == 2  # the registry entry was not mutated


def test_load_model_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(ValueError) as err:
        load_model(missing)
    assert missing in str(err.value) and "config.json" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_model(str(tmp_path / "empty"))


def test_save_and_load_checkpoint_round_trip(tmp_path):
    model, tok = load_model("tiny-qwen3", seed=3)
    save_checkpoint(model, tok, str(tmp_path))
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    loaded, loaded_tok = load_model(str(tmp_path))
    assert not loaded.training and loaded.dtype == torch.float32
    ids = torch.tensor([tok.encode("12+30=42")])
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids), token_logprobs(loaded, ids))
    assert loaded_tok.encode("12+30=42") == tok.encode("12+30=42")


def _pad(seqs: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_padding_invariant(temperature):
    model, tok = build_tiny("tiny-qwen2", seed=0)
    seqs = [tok.encode(t) for t in ("12+3=15", "what is 7*8? 56", "ab", "x")]
    with torch.no_grad():
        singles = [token_logprobs(model, torch.tensor([s]), temperature=temperature)[0]
                   for s in seqs]
        ids, mask = _pad(seqs, left=True)
        left = token_logprobs(model, ids, mask, temperature)
        ids, mask = _pad(seqs, left=False)
        right = token_logprobs(model, ids, mask, temperature)
    width = max(map(len, seqs))
    for i, s in enumerate(seqs):
        n = len(s) - 1
        assert left.dtype == torch.float32 and left.shape == (len(seqs), width - 1)
        assert torch.allclose(left[i, width - 1 - n:], singles[i], atol=1e-6, rtol=0)
        assert torch.allclose(right[i, :n], singles[i], atol=1e-6, rtol=0)


def test_token_logprobs_definition_and_temperature():
    model, tok = build_tiny("tiny-qwen2", seed=0)
    ids = torch.tensor([tok.encode("9-4=5")])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        got = token_logprobs(model, ids, temperature=0.5)[0]
        greedy = token_logprobs(model, ids, temperature=0.0)[0]
        plain = token_logprobs(model, ids, temperature=1.0)[0]
    expected = torch.log_softmax(logits[:-1] / 0.5, -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert torch.equal(greedy, plain)  # temperature 0 is treated as 1


def test_logits_helpers():
    logits = torch.zeros(3, 10)
    assert torch.allclose(logits_to_logprobs(logits, 0.0), torch.full((3, 10), -math.log(10)))
    assert torch.allclose(entropy_from_logits(logits), torch.full((3,), math.log(10)))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() < 1e-6
    assert logits_to_logprobs(torch.zeros(2, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_saved_char_tokenizer_keeps_spaces_and_the_base_model_is_weak_but_not_broken(tmp_path):
    """Regression: AutoTokenizer loads the model family's tokenizer class for a Qwen2 checkpoint,
    which drops spaces; our loader must return the checkpoint's own character tokenizer."""
    from models.load import load_model, load_tokenizer

    tok = load_tokenizer("examples/base-tiny")
    ids = tok.encode("rev ab c=", add_special_tokens=False)
    assert len(ids) == 9 and tok.decode(ids) == "rev ab c="
    model, tok2 = load_model("examples/base-tiny")
    assert tok2.decode(tok2.encode("a b", add_special_tokens=False)) == "a b"
