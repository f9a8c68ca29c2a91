"""The fault benchmarks' own checkers (bench/faults.py, bench/chaos.py): on hand-made journals
they find a sample trained twice (also behind a compacted journal's snapshot) and samples the
books miss; on a short real run (a compacted journal, the launcher killed, the newest
checkpoint damaged, `--resume`) the run survives with nothing lost or duplicated."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

import logic.buffer
from actors.buffer import BufferState, Journal, JournalEntry
from bench import chaos, faults
from logic.buffer import BufferConfig
from runtime.facts import RunFacts
from transport.schema import Sample, SampleGroup

ROOT = Path(__file__).resolve().parent.parent
CONFIG = BufferConfig(max_staleness=1)
FACTS = RunFacts(group_size=2, groups_per_batch=1)


def group(gid: str) -> SampleGroup:
    return SampleGroup(samples=[Sample(group_id=gid, index=i, domain="math", prompt_ids=[1],
                                       response_ids=[2], loss_mask=[1], rollout_logprobs=[-0.1])
                                for i in range(2)])


def version(v: int) -> JournalEntry:
    return JournalEntry("version", version=v, step=v, epoch="t")


def write_run(run_dir: Path, entries: list[JournalEntry], compact_after: int = -1,
              generated: int = 0) -> None:
    """A run directory with the buffer's journal (a snapshot replacing the first
    `compact_after` entries) and the rollout's totals."""
    journal = Journal(run_dir / "buffer" / "buffer.journal")
    state = BufferState(logic.buffer.RolloutBuffer(CONFIG, FACTS))
    for n, entry in enumerate(entries):
        journal.append(entry)
        state.apply(entry)
        if n + 1 == compact_after:
            journal.compact(state.snapshot())
    journal.close()
    (run_dir / "rollout").mkdir()
    (run_dir / "rollout" / "rollout.totals.json").write_text(json.dumps(
        {"samples_generated": generated, "samples_resent": 0, "starts": 1}))


# g0 is generated twice (a restarted rollout): the second copy must be a dropped duplicate
ENTRIES = [version(0), JournalEntry("group", group=group("g0")),
           JournalEntry("batch", step=0, version=0), version(1),
           JournalEntry("group", group=group("g0")), JournalEntry("group", group=group("g1")),
           JournalEntry("batch", step=1, version=1)]


@pytest.mark.parametrize("compact_after", [-1, 4])
def test_the_replay_finds_a_sample_trained_twice(tmp_path, monkeypatch, compact_after):
    write_run(tmp_path, ENTRIES, compact_after, generated=6)
    state, journal = faults.replay_journal(tmp_path, CONFIG, FACTS)
    assert (journal.snapshot_size > 0) == (compact_after > 0)
    assert faults.duplicated_samples(state) == 0
    assert state.logic.counters["dropped_duplicate"] == 2
    books = faults.reconcile(tmp_path, state)
    assert (books["trained"], books["in_flight"], books["unreconciled"]) == (4, 0, 0)
    # a buffer that forgets which groups it completed trains g0 twice: the checker says so,
    # from the full journal and from behind the snapshot (its remembered batches) alike
    monkeypatch.setattr(logic.buffer.RolloutBuffer, "_close", lambda self, gid, reason: None)
    (tmp_path / "broken").mkdir()
    write_run(tmp_path / "broken", ENTRIES, compact_after, generated=6)
    state, _ = faults.replay_journal(tmp_path / "broken", CONFIG, FACTS)
    assert faults.duplicated_samples(state) == 2


def test_reconcile_counts_samples_the_books_cannot_explain(tmp_path):
    write_run(tmp_path, ENTRIES, generated=2)  # the books took 6: 4 came from nowhere
    state, _ = faults.replay_journal(tmp_path, CONFIG, FACTS)
    assert faults.reconcile(tmp_path, state)["unreconciled"] == 4


def test_eval_gap_is_the_largest_domain_difference():
    assert chaos.eval_gap({"math": 0.8, "reverse": 0.2}, {"math": 0.75, "reverse": 0.3}) == \
        pytest.approx(0.1)
    assert chaos.eval_gap({"math": 0.8}, {}) == pytest.approx(0.8)  # a domain gone is all lost


