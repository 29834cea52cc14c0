"""Profiling a few steps with torch.profiler, in a real 2-process run."""

import json

from conftest import FAST, read_metrics, run_script


def test_rank_0_records_the_chosen_steps_into_a_trace_and_the_run_goes_on(tmp_path):
    args = [*FAST, "train.epochs=1", "data.train_size=512", "profiler.steps=3", "profiler.start_step=4"]
    run_script("train.py", [*args, f"output_dir={tmp_path}"], nproc=2)
    traces = list((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [trace.name.split(".")[0] for trace in traces] == ["rank0"]  # rank 0 only, by default
    events = json.loads(traces[0].read_text())["traceEvents"]  # what TensorBoard and Perfetto read
    steps = sorted({event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]  # optimizer steps 4, 5 and 6
    assert any(event.get("name") == "Optimizer.step#SGD.step" for event in events)
    assert read_metrics(tmp_path)[-1]["step"] == 512 // 32  # the run went on to its end
