"""FSDP with tied weights: a model whose output layer shares its embedding's weight (as
nanoGPT's lm_head and wte do) trains, stays tied and resumes bitwise on 2 processes."""

import json
import shutil

import pytest
import torch
import torch.nn as nn

from conftest import PROJECT, machinery_project, read_metrics, run_script, tensors
from engine.checkpoint import load_checkpoint
from engine.errors import TaskError
from engine.parts.fsdp import check_ties_within_blocks, move_to_meta

# A token model of the test's own on tests/sequence_task's data: each token predicts the
# next token id (modulo the vocabulary) through an output layer tied to its embedding.
TIED_MODEL = """
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import VOCAB
from engine.metrics import Mean


@dataclass
class ModelConfig:
    dim: int = 16


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mix = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.mix(x))


BLOCKS = (Block,)


class TiedTokens(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.block = Block(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.embed.weight = self.head.weight  # tied, as nanoGPT's wte and lm_head

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def build_model(cfg) -> nn.Module:
    return TiedTokens(cfg.model.dim)


def targets(tokens):
    return (tokens + 1) % VOCAB


def training_step(model, batch, cfg):
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits[batch["mask"]], targets(batch["tokens"])[batch["mask"]])
    return {"tokens": loss}


def build_metrics(cfg) -> dict:
    return {"acc": Mean()}


def validation_step(model, batch, metrics, cfg) -> None:
    hits = (model(batch["tokens"]).argmax(-1) == targets(batch["tokens"])).float() * batch["mask"]
    metrics["acc"].update(hits.sum(1) / batch["mask"].sum(1))
"""
RUN = [
    "fsdp.enabled=true",
    "optim.name=adamw",
    "optim.lr=0.05",
    "optim.scale_lr=false",
    "train.batch_size=16",
    "train.num_workers=0",
    "train.epochs=2",
    "data.train_size=512",
    "data.val_size=97",
]  # 16 steps an epoch on 2 processes


def tied_project(folder):
    project = folder / "project"
    shutil.copytree(machinery_project(), project)
    shutil.copy(PROJECT / "tests" / "sequence_task" / "data.py", project / "data.py")
    (project / "model.py").write_text(TIED_MODEL)
    return project


def run_tied(project, script, args, **kwargs):
    return run_script(str(project / script), args, cwd=project, nproc=2, **kwargs)


def test_tied_weights_train_stay_tied_and_resume_bitwise_under_fsdp(tmp_path):
    project = tied_project(tmp_path)
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_tied(project, "train.py", [*RUN, f"output_dir={whole}"])
    weights = load_checkpoint(whole / "checkpoints" / "last.pt")["model"]
    assert torch.equal(weights["embed.weight"], weights["head.weight"])  # one parameter, however saved
    assert read_metrics(whole)[-1]["val_acc"] > 0.5  # 1/16 by chance: it trained

    stopped = run_tied(project, "train.py", [*RUN, f"output_dir={split}", "train.stop_at_step=21"])
    assert "stopped at step 21" in stopped.stdout
    run_tied(project, "train.py", [*RUN, f"output_dir={split}"])
    a, b = (load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split))
    assert a["step"] == b["step"] == 32
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"

    # evaluate.py builds the model the same way: it gives the last epoch's validation.
    evaluated = run_tied(project, "evaluate.py", ["--checkpoint", whole / "checkpoints" / "last.pt", *RUN])
    result = json.loads(evaluated.stdout.splitlines()[-1])
    assert result["val_acc"] == read_metrics(whole)[-1]["val_acc"]


class Layer(nn.Linear):
    pass


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, a layer used twice, a tied buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        twice = Layer(8, 8)
        self.layers = nn.ModuleList([twice, Layer(8, 8), twice])
        self.register_buffer("scale", torch.ones(1))
        twice.register_buffer("scale", self.scale)


def test_rank_0s_model_goes_to_meta_with_its_ties_kept():
    model = Tied()
    move_to_meta(model)
    assert model.head.weight is model.embed.weight and model.embed.weight.is_meta
    assert model.layers[0].weight is model.layers[2].weight
    assert model.layers[0].scale is model.scale and model.scale.is_meta
    assert len(list(model.parameters())) == len(list(Tied().parameters()))


def test_tied_parameters_in_different_fsdp_blocks_are_refused_in_one_line():
    check_ties_within_blocks(Tied(), (nn.ModuleList,))  # each tie used within one block, or in none
    check_ties_within_blocks(Tied(), (Layer,))  # a block used at two places is one block
    with pytest.raises(TaskError) as refused:
        check_ties_within_blocks(Tied(), (nn.Embedding,))
    assert str(refused.value) == (
        "the tied parameters embed.weight (block embed) and head.weight (no block) are in different FSDP blocks, "
        "which cannot share a parameter; take Embedding out of model.py's BLOCKS, or set fsdp.enabled=false"
    )
