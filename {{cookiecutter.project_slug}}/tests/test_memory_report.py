"""The memory report (a part): every rank's memory each epoch, the imbalance warning, the
GPU processes section, figures that stay flat over the epochs, and the line that ends a
run out of host memory."""

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import FAST, clean_env, machinery_project, read_metrics, run_script
from engine.logs import report_errors
from engine.parts.memory import (
    SKIPPED,
    GpuUsage,
    extra_process_warnings,
    gpu_section_choice,
    gpu_table,
    imbalance_warning,
    memory_table,
    nvml_lines,
    read_gpus,
    report_gpu_processes,
    report_memory,
)

IMBALANCED = """
import torch, torch.distributed as dist
from engine.config import DistConfig
from engine.distributed import init_distributed_mode
from engine.parts.memory import report_gpu_processes, report_memory

env, device = init_distributed_mode(DistConfig())
report_gpu_processes(device, "start")  # as train.py does
if env.rank == 1:
    hoard = torch.ones(400 * 2**20 // 4)  # 400 MiB, touched, held only by rank 1
report_memory(device, "test")
report_memory(device, "again")
dist.destroy_process_group()
"""


def test_imbalance_warning_names_the_heavy_rank(tmp_path):
    script = tmp_path / "imbalanced.py"
    script.write_text(IMBALANCED)
    result = run_script(str(script), [], nproc=3, env={"PYTHONPATH": str(machinery_project())})
    assert result.stdout.count("memory per rank, MiB (test)") == 1
    assert "warning: rank 1 holds" in result.stdout and "x the median" in result.stdout
    assert result.stdout.count(SKIPPED["no gpu"]) == 1  # rank 0's, once: at the start, not at each report


def test_the_table_of_many_ranks_shows_rank_0_and_those_holding_the_most():
    per_rank = [{"rss_peak_mib": 800.0 + rank, "live_tensors": 10} for rank in range(40)]
    per_rank[13]["rss_peak_mib"] = 3000.0
    lines = memory_table(per_rank, most_rows=4).splitlines()
    assert [int(line.split()[0]) for line in lines[1:5]] == [0, 13, 38, 39]
    assert lines[5] == "(36 more ranks hold less rss_peak_mib: see metrics.jsonl)" and len(lines) == 6
    assert len(memory_table(per_rank[:4], most_rows=4).splitlines()) == 5  # few ranks: every one


def test_no_warning_when_balanced():
    rows = [{"rss_peak_mib": 800.0}, {"rss_peak_mib": 820.0}, {"rss_peak_mib": 790.0}]
    assert imbalance_warning(rows) is None
    assert "rank 2" in imbalance_warning([*rows[:2], {"rss_peak_mib": 1100.0}])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_report_has_the_cuda_peaks_of_its_own_period():
    device = torch.device("cuda", torch.cuda.current_device())
    spike = torch.ones(256 * 2**20, dtype=torch.uint8, device=device)  # 256 MiB, then freed
    del spike
    first = report_memory(device, "test")[0]["cuda_allocated_peak_mib"]
    second = report_memory(device, "test")[0]["cuda_allocated_peak_mib"]
    assert first >= 256 and second < first - 200, (first, second)


MiB = 2**20


def gpu(cuda_index: int, nvml_index: int, *processes: tuple[int, int | None]) -> GpuUsage:
    """A GPU of 80 GiB as NVML would report it, holding `processes` (pid, bytes)."""
    used = sum(size or 0 for _, size in processes)
    return GpuUsage(cuda_index, nvml_index, used, 80 * 1024 * MiB, list(processes))


def test_a_gpu_with_an_extra_process_is_one_warning_naming_it_and_the_pids():
    # Rank 1 (pid 4102) also holds memory on rank 0's GPU, e.g. from a load without map_location.
    gpus = [
        gpu(0, 2, (4101, 9000 * MiB), (4102, 600 * MiB)),
        gpu(1, 3, (4102, 9000 * MiB)),
        gpu(2, 0, (77, None), (78, None)),  # sizes the driver does not tell
    ]
    warnings = extra_process_warnings("node7", gpus)
    assert len(warnings) == 2 and all("\n" not in line for line in warnings)
    assert warnings[0].startswith("warning: node7: cuda:0 (nvidia-smi GPU 2) holds 2 processes, expected 1 at most")
    assert "pid 4101 9000 MiB, pid 4102 600 MiB" in warnings[0] and "map_location" in warnings[0]
    assert "cuda:2 (nvidia-smi GPU 0)" in warnings[1] and "pid 77 ? MiB, pid 78 ? MiB" in warnings[1]


def test_one_process_per_gpu_is_no_warning_and_a_row_per_gpu():
    gpus = [gpu(0, 0, (4101, 9000 * MiB)), gpu(1, 1, (4102, 8000 * MiB)), gpu(2, 2)]  # cuda:2 unused
    assert extra_process_warnings("node7", gpus) == []
    assert gpu_table("node7", "epoch 3", gpus).splitlines() == [
        "GPU memory by process on node7, MiB (epoch 3):",
        "  cuda:0 (nvidia-smi GPU 0): 9000 of 81920 in use; pid 4101 9000",
        "  cuda:1 (nvidia-smi GPU 1): 8000 of 81920 in use; pid 4102 8000",
        "  cuda:2 (nvidia-smi GPU 2): 0 of 81920 in use; no process",
    ]


