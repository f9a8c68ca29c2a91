"""Weight-memory benchmark: tier bandwidths and the teacher-switch overlap experiment.

Run on a GPU machine (it also runs on CPU with small sizes, where the GPU tier is the CPU):

    python -m bench.memory --out OUT_DIR                 # H200 sizes: 4 teachers x 3 GiB
    python -m bench.memory --device cpu --teacher-mib 64 --disk-mib 256 --out OUT_DIR

Measures, in one run:
1. pinned H2D peak (`cudaMemcpy` of a page-locked buffer, best of several) and the same from the
   shared arena registered with cudaHostRegister;
2. the restore bandwidth of a teacher-sized set (host arena -> GPU slot, `prefetch(tag, "gpu")`)
   vs that peak;
3. raw O_DIRECT read bandwidth of a file (several reads in flight, no checksum) vs NVMe -> pinned
   through `NvmeStore.read_into` (same chunking, CRC-32 verified), NVMe -> GPU pipelined by chunks,
   and cuFile (GPUDirect Storage) when present;
4. overlap: N teachers whose total exceeds the GPU slots, a compute loop per switch longer than one
   teacher's transfer, a fixed switch order; the exposed switch time (wall time minus the same
   compute with no switching) with prefetch (lookahead 1) vs synchronous restore (lookahead 0,
   slime's TensorBackuper behaviour: copy, synchronize, compute). Both modes start with the
   first teacher resident, as the previous step's hint (`WeightMemory.hint`) leaves it.
Writes timeline.json and timeline.png to --out. Final line:
`RESULT h2d_peak_gbps=... restore_vs_peak=... nvme_vs_raw=... exposed_switch_vs_sync=...`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from memory.layout import FlatLayout
from memory.manager import WeightMemory
from memory.timeline import Timeline, plot

MiB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_copy_gbps(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        sync(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(dst.device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


def teacher_layout(nbytes: int, dim: int) -> FlatLayout:
    """A teacher-shaped set: square bf16 matrices of `dim` (the compute uses the first one)."""
    per = dim * dim * 2
    return FlatLayout.from_shapes([(f"layers.{i}.weight", torch.bfloat16, (dim, dim))
                                   for i in range(max(1, nbytes // per))])


def fill_host(mem: WeightMemory, tag: str, layout: FlatLayout, seed: int) -> None:
    """Register a set and put random bytes straight into its arena region (no extra host copy)."""
    mem.register(tag, layout)
    view = mem.reserve_host(tag)
    gen = torch.Generator(device=mem.device).manual_seed(seed)
    step = 256 * MiB
    for off in range(0, layout.total_bytes, step):
        n = min(step, layout.total_bytes - off)
        view[off:off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=mem.device,
                                              generator=gen))


def raw_direct_read_gbps(path: Path, nbytes: int, chunk: int, readers: int) -> float:
    """O_DIRECT preads into one page-aligned anonymous buffer, `readers` in flight, no checks."""
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    np.frombuffer(buf, dtype=np.uint8)[:] = 1  # fault the pages in first, as the arena's are
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(readers) as pool:
            list(pool.map(lambda off: os.preadv(fd, [view[off:off + chunk]], off),
                          range(0, nbytes, chunk)))
        return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        view.release()
        buf.close()


def bandwidths(args, dev: torch.device, out: dict) -> None:
    n = args.peak_mib * MiB
    if dev.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out["h2d_peak_gbps"] = best_copy_gbps(pinned, torch.empty(n, dtype=torch.uint8,
                                                                  device=dev))
        out["pageable_h2d_gbps"] = best_copy_gbps(torch.empty(n, dtype=torch.uint8),
                                                  torch.empty(n, dtype=torch.uint8, device=dev))
        del pinned
    else:
        out["h2d_peak_gbps"] = best_copy_gbps(torch.empty(n, dtype=torch.uint8),
                                              torch.empty(n, dtype=torch.uint8))


def restore_and_disk(args, dev: torch.device, out: dict, workdir: Path) -> None:
    lay = teacher_layout(args.teacher_mib * MiB, args.dim)
    disk_lay = teacher_layout(args.disk_mib * MiB, args.dim)
    mem = WeightMemory(str(dev), gpu_slots=1, slot_bytes=max(lay.total_bytes,
                                                             disk_lay.total_bytes),
                       host_budget_bytes=lay.total_bytes + 2 * disk_lay.total_bytes,
                       nvme_dir=str(workdir / "nvme"), chunk_bytes=args.chunk_mib * MiB,
                       num_readers=args.readers, gds="auto")
    try:
        fill_host(mem, "teacher", lay, 0)
        slot = mem.slots[0][:lay.total_bytes]
        out["arena_h2d_gbps"] = best_copy_gbps(mem.arena.view(mem.sets["teacher"].region), slot)
        best = float("inf")
        for _ in range(5):
            mem.evict("teacher", "gpu")
            sync(dev)
            t0 = time.perf_counter()
            mem.prefetch("teacher", "gpu").result()  # host region -> slot
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        out["restore_gbps"] = lay.total_bytes / best / 1e9
        out["restore_vs_peak"] = out["restore_gbps"] / out["h2d_peak_gbps"]
        mem.evict("teacher", "gpu")

        fill_host(mem, "disk", disk_lay, 1)
        t0 = time.perf_counter()
        mem.spill("disk")
        out["nvme_write_gbps"] = disk_lay.total_bytes / (time.perf_counter() - t0) / 1e9
        path = mem.store.data_path("disk")
        out["raw_direct_gbps"] = max(raw_direct_read_gbps(path, disk_lay.total_bytes,
                                                          args.chunk_mib * MiB, args.readers)
                                     for _ in range(2))
        target = mem.arena.view(mem.arena.alloc("disk-read", disk_lay.total_bytes))
        t0 = time.perf_counter()
        stats = mem.store.read_into("disk", target, verify=True)
        out["nvme_to_pinned_gbps"] = disk_lay.total_bytes / (time.perf_counter() - t0) / 1e9
        out["nvme_direct"] = stats.direct
        out["nvme_vs_raw"] = out["nvme_to_pinned_gbps"] / out["raw_direct_gbps"]
        assert torch.equal(target[:disk_lay.total_bytes], mem.arena.view(mem.sets["disk"].region)
                           [:disk_lay.total_bytes]), "NVMe round trip is not bit-exact"
        nvme_to_gpu(mem, disk_lay, dev, out)
    finally:
        mem.close()


def nvme_to_gpu(mem: WeightMemory, lay: FlatLayout, dev: torch.device, out: dict) -> None:
    """The set only on NVMe -> GPU slot: cuFile if present, else pipelined by chunks."""
    mem.evict("disk", "host")  # on NVMe only now
    sync(dev)
    t0 = time.perf_counter()
    mem.acquire("disk")
    sync(dev)
    key = "gds_to_gpu_gbps" if mem.gds is not None else "nvme_to_gpu_pipelined_gbps"
    out[key] = lay.total_bytes / (time.perf_counter() - t0) / 1e9
    if mem.gds_error:
        out["gds_error"] = mem.gds_error
    mem.evict("disk", "gpu")
    mem.evict("disk", "host")  # the pipelined path staged it on the host
    if mem.gds is not None:  # the same without cuFile, for comparison
        gds, mem.gds = mem.gds, None
        try:
            sync(dev)
            t0 = time.perf_counter()
            mem.acquire("disk")
            sync(dev)
            out["nvme_to_gpu_pipelined_gbps"] = lay.total_bytes / (time.perf_counter() - t0) / 1e9
        finally:
            mem.gds = gds


def overlap(args, dev: torch.device, out: dict, workdir: Path) -> Timeline:
    lay = teacher_layout(args.teacher_mib * MiB, args.dim)
    tags = [f"teacher:{k}" for k in range(args.teachers)]
    order = tags * args.rounds
    timeline = Timeline()
    mem = WeightMemory(str(dev), gpu_slots=args.slots, slot_bytes=lay.total_bytes,
                       host_budget_bytes=len(tags) * lay.total_bytes, timeline=timeline)
    try:
        for k, tag in enumerate(tags):
            fill_host(mem, tag, lay, 10 + k)
        x = torch.randn(args.dim, args.dim, device=dev, dtype=torch.bfloat16)
        transfer_s = lay.total_bytes / 1e9 / out["h2d_peak_gbps"]

        def compute(tag, tensors, reps):
            w = tensors["layers.0.weight"]
            y = x
            span = timeline.cuda_span(torch.cuda.current_stream(dev)) if dev.type == "cuda" \
                else None
            t0 = timeline.now()
            for _ in range(reps):
                y = torch.tanh(y @ w)  # bounded values; the matmul dominates
            if span is not None:
                span.end("compute", tag, "compute")
            else:
                timeline.add("compute", tag, "compute", t0)
            return y

        resident = mem.acquire(tags[0])  # load it and warm the kernels before timing compute
        compute("warmup", resident, 2)
        reps = calibrate(lambda r: compute("calibrate", resident, r), dev,
                         args.compute_over_transfer * transfer_s)
        mem.release(tags[0])
        out["compute_reps"], out["transfer_ms"] = reps, transfer_s * 1e3
        t_compute = timed(lambda: [compute(t, mem.acquire(tags[0]), reps) for t in order], dev)
        results = {}
        mem.timeline = timeline = Timeline()  # the plot shows the two measured modes only
        for name, lookahead in (("sync", 0), ("prefetch", 1)):
            for tag in tags:  # each mode starts from the same residency: the first teacher
                mem.evict(tag, "gpu")  # only, as the previous step's hint left it
            mem.lookahead = 1
            for f in mem.hint(order[:1]):
                f.result()
            mem.lookahead = lookahead
            results[name] = timed(lambda: mem.run(order, lambda t, ts: compute(t, ts, reps)), dev)
        out["compute_only_s"] = t_compute
        out["sync_s"], out["prefetch_s"] = results["sync"], results["prefetch"]
        out["exposed_sync_ms_per_switch"] = (results["sync"] - t_compute) / len(order) * 1e3
        out["exposed_prefetch_ms_per_switch"] = max(results["prefetch"] - t_compute, 0.0) / len(
            order) * 1e3
        out["exposed_switch_vs_sync"] = (out["exposed_prefetch_ms_per_switch"]
                                         / out["exposed_sync_ms_per_switch"])
        return mem.timeline
    finally:
        mem.close()


def calibrate(run, dev: torch.device, target_s: float) -> int:
    reps = 4
    while True:
        t = timed(lambda: run(reps), dev)
        if t >= target_s or reps > 1 << 16:
            return max(1, int(reps * target_s / t) + 1)
        reps *= 2


def timed(fn, dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--teacher-mib", type=int, default=3072, help="size of each teacher")
    p.add_argument("--teachers", type=int, default=4)
    p.add_argument("--slots", type=int, default=2, help="GPU slots (fewer than teachers)")
    p.add_argument("--rounds", type=int, default=4, help="passes over the teachers")
    p.add_argument("--dim", type=int, default=8192, help="matrix size of the compute loop")
    p.add_argument("--compute-over-transfer", type=float, default=1.5)
    p.add_argument("--peak-mib", type=int, default=4096)
    p.add_argument("--disk-mib", type=int, default=8192)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--out", default="bench-memory-out")
    args = p.parse_args()
    dev = torch.device(args.device)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    if "CUFILE_ENV_PATH_JSON" not in os.environ:  # without nvidia-fs cuFile needs compat mode
        conf = outdir / "cufile.json"
        conf.write_text('{"properties": {"allow_compat_mode": true}}')
        os.environ["CUFILE_ENV_PATH_JSON"] = str(conf.resolve())
    workdir = Path(os.environ.get("BENCH_MEMORY_DIR", outdir / "work"))
    out: dict = {}
    bandwidths(args, dev, out)
    restore_and_disk(args, dev, out, workdir)
    timeline = overlap(args, dev, out, workdir)
    timeline.to_json(outdir / "timeline.json")
    plot(timeline.events(), outdir / "timeline.png",
         f"{args.teachers} teachers x {args.teacher_mib} MiB, {args.slots} GPU slots")
    for k, v in out.items():
        print(f"{k:34} {v:.4g}" if isinstance(v, float) else f"{k:34} {v}")
    print(f"RESULT h2d_peak_gbps={out['h2d_peak_gbps']:.2f} "
          f"restore_vs_peak={out['restore_vs_peak']:.3f} nvme_vs_raw={out['nvme_vs_raw']:.3f} "
          f"exposed_switch_vs_sync={out['exposed_switch_vs_sync']:.3f}")


if __name__ == "__main__":
    main()
