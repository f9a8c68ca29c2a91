"""training/checkpoints.py: checkpoints are complete or absent, and a damaged newest one is
reported and skipped for the previous intact one."""

from __future__ import annotations

import torch

from models.tiny import build_tiny
from training.checkpoints import MANIFEST, resumable_checkpoint, verify_checkpoint
from training.state import TrainState


def _state(seed: int) -> TrainState:
    model, tok = build_tiny("tiny-qwen2", seed=seed)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
    state.step = state.version = seed
    return state


def _save(folder, seed: int):
    _state(seed).save(folder / f"step_{seed:06d}")
    return folder / f"step_{seed:06d}"


def test_a_saved_checkpoint_verifies_and_resumes(tmp_path):
    path = _save(tmp_path, 3)
    assert (path / MANIFEST).exists() and not (tmp_path / "step_000003.tmp").exists()
    assert verify_checkpoint(path) == ""
    latest, skipped = resumable_checkpoint(tmp_path)
    assert (latest, skipped) == (path, [])
    fresh = _state(0)
    fresh.load(latest, "cpu")
    assert (fresh.step, fresh.version) == (3, 3)
    want = dict(_state(3).model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in fresh.model.named_parameters())


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    older, newest = _save(tmp_path, 1), _save(tmp_path, 2)
    weights = next(newest.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    latest, skipped = resumable_checkpoint(tmp_path)
    assert latest == older
    assert len(skipped) == 1 and skipped[0].startswith(f"step_000002: {weights.name} has 100 "
                                                       "bytes")


def test_a_flipped_bit_in_the_optimizer_state_is_detected(tmp_path):
    older, newest = _save(tmp_path, 1), _save(tmp_path, 2)
    state_file = newest / "trainer_state.pt"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0x10
    state_file.write_bytes(bytes(data))
    assert verify_checkpoint(newest) == "trainer_state.pt fails its CRC-32 (corrupted on disk)"
    assert resumable_checkpoint(tmp_path)[0] == older


def test_an_interrupted_write_is_never_resumed(tmp_path):
    older = _save(tmp_path, 1)
    (tmp_path / "step_000002.tmp").mkdir()  # the trainer died while writing step 2
    (tmp_path / "step_000003").mkdir()  # a directory with nothing of a checkpoint
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / MANIFEST).write_text("{not json")
    latest, skipped = resumable_checkpoint(tmp_path)
    assert latest == older
    assert [s.split(":")[0] for s in skipped] == ["step_000004", "step_000003"]
    assert resumable_checkpoint(tmp_path / "none") == (None, [])
