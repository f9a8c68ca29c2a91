"""The megatron trainer's ranks (training/ranks.py) at TP=2, DP=2 and PP=2 against one rank.

Role: this process plays the trainer actor (global rank 0): for each layout it starts the other
ranks as processes (`actors.trainer_rank.start_standalone`, the launcher's recipe without its
supervisor) and drives them through `training.ranks.RankGroup`, takes one optimizer step on the same
synthetic batch from the same initial weights (the trainer's AdamW, its GRPO loss, micro-batches
from the DP schedule; PP through megatron's 1F1B schedule), gathers the HF weights to rank 0 as
a weight push does, and compares them with the step of one rank (TP = PP = DP = 1).
On CPU the ranks run megatron-core over gloo with the test-only torch.cuda stand-ins
(backends/megatron/cpu_shim.py, armed for the rank processes through tests/megatron_shim on
PYTHONPATH); on GPUs over NCCL, rank r on cuda:r, no stand-ins.
`python -m bench.train_parallel [--device cpu|cuda] [--model examples/base-tiny]
[--dtype float32] [--samples 8] [--layouts tp2,dp2,pp2]`; `--backend torch --layouts
dp2,fsdp2` runs the torch backend's data parallelism, replicated and sharded (training/fsdp.py;
both sides then forward one padded pass per micro-batch, as FSDP does); layout `dp2do` is DP=2
with megatron's distributed optimizer (training/distributed_optimizer.py).
Final line: RESULT tp2_vs_tp1_max_abs=... dp2_vs_dp1_max_abs=... pp2_vs_pp1_max_abs=...
dp2do_vs_dp1_max_abs=... dp2do_vs_dp2_max_abs=...
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from actors.trainer import TrainerConfig
from actors.trainer_rank import start_standalone
from models.load import load_tokenizer
from training.config import MicroBatchConfig, OptimizerConfig, ParallelConfig
from training.ranks import load_trainer
from training.state import TrainState
from transport.schema import Sample
from transport.sockets import free_port

ROOT = Path(__file__).resolve().parent.parent
SHIM_DIR = ROOT / "tests" / "megatron_shim"  # sitecustomize arming the CPU stand-ins
LAYOUTS = {"tp2": dict(tp=2), "dp2": dict(dp=2), "pp2": dict(pp=2),
           "fsdp2": dict(dp=2, shard="fsdp2"),
           "dp2do": dict(dp=2, distributed_optimizer=True),  # megatron's distributed optimizer
           "tp2dp2do": dict(tp=2, dp=2, distributed_optimizer=True)}  # 4 ranks


def use_cpu_shim() -> None:
    """megatron-core on the CPU here and in every rank process started from here."""
    from backends.megatron import cpu_shim

    cpu_shim.install_on_import()
    path = os.environ.get("PYTHONPATH", "")
    if str(SHIM_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), path) if p)


def make_batch(num_samples: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Groups of two responses of varied lengths, random rewards (GRPO advantages != 0)."""
    rng = random.Random(seed)
    out = []
    for i in range(num_samples):
        prompt = [1] + [rng.randint(3, vocab - 1) for _ in range(rng.randint(3, 6))]
        n = rng.randint(2, 12)
        resp = [rng.randint(3, vocab - 1) for _ in range(n)]
        out.append(Sample(group_id=f"g{i // 2}", index=i % 2, domain="d", prompt_ids=prompt,
                          response_ids=resp, loss_mask=[1] * n, rollout_logprobs=[-3.0] * n,
                          reward=rng.random()))
    return out


def base_config(model: str, device: str, dtype: str, timeout_s: float = 120.0
                ) -> TrainerConfig:
    """The megatron trainer's config at one rank: AdamW (the trainer's optimizer), micro-batches
    of two samples, a global gradient clip."""
    return TrainerConfig(model=model, workers=["w"], backend="megatron", device=device,
                         dtype=dtype, micro_batches=MicroBatchConfig(size=2),
                         optimizer=OptimizerConfig(lr=1e-3, grad_clip=1.0),
                         parallel=ParallelConfig(timeout_s=timeout_s))


def at_layout(cfg: TrainerConfig, tp: int = 1, pp: int = 1, dp: int = 1, shard: str = "none",
              distributed_optimizer: bool = False) -> TrainerConfig:
    parallel = msgspec.structs.replace(cfg.parallel, tp=tp, pp=pp, dp=dp, shard=shard,
                                       distributed_optimizer=distributed_optimizer)
    return msgspec.structs.replace(cfg, parallel=parallel)


