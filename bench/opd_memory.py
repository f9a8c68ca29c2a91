"""Peak memory and time of one micro-batch's OPD signal: sampled / top-k / top-p / full.

    python -m bench.opd_memory                                   # GPU: V = 151,936, 8 x 4,096, bf16
    python -m bench.opd_memory --device cpu --vocab 8192 --tokens 4x512

Each mode runs the trainer's real `train_on_batch` (training/step.py) on one micro-batch of B
samples of R response tokens (`--tokens BxR`, after a 16-token prompt) with one colocated
teacher on weight memory, `loss.advantage_estimator = "none"` (pure distillation) and AdamW:
the student's recompute, then the policy pass in which the teacher's forward for the
micro-batch runs inside its loss callback (streamed), the OPD term, the backward. Modes:
- `sampled`: the teacher's log-prob of each sampled token shapes the advantage;
- `top_k`: k = `--top-k` ids from the student's sampling distribution (`top_k_from = "student"`);
- `top_p`: the nucleus recorded by the rollout (here: the smallest top-p set of a random
  distribution per token, `--top-p`), both sides renormalised over it;
- `top_p_student`: the same mode for samples without a recorded nucleus (rebuilt from the
  student's logits: a sort per position);
- `full`: the exact reverse KL over the whole vocabulary.
Student and teacher are the same stand-in model: token embeddings, one hidden layer and the
output head [V, hidden] (`HeadModel`); a real transformer's trunk adds the same activations in
every mode, so the ratios here are the worst case for the signals. Peak memory: on CUDA
`torch.cuda.max_memory_allocated` over the step minus the memory allocated before it (weights,
optimizer state, the teacher's slot); on the CPU the torch profiler's allocation events (every
tensor allocated and freed during the step, in order). Each mode runs a warm-up step first; the
time is that of a step after it (wall, synchronised; on the CPU without the profiler).
Final line: `RESULT <mode>_peak_over_logits=...` per mode: the peak over one micro-batch's bf16
logits [B, 16 + R, V] (goal: <= 1.0: the trainer never holds them, training/heads.py), and
`<mode>_peak_over_sampled=...`.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

from algos.opd import OpdConfig
from logic.teachers import TeacherSpec
from memory.layout import FlatLayout, bind
from memory.manager import WeightMemory
from training.colocated_teachers import ColocatedTeachers, meta_skeleton
from training.config import LossConfig, MicroBatchConfig, TrainConfig
from training.master_weights import make_optimizer
from training.state import TrainState
from training.step import train_on_batch
from transport.dtypes import dtype_name, model_dtype
from transport.schema import NUCLEUS_IDS_DTYPE, NUCLEUS_LOGMASS_DTYPE, Sample

PROMPT = 16
MODES = ("sampled", "top_k", "top_p", "top_p_student", "full")


class HeadModel(torch.nn.Module):
    """A causal LM reduced to what the OPD signals touch: embeddings, one layer, the head."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.lm_head(torch.tanh(self.mix(self.embed(input_ids)))))


def cpu_peak_bytes(fn) -> tuple[int, object]:
    """(the largest total of CPU tensor bytes alive at once during fn() beyond what was alive
    before it, fn's result), from the torch profiler's allocation and free events. The profiler
    reports the free of a tensor only if it was allocated under a profiler: run fn once under
    it before measuring (a warm-up), so that tensors freed and allocated again (gradients) are
    counted as they are, not twice."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result


def teacher_pool(vocab: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 1
                 ) -> ColocatedTeachers:
    """One teacher `t` (a HeadModel with random weights) in a WeightMemory of one slot."""
    with torch.device("meta"):
        model = HeadModel(vocab, hidden).to(dtype)
    layout = FlatLayout.from_shapes((n, t.dtype, tuple(t.shape))
                                    for n, t in model.state_dict().items())
    memory = WeightMemory(device, gpu_slots=1, slot_bytes=layout.total_bytes,
                          host_budget_bytes=layout.total_bytes, lookahead=1)
    memory.register("teacher:t", layout)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for view in bind(memory.reserve_host("teacher:t"), layout).values():
        view.copy_((torch.randn(view.shape, generator=gen) * 0.5).to(view.dtype))
    return ColocatedTeachers(memory, {"t": meta_skeleton(model, device)},
                             [TeacherSpec(name="t", model="random")])


def batch(samples: int, response: int, vocab: int, top_p: float, nucleus: bool,
          seed: int = 0) -> list[Sample]:
    """Random prompts and responses; with `nucleus`, each token's recorded top-p set: the
    smallest set of a random (Zipf-like) distribution reaching top_p, holding the token."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(samples):
        ids = rng.integers(3, vocab, PROMPT + response).tolist()
        fields = {}
        if nucleus:  # distinct ids, the token first (a stride coprime with V)
            probs = 1.0 / np.arange(1, 65) ** 1.1
            probs /= probs.sum() / 0.999
            size = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
            tokens = np.array(ids[PROMPT:])
            members = (tokens[:, None] + np.arange(size)[None, :] * 7919) % vocab
            fields = {"rollout_nucleus_ids": members.reshape(-1).astype(NUCLEUS_IDS_DTYPE),
                      "rollout_nucleus_offsets": (np.arange(response + 1) * size).astype(
                          NUCLEUS_IDS_DTYPE),
                      "rollout_nucleus_logmass": np.full(response, np.log(top_p),
                                                         dtype=NUCLEUS_LOGMASS_DTYPE)}
        out.append(Sample(group_id=f"g{i}", index=0, domain="d", prompt_ids=ids[:PROMPT],
                          response_ids=ids[PROMPT:], loss_mask=[1] * response,
                          rollout_logprobs=[-8.0] * response, teacher="t", **fields))
    return out