@pytest.mark.timeout(400)
def test_a_damaged_checkpoint_behind_a_compacted_journal_loses_nothing(tmp_path):
    """bench.faults' corrupt_checkpoint fault on a short run: the launcher killed at step 5,
    the newest checkpoint (step 4) truncated; --resume reports it, falls back to step 2 and
    finishes (the deadlock of a rollout that counted a phantom permit ended it here before)."""
    faults.hosts_file(tmp_path, steps=8, save_every=2, compact_bytes=4096)
    out = faults.run_fault("corrupt_checkpoint", tmp_path, 8, 2, random.Random(0))
    assert out["survived"], out.get("tail")
    assert out["at_step"] == 5 and out["journal_compacted"]
    assert (out["lost"], out["duplicated"], out["orphans"], out["unreconciled"]) == (0, 0, 0, 0)
    config = msgspec.convert(json.loads((tmp_path / "run" / "config.json").read_text())
                             ["actors"]["buffer"]["config"], BufferConfig)
    assert config.journal_compact_bytes == 4096


def test_opd_memory_reports_each_modes_peak_over_one_micro_batch_of_logits():
    from bench.opd_memory import logits_bytes, result_line

    unit = logits_bytes(2, 48, 1000)  # 2 x (16 + 48) x 1000 bf16 logits
    assert unit == 256_000
    line = result_line({"sampled": 64_000, "top_p_student": 128_000, "full": 64_000}, unit)
    assert line == ("RESULT sampled_peak_over_logits=0.250 topp_student_peak_over_logits=0.500 "
                    "full_peak_over_logits=0.250 topp_student_peak_over_sampled=2.000 "
                    "full_peak_over_sampled=1.000")


def test_train_mfu_counts_useful_flops_and_runs_on_the_cpu(tmp_path):
    from bench.train_mfu import lengths_for, useful_flops

    # 8 N T + four passes of causal attention: 2 s^2 d per layer and sample
    assert useful_flops(1000, [10, 20], hidden=4, layers=3) == \
        8 * 1000 * 30 + 4 * (2 * 100 * 4 * 3 + 2 * 400 * 4 * 3)
    lengths = lengths_for(5000, 4096)
    assert 5000 <= sum(lengths) < 5000 + 4096 and min(lengths) >= 2 and max(lengths) <= 4096
    out = subprocess.run([sys.executable, "-m", "bench.train_mfu", "--device", "cpu", "--shape",
                          "tiny,tiny-moe", "--tokens", "512", "--mb-tokens", "256", "--steps",
                          "1", "--replay", "--pack", "--backend", "torch,megatron",
                          "--profile", "--trace", str(tmp_path / "traces"), "--host-profile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    # --profile: one more step per dense run under the profiler, its operators, and a trace
    profiles = [line for line in out.stdout.splitlines() if line.startswith("profile tiny ")]
    assert [line.split(":")[0] for line in profiles] == [
        f"profile tiny {b} {layout}" for b in ("torch", "megatron")
        for layout in ("padded", "packed")]
    assert "aten::" in out.stdout.split(profiles[0])[1].split("profile tiny")[0]
    # --host-profile: one more step per dense run under cProfile, the step's own functions
    hosts = [line for line in out.stdout.splitlines() if line.startswith("host profile tiny ")]
    assert [line.split(":")[0] for line in hosts] == [
        f"host profile tiny {b} {layout}" for b in ("torch", "megatron")
        for layout in ("padded", "packed")]
    megatron = out.stdout.split(hosts[2])[1].split("host profile")[0]
    assert "training/step.py:" in megatron and "megatron/core/" in megatron
    for head in ("profile", "host profile"):  # with and without replay
        assert sum(line.startswith(f"{head} tiny-moe MoE padded")
                   for line in out.stdout.splitlines()) == 2, head
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "tiny-megatron-packed.json", "tiny-megatron-padded.json",
        "tiny-moe-torch-padded-replay.json", "tiny-moe-torch-padded.json",
        "tiny-torch-packed.json", "tiny-torch-padded.json"]
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert last.startswith("RESULT ")
    for key in ("mfu_torch", "mfu_megatron", "mfu_torch_packed", "mfu_megatron_padded"):
        assert 0 < float(fields[key]) < 1, key
    assert float(fields["mfu_best"]) == max(float(fields["mfu_torch"]),
                                            float(fields["mfu_megatron"]))
    assert float(fields["packed_vs_padded"]) == pytest.approx(
        float(fields["step_torch_padded_s"]) / float(fields["step_torch_packed_s"]), rel=1e-2)
    # long-tailed lengths: the padded rows compute padding, one packed row per micro-batch none
    for backend in ("torch", "megatron"):
        assert float(fields[f"padding_{backend}_padded"]) > 0.05
        assert float(fields[f"padding_{backend}_packed"]) == 0.0
    assert 0 < float(fields["mfu_moe"]) < 1 and float(fields["replay_overhead"]) > 0


def test_host_profile_names_the_functions_the_host_spent_its_time_in():
    from bench.step_profile import host_profiled

    def busy(n: int) -> int:
        return sum(i * i for i in range(n))

    def step() -> None:
        for _ in range(3):
            busy(200_000)

    got = host_profiled(step, "cpu", top=20)  # every function this step calls
    assert got.wall_ms >= got.host_ms > 0
    own = {name.split("(")[-1].rstrip(")"): (ms, calls) for name, ms, calls in got.by_self}
    assert own["<genexpr>"][1] == 3 * 200_001 and own["<genexpr>"][0] > 0
    assert any(name.startswith("tests/test_bench_checkers.py:") and name.endswith("(busy)")
               for name, _, _ in got.by_self)
    line = got.lines("tiny torch packed")
    assert line[0].startswith("host profile tiny torch packed: the host's ")


def test_step_profile_sums_kernels_by_kind_and_the_host_gap():
    from bench.step_profile import kind_of, summarise

    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128": "matmul",
             "nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNN": "matmul",
             "triton_tem_fused_flex_attention_0": "attention fwd",
             "triton_tem_fused_flex_attention_backward_1": "attention bwd",
             "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": "attention bwd",
             "triton_poi_fused_add_mul_silu_3": "compiled pointwise",
             "triton_red_fused__to_copy_mean_pow_2": "compiled pointwise",
             "triton_tem_fused_addmm_5": "matmul",
             "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
             "Memcpy DtoD (Device -> Device)": "copies",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>":
                 "eager other"}
    assert {n: kind_of(n) for n in names} == names
    prof = summarise([("gemm_a", 3.0), ("triton_poi_fused_1", 1.5), ("gemm_a", 2.0),
                      ("ncclKernel", 0.5)], wall_ms=10.0, top=2)
    assert prof.kernel_ms == 7.0 and prof.host_gap_ms == 3.0
    assert prof.kinds == {"matmul": 5.0, "compiled pointwise": 1.5, "communication": 0.5}
    assert prof.top == [("gemm_a", 5.0, 2), ("triton_poi_fused_1", 1.5, 1)]
    head = prof.lines("3b torch packed")[0]
    assert head.startswith("profile 3b torch packed: step 10 ms, device kernels 7 ms, "
                           "host gap 3 ms; matmul 5, compiled pointwise 2, communication 0")