def release(state: TrainState) -> None:
    """Tear down the one-rank group and the backend's model-parallel state (the next layout
    builds its own)."""
    state.backend.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def hf_weights(state: TrainState, ranks: Any) -> dict[str, torch.Tensor]:
    """The HF weights a push would send, gathered to this rank (float32 copies)."""
    return {k: v.detach().float().cpu().clone() for k, v in ranks.named_weights(state)}


def end(procs: list, timeout_s: float = 60) -> None:
    """Wait for rank processes told to stop; kill those still running after `timeout_s`."""
    for p in procs:
        try:
            p.wait(timeout_s)
        except Exception:  # noqa: BLE001 - a rank stuck in its exit: ended here
            p.kill()
            p.wait()


class Trainer:
    """The trainer's state and ranks at one layout, as the actor holds them (a context): rank 0
    here, ranks 1..N-1 as processes (logs in `<run_dir>/logs`)."""

    def __init__(self, cfg: TrainerConfig, run_dir: Path, resume: bool = False):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.procs: list = []
        store = ""
        if cfg.parallel.world_size > 1:
            store = f"127.0.0.1:{free_port('127.0.0.1')}"
            self.procs = start_standalone(cfg, str(run_dir), resume, run_dir / "logs", store)
        try:
            self.ranks = load_trainer(cfg, str(run_dir), resume, store)
        except BaseException:
            for p in self.procs:
                p.kill()
                p.wait()
            raise
        self.state = self.ranks.state

    def step(self, samples: list[Sample]) -> tuple[dict[str, float], float]:
        """One optimizer step on every rank: (rank 0's statistics, seconds)."""
        sync = torch.cuda.synchronize if self.cfg.device.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        stats = self.ranks.train(self.state, samples, self.cfg)
        sync()
        self.state.step += 1
        self.state.version += 1
        return stats, time.perf_counter() - t0

    def weights(self) -> dict[str, torch.Tensor]:
        return hf_weights(self.state, self.ranks)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ranks.stop()
        if self.procs:
            end(self.procs)
        else:
            release(self.state)


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"different tensors: {sorted(set(a) ^ set(b))}")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def fraction_within(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float
                    ) -> float:
    close = sum(int(((a[k] - b[k]).abs() <= tol).sum()) for k in a)
    return close / sum(t.numel() for t in a.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (gloo + stand-ins) or cuda (NCCL)")
    ap.add_argument("--model", default="examples/base-tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--layouts", default="tp2,dp2,pp2,dp2do")
    ap.add_argument("--backend", default="megatron", choices=["megatron", "torch"])
    args = ap.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    if not device.startswith("cuda"):
        use_cpu_shim()

    samples = make_batch(args.samples, len(load_tokenizer(args.model)))
    cfg = base_config(args.model, device, args.dtype)
    if args.backend == "torch":  # one padded forward per micro-batch on every layout
        cfg = msgspec.structs.replace(cfg, backend="torch", micro_batches=msgspec.structs.replace(
            cfg.micro_batches, forward_by_length=False))
    with tempfile.TemporaryDirectory() as tmp:
        with Trainer(cfg, Path(tmp) / "one") as one:
            want_stats, t_one = one.step(samples)
            want = one.weights()
        print(f"one rank: step {t_one:.3f} s, grad norm {want_stats['train/grad_norm']:.6f}",
              flush=True)
        result, weights = {}, {}
        for name in args.layouts.split(","):
            with Trainer(at_layout(cfg, **LAYOUTS[name]), Path(tmp) / name) as many:
                stats, t = many.step(samples)
                got = weights[name] = many.weights()
            result[name] = max_abs(got, want)
            norm = stats["train/grad_norm"] / want_stats["train/grad_norm"] - 1
            print(f"{name}: step {t:.3f} s, max |param - one rank's| {result[name]:.3e}, "
                  f"params within 1e-7 {fraction_within(got, want, 1e-7):.5f}, grad norm "
                  f"rel. diff {norm:.1e}", flush=True)
    extra = ""
    if "dp2" in weights and "dp2do" in weights:  # the distributed optimizer vs replicated
        extra = f" dp2do_vs_dp2_max_abs={max_abs(weights['dp2do'], weights['dp2']):.3e}"
    print("RESULT " + " ".join(f"{name}_vs_{'dp' if name in ('fsdp2', 'dp2do') else name[:2]}"
                               f"1_max_abs={value:.3e}" for name, value in result.items())
          + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