@pytest.mark.parametrize(
    "device_type, has_nvml, rank, local_rank, choice",
    [
        ("cpu", False, 0, 0, "no gpu"),
        ("cpu", True, 0, 0, "no gpu"),
        ("cpu", True, 4, 0, "nothing"),  # the skipped line is rank 0's alone
        ("cuda", False, 0, 0, "no nvml"),
        ("cuda", False, 8, 0, "nothing"),
        ("cuda", True, 0, 0, "read"),
        ("cuda", True, 8, 0, "read"),  # every node's local rank 0 reads its own node
        ("cuda", True, 3, 3, "nothing"),
        ("cuda", True, 9, 1, "nothing"),
    ],
)
def test_which_ranks_read_nvml(device_type, has_nvml, rank, local_rank, choice):
    assert gpu_section_choice(device_type, has_nvml, rank, local_rank) == choice


def test_on_cpu_the_gpu_section_is_one_skipped_line(capsys):
    report_gpu_processes(torch.device("cpu"), "test")
    assert capsys.readouterr().out == "GPU memory by process: skipped (no GPU)\n"


def test_on_cuda_without_nvidia_ml_py_the_gpu_section_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if not installed, whether it is or not
    report_gpu_processes(torch.device("cuda", 0), "test")  # only its type is used before NVML
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("GPU memory by process: skipped")
    assert "pip install nvidia-ml-py" in out and 'pip install -e ".[gpu]"' in out


def test_without_the_nvml_library_the_gpu_section_is_one_skipped_line():
    pynvml = pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    assert nvml_lines("node7", "test", main=True) == [
        "GPU memory by process: skipped on node7, NVML failed: NVML Shared Library Not Found"
    ]
    assert nvml_lines("node7", "test", main=False) == []  # other nodes do not repeat it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_shows_this_process_on_its_own_gpu_only():
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.ones(256 * MiB, dtype=torch.uint8, device=device)
    gpus = read_gpus()
    assert [g.cuda_index for g in gpus] == list(range(torch.cuda.device_count()))
    ours, pid = gpus[device.index], os.getpid()
    on = [g.cuda_index for g in gpus if pid in dict(g.processes)]
    if on:  # NVML reports pids of this PID namespace
        assert on == [device.index], on  # and reading the others' properties made no context there
        assert (dict(ours.processes)[pid] or ours.used) >= 256 * MiB, ours
    else:  # a container: NVML reports the host's pids
        assert ours.processes and ours.used >= 256 * MiB, ours
    del held


def test_memory_stays_flat_over_epochs(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, "train.num_workers=2", "train.epochs=6", f"output_dir={out}"], nproc=2)
    epochs = read_metrics(out)
    for rank in (0, 1):
        rss, used, kept, tensors = (
            [m["memory"][rank][key] for m in epochs[1:]]
            for key in ("rss_mib", "heap_used_mib", "heap_kept_mib", "live_tensors")
        )
        assert max(used) - used[0] < 25, f"rank {rank} C heap in use grew: {used}"
        # RSS may grow by what glibc keeps free for reuse (a cache), not beyond it
        grown_beyond_cache = [r - rss[0] - (k - kept[0]) for r, k in zip(rss, kept, strict=True)]
        assert max(grown_beyond_cache) < 25, f"rank {rank} RSS grew beyond the heap's cache: {rss}, kept {kept}"
        assert max(tensors) - min(tensors) <= 2, f"rank {rank} live tensors changed: {tensors}"


@pytest.mark.slow  # the slow tier (pytest -m slow)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) to hide /proc")
def test_without_proc_the_report_says_what_it_cannot_read(tmp_path):
    """As on macOS: /proc hidden under an empty file system, in a mount namespace of the
    run's own. The run trains, and the report names the figure it could not read."""
    out = tmp_path / "run"
    train = shlex.join([sys.executable, "train.py", *FAST, "train.epochs=1", f"output_dir={out}"])
    hidden = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"mount -t tmpfs tmpfs /proc && {train}"]
    result = subprocess.run(
        hidden, cwd=machinery_project(), env=clean_env(), capture_output=True, text=True, timeout=240
    )
    if "mount" in result.stderr and result.returncode != 0 and "Traceback" not in result.stderr:
        pytest.skip(f"cannot hide /proc here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not read here: rss_mib (no /proc/self/statm)" in result.stdout
    (row,) = read_metrics(out)
    assert "rss_mib" not in row["memory"][0] and row["memory"][0]["rss_peak_mib"] > 0


@pytest.mark.parametrize("what", ["MemoryError", "torch's allocator"])
def test_out_of_memory_is_one_line(capsys, what):
    @report_errors
    def main():
        if what == "MemoryError":
            raise MemoryError
        torch.empty(2**62, dtype=torch.uint8)  # RuntimeError: DefaultCPUAllocator: can't allocate memory

    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: out of host memory; use smaller data") and err.count("\n") == 1, err


HEAP_FIGURES = """
import importlib.util, json, torch
from engine.parts.memory import c_heap_mib

if importlib.util.find_spec("engine.parts.host"):  # the host_tuning part: the steps' allocator settings
    from engine.parts.host import set_host_allocator

    set_host_allocator()
before = c_heap_mib()
held = [torch.ones(2**20) for _ in range(64)]  # 256 MiB of tensor storage in 4 MiB blocks
holding = c_heap_mib()
del held
print(json.dumps([before, holding, c_heap_mib()]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallinfo2")
def test_the_c_heap_figures_tell_a_leak_from_a_cache(tmp_path):
    """heap_used counts what is handed out; what is freed and kept moves to heap_kept."""
    script = tmp_path / "heap_figures.py"
    script.write_text(HEAP_FIGURES)
    result = run_script(str(script), [], env={"PYTHONPATH": str(machinery_project())})
    before, holding, after = json.loads(result.stdout.splitlines()[-1])
    assert holding["heap_used_mib"] - before["heap_used_mib"] > 250
    assert abs(after["heap_used_mib"] - before["heap_used_mib"]) < 10
    assert after["heap_kept_mib"] - before["heap_kept_mib"] > 200  # what set_host_allocator asks for
