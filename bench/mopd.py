"""MOPD step time where switching is not free: teachers time-sharing the GPU, from host or NVMe.

    python -m bench.mopd                 # one H200: every configuration, 4 to 5 minutes
    python -m bench.mopd --small         # CPU, tiny shapes: the same code paths in seconds
    python -m bench.mopd --configs big,nvme --dir /nvme/scratch --repeat 5

One MOPD step is the trainer's real `train_on_batch` with colocated teachers
(`training/colocated_teachers.py`): teacher forwards from weight memory streamed into the policy
pass (micro-batches run by teacher, one switch per teacher), the student's recompute, forward and
backward with the OPD loss (sampled), AdamW. Every mode runs warm-up steps, then `--repeat` timed
steps on the same batch: median and spread (min..max). Modes: `1t` every sample routed to one
teacher, which stays in its slot (no switching); `4t` samples spread over 4 teachers, 2 device
slots (2 teachers switched in per step), prefetch ahead plus the buffer's hint of the next step's
teachers (by first appearance, as logic/buffer.py gives it; the teacher stream orders it the way
that step will run them, the teachers left in the slots first); `sync` the same 4
teachers, demand loads only (slime's restore-then-compute). Configurations:
- `base`: student and 4 teachers of the same ~1B Qwen2 shape, random weights straight into the
  arena (the original benchmark; RESULT `step_4t_vs_1t`, `step_4t_vs_sync`);
- `big` (a): a Qwen2-0.5B-shaped student and 4 Qwen2.5-3B-shaped teachers (bf16, 6.2 GB each,
  vocabulary 151,936), loaded by `ColocatedTeachers.load` from a safetensors checkpoint of random
  weights written once under `--dir` (the 4 teachers share its file; each is its own weight set),
  all 4 on the pinned host; 1t / 4t / sync (RESULT `big_4t_vs_1t`);
- `nvme` (b): the same teachers with a host budget of 2 of them: the load streams the others from
  the checkpoint to the NVMe tier under `--dir`, and every step reads 2 teachers from disk
  (O_DIRECT: checked; where the filesystem refuses it, the page cache is dropped before each
  step and the output says so). `lookahead = 4`, so the hint covers the next step and its disk
  reads start during this step's last teachers. The step is sized so that its compute could
  hide the disk reads (`--nvme-cover` times the disk time of 2 teachers at the bandwidth of a
  cold read after the load, from big's time per sample) unless `--nvme-samples` fixes it;
  1t / 4t (RESULT `nvme_4t_vs_1t`);
- `opd_memory`: bench.opd_memory's peak of `full` over `sampled` (RESULT
  `full_vocab_peak_over_sampled`).
Exposed switch time per step: median(4t or sync) - median(1t). Physical lower bound: bytes that
must move per step (2 teachers to the GPU; for nvme also 2 from disk) over the bandwidth measured
during the timed steps (the timeline's copy and disk events), minus the compute that can hide
them (the 1t step), at least 0. Checkpoint writing is timed apart and done once per `--dir`.
Final line: `RESULT step_4t_vs_1t=... step_4t_vs_sync=... big_4t_vs_1t=... nvme_4t_vs_1t=...
full_vocab_peak_over_sampled=...` (`n/a` for a configuration not run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from actors.trainer import TrainerConfig
from algos.opd import OpdConfig
from bench.opd_memory import run_mode
from logic.teachers import TeacherSpec
from memory.config import TeacherMemoryConfig
from memory.host import SHM_DIR
from memory.layout import FlatLayout, bind
from memory.manager import WeightMemory
from training.colocated_teachers import ColocatedTeachers
from training.config import MicroBatchConfig
from training.master_weights import make_optimizer
from training.state import TrainState
from training.step import train_on_batch
from training.teacher_weights import skeleton_from_config, skeleton_tensors
from transport.dtypes import dtype_name, model_dtype
from transport.schema import Sample

NAMES = ["t0", "t1", "t2", "t3"]
SLOTS = 2
# Qwen2-0.5B's and Qwen2.5-3B's shapes (tied embeddings); --small: the same structure, tiny
STUDENT = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)
TEACHER = dict(hidden_size=2048, num_hidden_layers=36, intermediate_size=11008,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936)
SMALL_STUDENT = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
SMALL_TEACHER = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
SAFETENSORS_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def qwen2_config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**{"tie_word_embeddings": True, **shape}, max_position_embeddings=4096)


def base_shape(args) -> dict:
    """The original configuration's shape (untied embeddings)."""
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                intermediate_size=args.ffn, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                tie_word_embeddings=False)


