"""The baked README: the first screen and a table of docs pages, one page per topic, every
link leading to a page; without a part, no line about it outside its own page."""

import re
from pathlib import Path

import pytest
from conftest import CHOICES, EVERY_PART, OWNED_FILES, PART_ANSWERS, WITHOUT_PARTS, bake

MAX_README_LINES = 250

# How a line that speaks of a part reads, where its answer's own words (e.g. "freezing") do not
# say it; a new part needs an entry only then. Its docs page is the one its manifest entry owns.
MENTIONS = {
    "ema": r"\bEMA\b|\bema[.:]|ema\.md",
    "early_stopping": r"early.stop",
    "freezing": r"\bfreez",
    "profiler": r"\bprofil",
    "tracking": r"tensorboard|wandb|weights & biases|mlflow|\btracking[.:]",
    "memory_report": r"memory (table|report)|nvidia-ml-py|\bNVML\b|\.\[gpu\]|(?<![\w-])memory\.md",
    "throughput": r"\bMFU\b|peak_tflops|count_items|model_tflops",  # a section of outputs.md
    "run_record": r"provenance|train\.log\b|git (commit|state)|flight.recorder",  # sections of outputs.md
    "host_tuning": r"mallopt|set_host_allocator|gc\.freeze|engine/parts/host\.py",  # saving-memory.md
    "pretrained": r"pretrained|ResNet18_Weights|TORCH_HOME",
    "launcher": r"engine\.launch",  # a section of launch.md, no page of its own
    "sweep": r"sweep\.py|\bsweeps?\b",  # a section of outputs.md
    "fsdp": r"\bfsdp|sharded",
    "streams": r"\bstream(s|ing)?\b|IterableDataset",
}
PAGES = {
    answer: {Path(path).name for path in OWNED_FILES[answer] if path.startswith("docs/")} for answer in PART_ANSWERS
}


def mention(answer: str) -> re.Pattern:
    return re.compile(MENTIONS.get(answer, rf"\b{answer.replace('_', '.')}"), re.IGNORECASE)


def test_each_part_has_at_most_one_docs_page_and_every_mention_names_a_part():
    assert all(len(pages) <= 1 for pages in PAGES.values()), PAGES
    assert set(MENTIONS) <= set(PART_ANSWERS)


# Each task with every part and with none; and the default task without one part at a time,
# where the other parts' pages may speak of it.
VARIANTS = [(task, answers) for task in CHOICES["task"] for answers in (EVERY_PART, WITHOUT_PARTS)] + [
    (CHOICES["task"][0], {**EVERY_PART, answer: "no"}) for answer in PART_ANSWERS
]

LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def variant_id(variant) -> str:
    task, answers = variant
    if answers == EVERY_PART:
        return f"{task}-every-part"
    if answers == WITHOUT_PARTS:
        return f"{task}-no-parts"
    return f"{task}-no-{next(name for name, value in answers.items() if value == 'no')}"


@pytest.fixture(scope="module", params=VARIANTS, ids=variant_id)
def project(request, tmp_path_factory):
    task, answers = request.param
    answered_no = {answer for answer, value in answers.items() if value == "no"}
    return bake(tmp_path_factory.mktemp("readme"), task=task, **answers), answered_no


def expected_pages(project, answered_no):
    """The docs pages of the bake but those of the parts answered no (the post-generation
    hook deletes them)."""
    off = {page for answer in answered_no for page in PAGES[answer]}
    return {page for page in (project / "docs").glob("*.md") if page.name not in off}


def links(page):
    return [(page.parent / target).resolve() for target in LINK.findall(page.read_text())]


def test_readme_fits_in_its_line_budget(project):
    project, _ = project
    lines = (project / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_the_first_screen_says_how_to_install_train_resume_and_evaluate(project):
    project, _ = project
    first_screen = "\n".join((project / "README.md").read_text().splitlines()[:40])
    for command in ('pip install -e ".[dev]"', "python train.py", "torchrun", "evaluate.py", "## Where to change what"):
        assert command in first_screen, command
    assert re.search(r"\b(sbatch|srun)\b", first_screen) and "resume" in first_screen.lower()


def test_every_link_to_a_docs_page_leads_to_one(project):
    project, answers = project
    for page in [project / "README.md", *expected_pages(project, answers)]:
        for target in links(page):
            assert target.is_file(), f"{page.name} links to {target.name}, which does not exist"


def test_every_docs_page_is_linked_from_the_readme(project):
    project, answers = project
    linked = set(links(project / "README.md"))
    pages = expected_pages(project, answers)
    assert pages, "no docs pages"
    assert {page.name for page in pages if page.resolve() not in linked} == set()


def test_without_its_part_no_page_speaks_of_it(project):
    project, answers = project
    for answer in answers:
        speaks = mention(answer)
        for page in [project / "README.md", *expected_pages(project, answers)]:
            lines = [line for line in page.read_text().splitlines() if speaks.search(line)]
            assert lines == [], f"{page.name} speaks of {answer}: {lines}"
