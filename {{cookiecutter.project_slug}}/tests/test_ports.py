"""What a recipe ported from another project needs from your files alone: a batch-level
augmentation (MixUp) and a label-smoothed loss, a sampler of its own (repeated
augmentation), and opening lines that say what the run changes from a plain loop. Each
trains on 2 processes, is stopped mid-epoch and resumed, and ends bitwise equal to a run
left alone."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import (
    FAST,
    assert_resume_is_bitwise,
    project_config,
    project_with,
    read_metrics,
    replaced,
    run_script,
)
from engine.distributed import DistEnv
from engine.errors import UsageError
from engine.loader import TrainSampler, build_train_loader
from engine.training import beyond_a_plain_loop

STEPS_PER_EPOCH = 256 // (16 * 2)
ARGS = [*FAST, "data.train_size=256", "train.epochs=2"]

MIXUP = '''

def build_augment(cfg, train_set):
    """MixUp on a whole training batch: its labels become class probabilities."""
    print("MixUp built", flush=True)  # once per process
    mixup = v2.MixUp(alpha=0.4, num_classes=count_classes(cfg))
    return lambda batch: mixup(*batch)
'''

# The steps check what reaches them: mixed batches in training, never in validation.
STEPS = (
    (
        "    images, labels = batch\n    return F.cross_entropy(",
        "    images, labels = batch\n"
        '    assert labels.is_floating_point() and labels.ndim == 2, "an unmixed training batch"\n'
        "    return F.cross_entropy(",
    ),
    (
        "    images, labels = batch\n    logits = model(images).float()\n",
        "    images, labels = batch\n"
        '    assert labels.dtype == torch.int64, "a mixed validation batch"\n'
        "    logits = model(images).float()\n",
    ),
    ("import torch.nn as nn\n", "import torch\nimport torch.nn as nn\n"),
)

REPEATED = '''

def train_order(num_samples, generator, cfg):
    """Repeated augmentation: each sample cfg.data.repeats times in a row, in an epoch as long as the data."""
    order = torch.randperm(num_samples, generator=generator).repeat_interleave(cfg.data.repeats)[:num_samples]
    assert cfg.data.repeats == 3 and torch.equal(order[:3], order[:1].repeat(3)), "the setting reaches train_order"
    return order  # a tensor: integer indices in any form
'''
# A key of your own in DataConfig (data.repeats), set in the run's config.
REPEATS = ("class DataConfig:\n", "class DataConfig:\n    repeats: int = 1  # repeated augmentation\n")


def resumes_bitwise(project, tmp_path, args) -> list[dict]:
    """2 processes stopped mid-epoch and resumed end as the run left alone; its metrics rows."""
    a, resumed = assert_resume_is_bitwise(args, tmp_path, 2, stop_at=STEPS_PER_EPOCH + 3, cwd=project)
    assert a["step"] == 2 * STEPS_PER_EPOCH  # equal steps on every rank, every epoch
    assert f"epoch 1's train_* figures will cover its steps from {STEPS_PER_EPOCH + 4} on" in resumed  # says so
    return read_metrics(tmp_path / "whole")


def test_mixup_and_label_smoothing_in_your_files_train_and_resume_bitwise_and_never_mix_validation(tmp_path):
    project = project_with(
        tmp_path, {"data.py": lambda text: text + MIXUP, "model.py": lambda text: replaced(text, STEPS)}
    )
    rows = resumes_bitwise(project, tmp_path, [*ARGS, "model.label_smoothing=0.1"])
    assert len(rows) == 2
    resumed = run_script("train.py", [*ARGS, f"output_dir={tmp_path / 'once'}"], nproc=2, cwd=project).stdout
    assert resumed.count("MixUp built") == 2, resumed  # once per process, not per batch


def test_an_augment_batch_of_before_is_told_to_become_build_augment(tmp_path):
    old = "\n\ndef augment_batch(batch, cfg):\n    return batch\n"
    project = project_with(tmp_path, {"data.py": lambda text: text + old})
    run = run_script("train.py", [*ARGS, f"output_dir={tmp_path / 'out'}"], cwd=project, check=False)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: data.py's augment_batch(batch, cfg) is now build_augment(cfg, train_set)")


def test_a_sampler_of_your_own_keeps_equal_steps_and_a_bitwise_resume(tmp_path):
    project = project_with(tmp_path, {"data.py": lambda text: replaced(text, (REPEATS,)) + REPEATED})
    resumes_bitwise(project, tmp_path, [*ARGS, "data.repeats=3"])


class Repeated(torch.utils.data.Dataset):
    def __len__(self):
        return 10


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_sampler_of_your_own_is_dealt_out_in_whole_steps_with_a_seed_per_repeat(world_size):
    def thrice(num_samples, generator):
        return torch.randperm(num_samples, generator=generator).repeat_interleave(3).tolist()

    order = thrice(10, torch.Generator().manual_seed(5 + 1))  # seed 5, epoch 1
    drawn = []
    for rank in range(world_size):
        sampler = TrainSampler(Repeated(), DistEnv(rank=rank, world_size=world_size), 5, 2, order=thrice)
        sampler.num_batches = 30 // (2 * world_size)
        sampler.set_epoch(1)
        drawn.append(list(sampler))
    assert all(len(mine) == len(drawn[0]) for mine in drawn)
    for rank, mine in enumerate(drawn):
        assert [index for _, index in mine] == order[rank::world_size][: len(mine)]
    seeds = [seed for mine in drawn for seed, _ in mine]
    assert len(set(seeds)) == len(seeds)  # each repeat of a sample augmented differently


def test_a_stream_that_no_part_reads_is_refused_in_one_line():
    """A project generated without the streams part (or a part list without it) has no
    reader for an IterableDataset: the run says so before building anything."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(10)

    cfg = project_config(None, ["train.max_steps=5"])
    with pytest.raises(UsageError, match=r"^the training set is a stream \(an IterableDataset\), which this project"):
        build_train_loader(Stream(), cfg, DistEnv(), torch.device("cpu"), parts=())