def opd_for(mode: str, args) -> OpdConfig:
    if mode == "top_k":
        return OpdConfig(mode="top_k", top_k=args.top_k)
    if mode.startswith("top_p"):
        return OpdConfig(mode="top_p", top_p=args.top_p)
    return OpdConfig(mode=mode)


class _Tok:
    pad_token_id = 0


def run_mode(mode: str, args, dtype: torch.dtype) -> tuple[int, list[float]]:
    """(peak bytes of the step beyond what was allocated before it, seconds of each of
    `args.repeat` steps after it) of the second of two steps of `mode`."""
    device = args.device
    torch.manual_seed(0)
    with torch.device(device):
        model = HeadModel(args.vocab, args.hidden).to(dtype)
    cfg = TrainConfig(model="random", device=device, dtype=dtype_name(dtype),
                      opd=opd_for(mode, args), teachers=[TeacherSpec(name="t", model="random")],
                      loss=LossConfig(advantage_estimator="none"),
                      micro_batches=MicroBatchConfig(size=args.batch, forward_by_length=False,
                                                     head_compile=not args.head_eager))
    state = TrainState(model, _Tok(), make_optimizer(model.parameters(), dtype, None, 1e-6))
    state.teachers = teacher_pool(args.vocab, args.hidden, dtype, device)
    samples = batch(args.batch, args.response, args.vocab, args.top_p, mode == "top_p")
    try:
        # warm-up: optimizer state, the teacher's slot (on the CPU under the profiler too: it
        # sees the frees of tensors only if it saw them allocated)
        if device.startswith("cuda"):
            train_on_batch(state, samples, cfg)
        else:
            cpu_peak_bytes(partial(train_on_batch, state, samples, cfg))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            train_on_batch(state, samples, cfg)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak, _ = cpu_peak_bytes(partial(train_on_batch, state, samples, cfg))
        seconds = []
        for _ in range(args.repeat):  # timed without the profiler, after the measured step
            t0 = time.perf_counter()
            train_on_batch(state, samples, cfg)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        return peak, seconds
    finally:
        state.teachers.close()
        del state, model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", default="8x4096", help="BxR: samples x response tokens")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeat", type=int, default=3, help="timed steps per mode (median shown)")
    p.add_argument("--head-eager", action="store_true", help="micro_batches.head_compile = "
                   "false: the loss head's chunk passes eager (default: compiled on CUDA)")
    args = p.parse_args()
    args.batch, args.response = (int(x) for x in args.tokens.lower().split("x"))
    dtype = model_dtype(args.dtype or ("bfloat16" if args.device.startswith("cuda")
                                       else "float32"))
    modes = args.modes.split(",")
    logits_gib = logits_bytes(args.batch, args.response, args.vocab) / 2**30
    print(f"{args.batch} x {args.response} response tokens (+{PROMPT} prompt), V = {args.vocab},"
          f" {dtype_name(dtype)} on {args.device}: one micro-batch's bf16 logits "
          f"{logits_gib:.2f} GiB", flush=True)
    results = {}
    for mode in modes:
        peak, times = run_mode(mode, args, dtype)
        seconds = float(np.median(times))
        results[mode] = peak
        print(f"{mode:>14}: peak {peak / 2**30:8.3f} GiB over the weights, step {seconds:.3f} s "
              f"(median of {len(times)}, {min(times):.3f}-{max(times):.3f})", flush=True)
    print(result_line(results, logits_bytes(args.batch, args.response, args.vocab)))


def logits_bytes(samples: int, response: int, vocab: int) -> int:
    """One micro-batch's bf16 logits [B, P + R, V]: the unit of the peaks."""
    return samples * (PROMPT + response) * vocab * 2


def result_line(peaks: dict[str, int], unit: int) -> str:
    """`RESULT <mode>_peak_over_logits=...` for every mode measured (goal: <= 1.0), and each
    mode's peak over sampled-token OPD's (the earlier measure)."""
    keys = {"sampled": "sampled", "top_k": "topk", "top_p": "topp",
            "top_p_student": "topp_student", "full": "full"}
    parts = [f"{keys[m]}_peak_over_logits={peaks[m] / unit:.3f}" for m in keys if m in peaks]
    if peaks.get("sampled"):
        parts += [f"{keys[m]}_peak_over_sampled={peaks[m] / peaks['sampled']:.3f}"
                  for m in keys if m in peaks and m != "sampled"]
    return "RESULT " + " ".join(parts)


if __name__ == "__main__":
    main()
