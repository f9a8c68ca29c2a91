"""launch.plot: a synthetic metrics.jsonl with known series -> valid PNGs that drew exactly
those series; missing series are skipped with a note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from launch import plot
from launch.plot import Series

T0 = 1_700_000_000.0
STEPS = [1, 2, 3, 4]
TRAIN = {  # key -> value at each trainer step
    "train/ppo_kl": [0.01, 0.02, 0.015, 0.03],
    "train/policy_kl": [0.1, 0.2, 0.3, 0.4],
    "train/logprob_abs_diff": [1e-3, 2e-3, 1.5e-3, 1e-3],
    "train/engine_logprob_abs_diff": [1e-7, 2e-7, 3e-7, 4e-7],
    "mismatch/kl_k3": [1e-6, 0.0, 4e-6, 2e-6],
    "mismatch/token_outside_frac": [0.0, 0.125, 0.25, 0.0],
    "train/staleness_mean": [0.0, 0.5, 0.75, 1.0],
    "train/staleness_max": [0.0, 1.0, 1.0, 1.0],
    "train/tokens": [800.0, 900.0, 1000.0, 1200.0],
    "time/wait_batch_s": [0.5, 0.25, 0.125, 0.0],
    "time/train_s": [2.0, 2.5, 3.0, 3.5],
    "time/weight_sync_s": [0.25, 0.5, 0.75, 1.0],
    "time/step_s": [2.75, 3.25, 4.0, 4.5],
}
OPD = {  # a distillation run's trainer values at each step
    "opd/arith/reverse_kl": [0.5, 0.25, 0.125, 0.0625],
    "opd/arith/tokens": [10.0, 10.0, 10.0, 10.0],
    "opd/reverse/reverse_kl": [1.0, 0.5, 0.0, 0.25],
    "opd/reverse/tokens": [30.0, 30.0, 30.0, 30.0],
    "opd/reverse_kl": [0.875, 0.4375, 0.03125, 0.203125],
    "opd/teacher_gpu_loads": [2.0, 3.0, 4.0, 5.0],
    "opd/teacher_gds_loads": [0.0, 0.0, 1.0, 1.0],
    "opd/teacher_sync_fallbacks": [0.0, 0.0, 0.0, 1.0],
}
REWARD = {"math": [0.5, 0.625, 0.75], "reverse": [0.125, 0.25, 0.125]}  # rollout batches 0..2


def records() -> list[dict]:
    """What the launcher writes: trainer, rollout and two workers, interleaved in time."""
    out, seq = [], {"trainer": 0, "rollout": 0, "worker0": 0, "worker1": 0, "prefetcher": 0}

    def add(actor: str, values: dict, step: int | None, t: float) -> None:
        seq[actor] += 1
        out.append({"actor": actor, "seq": seq[actor], "time_s": T0 + t, "values": values,
                    "step": step, "total_steps": 4 if actor == "trainer" else None,
                    "dropped": 0})

    add("worker0", {"memory/device_bytes": 1 * 2**20, "memory/released": 0.0,
                    "memory/nvml_bytes": 5 * 2**20}, None, 0.0)  # NVML: a GPU
    add("worker1", {"memory/device_bytes": 2 * 2**20, "memory/released": 0.0}, None, 0.5)
    for b in range(3):
        add("rollout", {"rollout/tokens_per_s": 100.0 * (b + 1),
                        **{f"rollout/reward/{d}": v[b] for d, v in REWARD.items()}}, b, 1.0 + b)
    add("rollout", {"eval/math": 0.5, "eval/reverse": 0.125}, 0, 1.5)
    add("rollout", {"eval/math": 0.75, "eval/reverse": 0.25}, 2, 3.5)
    for i, step in enumerate(STEPS):
        add("trainer", {k: v[i] for k, v in (TRAIN | OPD).items()}, step, 2.0 + i)
        add("prefetcher", {"prefetch/bytes": 2**20 * (i + 1), "prefetch/gbps": 1.0}, None,
            2.5 + i)
        add("trainer", {"memory/generate/trainer_device_bytes": 4 * 2**20}, step, 2.25 + i)
    add("worker0", {"memory/device_bytes": 3 * 2**20, "memory/released": 0.0}, None, 6.0)
    add("trainer", {"final_eval/math": 0.875, "final_eval/reverse": 0.375}, 4, 7.0)
    return out


@pytest.fixture(scope="module", autouse=True)
def matplotlib_warmed_up(tmp_path_factory):
    """matplotlib keeps the font files it used open for the life of the process (a cache):
    draw every figure once before the per-test leak check (conftest.py) takes its snapshot."""
    plot.plot_run(write_run(tmp_path_factory.mktemp("warm-up"), records()))


def write_run(tmp_path: Path, recs: list[dict], extra: str = "") -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + extra)
    return run_dir


def assert_png(path: Path) -> None:
    """A PNG that decodes, 900 px wide (9 in at 100 dpi), with more than a blank canvas."""
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] == 900
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 50


def test_every_figure_draws_exactly_the_input_series(tmp_path):
    run_dir = write_run(tmp_path, records())
    result = plot.plot_run(run_dir)
    names = ["reward.png", "kl_mismatch.png", "throughput.png", "step_time.png", "memory.png",
             "opd.png"]
    assert sorted(result.written) == sorted(names)
    assert result.notes == []
    for name in names:
        assert result.written[name] == run_dir / "plots" / name
        assert_png(result.written[name])
    drawn = result.drawn
    assert drawn["reward.png"] == {
        "rollout reward per domain": {f"rollout/reward/{d}": Series([0, 1, 2], v)
                                      for d, v in REWARD.items()},
        "greedy eval accuracy per domain": {
            "eval/math": Series([0, 2], [0.5, 0.75]), "eval/reverse": Series([0, 2], [0.125, 0.25]),
            "final_eval/math": Series([4], [0.875]), "final_eval/reverse": Series([4], [0.375])},
    }
    assert drawn["kl_mismatch.png"] == {
        "KL (trainer)": {k: Series(STEPS, TRAIN[k]) for k in ("train/ppo_kl", "train/policy_kl")},
        "train-rollout mismatch": {
            k: Series(STEPS, TRAIN[k]) for k in ("mismatch/kl_k3", "train/logprob_abs_diff",
                                                 "train/engine_logprob_abs_diff")},
        "importance weights outside [low, high]": {
            "mismatch/token_outside_frac": Series(STEPS, TRAIN["mismatch/token_outside_frac"])},
        "staleness": {k: Series(STEPS, TRAIN[k])
                      for k in ("train/staleness_mean", "train/staleness_max")},
    }
    tokens_per_s = [t / s for t, s in zip(TRAIN["train/tokens"], TRAIN["time/step_s"])]
    assert drawn["throughput.png"] == {"throughput": {
        "rollout/tokens_per_s": Series([0, 1, 2], [100.0, 200.0, 300.0]),
        "trainer tokens/s (train/tokens / time/step_s)": Series(STEPS, tokens_per_s)}}
    assert drawn["step_time.png"] == {"step time": {
        k: Series(STEPS, TRAIN[k])
        for k in ("time/wait_batch_s", "time/train_s", "time/weight_sync_s", "time/step_s")}}
    # seconds since the run's first record, MiB
    assert drawn["memory.png"] == {"device memory per process": {
        "trainer: memory/generate/trainer_device_bytes": Series([2.25, 3.25, 4.25, 5.25],
                                                                [4.0] * 4),
        "worker0: memory/device_bytes": Series([0.0, 6.0], [1.0, 3.0]),
        "worker1: memory/device_bytes": Series([0.5], [2.0]),
        "worker0: memory/nvml_bytes": Series([0.0], [5.0]),
    }}
    assert drawn["opd.png"] == {
        "reverse KL to each teacher": {
            "opd/arith/reverse_kl": Series(STEPS, OPD["opd/arith/reverse_kl"]),
            "opd/reverse/reverse_kl": Series(STEPS, OPD["opd/reverse/reverse_kl"]),
            "opd/reverse_kl (all teachers)": Series(STEPS, OPD["opd/reverse_kl"])},
        "teacher swaps (running counts)": {k: Series(STEPS, OPD[k]) for k in (
            "opd/teacher_gpu_loads", "opd/teacher_gds_loads", "opd/teacher_sync_fallbacks")},
        "prefetcher: NVMe bytes read (x: its record number)": {
            "prefetch/bytes": Series([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])}}


def test_memory_is_drawn_only_with_a_gpu_or_an_nvme_tier_in_the_metrics(tmp_path):
    """CPU alone (no NVML reading, no NVMe read): memory.png is skipped with a note; an NVMe
    tier (the prefetcher read bytes) draws it again; the trainer's distillation KL, without
    any teacher pool, draws opd.png without the pool's panel."""
    cpu = [r for r in records() if r["actor"] != "prefetcher"]
    for r in cpu:
        r["values"].pop("memory/nvml_bytes", None)
    result = plot.plot_run(write_run(tmp_path / "cpu", cpu))
    assert "memory.png" not in result.written
    assert any(n.startswith("memory.png skipped: none of memory/*bytes with a GPU or NVMe "
                            "tier") for n in result.notes), result.notes
    assert list(result.drawn["opd.png"]) == ["reverse KL to each teacher",
                                             "teacher swaps (running counts)"]
    nvme = cpu + [{"actor": "prefetcher", "seq": 1, "time_s": T0 + 9, "step": None,
                   "values": {"prefetch/bytes": 4096.0}}]
    result = plot.plot_run(write_run(tmp_path / "nvme", nvme))
    assert "worker0: memory/device_bytes" in result.drawn["memory.png"][
        "device memory per process"]


