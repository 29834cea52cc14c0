import pytest
import torch

from conftest import project_config
from data import DataError, build_datasets, prepare_data
from engine.distributed import DistEnv
from engine.loader import (
    EvalBatches,
    SeededSamples,
    TrainSampler,
    micro_batches_per_epoch,
)
from engine.seeding import derive_seed, sample_seeds

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def datasets(*overrides):
    return build_datasets(project_config(None, ["data.train_size=64", "data.val_size=13", *overrides]))


def test_synthetic_data_is_made_from_the_seed():
    a, _ = datasets()
    b, _ = datasets()
    c, _ = datasets("seed=1")
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)


def test_samples_are_fresh_copies():
    train, _ = datasets("data.augment=false")
    image, label = train[3]
    before = train[3][0].clone()
    image.mul_(0).add_(7)
    assert torch.equal(train[3][0], before)


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    train, _ = datasets()
    seeded = SeededSamples(train)
    seed_0, seed_1 = (sample_seeds(derive_seed(0, epoch), [5])[0] for epoch in (0, 1))
    state = torch.get_rng_state()
    first = seeded[(seed_0, 5)][0]
    assert torch.equal(torch.get_rng_state(), state)  # caller's RNG untouched
    assert torch.equal(seeded[(seed_0, 5)][0], first)
    assert not torch.equal(seeded[(seed_1, 5)][0], first)
    # A batch gives each sample what it gets alone, whatever its neighbours.
    batch = seeded.__getitems__([(seed_1, 7), (seed_0, 5), (seed_0, 6)])
    assert torch.equal(batch[1][0], first) and torch.equal(batch[0][0], seeded[(seed_1, 7)][0])
    assert torch.equal(torch.get_rng_state(), state)


def test_train_batches_do_not_depend_on_world_size():
    train, _ = datasets()
    cfg = project_config(None, ["train.batch_size=8"])

    def global_batches(world_size, batch_size):
        ranks = []
        for rank in range(world_size):
            env = DistEnv(rank=rank, world_size=world_size, launcher="torchrun")
            sampler = TrainSampler(
                train, env, seed=0, batch_size=batch_size, num_batches=64 // (world_size * batch_size)
            )
            sampler.set_epoch(3)
            keys = list(sampler)  # (sample seed, index)
            ranks.append([keys[i : i + batch_size] for i in range(0, len(keys), batch_size)])
        return [sorted(sum(step, [])) for step in zip(*ranks, strict=True)]

    assert global_batches(1, 16) == global_batches(2, 8) == global_batches(4, 4)
    assert micro_batches_per_epoch(64, cfg, DistEnv(world_size=2, launcher="torchrun")) == 4


def test_train_sampler_changes_order_every_epoch_and_resumes_mid_epoch():
    train, _ = datasets()
    sampler = TrainSampler(train, DistEnv(), seed=0, batch_size=8, num_batches=8)
    sampler.set_epoch(0)
    epoch0 = [i for _, i in sampler]
    sampler.set_epoch(1)
    epoch1 = [i for _, i in sampler]
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
    sampler.set_epoch(1, start_batch=3)
    assert [i for _, i in sampler] == epoch1[24:] and len(sampler) == 40


def test_eval_batches_cover_every_sample_once_in_the_same_batches_on_any_world_size():
    for world_size in (1, 2, 3, 5):
        shares = [list(EvalBatches(13, 4, DistEnv(rank=r, world_size=world_size))) for r in range(world_size)]
        batches = sorted(sum(shares, []))
        assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]


def test_every_sample_of_every_epoch_has_its_own_random_stream():
    # Augmentation is seeded per (seed, epoch, index), so no two ranks or workers (which
    # always load different indices) can draw the same random numbers.
    seeds = {seed for epoch in range(3) for seed in sample_seeds(derive_seed(0, epoch), list(range(5000)))}
    assert len(seeds) == 3 * 5000 and all(0 <= seed < 2**64 for seed in seeds)
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2) != derive_seed(1, 1, 2)


def test_missing_cifar10_says_where_it_looked_and_what_to_set(tmp_path):
    cfg = project_config(None, ["data.name=cifar10", f"data.root={tmp_path}"])
    prepare_data(cfg)  # data.download=false: nothing to fetch
    with pytest.raises(DataError, match=r"no complete dataset in .*cifar-10-batches-py'; set data.download=true"):
        build_datasets(cfg)


def test_image_folder_keeps_metadata_in_arrays(tmp_path):
    import numpy as np
    from PIL import Image

    from data import ImageFiles

    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / label / f"{i}.png")
    files = ImageFiles(tmp_path, transform=lambda image: image)
    assert isinstance(files.paths, np.ndarray) and isinstance(files.labels, torch.Tensor)
    assert files.classes == ["a", "b"] and len(files) == 6 and files[4][1] == 1
