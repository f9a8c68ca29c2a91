"""One trainer step with the mismatch options: recompute, bypass, rejection, entropy bonus."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from actors.trainer import TrainerConfig
from algos.mismatch import MismatchConfig
from models.tiny import build_tiny
from training.config import LossConfig, MicroBatchConfig
from training.step import TrainState, train_on_batch
from transport.schema import Sample


def batch(tok) -> list[Sample]:
    out = []
    for g, (prompt, answers) in enumerate([("1+2=", ["3", "4"]), ("rev ab=", ["ba", "ab"])]):
        for i, (ans, r) in enumerate(zip(answers, [1.0, 0.0])):
            ids = tok.encode(ans, add_special_tokens=False) + [tok.eos_token_id]
            out.append(Sample(group_id=f"g{g}", index=i, domain="d",
                              prompt_ids=[tok.bos_token_id] + tok.encode(prompt,
                                                                         add_special_tokens=False),
                              response_ids=ids, loss_mask=[1] * len(ids),
                              rollout_logprobs=[0.0] * len(ids), reward=r))
    return out


def step(**overrides) -> dict[str, float]:
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=3),
                        **overrides)
    return train_on_batch(state, batch(tok), cfg)


def test_recompute_bypass_and_rejection_differ_as_they_should():
    base = step()
    # rollout log-probs are 0 (probability 1): every token mismatches by -logp
    assert base["train/ppo_kl"] == 0.0  # old policy = the trainer's own recompute
    assert base["mismatch/abs_diff_mean"] == pytest.approx(base["train/logprob_abs_diff"])
    assert base["mismatch/abs_diff_mean"] > 1.0 and base["train/kept_token_frac"] == 1.0
    bypass = step(mismatch=MismatchConfig(bypass=True))
    # old = rollout (0): ppo_kl = mean(old - logp) = mean |logp| over the same tokens
    assert bypass["train/ppo_kl"] == pytest.approx(base["mismatch/abs_diff_mean"], rel=1e-5)
    assert bypass["train/clipfrac"] > 0  # ratios exp(logp) << 0.8 are clipped
    rejected = step(mismatch=MismatchConfig(correction="rejection_token", low=0.5, high=2.0))
    assert rejected["train/kept_token_frac"] == 0.0  # every w = exp(logp) < 0.5
    assert rejected["train/grad_norm"] == 0.0 and rejected["train/policy_kl"] == 0.0
    assert base["train/grad_norm"] > 0


def test_entropy_bonus_changes_the_update():
    plain, bonus = step(), step(loss=LossConfig(entropy_coef=0.5))
    assert bonus["train/grad_norm"] != pytest.approx(plain["train/grad_norm"], rel=1e-4)


def grpo_scores(rewards: list[float]) -> list[float]:
    """(r - mean) / (unbiased std + 1e-6) of one group, in plain floats."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


