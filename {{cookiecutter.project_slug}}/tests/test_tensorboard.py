"""TensorBoard curves (the tracking part): the same figures as metrics.jsonl, from rank 0,
continued across a resume; off, or without the package, the run goes on without them."""

import pytest

from conftest import FAST, read_metrics, run_script

FAST_SHORT = [*FAST, "train.epochs=1", "data.train_size=512"]
STEP_TAGS = {"train/loss", "train/lr", "train/samples_per_s"}  # every train.log_every_steps (4 in FAST)
EPOCH_TAGS = {"train/epoch_loss", "val/loss", "val/acc", "throughput/samples_per_s"}


def read_tensorboard(run_dir) -> dict[str, list]:
    """Every scalar curve in the run's TensorBoard folder, read with TensorBoard's own
    reader: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_curves_match_metrics(curves: dict, metrics: list[dict]) -> None:
    """The epoch curves are metrics.jsonl's figures (to float32), at each epoch's last step;
    with the memory report, its rank 0 and largest figures too."""
    assert set(curves) >= STEP_TAGS | EPOCH_TAGS
    for tag, key in [("val/acc", "val_acc"), ("val/loss", "val_loss"), ("train/epoch_loss", "train_loss")]:
        assert [step for step, _ in curves[tag]] == [m["step"] for m in metrics], tag
        assert [value for _, value in curves[tag]] == pytest.approx([m[key] for m in metrics], rel=1e-6), tag
    if "memory" not in metrics[0]:
        return
    rank_0 = [m["memory"][0]["rss_peak_mib"] for m in metrics]
    largest = [max(row["rss_peak_mib"] for row in m["memory"]) for m in metrics]
    assert [value for _, value in curves["memory/rss_peak_mib"]] == pytest.approx(rank_0)
    assert [value for _, value in curves["memory/rss_peak_mib_max"]] == pytest.approx(largest)


def test_the_curves_are_rank_0s_metrics_and_go_on_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard", reason='needs pip install -e ".[tensorboard]"')
    out = tmp_path / "run"
    args = [*FAST, "tracking.tensorboard=true", f"output_dir={out}"]
    run_script("train.py", [*args, "train.epochs=2"], nproc=2)
    assert len(list((out / "tensorboard").iterdir())) == 1  # one events file: rank 0's
    curves = read_tensorboard(out)
    assert_curves_match_metrics(curves, read_metrics(out))
    for tag in STEP_TAGS:
        assert [step for step, _ in curves[tag]] == list(range(4, 65, 4)), tag

    run_script("train.py", [*args, "train.epochs=3"], nproc=2)
    assert len(list((out / "tensorboard").iterdir())) == 2  # the resumed run's own events file
    curves = read_tensorboard(out)
    assert_curves_match_metrics(curves, read_metrics(out))  # the curves continue, nothing lost or doubled
    assert [step for step, _ in curves["train/loss"]] == list(range(4, 97, 4))


def test_off_no_tensorboard_folder(tmp_path):
    run_script("train.py", [*FAST_SHORT, "tracking.tensorboard=false", f"output_dir={tmp_path}"])
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [0]
    assert not (tmp_path / "tensorboard").exists()


def test_without_the_tensorboard_package_training_goes_on_and_says_so_once(tmp_path):
    # A package of that name first on the path that fails to import, as a missing one does.
    (tmp_path / "stub" / "tensorboard").mkdir(parents=True)
    (tmp_path / "stub" / "tensorboard" / "__init__.py").write_text('raise ImportError("tensorboard: test stub")')
    out = tmp_path / "run"
    args = [*FAST_SHORT, f"output_dir={out}", "tracking.tensorboard=true"]
    result = run_script("train.py", args, nproc=2, env={"PYTHONPATH": str(tmp_path / "stub")})
    said = [line for line in (result.stdout + result.stderr).splitlines() if "tensorboard" in line.lower()]
    assert len(said) == 1, said
    assert said[0].startswith("warning: tracking.tensorboard is on but tensorboard cannot be imported (tensorboard:")
    assert 'pip install -e ".[tensorboard]"' in said[0] and "tracking.tensorboard=false" in said[0]
    assert [m["epoch"] for m in read_metrics(out)] == [0]
    assert not (out / "tensorboard").exists()
