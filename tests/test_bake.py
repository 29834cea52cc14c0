"""Baking the template: every choice renders, bad answers are refused, hostile text is safe."""

import ast
import email.parser
import json
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import BIN, CHOICES, EVERY_PART, OWNED_FILES, PART_ANSWERS, TEMPLATE, WITHOUT_PARTS, bake
from cookiecutter.exceptions import FailedHookException

# The top of a baked project: what the user edits, and one package of machinery.
USER_FILES = {
    *("train.py", "evaluate.py", "export.py", "predict.py", "sweep.py"),
    *("model.py", "data.py", "synthetic_data.py", "recipe.py", "config.yaml"),
}
TOP_LEVEL = USER_FILES | {"engine", "tests", "scripts", "docs", "README.md", "LICENSE", "pyproject.toml"}


def rendered_files(project):
    return [p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_defaults_bake_a_complete_project(baked):
    assert baked.name == "ddp_classifier"
    assert {p.name for p in baked.iterdir() if not p.name.startswith(".")} == TOP_LEVEL
    assert {p.name for p in baked.glob("*.py")} == USER_FILES - {"config.yaml"}
    assert (baked / "scripts" / "slurm" / "train.sbatch").is_file()
    for path in rendered_files(baked):
        text = path.read_text()
        assert not re.search(r"{{\s*cookiecutter|{%", text), path  # nothing left unrendered
        if path.suffix == ".py":
            ast.parse(text, filename=str(path))


@pytest.mark.parametrize("license_name", CHOICES["license"])
def test_every_license_choice(tmp_path, license_name):
    project = bake(tmp_path, license=license_name, author="Ada Lovelace")
    text = (project / "LICENSE").read_text()
    assert "Ada Lovelace" in text
    spdx = {"Proprietary": "LicenseRef-Proprietary"}.get(license_name, license_name)
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["license"] == spdx


@pytest.mark.parametrize("version", CHOICES["python_version"])
def test_every_python_version_choice(tmp_path, version):
    project = bake(tmp_path, python_version=version)
    assert tomllib.loads((project / "pyproject.toml").read_text())["project"]["requires-python"] == f">={version}"


@pytest.mark.parametrize(
    "slug, problem",
    [
        ("2fast", "is not a Python identifier"),
        ("my-project", "is not a Python identifier"),
        ("class", "is a Python keyword"),
        ("torch", "would shadow a module the project imports"),
        ("json", "would shadow a module the project imports"),
        ("engine", "is the name of one of the project's own modules"),
        ("recipe", "is the name of one of the project's own modules"),
    ],
)
def test_bad_slug_is_refused_and_nothing_is_left(tmp_path, slug, problem):
    with pytest.raises(FailedHookException):
        bake(tmp_path, project_slug=slug)
    assert list(tmp_path.iterdir()) == []


def cookiecutter_cli(out, *args):
    """Run cookiecutter's command line into the empty folder `out`: its whole output and exit code."""
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", *args, "-o", str(out)], capture_output=True, text=True
    )
    return result.returncode, result.stdout + result.stderr


def replay_file(folder, **answers):
    """A replay file (as the baked .cookiecutter.json is) with the default answers, overridden by
    `answers`: the route by which a choice outside its list, or a boolean that is not one,
    reaches the template (cookiecutter refuses those itself on its command line)."""
    defaults = {key: value[0] if isinstance(value, list) and key[0] != "_" else value for key, value in CHOICES.items()}
    defaults.update(project_slug="ddp_classifier", description="Image classification.")
    path = folder / "answers.json"
    path.write_text(json.dumps({"cookiecutter": {**defaults, **answers}}))
    return path


# Answers from the command line (key=value), each with the answer its one line must name.
BAD_CLI_ANSWERS = [
    ("author", "author=Bob\nRequires-Dist: evilpkg"),  # a header in the wheel's METADATA
    ("author", "author=Bob\rRequires-Dist: evilpkg"),
    ("author", "author=Bob\u2028Requires-Dist: evilpkg"),
    ("author", "author=Bob\x1b[2J"),  # a terminal escape, into LICENSE
    ("description", "description=One line\nRequires-Dist: evilpkg"),
    ("project_name", "project_name=My\tProject"),
    ("project_name", "project_name={{ 7*7 }}"),  # kept literal; its slug '7_7' is no identifier
    ("project_name", "project_name={% for %}"),  # its slug 'for' is a keyword
    ("project_name", "project_name="),
    ("project_name", "project_name=!!!"),
    ("project_slug", "project_slug={{ cookiecutter.x }}"),
    ("project_slug", "project_slug=torch"),
]
# Answers from a replay file, each with the answer its one line must name.
BAD_REPLAYED_ANSWERS = [
    ("task", {"task": "foo"}),
    ("python_version", {"python_version": "2.7"}),
    ("license", {"license": "GPL"}),
    ("ci_workflow", {"ci_workflow": "maybe"}),
    ("slurm_script", {"slurm_script": 1}),
    ("author", {"author": "Bob\u0085Requires-Dist: evilpkg"}),
]


