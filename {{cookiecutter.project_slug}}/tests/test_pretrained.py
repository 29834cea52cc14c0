"""Starting from torchvision's published weights, read from torch's hub cache."""

import pytest
import torch
from torchvision.models import resnet18

from conftest import FAST, reference_config, reference_task
from engine.errors import ConfigError, UsageError

WEIGHTS = "ResNet18_Weights.IMAGENET1K_V1"
ARGS = [*FAST, "model.name=resnet18", f"model.pretrained={WEIGHTS}"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A TORCH_HOME holding a file under the published weights' name (made here: nothing
    is downloaded), as a cluster node would after the weights were fetched elsewhere."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    checkpoints = tmp_path / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.manual_seed(1)
    published = resnet18(weights=None).state_dict()  # ImageNet's shapes: 7x7 stem, 1000 classes
    torch.save(published, checkpoints / "resnet18-f37072fd.pth")
    return published


def test_the_weights_that_fit_are_loaded_and_the_rest_named_in_one_line(hub_cache, capsys):
    model = reference_task().model.build_model(reference_config(None, ARGS))
    own = model.state_dict()
    fresh = ["conv1.weight", "fc.weight", "fc.bias"]  # the small-image stem, 10 classes
    for key, value in own.items():
        if key not in fresh:
            assert torch.equal(value, hub_cache[key]), key
    assert not torch.equal(own["conv1.weight"][:, :, :3, :3], hub_cache["conv1.weight"][:, :, :3, :3])
    lines = [line for line in capsys.readouterr().out.splitlines() if "pretrained" in line]
    assert lines == [
        f"pretrained {WEIGHTS}: {len(own) - 3} of {len(own)} tensors loaded; initialised fresh "
        "(another shape, or not in the weights): conv1.weight, fc.weight, fc.bias"
    ]


def test_missing_or_unknown_weights_are_one_line_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache: nothing may be downloaded
    build_model = reference_task().model.build_model
    with pytest.raises(UsageError, match=r"are not in .*resnet18-f37072fd\.pth; fetch them once where there is"):
        build_model(reference_config(None, ARGS))
    with pytest.raises(ConfigError, match="unknown weights 'ResNet18_Weights.NOPE'"):
        build_model(reference_config(None, [*ARGS, "model.pretrained=ResNet18_Weights.NOPE"]))
    with pytest.raises(ConfigError, match="model.pretrained is for resnet18, not mlp"):
        reference_config(None, [*ARGS, "model.name=mlp"])
