"""Teachers beyond the host budget: streamed from their checkpoints to NVMe at load, with the
checkpoint as their source (training/teacher_weights.py, memory/sources.py, NvmeStore.write_stream).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from logic.teachers import TeacherSpec
from memory.config import TeacherMemoryConfig
from memory.layout import PAGE_BYTES, FlatLayout, bind, pack
from memory.manager import WeightMemory
from memory.nvme import NvmeStore
from memory.sources import source_pieces
from models.load import load_model, quiet_progress
from models.tokenizer import char_vocab
from training.batching import make_micro_batch
from training.colocated_teachers import ColocatedTeachers
from training.teacher_weights import host_placement, load_teachers
from transport.schema import Sample

NAMES = ("a", "b", "c")
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three teachers of one Qwen2 shape (~13 MiB each in float32), the char vocabulary; `b`
    is stored in bfloat16 (read with a cast to float32, as from_pretrained does)."""
    root = tmp_path_factory.mktemp("teachers")
    cfg = Qwen2Config(vocab_size=len(char_vocab()), hidden_size=384, intermediate_size=1024,
                      num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True)
    paths = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i)
        model = Qwen2ForCausalLM(cfg)
        paths[name] = root / name
        with quiet_progress():
            model.to(torch.bfloat16 if name == "b" else torch.float32).save_pretrained(
                paths[name])
    return paths


def specs(paths) -> list[TeacherSpec]:
    return [TeacherSpec(name=n, model=str(p)) for n, p in paths.items()]