def test_missing_series_are_skipped_with_a_note_not_an_error(tmp_path, capsys):
    only_rollout = [r for r in records() if r["actor"] == "rollout"]
    run_dir = write_run(tmp_path, only_rollout, extra='{"actor": "trainer", "seq": 9, "val\n')
    assert plot.main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["reward.png",
                                                                     "throughput.png"]
    assert "note: kl_mismatch.png skipped: none of train/*_kl, mismatch/*" in out
    assert "note: step_time.png skipped" in out and "note: memory.png skipped" in out
    assert "1 line(s) that are not metrics records were skipped" in out  # the torn last line
    assert f"wrote {tmp_path / 'out' / 'reward.png'}" in out
    result = plot.plot_run(run_dir, tmp_path / "out")
    assert result.drawn["throughput.png"] == {"throughput": {
        "rollout/tokens_per_s": Series([0, 1, 2], [100.0, 200.0, 300.0])}}
    # no eval records: the reward figure keeps its reward panel and says the other is empty
    no_eval = [r for r in only_rollout if not any(k.startswith("eval/") for k in r["values"])]
    result = plot.plot_run(write_run(tmp_path / "b", no_eval))
    assert list(result.drawn["reward.png"]) == ["rollout reward per domain"]
    assert "reward.png: no data for greedy eval accuracy per domain; drawn without" in \
        result.notes


