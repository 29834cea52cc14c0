"""The common changes, each made in one of your files only (recipe.py, model.py, train.py):
an optimizer and a schedule of your own, a new metric, and an object of yours saved in the
checkpoints. Each trains on 2 processes, is stopped mid-epoch and resumed, and ends
bitwise equal to a run left alone, under DDP and under FSDP."""

import pytest
import torch

from conftest import FAST, STRATEGIES, project_with, read_metrics, replaced, run_script, strategy_args, tensors
from engine.checkpoint import load_checkpoint
from engine.errors import UsageError
from engine.training import TrainState

STEPS_PER_EPOCH = 256 // (16 * 2)
ARGS = [*FAST, "data.train_size=256", "train.epochs=2"]

OWN_RECIPE = '''

class SignMomentum(torch.optim.Optimizer):
    """The test's own optimizer: steps by the sign of a momentum, with state of its own."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["velocity"] = torch.zeros_like(p)
                state["velocity"].mul_(0.8).add_(p.grad)
                p.add_(state["velocity"].sign(), alpha=-group["lr"])


def build_optimizer(model, cfg, world_size, joins_later):
    return SignMomentum([p for p in model.parameters() if p.requires_grad], lr=0.01)


def build_scheduler(optimizer, cfg, steps_per_epoch):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** (step // 3))
'''

TOP2_METRIC = (
    (
        '    return {"loss": Mean(), "acc": Mean()}',
        '    return {"loss": Mean(), "acc": Mean(), "top2": Mean()}',
    ),
    (
        '    metrics["acc"].update((logits.argmax(dim=1) == labels).float())',
        '    metrics["acc"].update((logits.argmax(dim=1) == labels).float())\n'
        '    metrics["top2"].update((logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1).float())',
    ),
)

OWN_STATE = '''

class LrTally(Part):
    """The test's own checkpointed object: the steps taken and the sum of their lrs."""

    def __init__(self):
        self.steps, self.lr_sum = 0, 0.0

    def after_step(self, state):
        self.steps, self.lr_sum = self.steps + 1, self.lr_sum + state.scheduler.get_last_lr()[0]

    def state_dict(self):
        return {"steps": self.steps, "lr_sum": self.lr_sum}

    def load_state_dict(self, state):
        self.steps, self.lr_sum = state["steps"], state["lr_sum"]
'''
REGISTER = "    return train_loader, val_loader, state\n"


def own_state(text: str) -> str:
    """The object, and the one line that registers it."""
    text = replaced(text, [(REGISTER, '    state.register("lr_tally", LrTally())\n' + REGISTER)])
    text = replaced(text, [("import data\n", "import data\nfrom engine import Part\n")])
    return replaced(text, [('\n\nif __name__ == "__main__":', OWN_STATE + '\n\nif __name__ == "__main__":')])


EDITS = {
    "recipe": ("recipe.py", lambda text: text + OWN_RECIPE),
    "metric": ("model.py", lambda text: replaced(text, TOP2_METRIC)),
    "state": ("train.py", own_state),
}


def run_whole_and_resumed(project, tmp_path, args):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_script("train.py", [*args, f"output_dir={whole}"], nproc=2, cwd=project)
    stop = f"train.stop_at_step={STEPS_PER_EPOCH + 3}"  # mid-epoch, in the second epoch
    run_script("train.py", [*args, f"output_dir={split}", stop], nproc=2, cwd=project)
    assert "resumed from" in run_script("train.py", [*args, f"output_dir={split}"], nproc=2, cwd=project).stdout
    return [load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split)], whole, split


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("change", list(EDITS))
def test_a_change_in_one_user_file_trains_and_resumes_bitwise(tmp_path, change, strategy):
    name, edit = EDITS[change]
    project = project_with(tmp_path, {name: edit})
    (a, b), whole, split = run_whole_and_resumed(project, tmp_path, [*ARGS, *strategy_args(strategy)])
    assert a["step"] == b["step"] == 2 * STEPS_PER_EPOCH
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert a["scheduler"] == b["scheduler"] and a["states"] == b["states"]
    rows_a, rows_b = (read_metrics(out) for out in (whole, split))
    for row_a, row_b in zip(rows_a, rows_b, strict=True):  # every validation metric, to the bit
        assert {k: v for k, v in row_a.items() if "val_" in k} == {k: v for k, v in row_b.items() if "val_" in k}
    if change == "recipe":  # the test's optimizer and schedule ran: its state, its lr
        assert any(key.endswith("velocity") for key in tensors(a["optimizer"]))
        assert a["scheduler"]["_last_lr"][0] == pytest.approx(0.01 * 0.9 ** (2 * STEPS_PER_EPOCH // 3))
    if change == "metric":
        assert all(row["val_top2"] >= row["val_acc"] for row in rows_a)
    if change == "state":
        assert a["states"]["lr_tally"]["steps"] == 2 * STEPS_PER_EPOCH


def test_a_recipe_without_joins_later_is_refused_in_one_line(tmp_path):
    """build_optimizer's signature before 0.9.0, in a project generated without freezing."""
    old = OWN_RECIPE.replace("world_size, joins_later):", "world_size):")
    project = project_with(tmp_path, {"recipe.py": lambda text: text + old})
    result = run_script("train.py", [*ARGS, f"output_dir={tmp_path / 'run'}"], nproc=2, check=False, cwd=project)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors == [
        "error: recipe.py's build_optimizer must take (model, cfg, world_size, joins_later): joins_later maps the "
        "parameters that join training at a later step to that step (empty unless a part holds some back)"
    ], result.stderr


class Counter:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_name_taken_twice_or_an_object_without_state_is_refused_in_one_line():
    state = TrainState(*[None] * 7)
    state.register("counter", Counter())
    with pytest.raises(
        UsageError, match=r"^a checkpointed state is already named 'counter'; register it under another"
    ):
        state.register("counter", Counter())
    with pytest.raises(UsageError, match=r"^'plain': a list has no state_dict\(\) and load_state_dict\(\) to save$"):
        state.register("plain", [])
    assert list(state.states) == ["counter"]