def test_step_profile_splits_the_devices_idle_time_by_phase_and_host_operator():
    from bench.step_profile import StepProfile, idle_split

    # kernels busy 0-2, 5-6 and 8-10 (one overlapping 1-1.5) of a 0-12 window: idle 2-5, 6-8,
    # 10-12; the loss range nested in the forward takes its own idle moment
    kernels = [(0, 2), (1, 1.5), (5, 6), (8, 10)]
    phases = [("rlx.forward", 0, 6), ("rlx.backward", 6, 11), ("rlx.loss", 4, 5)]
    leaves = [("aten::item", 2, 3), ("aten::add", 6, 7), ("aten::add", 10.5, 11)]
    by_phase, by_op = idle_split(kernels, (0, 12), phases, leaves)
    assert by_phase == {"rlx.backward": 3.0, "rlx.forward": 2.0, "rlx.loss": 1.0, "other": 1.0}
    assert by_op == [("(python)", 4.5), ("aten::add", 1.5), ("aten::item", 1.0)]
    prof = StepProfile(wall_ms=12.0, kernel_ms=5.5, idle_phases=by_phase, idle_ops=by_op)
    assert prof.lines("x")[1] == ("  device idle by phase: rlx.backward 3, rlx.forward 2, "
                                  "rlx.loss 1, other 1")
    assert prof.lines("x")[2].startswith("  device idle while the host ran: (python) 4.5, ")


