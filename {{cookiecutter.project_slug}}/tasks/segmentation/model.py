"""The task: edit this file to train your own model, loss and metrics.

What train.py and evaluate.py use from here:
- `ModelConfig`: the `model:` section of config.yaml, each key with its default.
- `build_model(cfg) -> nn.Module`: a plain module, unaware of distribution: the
  machinery converts BatchNorm to SyncBatchNorm, moves it to the device and wraps it
  in DDP, or FSDP (the fsdp part). Under FSDP, ranks other than 0 build it on the meta device (no memory)
  and receive rank 0's weights: it may create tensors but not read their values.
- `training_step(model, batch, cfg) -> loss`: the loss of one batch (a tensor), or a dict
  of named losses: backward runs on their sum, and each is logged as `train_<name>`.
  `cfg` is the run's config (e.g. cfg.model.<your setting>): keep settings and helper
  objects there or in this module, not as attributes of the model, where a module (a
  torchvision transform is one) would become part of the model.
- `build_metrics(cfg) -> {name: metric}` and `validation_step(model, batch, metrics, cfg)`:
  the validation metrics (engine.metrics: `Mean`, `Sum`, or `Gathered`), updated batch by
  batch; each is reported as `val_<name>`, exact over the whole validation set on any
  number of processes.
- `predict_step(model, batch) -> [result, ...]` (for predict.py): one result per input of
  a batch from data.py's `build_predict_set`, each a dict that JSON can write.
- `model_inputs(batch) -> tuple` (for export.py --program): what `model(...)` takes for a
  batch, from which torch.export traces the model.
- `BLOCKS`: the repeated blocks of the model, the units that train.activation_checkpointing
  recomputes, and that FSDP shards (the fsdp part).

A batch is (images [N, 3, H, W], masks [N, H, W]) from data.py, already on the device.
Both steps run under autocast when train.precision is bf16 or fp16.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.mobilenetv3 import InvertedResidual
from torchvision.models.segmentation import lraspp_mobilenet_v3_large

from data import IGNORE
from engine import ConfigError, Mean, Sum


@dataclass
class ModelConfig:
    name: str = "lraspp_mobilenet_v3"  # torchvision's LR-ASPP on MobileNetV3-Large, from scratch

    may_change_on_resume: ClassVar[tuple[str, ...]] = ()  # every key here changes what the weights mean

    def __post_init__(self):
        if self.name != "lraspp_mobilenet_v3":
            raise ConfigError(f"unknown model.name {self.name!r}: use lraspp_mobilenet_v3, or add yours in model.py")


BLOCKS = (InvertedResidual,)


def build_model(cfg) -> nn.Module:
    # No downloads: weights and backbone weights from scratch (set weights_backbone to
    # start from ImageNet features on real data).
    model = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=cfg.data.num_classes)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            # MobileNetV3's BatchNorm keeps running statistics with momentum 0.01, made for
            # ImageNet's long runs: after a few hundred steps they are still near their
            # initial values and evaluation sees garbage. 0.1 is PyTorch's default.
            module.momentum = 0.1
    return model


def training_step(model: nn.Module, batch, cfg):
    images, masks = batch
    return F.cross_entropy(model(images)["out"], masks, ignore_index=IGNORE)


def build_metrics(cfg) -> dict:
    num_classes = cfg.data.num_classes
    # The confusion matrix is a sum over pixels, so it adds up exactly across ranks; the
    # IoUs are computed once from the whole matrix (not averaged per rank or per batch).
    return {"loss": Mean(), "confusion": Sum((num_classes, num_classes), compute=iou_metrics)}


def validation_step(model: nn.Module, batch, metrics: dict, cfg) -> None:
    images, masks = batch
    logits = model(images)["out"].float()
    losses = F.cross_entropy(logits, masks, ignore_index=IGNORE, reduction="none")
    valid = masks != IGNORE
    metrics["loss"].update((losses * valid).sum(dim=(1, 2)) / valid.sum(dim=(1, 2)).clamp(min=1))
    # The batch's confusion matrix, a total over its pixels: count= says it is not one row per image.
    metrics["confusion"].update(confusion_matrix(logits.argmax(dim=1), masks, logits.shape[1]), count=len(images))


def predict_step(model: nn.Module, batch) -> list[dict]:
    images, paths = batch
    masks = model(images)["out"].argmax(dim=1).cpu()
    # The predicted mask at data.image_size, row by row as [class, run length] pairs.
    return [
        {"input": path, "size": list(mask.shape), "mask_runs": run_lengths(mask)}
        for path, mask in zip(paths, masks, strict=True)
    ]


def run_lengths(mask: torch.Tensor) -> list[list[int]]:
    flat = mask.flatten()
    starts = torch.cat([torch.tensor([0]), torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([flat.numel()]))
    return [[value, length] for value, length in zip(flat[starts].tolist(), lengths.tolist(), strict=True)]


def model_inputs(batch) -> tuple:
    images, _ = batch
    return (images,)


def confusion_matrix(predicted: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """counts[t, p]: pixels of true class t predicted as p, over the pixels that count."""
    valid = target != IGNORE
    index = target[valid] * num_classes + predicted[valid]
    return torch.bincount(index, minlength=num_classes**2).reshape(num_classes, num_classes)


def iou_metrics(counts: torch.Tensor) -> dict:
    """val_miou: the mean over classes present (in truth or prediction) of
    intersection / union; val_pixel_acc: the share of pixels classified right."""
    intersection = counts.diag()
    union = counts.sum(0) + counts.sum(1) - intersection
    present = union > 0
    return {
        "miou": (intersection[present] / union[present]).mean().item(),
        "pixel_acc": (intersection.sum() / counts.sum().clamp(min=1)).item(),
    }
