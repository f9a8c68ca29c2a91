"""One GRPO optimizer step on a batch of samples, and the trainer state it updates.

Invariant: the old-policy log-probs are recomputed on exactly the micro-batches that training
then uses (same split, same padding, same temperature), with the same function the inference
worker uses for its log-probs (`models.logprobs`), so the train-rollout mismatch measures the
engines, not the bookkeeping.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from algos.batching import MicroBatch, make_micro_batch, response_slice, split_micro_batches
from algos.grpo import grpo_advantages, ppo_clip_loss
from transport.schema import Sample


class TrainState:
    """Model, tokenizer, optimizer and counters: everything a checkpoint holds."""

    def __init__(self, model: Any, tokenizer: Any, optimizer: torch.optim.Optimizer):
        self.model, self.tokenizer, self.optimizer = model, tokenizer, optimizer
        self.step = 0
        self.version = 0

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def save_weights(self, path: Path) -> None:
        from models.load import save_checkpoint

        tmp = path.with_name(path.name + ".tmp")
        save_checkpoint(self.model, self.tokenizer, tmp)
        tmp.replace(path) if not path.exists() else None

    def save(self, path: Path) -> None:
        """Model as an HF directory plus optimizer/step/version; the state file is written last,
        so a directory without it is an incomplete checkpoint and is never resumed from."""
        from models.load import save_checkpoint

        path.mkdir(parents=True, exist_ok=True)
        save_checkpoint(self.model, self.tokenizer, path)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step,
                    "version": self.version, "rng": torch.get_rng_state()},
                   path / "trainer_state.pt.tmp")
        (path / "trainer_state.pt.tmp").replace(path / "trainer_state.pt")

    def load(self, path: Path, device: str) -> None:
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(f), device=device))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, "
                             f"unexpected {unexpected}")
        state = torch.load(path / "trainer_state.pt", map_location=device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.version = state["step"], state["version"]
        torch.set_rng_state(state["rng"].cpu())

    def to_device(self, device: str) -> None:
        """Move weights and optimizer state (colocated mode; a no-op between identical devices)."""
        self.model.to(device)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(device)

    def device_bytes(self, device: str) -> int:
        if device.startswith("cuda"):
            return torch.cuda.memory_allocated(torch.device(device))
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def group_advantages(samples: list[Sample], std_normalization: bool) -> torch.Tensor:
    """GRPO advantages per sample, groups by group_id (groups may have lost failed samples)."""
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_group[s.group_id].append(i)
    adv = torch.zeros(len(samples))
    for idx in by_group.values():
        rewards = torch.tensor([samples[i].reward for i in idx])
        adv[idx] = grpo_advantages(rewards, len(idx), std_normalization)
    return adv


def forward(state: TrainState, mb: MicroBatch, temperature: float) -> tuple[torch.Tensor, ...]:
    """Response-aligned (log-probs, entropies) of a micro-batch."""
    from models.logprobs import token_logprobs_and_entropy

    logp, ent = token_logprobs_and_entropy(state.model, mb.input_ids, mb.attention_mask,
                                           temperature)
    cols = mb.num_response_cols
    return response_slice(logp, mb.prompt_lens, cols), response_slice(ent, mb.prompt_lens, cols)


def train_on_batch(state: TrainState, samples: list[Sample], cfg: Any) -> dict[str, float]:
    device = next(state.model.parameters()).device
    state.model.eval()  # no dropout: training and recompute see the same function
    mbs = [make_micro_batch(mb, state.pad_id) for mb in split_micro_batches(
        samples, cfg.micro_batch_size)]
    mbs = [_to(mb, device) for mb in mbs]
    adv = group_advantages(samples, cfg.std_normalization).to(device)
    with torch.no_grad():
        old = [forward(state, mb, cfg.temperature)[0] for mb in mbs]
    totals: dict[str, float] = defaultdict(float)
    state.optimizer.zero_grad(set_to_none=True)
    offset = 0
    for mb, old_lp in zip(mbs, old):
        n = len(mb.samples)
        logp, ent = forward(state, mb, cfg.temperature)
        terms = ppo_clip_loss(logp, old_lp, adv[offset:offset + n], mb.mask, len(samples),
                              cfg.eps_clip, cfg.eps_clip_high)
        terms.loss.backward()
        offset += n
        tokens = float(mb.mask.sum())
        totals["loss"] += float(terms.loss.detach())
        totals["clipfrac"] += terms.clipfrac * tokens
        totals["ppo_kl"] += terms.ppo_kl * tokens
        totals["entropy"] += float((ent.detach() * mb.mask).sum())
        totals["tokens"] += tokens
        totals["logprob_abs_diff"] += float(((old_lp - mb.rollout_logp).abs() * mb.mask).sum())
    params = [p for p in state.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
    state.optimizer.step()
    with torch.no_grad():
        new = [forward(state, mb, cfg.temperature)[0] for mb in mbs]
    kl = sum(float((k3(o, n_) * mb.mask).sum()) for o, n_, mb in zip(old, new, mbs))
    return summarize(samples, totals, float(grad_norm), kl, state.version)


def k3(old_logp: torch.Tensor, new_logp: torch.Tensor) -> torch.Tensor:
    """Non-negative per-token estimate of KL(old || new) on tokens sampled from old."""
    log_ratio = new_logp - old_logp
    return torch.exp(log_ratio) - 1 - log_ratio


def summarize(samples: list[Sample], totals: dict[str, float], grad_norm: float, kl_sum: float,
              version: int) -> dict[str, float]:
    tokens = max(totals["tokens"], 1.0)
    stats: dict[str, float] = {}
    for domain in sorted({s.domain for s in samples}):
        mine = [s for s in samples if s.domain == domain]
        stats[f"reward/{domain}"] = sum(s.reward for s in mine) / len(mine)
    stats |= {"train/loss": totals["loss"], "train/clipfrac": totals["clipfrac"] / tokens,
             "train/ppo_kl": totals["ppo_kl"] / tokens, "train/entropy": totals["entropy"] / tokens,
             "train/policy_kl": kl_sum / tokens, "train/grad_norm": grad_norm,
             "train/logprob_abs_diff": totals["logprob_abs_diff"] / tokens,
             "train/tokens": totals["tokens"], "train/samples": len(samples)}
    stale = [version - s.weight_version for s in samples]
    stats["train/staleness_mean"] = sum(stale) / len(stale)
    stats["train/staleness_max"] = max(stale)
    for domain in sorted({s.domain for s in samples}):
        mine = [s for s in samples if s.domain == domain]
        stats[f"response_len/{domain}"] = sum(len(s.response_ids) for s in mine) / len(mine)
    return stats


def _to(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    return MicroBatch(mb.samples, *(t.to(device) for t in (
        mb.input_ids, mb.attention_mask, mb.prompt_lens, mb.mask, mb.rollout_logp, mb.rewards)))
