"""What a recipe ported from another project needs from your files alone: a batch-level
augmentation (MixUp) and a label-smoothed loss, a sampler of its own (repeated
augmentation), and opening lines that say what the run changes from a plain loop. Each
trains on 2 processes, is stopped mid-epoch and resumed, and ends bitwise equal to a run
left alone."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from conftest import FAST, assert_resume_is_bitwise, project_config, project_with, read_metrics, replaced
from engine.distributed import DistEnv
from engine.errors import UsageError
from engine.loader import TrainSampler
from engine.training import beyond_a_plain_loop

STEPS_PER_EPOCH = 256 // (16 * 2)
ARGS = [*FAST, "data.train_size=256", "train.epochs=2"]

MIXUP = '''

def augment_batch(batch, cfg):
    """MixUp on a whole training batch: its labels become class probabilities."""
    images, labels = batch
    return v2.MixUp(alpha=0.4, num_classes=count_classes(cfg))(images, labels)
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

def train_order(num_samples, generator):
    """Repeated augmentation: each sample 3 times in a row, in an epoch as long as the data."""
    return torch.randperm(num_samples, generator=generator).repeat_interleave(3)[:num_samples].tolist()
'''


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


def test_a_sampler_of_your_own_keeps_equal_steps_and_a_bitwise_resume(tmp_path):
    project = project_with(tmp_path, {"data.py": lambda text: text + REPEATED})
    resumes_bitwise(project, tmp_path, ARGS)


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


def test_a_sampler_that_changes_its_length_or_leaves_the_data_is_refused_in_one_line():
    def shrinking(num_samples, generator):  # 11 indices in epoch 0, 10 in epoch 1 (seed 0)
        return [0] * (num_samples + 1 - generator.initial_seed())

    sampler = TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=shrinking)
    sampler.set_epoch(1)
    with pytest.raises(UsageError, match=r"^data.py's train_order gave 10 indices for epoch 1; give the same number"):
        list(sampler)
    with pytest.raises(UsageError, match=r"each in \[0, 10\) \(the training set's samples\)$"):
        TrainSampler(Repeated(), DistEnv(rank=0, world_size=1), 0, 2, order=lambda n, g: [n])


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
