"""Models: edit this file to train your own.

`build_model(cfg)` returns a plain `nn.Module` mapping images [N, C, H, W] to class
logits [N, num_classes]. Keep it unaware of distribution: parallel.py converts BatchNorm
to SyncBatchNorm, moves it to the device and wraps it in DDP or FSDP.
"""

import torch.nn as nn
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock

from config import Config, ConfigError


class MLPBlock(nn.Module):
    def __init__(self, in_features: int, out_features: int, dropout: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.activation = nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.activation(self.linear(x)))


# The repeated blocks of your model: the units that model.activation_checkpointing
# recomputes and that FSDP shards. Add your own block types here.
BLOCKS = (BasicBlock, MLPBlock)


def build_model(cfg: Config) -> nn.Module:
    num_classes = cfg.data.num_classes
    if cfg.model.name == "resnet18":
        return small_image_resnet18(num_classes)
    if cfg.model.name == "mlp":
        in_features = 3 * cfg.data.image_size**2
        return MLP(in_features, cfg.model.hidden_dim, num_classes, cfg.model.dropout)
    raise ConfigError(f"unknown model.name {cfg.model.name!r}: choose resnet18 or mlp, or add yours in model.py")


def small_image_resnet18(num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 for small (e.g. 32x32) images: a 3x3 stem, no max-pool,
    so early layers keep enough resolution."""
    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class MLP(nn.Module):
    """A small fully connected classifier: fast on CPU, no BatchNorm."""

    def __init__(self, in_features: int, hidden_dim: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            MLPBlock(in_features, hidden_dim, dropout),
            MLPBlock(hidden_dim, hidden_dim, dropout),
            nn.Linear(hidden_dim, num_classes),
        )

    def forward(self, x):
        return self.net(x)