def test_step_profile_reads_phases_and_leaf_operators_from_the_profilers_events():
    """`idle_of` on profiler-shaped events (times in us): `rlx.*` ranges are the phases; an
    operator whose only children are CUDA runtime calls is a leaf (its launch counts as its own
    time), one with an operator below it is not, and runtime calls are never named."""
    from types import SimpleNamespace

    from bench.step_profile import idle_of

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, start, end, device=cpu, children=()):
        return SimpleNamespace(name=name, device_type=device, cpu_children=list(children),
                               time_range=SimpleNamespace(start=start * 1e3, end=end * 1e3))

    launch = event("cudaLaunchKernel", 2.5, 3)
    mm = event("aten::mm", 2, 3, children=[launch])
    linear = event("aten::linear", 1.5, 3.5, children=[mm])
    kernels = [event("gemm", 0, 1, cuda), event("gemm", 3, 6, cuda)]
    events = [event("rlx.forward", 0, 4), linear, mm, launch,
              event("aten::item", 6, 7), event("rlx.optimizer", 6, 8), *kernels]
    phases, ops = idle_of(events, kernels)
    # idle 1-3 and 6-8 ms: the forward's, the optimizer's
    assert phases == {"rlx.forward": 2.0, "rlx.optimizer": 2.0}
    # leaves: aten::mm over 2-3, aten::item over 6-7; no operator ran 1-2 and 7-8
    assert ops == [("(python)", 2.0), ("aten::mm", 1.0), ("aten::item", 1.0)]


def test_step_profile_counts_the_hosts_waits_for_the_device_by_phase_and_operator():
    """`host_waits`: every cudaStreamSynchronize / cudaDeviceSynchronize /
    cudaEventSynchronize, by the innermost `rlx.*` range it falls in (else "other") and by the
    operator around it; launches and copies are not waits. The profile's lines say them."""
    from types import SimpleNamespace

    from bench.step_profile import StepProfile, host_waits

    cpu = torch.autograd.DeviceType.CPU

    def event(name, start, end, parent=None):
        return SimpleNamespace(name=name, device_type=cpu, cpu_parent=parent,
                               time_range=SimpleNamespace(start=start, end=end))

    item = event("aten::_local_scalar_dense", 2, 3)
    nonzero = event("aten::nonzero", 12, 13)
    events = [event("rlx.recompute", 0, 10), event("rlx.loss", 1, 4), item,
              event("cudaMemcpyAsync", 2.1, 2.2, item), event("cudaStreamSynchronize", 2.3, 2.9,
                                                              item),
              event("rlx.forward", 10, 20), nonzero, event("cudaStreamSynchronize", 12, 13,
                                                             nonzero),
              event("cudaStreamSynchronize", 14, 15, nonzero),
              event("cudaLaunchKernel", 16, 17), event("cudaDeviceSynchronize", 30, 31)]
    waits, ops = host_waits(events)
    assert waits == {"rlx.forward": 2, "rlx.loss": 1, "other": 1}
    assert ops == [("aten::nonzero", 2), ("aten::_local_scalar_dense", 1), ("(python)", 1)]
    prof = StepProfile(wall_ms=9.0, kernel_ms=5.0, waits=waits, wait_ops=ops)
    assert prof.lines("x")[1] == ("  host waits for the device: 4 (rlx.forward 2, rlx.loss 1, "
                                  "other 1; aten::nonzero 2, aten::_local_scalar_dense 1, "
                                  "(python) 1)")
    assert StepProfile(wall_ms=9.0, kernel_ms=5.0).lines("x")[1] == \
        "  host waits for the device: 0"


def test_train_mfu_counts_a_moe_models_active_parameters():
    from bench.train_mfu import active_params, hf_model

    model = hf_model("tiny-moe", "cpu", torch.float32)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * 4 * 3 * 64 * 64  # 2 layers x 4 experts x (gate, up, down) x 64 x 64
    assert active_params(model) == total - experts // 2  # top-2 of 4


@pytest.mark.timeout(300)  # three child processes (two trainers, one push against a worker)
def test_lora_bench_measures_both_trainers_and_both_pushes_on_the_cpu():
    from bench.lora import check_result

    with pytest.raises(ValueError, match="lacks"):
        check_result("RESULT lora_mem_vs_full=0.3")
    out = subprocess.run([sys.executable, "-m", "bench.lora", "--device", "cpu", "--shape",
                          "tiny", "--rank", "4", "--tokens", "128", "--mb-tokens", "128",
                          "--steps", "1", "--pushes", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    values = check_result(out.stdout.strip().splitlines()[-1])
    # tiny shape, rank 4, all seven linear layers: 4 x (in + out) per layer vs in x out
    assert 0.05 < values["lora_push_bytes_vs_full"] < 0.5
    assert values["lora_logprob_diff"] < 1e-5  # the worker serves exactly the pushed adapter
    assert values["lora_push_s"] > 0 and values["full_push_s"] > 0
    assert 0 < values["lora_mem_vs_full"] < 2 and values["lora_step_vs_full"] > 0
