"""A GRU over padded token sequences, for the tests: two named losses (the sequence's
label, and each token's target weighted by a model attribute), and four metrics, one
of each way to update them: a per-sample Mean, a token-weighted Mean, a Sum of
per-sample rows, and a two-column Gathered AUROC.

`model.mistake` makes one of the mistakes users make, for the tests that catch them.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import Gathered, Mean, Sum


@dataclass
class ModelConfig:
    hidden: int = 32
    token_weight: float = 0.5  # training_step reads it from the run's settings
    # "" | batch_mean | two_columns | loss_none | float_loss | raising_step | plain_metric
    mistake: str = ""


BLOCKS = ()


class Tagger(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(16, 16)
        self.gru = nn.GRU(16, cfg.hidden, batch_first=True)
        self.token_head = nn.Linear(cfg.hidden, 1)
        self.label_head = nn.Linear(cfg.hidden, 1)
        self.mistake = cfg.mistake  # kept on the model: the steps read model.mistake, also under DDP

    def forward(self, tokens, mask):
        states, _ = self.gru(self.embed(tokens))
        last = states[torch.arange(len(tokens)), mask.sum(1) - 1]  # each sequence's last real token
        return self.token_head(states).squeeze(-1), self.label_head(last).squeeze(-1)


def build_model(cfg) -> nn.Module:
    return Tagger(cfg.model)


def token_losses(token_logits, batch):
    return F.binary_cross_entropy_with_logits(token_logits, batch["upper"], reduction="none") * batch["mask"]


def training_step(model, batch, cfg):
    token_logits, label_logits = model(batch["tokens"], batch["mask"])
    label = F.binary_cross_entropy_with_logits(label_logits, batch["label"])
    token = token_losses(token_logits, batch).sum() / batch["mask"].sum()
    if model.mistake == "loss_none":
        label = F.binary_cross_entropy_with_logits(label_logits, batch["label"], reduction="none")
    losses = {"label": label, "token": cfg.model.token_weight * token}
    if model.mistake == "float_loss":
        losses["l2"] = 0.0
    return losses


def count_items(batch):
    return "tokens", batch["mask"].sum()  # a tensor on the device: summed there, no sync per step


def build_metrics(cfg) -> dict:
    metrics = {
        "acc": Mean(),
        "token_loss": Mean(),
        "confusion": Sum((2, 2), compute=lambda m: {"precision": m[1, 1] / m[:, 1].sum().clamp(min=1)}),
        "auroc": Gathered(compute=auroc),
    }
    if cfg.model.mistake == "plain_metric":
        metrics["auroc"] = auroc
    return metrics


def validation_step(model, batch, metrics, cfg) -> None:
    token_logits, label_logits = model(batch["tokens"], batch["mask"])
    predicted, label = (label_logits > 0).long(), batch["label"].long()
    hits = (predicted == label).float()
    if model.mistake == "raising_step":
        raise KeyError("labels")
    if model.mistake == "batch_mean":
        hits = hits.mean()
    if model.mistake == "two_columns":
        hits = torch.stack([hits, hits], dim=1)
    metrics["acc"].update(hits)
    metrics["token_loss"].update(token_losses(token_logits, batch).sum(), count=batch["mask"].sum())
    metrics["confusion"].update(F.one_hot(label * 2 + predicted, 4).reshape(-1, 2, 2))
    metrics["auroc"].update(torch.sigmoid(label_logits), label)


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The chance that a random positive scores above a random negative (ties count half)."""
    positives, negatives = scores[labels == 1], scores[labels == 0]
    above = (positives[:, None] > negatives[None, :]).double().sum()
    ties = (positives[:, None] == negatives[None, :]).double().sum()
    return float((above + ties / 2) / max(len(positives) * len(negatives), 1))
