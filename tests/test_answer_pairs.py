"""Every bake the answers allow, tested by construction: a set of bakes in which every pair
of answer values (each yes/no answer of manifest.json, and the task) appears together at
least once. The two bakes whose whole suites run (test_generated_project.py: every part, and
none with the second task) are given, and cover many pairs already; each bake added to them
lints as its own CI does and passes its quick tier."""

import ast
import itertools
import random
import re
import subprocess

import pytest
from conftest import BIN, CHOICES, OWNED_FILES, TOOLS_ENV, WHOLE_SUITES, bake

FACTORS = {"task": CHOICES["task"], **{answer: ["yes", "no"] for answer in OWNED_FILES}}


def covering_bakes(factors: dict[str, list[str]], given: list[dict[str, str]], tries: int = 50) -> list[dict[str, str]]:
    """Answers for a few bakes that, with the `given` ones, cover every pair of values of two
    factors. Each bake is the best of `tries` greedy candidates: start from a pair not yet
    covered, then give the other factors, in a shuffled order, the value covering most pairs
    still uncovered. A fixed seed keeps the set (and each failing bake's id) the same from run
    to run."""
    names, rng = list(factors), random.Random(0)
    uncovered = {
        pair
        for a, b in itertools.combinations(names, 2)
        for pair in itertools.product([(a, v) for v in factors[a]], [(b, v) for v in factors[b]])
    }
    for answers in given:
        uncovered -= pairs_of(answers)
    bakes = []
    while uncovered:
        candidates = [candidate(factors, uncovered, rng) for _ in range(tries)]
        best = max(candidates, key=lambda answers: len(uncovered & pairs_of(answers)))
        uncovered -= pairs_of(best)
        bakes.append(best)
    return bakes


def candidate(factors: dict[str, list[str]], uncovered: set, rng: random.Random) -> dict[str, str]:
    (a, va), (b, vb) = sorted(uncovered)[rng.randrange(len(uncovered))]
    answers = {a: va, b: vb}
    for name in rng.sample(list(factors), len(factors)):
        if name not in answers:
            gain = {value: len(uncovered & pairs_of({**answers, name: value})) for value in factors[name]}
            best = max(gain.values())
            answers[name] = rng.choice([value for value in factors[name] if gain[value] == best])
    return {name: answers[name] for name in factors}


def pairs_of(answers: dict[str, str]) -> set:
    return set(itertools.combinations(answers.items(), 2))


def as_factors(answers: dict) -> dict[str, str]:
    """A bake's answers as the factors' values, the defaults where `answers` says nothing."""

    def value(name: str) -> str:
        given = answers.get(name, CHOICES[name])
        if isinstance(given, list):
            return given[0]  # a choice's default is its first
        return ("yes" if given else "no") if isinstance(given, bool) else given

    return {name: value(name) for name in FACTORS}


GIVEN = [as_factors(answers) for answers in WHOLE_SUITES.values()]
BAKES = covering_bakes(FACTORS, GIVEN)


def bake_id(answers: dict) -> str:
    off = [name for name, value in answers.items() if value == "no"]
    return f"{answers['task']}-without-{'-'.join(off) or 'none'}"


def test_the_bakes_cover_every_pair_of_answer_values():
    names = list(FACTORS)
    for a, b in itertools.combinations(names, 2):
        wanted = set(itertools.product(FACTORS[a], FACTORS[b]))
        assert wanted == {(answers[a], answers[b]) for answers in GIVEN + BAKES}, (a, b)
    assert len(GIVEN + BAKES) <= 12


def part_hooks(project) -> set[str]:
    """The names `engine.Part` defines in this bake."""
    tree = ast.parse((project / "engine" / "hooks.py").read_text())
    part = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Part")
    names = {node.name for node in part.body if isinstance(node, ast.FunctionDef)}
    return names | {
        target.id
        for node in part.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }


def run(command: list[str], project) -> None:
    result = subprocess.run(command, cwd=project, env=TOOLS_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"


def assert_only_defined_hooks_are_called(project) -> None:
    """Every hook the code calls on a part (`part.x`) is one that Part still defines."""
    sources = [*(project / "engine").rglob("*.py"), project / "train.py", project / "evaluate.py"]
    called = {(path.name, name) for path in sources for name in re.findall(r"\bpart\.(\w+)", path.read_text())}
    hooks = part_hooks(project)
    assert [f"{file}: part.{name}" for file, name in sorted(called) if name not in hooks] == []


@pytest.mark.parametrize("answers", BAKES, ids=bake_id)
def test_each_bake_lints_and_passes_its_quick_tier(tmp_path, answers):
    project = bake(tmp_path, **answers)
    run([str(BIN / "ruff"), "check", "."], project)
    run([str(BIN / "ruff"), "format", "--check", "."], project)
    assert_only_defined_hooks_are_called(project)
    run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "quick"], project)


@pytest.mark.parametrize("answers", GIVEN, ids=bake_id)
def test_the_bakes_with_whole_suites_call_only_hooks_part_defines(tmp_path, answers):
    assert_only_defined_hooks_are_called(bake(tmp_path, **answers))