def test_rejected_tokens_leave_the_numerator_not_the_denominator():
    """rejection_token: each sample's loss is its kept tokens' sum over ALL its policy tokens
    (the source's denominator). Ratios are 1 at the step's start, so the PPO loss is
    sum_i -A_i * kept_i / n_i / N."""
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
    answers = [("1+2=", ["3", "4", "33"]), ("rev ab=", ["ba", "ab", "b"])]
    rejected = [[1, 0, 2], [2, 1, 1]]  # leading tokens rejected, per sample
    samples, expected, scores = [], 0.0, []
    for g, (prompt, group) in enumerate(answers):
        rewards = [1.0, 0.0, 0.5]
        scores += grpo_scores(rewards)
        for i, ans in enumerate(group):
            ids = tok.encode(ans, add_special_tokens=False) + [tok.eos_token_id]
            # the tiny model gives log p ~ -4: rollout -9 is w ~ e^5 > 2 (rejected), -3 is
            # w ~ e^-1 (kept with low = 0)
            lps = [-9.0] * rejected[g][i] + [-3.0] * (len(ids) - rejected[g][i])
            samples.append(Sample(group_id=f"g{g}", index=i, domain="d",
                                  prompt_ids=[tok.bos_token_id]
                                  + tok.encode(prompt, add_special_tokens=False),
                                  response_ids=ids, loss_mask=[1] * len(ids),
                                  rollout_logprobs=lps, reward=rewards[i]))
    for s, a in zip(samples, scores):
        n = len(s.response_ids)
        expected += -a * sum(lp == -3.0 for lp in s.rollout_logprobs) / n / len(samples)
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=2),
                        mismatch=MismatchConfig(correction="rejection_token", low=0.0, high=2.0))
    stats = train_on_batch(state, samples, cfg)
    kept = sum(len(s.response_ids) for s in samples) - sum(map(sum, rejected))
    assert stats["train/kept_token_frac"] == pytest.approx(kept / 15)
    assert stats["train/loss"] == pytest.approx(expected, abs=1e-5)
    assert expected == pytest.approx(0.8333317 / 6, rel=1e-5)  # kept-token means gave 0.0


def test_the_entropy_bonus_keeps_rejected_tokens():
    """Every token rejected: the PPO term is 0, the entropy bonus still trains (the source
    reduces it over the loss mask before rejection)."""
    rejected = step(mismatch=MismatchConfig(correction="rejection_token"),
                    loss=LossConfig(entropy_coef=0.5))
    assert rejected["train/kept_token_frac"] == 0.0 and rejected["train/loss"] == 0.0
    assert rejected["train/grad_norm"] > 0



def test_measure_policy_kl_off_skips_the_forward_after_the_update():
    calls = []
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    model.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    stats = {}
    for measure in (True, False):
        calls.clear()
        state = TrainState(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
        cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], measure_policy_kl=measure,
                            micro_batches=MicroBatchConfig(size=4, forward_by_length=False))
        stats[measure] = (train_on_batch(state, batch(tok), cfg), list(calls))
    (on, on_calls), (off, off_calls) = stats[True], stats[False]
    # recompute (no grad), policy pass (grad), and with the metric one more no-grad forward
    assert on_calls == [False, True, False] and off_calls == [False, True]
    assert on["train/policy_kl"] == 0.0  # lr 0: the policy did not move
    assert "train/policy_kl" not in off
    assert off["train/loss"] == on["train/loss"] and off["train/grad_norm"] == on["train/grad_norm"]


class DeviceReads(TorchFunctionMode):
    """Counts, by the project's file and line that called them, the operations that read a
    tensor's values on the host (on a GPU each waits for the device: the host stops queueing
    work), and boolean-mask indexing (its output size is read from the device)."""
    READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__,
                       torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.nonzero,
                       torch.nonzero})
    ROOT = str(Path(__file__).resolve().parents[1]) + "/"

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        masked = func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) \
            and args[1].dtype == torch.bool
        if func in self.READS or masked:
            ours = [f for f in traceback.extract_stack()[:-1]
                    if f.filename.startswith(self.ROOT) and "site-packages" not in f.filename
                    and not f.filename.startswith(self.ROOT + "tests/")]
            if ours and ours[-1] == traceback.extract_stack()[-2]:  # called by our code
                self.sites[f"{ours[-1].filename[len(self.ROOT):]}:{ours[-1].lineno}"] += 1
        return func(*args, **(kwargs or {}))


