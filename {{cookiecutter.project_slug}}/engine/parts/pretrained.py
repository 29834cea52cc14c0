"""Starting the model from torchvision's pretrained weights (pretrained.weights) wherever a tensor's name and
shape fit. Read from torch's hub cache, never downloaded: every process would fetch at once, and cluster nodes
often have no internet."""

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

import torch
import torch.nn as nn
from torchvision.models import get_weight

from engine.distributed import is_main
from engine.errors import ConfigError, UsageError
from engine.hooks import Part
from engine.logs import log

MOVED_KEYS = {"model.pretrained": "pretrained.weights"}  # where 0.7.0 had it


@dataclass
class Section:
    weights: str = ""  # torchvision weights to start from, e.g. ResNet18_Weights.DEFAULT; "" = off

    may_change_on_resume: ClassVar[tuple[str, ...]] = ("weights",)  # the start only: a checkpoint has the weights


def build(cfg, env) -> "Pretrained | None":
    return Pretrained(cfg.pretrained.weights) if cfg.pretrained.weights else None


class Pretrained(Part):
    name = "pretrained"

    def __init__(self, source: str):
        self.source = source

    def prepare_model(self, model: nn.Module) -> None:
        load_pretrained(model, self.source)


SHOWN = 6  # fresh tensors named in the line; the rest are counted


def load_pretrained(model: nn.Module, name: str) -> None:
    """Where name and shape match; rank 0 says which stay fresh. On meta (the fsdp part), rank 0's come at setup."""
    if any(p.is_meta for p in model.parameters()):
        return
    try:
        path = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(get_weight(name).url).path).name
    except (ValueError, KeyError, AttributeError):
        raise ConfigError(
            f"pretrained.weights: unknown weights {name!r}; name torchvision's, e.g. ResNet18_Weights.DEFAULT"
        ) from None
    if not path.is_file():
        fetch = f"python -c \"from torchvision.models import get_weight; get_weight('{name}').get_state_dict()\""
        raise UsageError(
            f"pretrained weights {name} are not in {path}; fetch them once where there is internet: {fetch}"
        )
    try:
        published = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  torn download, or not a weights file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(
            f"pretrained weights {path} cannot be loaded ({reason}); delete the file and fetch it again"
        ) from None
    own = model.state_dict()
    fits = {key: value for key, value in published.items() if key in own and value.shape == own[key].shape}
    if not fits:
        raise ConfigError(f"pretrained.weights: no tensor of {name} fits the model (names or shapes differ); unset it")
    model.load_state_dict(fits, strict=False)
    fresh = [key for key in own if key not in fits and not key.endswith("num_batches_tracked")]
    if is_main():
        named = ", ".join(fresh[:SHOWN]) + (f" and {len(fresh) - SHOWN} more" if len(fresh) > SHOWN else "")
        fresh_line = f"; initialised fresh (another shape, or not in the weights): {named}" if fresh else ""
        log(f"pretrained {name}: {len(fits)} of {len(own)} tensors loaded{fresh_line}")
