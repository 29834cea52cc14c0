"""A task that is not classification, for the tests: two regression heads, two named
losses, and a validation metric that is not a sum (the median absolute error)."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import Gathered, Mean


@dataclass
class ModelConfig:
    hidden: int = 32
    dropout: float = 0.1  # randomness inside the model: resume must restore it exactly
    unused_layer: bool = False  # a layer forward never uses (DDP then needs find_unused_parameters)


BLOCKS = ()


class TwoHeads(nn.Module):
    def __init__(self, features: int, cfg: ModelConfig):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(features, cfg.hidden), nn.ReLU(), nn.Dropout(cfg.dropout))
        self.main = nn.Linear(cfg.hidden, 1)
        self.aux = nn.Linear(cfg.hidden, 1)
        self.spare = nn.Linear(cfg.hidden, 1) if cfg.unused_layer else None

    def forward(self, x):
        h = self.trunk(x)
        return self.main(h).squeeze(1), self.aux(h).squeeze(1)


def build_model(cfg) -> nn.Module:
    return TwoHeads(cfg.data.features, cfg.model)


def training_step(model, batch, cfg) -> dict:
    main, aux = model(batch.inputs["x"])
    return {"main": F.mse_loss(main, batch.targets.main), "aux": 0.5 * F.l1_loss(aux, batch.targets.aux)}


def build_metrics(cfg) -> dict:
    return {
        "mse": Mean(),
        "median_abs_error": Gathered(compute=lambda errors: errors.median()),
        "quantiles": Gathered(
            compute=lambda errors, aux: {"error_q90": errors.quantile(0.9), "aux_max": torch.stack(aux).max()}
        ),
    }


def validation_step(model, batch, metrics, cfg) -> None:
    # A draw from torch's RNG, as test-time augmentation makes (left out of the metrics, which
    # must not depend on the rank): the check before training must give the RNG back untouched.
    torch.rand(len(batch.targets.main))
    main, aux = model(batch.inputs["x"])
    errors = (main - batch.targets.main).abs()
    metrics["mse"].update(errors.square())
    metrics["median_abs_error"].update(errors)
    metrics["quantiles"].update(errors, list(aux.unbind()))  # a tensor column and a list column