def assert_one_error_line_and_nothing_left(returncode, output, answer, out):
    assert returncode != 0
    assert "Traceback" not in output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert f"{answer} " in lines[0] and "rerun with e.g." in lines[0], lines[0]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("answer, argument", BAD_CLI_ANSWERS)
def test_a_bad_answer_is_one_line_from_the_cli_and_nothing_is_left(tmp_path, answer, argument):
    returncode, output = cookiecutter_cli(tmp_path, str(TEMPLATE), "--no-input", argument)
    assert_one_error_line_and_nothing_left(returncode, output, answer, tmp_path)


@pytest.mark.parametrize("answer, answers", BAD_REPLAYED_ANSWERS)
def test_a_bad_replayed_answer_is_one_line_and_nothing_is_left(tmp_path, answer, answers):
    replay = replay_file(tmp_path, **answers)
    out = tmp_path / "out"
    out.mkdir()
    returncode, output = cookiecutter_cli(out, "--replay-file", str(replay), str(TEMPLATE))
    assert_one_error_line_and_nothing_left(returncode, output, answer, out)


def test_name_is_turned_into_a_slug(tmp_path):
    assert bake(tmp_path, project_name="My Great Model").name == "my_great_model"


# One line (a line break is refused) of everything else that could break a file it lands in.
HOSTILE = 'It\'s "quoted" and\\back {{ cookiecutter.author }} {% if %} ${{ github }} \u00e9\U0001f600'


@pytest.mark.parametrize("key", ["project_name", "description", "author"])
def test_hostile_free_text_is_kept_verbatim_and_safe(tmp_path, key):
    project = bake(tmp_path, project_slug="hostile", **{key: HOSTILE})
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    if key == "description":
        assert meta["description"] == HOSTILE
    if key == "author":
        assert meta["authors"][0]["name"] == HOSTILE
    for path in rendered_files(project):
        if path.suffix == ".py":
            ast.parse(path.read_text(), filename=str(path))