def test_a_restarted_actor_redoing_steps_counts_its_last_record_per_step(tmp_path):
    recs = [{"actor": "trainer", "seq": i + 1, "time_s": T0 + i, "step": step,
             "values": {"train/ppo_kl": v}} for i, (step, v) in
            enumerate([(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)])]
    result = plot.plot_run(write_run(tmp_path, recs))
    assert result.drawn["kl_mismatch.png"]["KL (trainer)"] == {
        "train/ppo_kl": Series([1, 2, 3, 4], [0.1, 0.25, 0.35, 0.4])}


def test_a_key_from_two_actors_is_labelled_by_actor(tmp_path):
    recs = [{"actor": a, "seq": 1, "time_s": T0, "step": 0, "values": {"rollout/reward/m": v}}
            for a, v in (("rollout_b", 0.5), ("rollout_a", 0.25))]
    result = plot.plot_run(write_run(tmp_path, recs))
    assert result.drawn["reward.png"]["rollout reward per domain"] == {
        "rollout_a: rollout/reward/m": Series([0], [0.25]),
        "rollout_b: rollout/reward/m": Series([0], [0.5])}


def test_no_metrics_file_is_exit_code_1_naming_the_sink(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 1
    assert "metrics.jsonl: no such file (is `jsonl` among the run's [run] sinks?)" in \
        capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        plot.plot_run(tmp_path)
