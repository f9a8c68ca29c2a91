"""Per-process device memory (NVML, what nvidia-smi lists) of a colocated worker and trainer,
awake and asleep, on one GPU.

Three processes on the same GPU, each started by this script (`--role`): an inference worker
(the embedded engine's `Scheduler` over a Qwen2-0.5B-shaped bf16 model: hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, vocabulary 151936; it decodes a batch so that KV
caches and logits have been allocated), a trainer (the same model with fp32 master weights and
AdamW, two optimizer steps so that gradients and Adam's moments exist) and a bare CUDA context
(the floor no process goes under). This script itself never touches CUDA: it reads NVML per pid.

Then: the trainer sleeps (training/sleep.py) and the worker releases its memory (SGLang's
/release_memory_occupation path: engine/scheduler.py `release`); both are read asleep; both wake,
the worker's greedy output must equal its output before the release and the trainer takes one
more step. Under 3 minutes on an H200:
    python -m bench.sleep_memory [--device cuda:0]
Final line: RESULT worker_asleep_mib=... trainer_asleep_mib=... context_mib=... (and the awake
figures, and each asleep process's excess over the bare context).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from engine.sampling import GenRequest, SamplingParams
from engine.scheduler import Scheduler
from memory.device_usage import process_device_bytes
from models.tiny import build_tiny
from training.master_weights import make_optimizer
from training.sleep import TrainerSleep

MiB = 1 << 20
PROMPTS, NEW_TOKENS = 32, 128
BATCH, SEQ = 4, 256


def qwen2_05b_config():
    return Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       max_position_embeddings=4096, tie_word_embeddings=True)


def build_model(device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_05b_config(), dtype=torch.bfloat16)
    return model


def say(*parts) -> None:
    print(*parts, flush=True)


def command() -> str:
    return sys.stdin.readline().strip()


# ----------------------------------------------------------------------------- roles
def context_role(device: str) -> None:
    torch.zeros(1, device=device)
    say("ready")
    command()


def trainer_role(device: str) -> None:
    model = build_model(device)
    opt = make_optimizer(model.parameters(), torch.bfloat16, None, lr=1e-5)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, 151936, (BATCH, SEQ), device=device, generator=gen)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(), step()]
    sleeper = TrainerSleep(model, opt)
    first = sleeper.sleep()  # the first sleep pins its host buffer: timed apart
    sleeper.wake()
    say("ready", f"loss {losses[-1]:.4f}; first sleep (pins {first.moved_bytes / MiB:.0f} MiB "
        f"of host memory) {first.seconds:.3f} s")
    command()
    report = sleeper.sleep()
    say("asleep", f"moved {report.moved_bytes / MiB:.0f} MiB in {report.seconds:.3f} s, "
        f"allocated {torch.cuda.memory_allocated(device) / MiB:.1f} MiB, reserved "
        f"{torch.cuda.memory_reserved(device) / MiB:.1f} MiB")
    command()
    report = sleeper.wake()
    say("awake", f"woke in {report.seconds:.3f} s, next step loss {step():.4f}")
    command()


def worker_role(device: str) -> None:
    asyncio.run(_worker(device))


async def _worker(device: str) -> None:
    _, tokenizer = build_tiny("tiny-qwen2")  # prompts are token ids; text is not read
    s = Scheduler(build_model(device).eval(), tokenizer, source=None, device=device,
                  dtype=torch.bfloat16, max_batch_size=PROMPTS)
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(s.run())

    def requests(n: int) -> list[GenRequest]:
        return [GenRequest(rid=f"r{i}", input_ids=[5 + i, 6, 41, 7, 44],
                           params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                 ignore_eos=True)) for i in range(n)]

    await s.generate(requests(1))
    t0 = time.perf_counter()
    await s.release()  # the first release pins its host buffer: timed apart
    first = time.perf_counter() - t0
    await s.resume()
    before = [r.output_ids for r in await s.generate(requests(PROMPTS))]
    say("ready", f"decoded {PROMPTS} x {NEW_TOKENS} tokens; first release {first:.3f} s")
    await loop.run_in_executor(None, command)
    t0 = time.perf_counter()
    await s.release()
    say("asleep", f"released in {time.perf_counter() - t0:.3f} s, allocated "
        f"{torch.cuda.memory_allocated(device) / MiB:.1f} MiB, reserved "
        f"{torch.cuda.memory_reserved(device) / MiB:.1f} MiB")
    await loop.run_in_executor(None, command)
    t0 = time.perf_counter()
    await s.resume()
    resumed = time.perf_counter() - t0
    after = [r.output_ids for r in await s.generate(requests(PROMPTS))]
    say("awake", f"resumed in {resumed:.3f} s, same greedy outputs: {after == before}")
    await loop.run_in_executor(None, command)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await s.close()


ROLES = {"context": context_role, "trainer": trainer_role, "worker": worker_role}


# ----------------------------------------------------------------------------- driver
class Role:
    """One role's process; `ask` sends a command and returns its one-line answer."""

    def __init__(self, name: str, device: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.sleep_memory", "--role", name, "--device", device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def answer(self) -> str:
        line = self.proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) without answering")
        say(f"{self.name}: {line}")
        return line

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def mib(self) -> float:
        used = process_device_bytes(self.proc.pid)
        if used is None:
            raise RuntimeError("NVML is not available (install nvidia-ml-py)")
        return used / MiB

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def main(device: str) -> None:
    t0 = time.perf_counter()
    roles = {name: Role(name, device) for name in ("context", "worker", "trainer")}
    try:
        for role in roles.values():
            role.answer()  # ready
        context = roles["context"].mib()
        worker, trainer = roles["worker"], roles["trainer"]
        awake = {"worker": worker.mib(), "trainer": trainer.mib()}
        trainer.ask("sleep")
        worker.ask("sleep")
        time.sleep(0.5)  # NVML's per-process figure is sampled
        asleep = {"worker": worker.mib(), "trainer": trainer.mib()}
        for role in (worker, trainer):
            role.ask("wake")
        woke = {"worker": worker.mib(), "trainer": trainer.mib()}
        for name in ("worker", "trainer"):
            say(f"{name}: awake {awake[name]:.0f} MiB, asleep {asleep[name]:.0f} MiB "
                f"(context + {asleep[name] - context:.0f} MiB), awake again {woke[name]:.0f} MiB")
        say(f"bare CUDA context: {context:.0f} MiB; wall time {time.perf_counter() - t0:.0f} s")
        say(f"RESULT worker_asleep_mib={asleep['worker']:.0f} "
            f"trainer_asleep_mib={asleep['trainer']:.0f} context_mib={context:.0f} "
            f"worker_awake_mib={awake['worker']:.0f} trainer_awake_mib={awake['trainer']:.0f} "
            f"worker_over_context_mib={asleep['worker'] - context:.0f} "
            f"trainer_over_context_mib={asleep['trainer'] - context:.0f}")
    finally:
        for role in roles.values():
            role.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--role", choices=sorted(ROLES), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role is not None:
        ROLES[args.role](args.device)
    else:
        main(args.device)