def micro_batches():
    """Three micro-batches of two samples, one teacher each (as teacher-ordered packing does),
    then one of all three."""
    _, tok = load_model("examples/base-tiny", "cpu", torch.float32)
    out = []
    for i in range(9):
        prompt = tok.encode(f"{i}+{i}=", add_special_tokens=False)
        resp = tok.encode(str(2 * i) + "abc"[:i % 3], add_special_tokens=False)
        out.append(Sample(group_id=f"g{i}", index=0, domain="d", prompt_ids=prompt,
                          response_ids=resp, loss_mask=[1] * len(resp),
                          rollout_logprobs=[-1.0] * len(resp), teacher=NAMES[min(i // 2, 2)
                                                                             if i < 6 else i - 6]))
    return [make_micro_batch(out[i:i + 2], 0) for i in (0, 2, 4)] + [make_micro_batch(out[6:], 0)]


def load(paths, tmp_path, budget: int, sub: str, slots: int = 1) -> ColocatedTeachers:
    memory, skeletons = load_teachers(specs(paths), "cpu", torch.float32, TeacherMemoryConfig(
        gpu_slots=slots, host_budget_bytes=budget, nvme_dir=str(tmp_path / sub)),
        str(tmp_path), chunk_bytes=CHUNK)
    return ColocatedTeachers(memory, skeletons, specs(paths))


def peak_rss_growth(fn):
    """(VmHWM - VmRSS before fn: the growth of the resident set's peak during fn, bytes,
    arena pages included; fn's result). The kernel resets the peak on writing 5 to clear_refs."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    before = status("VmRSS:")
    result = fn()
    return status("VmHWM:") - before, result


def test_teachers_beyond_the_budget_stream_to_nvme_and_compute_the_same(checkpoints, tmp_path,
                                                                        caplog):
    mbs = micro_batches()
    roomy = load(checkpoints, tmp_path, 0, "roomy")  # everything on the host (and imports warm)
    size = roomy.memory.sets["teacher:a"].layout.total_bytes
    try:
        assert roomy.memory.residency()["host"] == [f"teacher:{n}" for n in NAMES]
        for name in NAMES:  # bytes equal to the HF loader's (b: bfloat16 cast to float32)
            ref = load_model(str(checkpoints[name]), "cpu", torch.float32)[0].state_dict()
            assert all(torch.equal(t, ref[k])
                       for k, t in roomy.memory.host_tensors(f"teacher:{name}").items())
        want = roomy.outputs(mbs, 1.0, True)

        # a budget of two teachers: `a` stays, the second region stages the others
        growth, tight = peak_rss_growth(lambda: load(checkpoints, tmp_path, 2 * size, "tight"))
        mem = tight.memory
        # the peak grew by a's region, the streaming buffers (three chunks) and at most 4 MiB of
        # the interpreter's own (measured: 1.6 MiB beyond a's region in all); loading every
        # teacher to the CPU first, as before, grows it by 3 teachers (54 MiB) at least
        assert growth <= size + 3 * CHUNK + (4 << 20), (growth, size)
        assert mem.residency() == {"gpu": [], "host": ["teacher:a"],
                                   "nvme": ["teacher:b", "teacher:c"]}
        assert {t: ws.source for t, ws in mem.sets.items()} == {
            f"teacher:{n}": str(p) for n, p in checkpoints.items()}
        assert mem.store.manifest("teacher:c").source == str(checkpoints["c"])

        with open(mem.store.data_path("teacher:c"), "r+b") as f:  # one bad byte, chunk 2
            f.seek(CHUNK + 123)
            byte = f.read(1)
            f.seek(CHUNK + 123)
            f.write(bytes([byte[0] ^ 0x5A]))
        with caplog.at_level(logging.WARNING, logger="memory.manager"):
            for _ in range(2):  # two steps: every teacher through the one slot twice
                got = tight.outputs(mbs, 1.0, True)
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k])
                                                         for k in want)
        assert mem.counters["checksum_reloads"] == 1
        assert f"offset {CHUNK} ({CHUNK} bytes) fails its checksum; reloading 'teacher:c' " \
               f"from its source {checkpoints['c']}" in caplog.text
        mem.store.read_into("teacher:c", torch.empty(size, dtype=torch.uint8))  # rewritten
        assert mem.store.has("teacher:a")  # spilled once when it left the host
        tight.close()
    finally:
        roomy.close()


def test_a_bad_chunk_whose_checkpoint_is_gone_names_both(checkpoints, tmp_path):
    paths = dict(checkpoints)
    paths["c"] = tmp_path / "c-copy"
    shutil.copytree(checkpoints["c"], paths["c"])
    size = FlatLayout.from_checkpoint(paths["a"]).total_bytes
    teachers = load(paths, tmp_path, size, "nvme")  # nothing stays on the host
    try:
        with open(teachers.memory.store.data_path("teacher:c"), "r+b") as f:
            f.write(b"\xff" * 16)
        shutil.rmtree(paths["c"])
        want = (f"weight set 'teacher:c': an NVMe chunk failed its checksum and its source "
                f"{paths['c']} cannot be read")
        with pytest.raises(ValueError, match=want):
            teachers.memory.prefetch("teacher:c", "host").result()
    finally:
        teachers.close()


def test_missing_or_unreadable_checkpoints_name_the_teacher_and_the_path(checkpoints, tmp_path):
    gone = tmp_path / "gone"
    with pytest.raises(ValueError, match=f"teacher 'x': cannot load its checkpoint {gone}"):
        load_teachers([TeacherSpec(name="x", model=str(gone))], "cpu", torch.float32,
                      TeacherMemoryConfig(), str(tmp_path))
    cut = tmp_path / "cut"
    shutil.copytree(checkpoints["a"], cut)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    with pytest.raises(ValueError, match=f"teacher 'y': cannot load its checkpoint {cut}: "
                                         f".*model.safetensors: .* in a file of"):
        load_teachers([TeacherSpec(name="y", model=str(cut))], "cpu", torch.float32,
                      TeacherMemoryConfig(), str(tmp_path))


def test_a_checkpoint_with_other_names_is_loaded_whole_with_a_warning(checkpoints, tmp_path,
                                                                       caplog):
    """Names transformers would convert on load (here: one renamed) cannot be streamed."""
    other = tmp_path / "other"
    shutil.copytree(checkpoints["a"], other)
    sd = load_file(other / "model.safetensors")
    sd["model.norm.gain"] = sd.pop("model.norm.weight")
    save_file(sd, str(other / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="training.teacher_weights"):
        memory, _ = load_teachers([TeacherSpec(name="z", model=str(other))], "cpu",
                                  torch.float32, TeacherMemoryConfig(nvme_dir=str(tmp_path / "n")),
                                  str(tmp_path))
    try:
        assert "has no tensor named ['model.norm.weight'] as the model does; loading it whole" \
            in caplog.text
        assert memory.sets["teacher:z"].source == "" and memory.residency()["host"] == [
            "teacher:z"]
    finally:
        memory.close()


def test_the_gds_setting_reaches_the_teachers_nvme_reads(checkpoints, tmp_path, monkeypatch,
                                                          caplog):
    """`teacher_memory.gds`: "auto" would open cuFile for a CUDA device; for this CPU device
    neither setting tries it, and the teachers on NVMe are read through host memory."""
    from memory.gds import GdsReader

    def never(threads):
        raise AssertionError("cuFile opened for a CPU device")

    monkeypatch.setattr(GdsReader, "open", never)
    caplog.set_level(logging.INFO, logger="memory.manager")
    assert TeacherMemoryConfig().gds == "auto"
    size = max(FlatLayout.from_checkpoint(p).total_bytes for p in checkpoints.values())
    for mode, why in (("auto", "gds = auto, the device is cpu, not CUDA"), ("off", "gds = off")):
        memory, _ = load_teachers(specs(checkpoints), "cpu", torch.float32, TeacherMemoryConfig(
            host_budget_bytes=size, nvme_dir=str(tmp_path / mode), gds=mode), str(tmp_path),
            chunk_bytes=CHUNK)
        try:
            assert (memory.nvme_reader, memory.nvme_reader_why) == ("host", why)
            assert f"reads through pinned host memory ({why})" in caplog.text
            assert memory.residency()["host"] == []  # room for staging only: all on NVMe
            memory.prefetch("teacher:a", "gpu").result()
            assert memory.counters["gpu_loads"] == 1 and memory.counters["gds_loads"] == 0
        finally:
            memory.close()


def test_the_buffer_hint_is_ordered_as_the_next_step_runs(checkpoints, tmp_path):
    """3 teachers, 2 slots, one micro-batch per teacher: a step leaves its last two teachers in
    the slots and the next starts with them, so one load per step is the minimum. The buffer's
    hint lists the teachers by first appearance; ordered as the next step runs them, the plan
    loads no teacher that step will not need first (unordered: 2 loads per step)."""
    teachers = load(checkpoints, tmp_path, 0, "hint", slots=2)
    mbs = micro_batches()[:3]
    try:
        loads = []
        for _ in range(4):
            before = teachers.memory.counters["gpu_loads"]
            teachers.outputs(mbs, 1.0, False, next_teachers=list(NAMES))
            for ws in teachers.memory.sets.values():  # a prefetch may still be copying
                if ws.copy_future is not None:
                    ws.copy_future.result()
            loads.append(teachers.memory.counters["gpu_loads"] - before)
        assert loads == [3, 1, 1, 1]
    finally:
        teachers.close()


def test_host_placement_keeps_room_to_stage_the_largest():
    sizes = {"a": 4, "b": 3, "c": 4, "d": 1}
    assert host_placement(sizes, 12) == ["a", "b", "c", "d"]
    assert host_placement(sizes, 11) == ["a", "b"]  # 11 - 4 = 7 for the kept ones
    assert host_placement(sizes, 8) == ["a"]
    assert host_placement(sizes, 5) == ["d"]


def test_streamed_write_equals_the_buffer_write_in_pieces_of_any_size(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"emb.weight": torch.randn(300, 16, generator=g),
          "layer.w": torch.randn(40, 16, generator=g).to(torch.bfloat16),
          "step": torch.tensor(7, dtype=torch.int64), "mask": torch.rand(9, generator=g) > 0.5}
    save_file(sd, str(tmp_path / "t.safetensors"))
    lay = FlatLayout.from_checkpoint(tmp_path / "t.safetensors")
    buf = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    pack(sd, buf, lay)
    store = NvmeStore(tmp_path / "nvme", chunk_bytes=PAGE_BYTES)
    store.write("ref", buf, lay, "src")
    for piece_bytes in (16, 1000, PAGE_BYTES, 1 << 20):
        pieces = list((off, p.clone()) for off, p in
                      source_pieces(str(tmp_path / "t.safetensors"), lay, piece_bytes))
        assert max(p.numel() for _, p in pieces) <= piece_bytes
        store.write_stream("s", lay, iter(pieces), "src")
        assert store.manifest("s") == store.manifest("ref")
        assert store.data_path("s").read_bytes() == store.data_path("ref").read_bytes()
    # a float32 layout of the bfloat16 tensor: cast piece by piece
    wide = FlatLayout.from_shapes((s.name, "float32" if s.name == "layer.w" else s.dtype,
                                   s.shape) for s in lay.specs)
    mem = WeightMemory(gpu_slots=1, slot_bytes=wide.total_bytes,
                       host_budget_bytes=wide.total_bytes, nvme_dir=str(tmp_path / "m"),
                       chunk_bytes=PAGE_BYTES)
    try:
        mem.load_source("w", wide, str(tmp_path / "t.safetensors"), "nvme")
        assert mem.residency()["host"] == [] and mem.store.has("w")
        mem.prefetch("w", "host").result()
        got = mem.host_tensors("w")
        assert torch.equal(got["layer.w"], sd["layer.w"].float())
        assert torch.equal(got["emb.weight"], sd["emb.weight"]) and int(got["step"]) == 7
        with pytest.raises(ValueError, match="is already registered"):
            mem.load_source("w", wide, str(tmp_path / "t.safetensors"), "host")
        with pytest.raises(ValueError, match="has no tensor 'nope'"):
            mem.load_source("x", FlatLayout.from_shapes([("nope", "float32", (2,))]),
                            str(tmp_path / "t.safetensors"), "nvme")
        assert "x" not in mem.sets and not mem.store.has("x")  # nothing left registered
    finally:
        mem.close()
    assert bind(buf, lay)["step"].item() == 7