def student_model(shape: dict, dtype: torch.dtype, device: str):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(qwen2_config(shape)).to(dtype)


def random_teachers(shape: dict, dtype, device: str) -> ColocatedTeachers:
    """The base configuration's pool: 4 teachers of random weights in the host arena."""
    skeleton = skeleton_from_config(qwen2_config(shape), dtype, device)
    layout = FlatLayout.from_shapes((n, t.dtype, tuple(t.shape))
                                    for n, t in skeleton_tensors(skeleton).items())
    mem = WeightMemory(device, gpu_slots=SLOTS, slot_bytes=layout.total_bytes,
                       host_budget_bytes=len(NAMES) * layout.total_bytes)
    gen = torch.Generator(device=device).manual_seed(0)
    for name in NAMES:
        mem.register(f"teacher:{name}", layout)
        for view in bind(mem.reserve_host(f"teacher:{name}"), layout).values():
            view.copy_(torch.randn(view.shape, generator=gen, device=device, dtype=view.dtype)
                       * 0.02)
    return ColocatedTeachers(mem, {n: skeleton for n in NAMES},
                             [TeacherSpec(name=n, model="random") for n in NAMES])


def write_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: str) -> float:
    """An HF checkpoint directory of random weights (normal, std 0.02) in `dtype`, written tensor
    by tensor (generated on `device`: no copy of the model in host memory). Seconds taken, 0 when
    a complete one is there already."""
    from transformers import AutoModelForCausalLM

    if (path / "complete").exists():
        return 0.0
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(shape)
    with torch.device("meta"):
        tensors = skeleton_tensors(AutoModelForCausalLM.from_config(config, dtype=dtype))
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator(device=device).manual_seed(1)
    tmp = path / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for t in tensors.values():
            x = torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype) * 0.02
            f.write(x.cpu().reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path / "model.safetensors")
    config.save_pretrained(path)
    (path / "complete").write_text("")
    return time.perf_counter() - t0