def test_hostile_text_reaches_the_package_metadata_as_written(tmp_path):
    """setuptools writes author and description raw into the wheel's METADATA headers: built for
    real, they hold the text as written and add no header (a line break would have)."""
    project = bake(tmp_path, project_slug="hostile", author=HOSTILE, description=HOSTILE)
    build = "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('meta'))"
    (project / "meta").mkdir()
    name = subprocess.run([sys.executable, "-c", build], cwd=project, capture_output=True, text=True, check=True)
    text = (project / "meta" / name.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    headers = email.parser.HeaderParser().parsestr(text)
    assert headers["Author"] == HOSTILE and headers["Summary"] == HOSTILE
    declared = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [r for r in headers.get_all("Requires-Dist") if "extra ==" not in r] == declared


def test_hook_knows_every_module_of_the_project(baked):
    hook = (TEMPLATE / "local_extensions.py").read_text()
    block = hook[hook.index("PROJECT_MODULES = {") : hook.index("}", hook.index("PROJECT_MODULES = {"))]
    for module in baked.glob("*.py"):
        assert f'"{module.stem}"' in block, f"add {module.stem!r} to PROJECT_MODULES"


def test_the_machinery_knows_no_task(baked):
    """Loss, metrics and batch structure are the user's: nothing of the classification
    example (its loss, its metric, its batch layout) appears in the engine package."""
    for path in (baked / "engine").rglob("*.py"):
        text = path.read_text()
        for word in ("cross_entropy", "argmax", "val_acc", "num_classes", "labels", "images"):
            assert word not in text, f"{path.name} mentions {word!r}"


def test_the_machinerys_tests_train_a_frozen_copy_of_the_example(baked):
    """tests/reference_task is the example task, train.py and recipe.py, byte for byte, under
    a one-line header: the machinery's tests then hold whatever the user's model.py, data.py,
    config.yaml, train.py and recipe.py become, and test exactly what the user started from."""
    for name in ("model.py", "data.py", "synthetic_data.py", "config.yaml", "train.py", "recipe.py"):
        header, _, body = (baked / "tests" / "reference_task" / name).read_text().partition("\n")
        assert header.startswith(("# The example task, frozen", "# The project's"))
        assert body == (baked / name).read_text(), name


# What names each part in config.yaml and pyproject.toml (README.md and docs/: test_readme.py).
PART_WORDS = {
    "ema": [r"\bema\b", r"\bEMA\b"],
    "early_stopping": [r"early.stop", r"Early stop"],
    "freezing": [r"\bfreeze\.", r"\bfreez", r"\bFreez"],
    "profiler": [r"\bprofiler\b", r"\bProfiler\b"],
    "tracking": [r"\btracking\b", r"TensorBoard", r"tensorboard", r"W&B", r"wandb", r"MLflow", r"mlflow"],
    "memory_report": [r"memory report", r"memory table", r"nvidia-ml-py", r"NVML"],
    "throughput": [r"\bMFU\b", r"peak_tflops", r"count_items"],
    "run_record": [r"provenance", r"train\.log\b", r"git commit", r"flight.recorder"],
    "host_tuning": [r"mallopt", r"set_host_allocator", r"gc\.freeze", r"freeze_setup_objects"],
    "pretrained": [r"\bpretrained\b", r"\bPretrained\b"],
    "launcher": [r"engine\.launch"],
    "sweep": [r"sweep\.py", r"\bsweeps?\b"],
    "fsdp": [r"\bfsdp\b", r"\bFSDP\b", r"sharded"],
}


def test_the_default_answers_leave_only_fsdp_out():
    """As README.md's answers table says. (test_manifest.py checks that every part is a yes/no
    answer, so EVERY_PART and WITHOUT_PARTS bake each one on and off.)"""
    assert [answer for answer in PART_ANSWERS if not CHOICES[answer]] == ["fsdp"]


def print_config_keys(project) -> set[str]:
    printed = subprocess.run(
        [sys.executable, "train.py", "--print-config"], cwd=project, capture_output=True, text=True, check=True
    ).stdout
    keys, section = set(), ""
    for line in printed.splitlines():
        if re.match(r"^\S[^:]*:\s*$", line):
            section = line.rstrip(":") + "."
        elif re.match(r"^\s+\w+:", line):
            keys.add(section + line.split(":")[0].strip())
        elif re.match(r"^\w+:", line):
            keys.add(line.split(":")[0])
    return keys


def test_a_part_answered_no_leaves_no_file_config_key_or_line_of_text(tmp_path):
    full, bare = bake(tmp_path / "full", **EVERY_PART), bake(tmp_path / "bare", **WITHOUT_PARTS)
    full_files, bare_files = ({str(p.relative_to(root)) for p in rendered_files(root)} for root in (full, bare))
    gone = full_files - bare_files
    assert bare_files <= full_files and gone == {path for part in PART_ANSWERS for path in OWNED_FILES[part]}
    assert sorted(p.name for p in (bare / "engine" / "parts").iterdir()) == ["__init__.py"]

    full_keys, bare_keys = print_config_keys(full), print_config_keys(bare)
    # Every part's settings are its own section, named like its module.
    modules = [path for part in PART_ANSWERS for path in OWNED_FILES[part] if path.startswith("engine/parts/")]
    part_sections = tuple(f"{path.removeprefix('engine/parts/').removesuffix('.py')}." for path in modules)
    assert {key for key in full_keys if key.startswith(part_sections)}  # the bake with every part has them
    assert bare_keys == {key for key in full_keys if not key.startswith(part_sections)}

    for path in (bare / "config.yaml", bare / "pyproject.toml"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for part, words in PART_WORDS.items():
                found = [word for word in words if re.search(word, line)]
                assert not found, f"{path.relative_to(bare)}:{number} names the {part} part: {line}"


# What the core of a bake without parts must not name: a "no" removes the code that served
# the part, not only its module. The one line refusing a sharded folder may name the answer.
CORE_NAMES = re.compile(r"\b(ema|EMA|W&B|wandb|mlflow|MLflow|fsdp|FSDP|profiler|freezing|pretrained)\b")
ALLOWED = ("come with the fsdp answer when it is generated",)


def test_the_core_of_a_bake_without_parts_names_none_of_them(tmp_path):
    bare = bake(tmp_path, **WITHOUT_PARTS)
    core = [
        *sorted((bare / "engine").rglob("*.py")),
        *(bare / name for name in ("train.py", "recipe.py", "evaluate.py")),
    ]
    named = [
        f"{path.relative_to(bare)}:{number}: {line.strip()}"
        for path in core
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CORE_NAMES.search(line) and not any(allowed in line for allowed in ALLOWED)
    ]
    assert named == []


@pytest.mark.parametrize("launcher", ["yes", "no"])
def test_the_printed_next_steps_launch_as_the_readme_does(tmp_path, launcher):
    result = subprocess.run(
        [BIN / "cookiecutter", TEMPLATE, "--no-input", "--output-dir", tmp_path, f"launcher={launcher}"],
        capture_output=True,
        text=True,
        check=True,
    )
    launch = "python -m engine.launch --standalone" if launcher == "yes" else "torchrun --standalone"
    printed = [line.strip() for line in result.stdout.splitlines() if "--nproc_per_node" in line]
    assert printed and all(line.startswith(launch) for line in printed), result.stdout
    assert f"{launch} --nproc_per_node" in (tmp_path / "ddp_classifier" / "README.md").read_text()
