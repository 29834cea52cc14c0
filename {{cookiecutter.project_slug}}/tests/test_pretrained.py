"""Starting from torchvision's published weights, read from torch's hub cache."""

import pytest
import torch
from torchvision.models import resnet18

from conftest import FAST, reference_config, reference_task, run_script
from engine.errors import ConfigError, UsageError
from engine.parts.pretrained import build

WEIGHTS = "ResNet18_Weights.IMAGENET1K_V1"
ARGS = [*FAST, "model.name=resnet18", f"pretrained.weights={WEIGHTS}"]


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


def start_model(args):
    """The task's model as train.py starts it: built, then the part's weights loaded."""
    cfg = reference_config(None, args)
    model = reference_task().model.build_model(cfg)
    build(cfg, None).prepare_model(model)
    return model


def test_the_weights_that_fit_are_loaded_and_the_rest_named_in_one_line(hub_cache, capsys):
    model = start_model(ARGS)
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


def test_missing_unknown_or_unfitting_weights_are_one_line_saying_what_to_do(tmp_path, monkeypatch, hub_cache):
    with pytest.raises(ConfigError, match="unknown weights 'ResNet18_Weights.NOPE'"):
        start_model([*ARGS, "pretrained.weights=ResNet18_Weights.NOPE"])
    with pytest.raises(ConfigError, match=f"no tensor of {WEIGHTS} fits the model"):
        start_model([*ARGS, "model.name=mlp"])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))  # nothing may be downloaded
    with pytest.raises(UsageError, match=r"are not in .*resnet18-f37072fd\.pth; fetch them once where there is"):
        start_model(ARGS)
    assert build(reference_config(None, FAST), None) is None  # off by default


def test_a_run_starts_from_them_and_a_config_of_0_7_0_is_told_where_the_key_went(hub_cache, tmp_path):
    args = [*ARGS, "data.image_size=8", "data.train_size=64", "train.epochs=1", f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=2, env={"TORCH_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert f"pretrained {WEIGHTS}: " in result.stdout and "Traceback" not in result.stderr
    old = run_script("train.py", [*FAST, f"model.pretrained={WEIGHTS}", f"output_dir={tmp_path}/old"], check=False)
    assert old.returncode == 2
    assert old.stderr.strip() == "error: config key 'model.pretrained' moved to 'pretrained.weights'; rename it"


def test_a_checkpoints_config_of_0_8_0_still_loads_without_its_model_pretrained_key():
    """0.8.0 stored model.pretrained in every checkpoint's config; evaluate.py, predict.py and
    export.py build from it, and the weights are in the checkpoint."""
    base = {"model": {"name": "mlp", "hidden_dim": 16, "pretrained": WEIGHTS}, "seed": 3}
    cfg = reference_config(None, [], base=base)
    assert (cfg.model.name, cfg.model.hidden_dim, cfg.seed) == ("mlp", 16, 3)
    assert cfg.pretrained.weights == ""