def batch(samples: int, seq: int, vocab: int, names: list[str], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(samples):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        p = seq // 4
        out.append(Sample(group_id=f"g{i // 4}", index=i % 4, domain="d", prompt_ids=ids[:p],
                          response_ids=ids[p:], loss_mask=[1] * (seq - p),
                          rollout_logprobs=[-5.0] * (seq - p), reward=float(i % 2),
                          teacher=names[(i * len(names)) // samples]))
    return out


class Runner:
    """A student, its optimizer and a teacher pool: timed steps per mode."""

    def __init__(self, pool: ColocatedTeachers, shape: dict, dtype, device: str, micro: int,
                 specs: list[TeacherSpec]):
        self.pool, self.device = pool, device
        self.model = student_model(shape, dtype, device)
        self.state = TrainState(self.model, _Tok(), make_optimizer(self.model.parameters(),
                                                                   dtype, None, 1e-5))
        self.state.teachers = pool
        self.cfg = TrainerConfig(model="random", workers=["w"], dtype=dtype_name(dtype),
                                 opd=OpdConfig(mode="sampled", kl_coef=1.0), teachers=specs,
                                 micro_batches=MicroBatchConfig(size=micro,
                                                                forward_by_length=False))
        self.drop_cache = False  # the NVMe tier is read through the page cache: drop it first

    def mode(self, label: str, samples: list[Sample], warmup: int, repeat: int,
             lookahead: int, hint: bool) -> dict:
        mem = self.pool.memory
        mem.lookahead = lookahead
        names = sorted({s.teacher for s in samples})
        for _ in range(warmup):
            self._step(samples, names, hint)
        c0, ev0 = dict(mem.counters), mem.timeline.now()
        times = [self._step(samples, names, hint) for _ in range(repeat)]
        loads = {k: (mem.counters[k] - c0[k]) / repeat for k in ("gpu_loads", "host_loads")}
        out = {"median": statistics.median(times), "min": min(times), "max": max(times),
               "times": times, **loads, **moved(mem, ev0)}
        print(f"  {label:>9}: step {out['median']:.3f} s (min {out['min']:.3f}, max "
              f"{out['max']:.3f}; {[round(t, 3) for t in times]}), per step "
              f"{loads['gpu_loads']:.1f} device loads, {loads['host_loads']:.1f} disk reads",
              flush=True)
        return out

    def _step(self, samples, names, hint: bool) -> float:
        self.state.next_teachers = names if hint else []  # the buffer's: by first appearance
        if self.drop_cache:
            for tag in self.pool.memory.residency()["nvme"]:
                self.pool.memory.store.drop_cache(tag)
        _sync(self.device)
        t0 = time.perf_counter()
        train_on_batch(self.state, samples, self.cfg)
        _sync(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.close()
        del self.state, self.model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def moved(mem: WeightMemory, since_s: float) -> dict:
    """Bytes and busy seconds of H2D copies and NVMe -> host reads since `since_s`."""
    out = {"h2d_bytes": 0, "h2d_s": 0.0, "disk_bytes": 0, "disk_s": 0.0}
    for e in mem.timeline.events():
        if e.start_s < since_s:
            continue
        key = ("h2d" if e.kind == "h2d" and e.src != "nvme" else
               "disk" if (e.kind, e.src, e.dst) == ("disk", "nvme", "host") else "")
        if key:
            out[f"{key}_bytes"] += e.nbytes
            out[f"{key}_s"] += e.end_s - e.start_s
    return out


def bound(one_t: dict, nbytes: int, seconds_per_byte: float) -> float:
    """Lower bound on the exposed time per step: moving `nbytes` at the measured rate, less the
    compute that can hide it (the 1t step)."""
    return max(0.0, nbytes * seconds_per_byte - one_t["median"])


def rate(r: dict, key: str) -> float:
    """Measured seconds per byte of `key` ("h2d" or "disk") over a mode's timed steps."""
    return r[f"{key}_s"] / r[f"{key}_bytes"] if r[f"{key}_bytes"] else 0.0


def report(name: str, r: dict, teacher_bytes: int, disk: bool = False) -> None:
    one = r["1t"]
    h2d = rate(r["4t"], "h2d") or rate(r.get("sync", r["4t"]), "h2d")
    lines = [f"{name}: exposed switch time per step: 4t {r['4t']['median'] - one['median']:+.3f} s"]
    if "sync" in r:
        lines[0] += f", sync {r['sync']['median'] - one['median']:+.3f} s"
    if h2d:
        lines.append(f"  H2D {1 / h2d / 1e9:.1f} GB/s measured: {SLOTS} teachers per step "
                     f"({SLOTS * teacher_bytes / 1e9:.2f} GB) take "
                     f"{SLOTS * teacher_bytes * h2d:.3f} s; lower bound on exposed "
                     f"{bound(one, SLOTS * teacher_bytes, h2d):.3f} s")
    if disk:
        d = rate(r["4t"], "disk")
        lb = bound(one, SLOTS * teacher_bytes, d)
        lines.append(f"  disk {1 / d / 1e9 if d else float('nan'):.2f} GB/s measured: {SLOTS} "
                     f"teachers per step ({SLOTS * teacher_bytes / 1e9:.2f} GB) take "
                     f"{SLOTS * teacher_bytes * d:.2f} s against a {one['median']:.2f} s step; "
                     f"lower bound on exposed {lb:.2f} s, on nvme_4t_vs_1t "
                     f"{(one['median'] + lb) / one['median']:.3f}")
    print("\n".join(lines), flush=True)


def run_base(args, dtype) -> dict:
    shape = base_shape(args)
    params = sum(t.numel() for t in skeleton_tensors(student_model(shape, dtype, "meta")).values())
    print(f"base: student and 4 teachers of {params / 1e9:.2f}B params, {args.samples} samples x "
          f"{args.seq} tokens per step", flush=True)
    pool = random_teachers(shape, dtype, args.device)
    run = Runner(pool, shape, dtype, args.device, args.micro_batch,
                 [TeacherSpec(name=n, model="random") for n in NAMES])
    try:
        r = modes(run, args.samples, args.seq, shape["vocab_size"], args.repeat,
                  lookahead=1, with_sync=True)
    finally:
        run.close()
    report("base", r, pool.memory.sets["teacher:t0"].layout.total_bytes)
    return r


def modes(run: Runner, samples: int, seq: int, vocab: int, repeat: int, lookahead: int,
          with_sync: bool, warmup: int = 1) -> dict:
    one = batch(samples, seq, vocab, NAMES[:1])
    four = batch(samples, seq, vocab, NAMES)
    r = {"1t": run.mode("1t", one, 1, repeat, lookahead, hint=True),
         "4t": run.mode("4t", four, warmup, repeat, lookahead, hint=True)}
    if with_sync:
        r["sync"] = run.mode("sync", four, 1, repeat, 0, hint=False)
    return r


def load_big(args, dtype, ckpt: Path, budget_teachers: int, lookahead: int
             ) -> tuple[ColocatedTeachers, list[TeacherSpec]]:
    specs = [TeacherSpec(name=n, model=str(ckpt)) for n in NAMES]
    size = FlatLayout.from_checkpoint(ckpt).total_bytes  # bf16 checkpoint, bf16 teachers
    nvme = Path(args.dir) / "nvme"
    shutil.rmtree(nvme, ignore_errors=True)
    cfg = TeacherMemoryConfig(gpu_slots=SLOTS, host_budget_bytes=budget_teachers * size,
                              nvme_dir=str(nvme), lookahead=lookahead)
    t0 = time.perf_counter()
    pool = ColocatedTeachers.load(specs, args.device, dtype, cfg, args.dir)
    res = pool.memory.residency()
    print(f"  loaded in {time.perf_counter() - t0:.1f} s: host {res['host']}, NVMe {res['nvme']}",
          flush=True)
    return pool, specs


def run_big(args, dtype, ckpt: Path) -> dict:
    print(f"big (a): {args.big_samples} samples x {args.big_seq} tokens per step, 4 teachers on "
          f"the host, {SLOTS} device slots", flush=True)
    pool, specs = load_big(args, dtype, ckpt, len(NAMES), lookahead=1)
    run = Runner(pool, args.student_shape, dtype, args.device, args.micro_batch, specs)
    try:
        r = modes(run, args.big_samples, args.big_seq, args.student_shape["vocab_size"],
                  args.repeat, lookahead=1, with_sync=True)
    finally:
        run.close()
    report("big", r, pool.memory.sets["teacher:t0"].layout.total_bytes)
    return r


def run_nvme(args, dtype, ckpt: Path, big: dict | None) -> dict:
    print(f"nvme (b): host budget of 2 teachers, {SLOTS} device slots", flush=True)
    pool, specs = load_big(args, dtype, ckpt, 2, lookahead=len(NAMES))
    mem = pool.memory
    size = mem.sets["teacher:t0"].layout.total_bytes
    direct, disk_s_per_byte = probe_disk(mem)
    samples = args.nvme_samples or auto_samples(args, big, 2 * size * disk_s_per_byte)
    how = "O_DIRECT" if direct else ("buffered (O_DIRECT refused: the page cache is dropped "
                                     "before each step)")
    print(f"  NVMe reads: {how}, {1 / disk_s_per_byte / 1e9:.2f} GB/s cold "
          f"({fs_info(Path(args.dir))}); step: {samples} samples x {args.big_seq} tokens",
          flush=True)
    if 1 / disk_s_per_byte > 10e9:
        print("  (faster than one NVMe drive: a cache below this filesystem may serve the reads, "
              "and the nvme result then says little about disks)", flush=True)
    run = Runner(pool, args.student_shape, dtype, args.device, args.micro_batch, specs)
    run.drop_cache = not direct
    try:  # two warm-up steps: the teacher loaded to the host is written to NVMe once
        r = modes(run, samples, args.big_seq, args.student_shape["vocab_size"], args.repeat,
                  lookahead=len(NAMES), with_sync=False, warmup=2)
    finally:
        run.close()
    r["direct"], r["samples"] = direct, samples
    report("nvme", r, size, disk=True)
    return r


def probe_disk(mem: WeightMemory) -> tuple[bool, float]:
    """(whether O_DIRECT is used, seconds per byte) of reading one NVMe set as the tier does,
    into the host region the other sets stage through."""
    tag = mem.residency()["nvme"][-1]
    size = mem.sets[tag].layout.total_bytes
    region = mem.arena.alloc("probe", size)
    try:
        mem.store.drop_cache(tag)
        t0 = time.perf_counter()
        stats = mem.store.read_into(tag, mem.arena.view(region))
        return stats.direct, (time.perf_counter() - t0) / size
    finally:
        mem.arena.free("probe")


def fs_info(path: Path) -> str:
    """The filesystem holding `path` and the kernel, as /proc/mounts and uname tell them."""
    best, fstype = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and str(path.resolve()).startswith(parts[1]) and \
                        len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return f"{path} on {fstype} ({best or '?'}), kernel {os.uname().release}"


def auto_samples(args, big: dict | None, disk_s: float) -> int:
    """Samples per step so that the 1t step's compute is `--nvme-cover` times the disk time of
    2 teachers (from big's 1t step time per sample), in whole micro-batches, at most
    `--max-nvme-samples` and `--max-nvme-step-s` (a slow disk then shows in the bound); big's
    own size when big did not run."""
    if big is None:
        return args.big_samples
    per_sample = big["1t"]["median"] / args.big_samples
    want = min(args.nvme_cover * disk_s, args.max_nvme_step_s) / per_sample
    mb = args.micro_batch
    return int(min(args.max_nvme_samples, max(args.big_samples, -(-want // mb) * mb)))


def run_opd_memory(args) -> float:
    ns = SimpleNamespace(device=args.device, vocab=args.opd_vocab, hidden=args.opd_hidden,
                         batch=args.opd_batch, response=args.opd_response, top_k=20, top_p=0.95,
                         repeat=1)
    dtype = model_dtype("bfloat16" if args.device.startswith("cuda") else "float32")
    peaks = {m: run_mode(m, ns, dtype)[0] for m in ("sampled", "full")}
    ratio = peaks["full"] / peaks["sampled"]
    print(f"opd_memory: V = {ns.vocab}, {ns.batch} x {ns.response} tokens: peak sampled "
          f"{peaks['sampled'] / 2**30:.3f} GiB, full {peaks['full'] / 2**30:.3f} GiB "
          f"({ratio:.3f}x)", flush=True)
    return ratio


def check_space(args, ckpt: Path, teacher_bytes: int) -> str:
    """'' when --dir and /dev/shm can hold what the big configurations need, else why not."""
    need = (0 if (ckpt / "complete").exists() else teacher_bytes) + len(NAMES) * teacher_bytes
    free = shutil.disk_usage(args.dir).free
    shm = shutil.disk_usage(SHM_DIR).free
    print(f"--dir {args.dir}: {free / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB (checkpoint "
          f"once, NVMe tier up to 4 teachers); {SHM_DIR}: {shm / 1e9:.1f} GB free, the host "
          f"arena needs {len(NAMES) * teacher_bytes / 1e9:.1f} GB", flush=True)
    if free < need:
        return f"--dir {args.dir} has {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed"
    if shm < len(NAMES) * teacher_bytes:
        return f"{SHM_DIR} has {shm / 1e9:.1f} GB free, {len(NAMES) * teacher_bytes / 1e9:.1f}"
    return ""


def main() -> None:
    args = parse_args()
    dtype = model_dtype(args.dtype)
    configs = args.configs.split(",")
    res: dict = {}
    t_start = time.perf_counter()
    if "opd_memory" in configs:  # first: it needs most of the GPU's memory
        res["opd"] = run_opd_memory(args)
    if "base" in configs:
        res["base"] = run_base(args, dtype)
    if {"big", "nvme"} & set(configs):
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        shape = args.teacher_shape
        ckpt = Path(args.dir) / (f"teacher-{shape['hidden_size']}x{shape['num_hidden_layers']}-"
                                 f"{dtype_name(dtype)}")
        teacher_bytes = sum(t.numel() * t.element_size() for t in skeleton_tensors(
            student_model(args.teacher_shape, dtype, "meta")).values())
        why = check_space(args, ckpt, teacher_bytes)
        if why:
            print(f"big and nvme not run: {why}", flush=True)
        else:
            seconds = write_checkpoint(ckpt, args.teacher_shape, dtype, args.device)
            print(f"teacher checkpoint {ckpt} ({teacher_bytes / 1e9:.2f} GB): " +
                  (f"written in {seconds:.1f} s ({teacher_bytes / seconds / 1e9:.2f} GB/s)"
                   if seconds else "reused"), flush=True)
            if "big" in configs:
                res["big"] = run_big(args, dtype, ckpt)
            if "nvme" in configs:
                res["nvme"] = run_nvme(args, dtype, ckpt, res.get("big"))
    print(f"wall time {time.perf_counter() - t_start:.0f} s", flush=True)
    print_result(res)


def print_result(res: dict) -> None:
    def ratio(cfg: str, a: str, b: str) -> str:
        r = res.get(cfg)
        return f"{r[a]['median'] / r[b]['median']:.3f}" if r and a in r and b in r else "n/a"

    extra = {"big_4t_vs_sync": ratio("big", "4t", "sync"), "big_sync_vs_1t":
             ratio("big", "sync", "1t"), "base_sync_vs_1t": ratio("base", "sync", "1t")}
    print("SUMMARY " + " ".join(f"{k}={v}" for k, v in extra.items()))
    opd = f"{res['opd']:.3f}" if "opd" in res else "n/a"
    print(f"RESULT step_4t_vs_1t={ratio('base', '4t', '1t')} "
          f"step_4t_vs_sync={ratio('base', '4t', 'sync')} big_4t_vs_1t={ratio('big', '4t', '1t')}"
          f" nvme_4t_vs_1t={ratio('nvme', '4t', '1t')} full_vocab_peak_over_sampled={opd}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="CPU, tiny shapes (a test of the paths)")
    p.add_argument("--configs", default="opd_memory,base,big,nvme")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", "--steps", type=int, default=3, help="timed steps per mode")
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                 "rlx-bench-mopd"),
                   help="teacher checkpoint (written once) and NVMe tier; on the disk to test")
    p.add_argument("--hidden", type=int, default=2048)  # base: student = teachers
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--big-samples", type=int, default=32)
    p.add_argument("--big-seq", type=int, default=1024)
    p.add_argument("--nvme-samples", type=int, default=0, help="0: sized from --nvme-cover")
    p.add_argument("--nvme-cover", type=float, default=1.3,
                   help="the nvme step's compute over the disk time of 2 teachers")
    p.add_argument("--max-nvme-samples", type=int, default=256)
    p.add_argument("--max-nvme-step-s", type=float, default=12.0)
    p.add_argument("--opd-vocab", type=int, default=151936)
    p.add_argument("--opd-hidden", type=int, default=1024)
    p.add_argument("--opd-batch", type=int, default=8)
    p.add_argument("--opd-response", type=int, default=4096)
    args = p.parse_args()
    args.student_shape, args.teacher_shape = STUDENT, TEACHER
    if args.small:
        args.device, args.dtype = "cpu", "float32"
        args.hidden, args.layers, args.ffn, args.heads, args.kv_heads = 64, 2, 128, 4, 2
        args.vocab, args.samples, args.seq, args.micro_batch = 256, 16, 32, 4
        args.big_samples, args.big_seq, args.max_nvme_samples = 16, 32, 32
        args.opd_vocab, args.opd_hidden, args.opd_batch, args.opd_response = 4096, 64, 2, 128
        args.student_shape, args.teacher_shape = SMALL_STUDENT, SMALL_TEACHER
    return args


class _Tok:
    pad_token_id = 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