def test_a_sampler_that_changes_its_length_or_leaves_the_data_is_refused_in_one_line():
    def shrinking(num_samples, generator):  # 11 indices in epoch 0, 10 in epoch 1 (seed 0)
        return [0] * (num_samples + 1 - generator.initial_seed())

    sampler = TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=shrinking)
    sampler.set_epoch(1)
    with pytest.raises(UsageError, match=r"^data.py's train_order gave 10 indices for epoch 1; give the same number"):
        list(sampler)
    with pytest.raises(UsageError, match=r"each in \[0, 10\) \(the training set's samples\)$"):
        TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=lambda n, g: [n])


@pytest.mark.parametrize(
    "returned, message",
    [
        (None, "returned NoneType for epoch 0; return a list (or a 1-D integer tensor)"),
        (5, "returned int for epoch 0; return a list"),
        ("0123", "returned str for epoch 0; return a list"),
        (torch.zeros(2, 5, dtype=torch.long), "returned Tensor for epoch 0; return a list"),
        (torch.full((10,), float("nan")), "returned Tensor for epoch 0; return a list"),
        ([[0, 1], [2, 3]], "returned list for epoch 0 holding list '[0, 1]'; give integer indices only"),
        ([0.9] * 10, "returned list for epoch 0 holding float '0.9'; give integer indices only"),
        ([True] * 10, "returned list for epoch 0 holding bool 'True'; give integer indices only"),
        (["3"] * 10, "returned list for epoch 0 holding str '3'; give integer indices only"),
        ([float("nan")] * 10, "returned list for epoch 0 holding float 'nan'; give integer indices only"),
        ([], "returned list for epoch 0 with no indices; return the epoch's order"),
    ],
)
def test_a_sampler_of_your_own_that_returns_no_indices_is_refused_in_one_line(returned, message):
    with pytest.raises(UsageError) as error:
        TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=lambda n, g: returned)
    assert str(error.value).startswith(f"data.py's train_order {message}") and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "indices",
    [list(range(10)), (*range(10),), range(10), torch.arange(10), [*torch.arange(10)], [*np.arange(10)]],
)
def test_a_sampler_of_your_own_may_give_integers_in_any_form(indices):
    sampler = TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=lambda n, g: indices)
    sampler.num_batches = 5
    assert [index for _, index in sampler] == list(range(10))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_randperm_from_the_generator_is_the_built_in_order(world_size):
    def randperm(num_samples, generator):
        return torch.randperm(num_samples, generator=generator)

    for rank in range(world_size):
        samplers = [
            TrainSampler(Repeated(), DistEnv(rank=rank, world_size=world_size), 7, 1, order=o) for o in (None, randperm)
        ]
        for sampler in samplers:
            sampler.num_batches = 10 // world_size
            sampler.set_epoch(3)
        assert list(samplers[0]) == list(samplers[1])


GLOBAL_RNG = """

def train_order(num_samples, generator, cfg):
    return torch.randperm(num_samples).tolist()  # generator forgotten: each process draws its own
"""


def test_a_sampler_of_your_own_that_ignores_its_generator_is_refused_before_training(tmp_path):
    project = project_with(tmp_path, {"data.py": lambda text: text + GLOBAL_RNG})
    run = run_script("train.py", [*ARGS, f"output_dir={tmp_path / 'out'}"], nproc=2, cwd=project, check=False)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if "train_order" in line]
    assert len(lines) == 1 and lines[0].startswith(  # from rank 0 alone: every rank found it
        "error: data.py's train_order gave each process another order for epoch 0; draw it from its `generator`"
    )
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_sampler_of_your_own_without_the_settings_argument_is_refused_in_one_line(tmp_path):
    project = project_with(
        tmp_path, {"data.py": lambda text: text + "\n\ndef train_order(num_samples, generator):\n    return []\n"}
    )
    run = run_script("train.py", [*ARGS, f"output_dir={tmp_path / 'out'}"], cwd=project, check=False)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: data.py's train_order must take (num_samples, generator, cfg)")


def test_the_opening_lines_name_what_changes_the_math_from_a_plain_loop():
    cfg = project_config(None, ["train.accum_steps=2"])
    state = SimpleNamespace(model=nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)), steps_per_epoch=7)
    line = beyond_a_plain_loop(cfg.train, state, epoch_samples=1000, per_step=128)
    assert line == (
        "beyond a plain loop: gradients clipped to norm 5 (train.grad_clip=0: off); BatchNorm statistics over every "
        "process (dist.sync_bn=false: each its own); each epoch leaves out its last 104 of 1000 samples (less than "
        "one effective batch); gradients of 2 micro-batches summed per step (train.accum_steps)"
    )
    plain = project_config(None, ["train.grad_clip=0"])
    state = SimpleNamespace(model=nn.Linear(2, 2), steps_per_epoch=8)
    assert beyond_a_plain_loop(plain.train, state, epoch_samples=1024, per_step=128) == "beyond a plain loop: nothing"
