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
  the validation metrics (engine.metrics: `Mean`, `Sum`, or `Gathered` for metrics that
  are not sums, such as AUROC or mAP), updated batch by batch; each is reported as
  `val_<name>`, exact over the whole validation set on any number of processes.
- `predict_step(model, batch) -> [result, ...]` (for predict.py): one result per input of
  a batch from data.py's `build_predict_set`, each a dict that JSON can write.
- `model_inputs(batch) -> tuple` (for export.py --program): what `model(...)` takes for a
  batch, from which torch.export traces the model.
- `count_items(batch) -> (unit, count)` (optional): the batch's size in the task's own
  unit, reported per second beside samples by the throughput part (here pixels; tokens for
  a language model).
- `BLOCKS`: the repeated blocks of the model, the units that train.activation_checkpointing
  recomputes, and that FSDP shards (the fsdp part).

A batch is what data.py's dataset (and its `collate_fn`, if any) makes, already on the
device. Both steps run under autocast when train.precision is bf16 or fp16.
"""

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock

from data import count_classes
from engine import ConfigError, Mean, check_positive


@dataclass
class ModelConfig:
    name: str = "resnet18"  # resnet18 (BatchNorm) | mlp (small, fast on CPU)
    hidden_dim: int = 256  # mlp only
    dropout: float = 0.0  # mlp only
    label_smoothing: float = 0.0  # of the training loss's targets (e.g. 0.1); 0 = plain cross-entropy

    def __post_init__(self):
        if self.name not in ("resnet18", "mlp"):
            raise ConfigError(f"unknown model.name {self.name!r}: choose resnet18 or mlp, or add yours in model.py")
        check_positive("model.hidden_dim", self.hidden_dim)
        for key in ("dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key} must be in [0, 1), got {getattr(self, key)}")


class MLPBlock(nn.Module):
    """Linear, LayerNorm, ReLU: the norm keeps activations at one scale whatever the
    weights' size, as BatchNorm does in the ResNet, so a high learning rate stays stable."""

    def __init__(self, in_features: int, out_features: int, dropout: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = nn.LayerNorm(out_features)
        self.activation = nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.activation(self.norm(self.linear(x))))


BLOCKS = (BasicBlock, MLPBlock)


def build_model(cfg) -> nn.Module:
    num_classes = count_classes(cfg)
    if cfg.model.name == "resnet18":
        return small_image_resnet18(num_classes)
    in_features = 3 * cfg.data.image_size**2
    return MLP(in_features, cfg.model.hidden_dim, num_classes, cfg.model.dropout)


def training_step(model: nn.Module, batch, cfg):
    images, labels = batch
    return F.cross_entropy(model(images), labels, label_smoothing=cfg.model.label_smoothing)


def build_metrics(cfg) -> dict:
    return {"loss": Mean(), "acc": Mean()}


def validation_step(model: nn.Module, batch, metrics: dict, cfg) -> None:
    images, labels = batch
    logits = model(images).float()
    metrics["loss"].update(F.cross_entropy(logits, labels, reduction="none"))
    metrics["acc"].update((logits.argmax(dim=1) == labels).float())


def count_items(batch) -> tuple[str, int]:
    images, _ = batch
    return "pixels", images.shape[0] * images.shape[-2] * images.shape[-1]


def predict_step(model: nn.Module, batch) -> list[dict]:
    images, paths = batch
    scores, labels = model(images).float().softmax(dim=1).max(dim=1)
    # label: the class's index, in the sorted class folder names of data.root/train/.
    return [
        {"input": path, "label": label, "score": round(score, 6)}
        for path, label, score in zip(paths, labels.tolist(), scores.tolist(), strict=True)
    ]


def model_inputs(batch) -> tuple:
    images, _ = batch
    return (images,)


def small_image_resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 for small (e.g. 32x32) images: a 3x3 stem, no max-pool,
    so early layers keep enough resolution.

    Each residual block starts as the identity (its last BatchNorm scale at zero). With
    every branch adding at full strength from the start, the features reaching the
    classifier are twice as large, its first SGD steps four times as large, and the
    logits blow up within a few steps at lr 0.1 (Goyal et al. 2017 use this fix too)."""
    model = resnet18(weights=None, num_classes=num_classes, zero_init_residual=True)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class MLP(nn.Module):
    """A small fully connected classifier: fast on CPU, no BatchNorm.

    Each image is standardised on its own first: raw pixels share a large common offset
    (a dark background is -2 everywhere after data.py's normalisation), which makes the
    first layer's steps huge and training diverge at ordinary learning rates."""

    def __init__(self, in_features: int, hidden_dim: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.LayerNorm(in_features, elementwise_affine=False),
            MLPBlock(in_features, hidden_dim, dropout),
            MLPBlock(hidden_dim, hidden_dim, dropout),
            nn.Linear(hidden_dim, num_classes),
        )

    def forward(self, x):
        return self.net(x)