def test_the_step_reads_its_losses_and_statistics_from_the_device_once():
    """The loss and its statistics stay on the device until the step's end, and the loss head
    checks token ids with the micro-batch's bounds known on the host: per micro-batch the
    project's code reads only the host tensor of its ids (`bounds_of`, two reads of a CPU
    tensor). Before, `LossTerms` and the step's totals read 16 values per micro-batch and the
    head's id check two per forward, so a GPU sat idle while the host caught up after each."""
    reads = {}
    for size in (4, 1):  # one micro-batch, then four
        torch.manual_seed(0)
        model, tok = build_tiny("tiny-qwen2", seed=0)
        state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
        cfg = TrainerConfig(model="tiny-qwen2", workers=["w"],
                            micro_batches=MicroBatchConfig(size=size, forward_by_length=False))
        with DeviceReads() as mode:
            stats = train_on_batch(state, batch(tok), cfg)
        reads[size] = mode.sites
        assert stats["train/tokens"] == 10 and stats["train/grad_norm"] > 0
    assert not [s for s in reads[1] if s.startswith(("algos/policy_loss.py", "algos/value.py",
                                                     "algos/loss_head.py"))], reads[1]
    per_step = [s for s in reads[1] if s.startswith("training/step.py")]
    assert len(per_step) == 1 and reads[1][per_step[0]] == 1  # the step's totals, once
    more = reads[1] - reads[4]  # what three more micro-batches read
    assert all(s.startswith("training/batching.py") for s in more), more
    assert sum(more.values()) == 3 * 2, more


def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward():
    torch.manual_seed(0)
    model, tok = build_tiny("tiny-qwen2", seed=0)
    state = TrainState(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3))
    samples = batch(tok)
    samples[2].response_ids[0] = model.config.vocab_size  # one past the last row
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], micro_batches=MicroBatchConfig(size=2))
    with pytest.raises(ValueError, match=rf"vocabulary \[0, {model.config.vocab_size}\) in "
                                         r"sample\(s\) \('g1', 0\): the rollout's tokenizer"):
        train_on_batch(state, samples, cfg)
    assert calls == []


# dynamo's tracing reads `.grad` of non-leaf tensors and warns about it (its own access)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compile_layers_compiles_the_policys_decoder_layers_and_changes_no_value(
        tmp_path, monkeypatch):
    """compile_layers = true through the trainer's setup: every decoder layer is compiled
    (traced here with aot_eager: inductor's code generation takes minutes on a CPU; the GPU
    bench runs inductor) and the step's values equal the eager step's."""
    import torch._dynamo

    import training.setup as setup

    monkeypatch.setattr(setup, "COMPILE_BACKEND", "aot_eager")
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = TrainerConfig(model="tiny-qwen2", workers=["w"], device="cpu", dtype="float32",
                            compile_layers=compiled,
                            micro_batches=MicroBatchConfig(size=3, forward_by_length=False))
        state = setup.load_train_state(cfg, str(tmp_path / str(compiled)), False)
        layers = setup.decoder_layers(state.model)
        assert len(layers) == 2
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        out[compiled] = train_on_batch(state, batch(state.tokenizer), cfg)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == compiled, graphs
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-5, abs=1e-7), key
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="no decoder layer list"):
        setup.compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    from tqdm import tqdm

    if tqdm.monitor is not None:  # compilation's progress bars start tqdm's monitor thread
        tqdm.monitor.exit()
        tqdm.monitor.join()
        tqdm.monitor = None


def test_forwards_by_length_only_where_ranks_share_no_collective_in_the_forward():
    """CPU fp32 defaults to one forward per distinct length; with expert parallelism (the
    experts' all-to-all across data-parallel ranks, whose micro-batches differ) or fsdp2 every
    rank runs one forward per micro-batch, so the ranks' collectives pair up."""
    from training.config import ParallelConfig
    from training.step import _by_length

    cpu = torch.device("cpu")

    def by_length(**parallel):
        return _by_length(TrainerConfig(model="tiny-qwen3-moe", workers=["w"],
                                        backend="megatron" if "ep" in parallel else "torch",
                                        parallel=ParallelConfig(**parallel)), cpu)

    assert by_length() is True
    assert by_length(dp=2) is True
    assert by_length(dp=2, ep=2) is False
    assert by_length(dp=2, shard="fsdp2") is False
