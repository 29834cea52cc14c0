"""The run configuration: one typed schema, each default written once, beside its meaning.

The schema is made of sections, each a dataclass. `data` (DataConfig in data.py),
`model` (ModelConfig in model.py) and `optim` (OptimConfig in recipe.py) are the
project's; `train`, `checkpoint` and `dist` below belong to the machinery,
and each optional part has its own (in engine/parts). config.yaml holds
only what a project sets differently from these defaults; `python train.py --print-config`
shows every key with its value and meaning, and each run saves that in
output_dir/config.yaml.

Values come from the YAML file, then from `section.key=value` overrides on the command
line, each key once. Both read a value as YAML 1.2's core schema does (010 is 10, 0o10 is
8, 1:00, 1_000 and yes are text; booleans are true and false). A key the schema does not
know, a value of the wrong type or an invalid value is a `ConfigError` that names the key;
the entry points turn it into one line and exit code 2.

A field's type is bool, int, float, str, list[T], tuple[T, ...], a fixed tuple[T1, T2],
T | None (null in YAML), Literal["a", "b"] or a dataclass (a sub-section, `model.head.x=1`),
with T any of these. On the command line a list, tuple or section is written as in YAML:
`model.widths=[32,64]`.
"""

import copy
import dataclasses
import difflib
import inspect
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import parts
from engine.errors import ConfigError
from engine.files import write_text_whole


@dataclass
class TrainConfig:
    epochs: int = 10  # the run's length, unless max_steps is set
    max_steps: int = 0  # the run's length in optimizer steps instead of epochs (a stream needs it); 0 = epochs
    batch_size: int = 64  # per process; effective = batch_size x processes x accum_steps
    accum_steps: int = 1  # gradient accumulation: micro-batches per optimizer step
    grad_clip: float = 5.0  # max gradient norm: a guard against rare spikes, not a limit on normal steps; 0 = off
    max_bad_steps: int = 0  # steps with non-finite gradients to skip before stopping (>0: a host sync per step)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 needs CUDA; uses a GradScaler)
    activation_checkpointing: bool = False  # recompute model.BLOCKS' activations in backward: less memory
    compile: bool = False  # torch.compile the model (slow first steps, faster later)
    channels_last: bool = False  # NHWC layout for 4-D batch tensors: faster convolutions on recent GPUs
    eval_batch_size: int = 256  # per process; fixed batches in dataset order: the same metrics on any world size
    sanity_check: bool = True  # before training: validation_step and the metrics on 2 batches per process
    num_workers: int = 2  # DataLoader worker processes per process
    log_every_steps: int = 10
{%- if cookiecutter.throughput %}
    peak_tflops: float = 0.0  # one device's peak, for the MFU figure; 0 = a listed GPU's (engine/throughput.py)
{%- endif %}
    eval_every_steps: int = 0  # evaluate, write a metrics row and save every N steps; 0 = at each epoch's end
    stop_at_step: int = 0  # stop with a checkpoint at this optimizer step; 0 = run all epochs
    deterministic: bool = False  # torch.use_deterministic_algorithms

    def __post_init__(self):
        for key in ("epochs", "batch_size", "accum_steps", "eval_batch_size", "log_every_steps"):
            check_positive(f"train.{key}", getattr(self, key))
        zero_allowed = ("max_steps", "eval_every_steps", "grad_clip", "max_bad_steps", "stop_at_step", "num_workers")
        for key in {{ '(*zero_allowed, "peak_tflops")' if cookiecutter.throughput else 'zero_allowed' }}:
            check_positive(f"train.{key}", getattr(self, key), allow_zero=True)
        check_choice("train.precision", self.precision, ("fp32", "bf16", "fp16"))


def effective_batch(train: TrainConfig, world_size: int) -> int:
    """Samples per optimizer step: batch_size x processes x accum_steps."""
    return train.batch_size * world_size * train.accum_steps


@dataclass
class CheckpointConfig:
    resume: str = "auto"  # auto (last.pt in output_dir if any) | none | a checkpoint path
    init_from: str = ""  # fine-tuning: load model weights only from this checkpoint
    every_steps: int = 0  # also checkpoint every N optimizer steps; 0 = at epoch ends only
    keep_last: int = 3  # step checkpoints kept besides last.pt and best.pt
    best_metric: str = "val_loss"  # best.pt is the epoch with the best value of this metric
    best_mode: str = "min"  # min | max: whether a lower or a higher best_metric is better

    def __post_init__(self):
        if not self.resume:
            raise ConfigError("checkpoint.resume must be auto, none or a path, got ''")
        check_positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        check_positive("checkpoint.keep_last", self.keep_last)
        check_choice("checkpoint.best_mode", self.best_mode, ("min", "max"))


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_minutes: float = 30.0  # until the first step: a collective waiting longer fails the run
    step_timeout_minutes: float = 10.0  # after it (a hang costs this long): cover a save and an evaluation
{%- if cookiecutter.run_record %}
    flight_recorder_entries: int = 2000  # collectives each rank keeps for output_dir/flight_recorder (0: off)
{%- endif %}
    sync_bn: bool = True  # BatchNorm -> SyncBatchNorm (CUDA with more than one process only)
    find_unused_parameters: bool = False  # DDP: allow parameters that get no gradient in a step
    static_graph: bool = False  # DDP: the graph never changes between steps (enables optimisations)
    bucket_cap_mb: float = 25.0  # DDP: gradient all-reduce bucket size

    def __post_init__(self):
        check_choice("dist.backend", self.backend, ("auto", "nccl", "gloo"))
        for key in ("timeout_minutes", "step_timeout_minutes"):
            check_positive(f"dist.{key}", getattr(self, key))
            check_at_most(f"dist.{key}", getattr(self, key), MAX_MINUTES)
{%- if cookiecutter.run_record %}
        check_positive("dist.flight_recorder_entries", self.flight_recorder_entries, allow_zero=True)
{%- endif %}
        check_positive("dist.bucket_cap_mb", self.bucket_cap_mb)


@dataclass
class Config:
    seed: int = 0
    output_dir: str = "runs/default"  # checkpoints, metrics.jsonl, the resolved config
{%- if cookiecutter.run_record %}
    provenance: bool = True  # record the git commit: runs git in the project folder; false: no git call
{%- endif %}
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # The project's sections (data, model, optim) and the parts' (engine/parts), by name:
    # cfg.data is cfg.sections["data"].
    sections: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_positive("seed", self.seed, allow_zero=True)
        if not self.output_dir:
            raise ConfigError("output_dir must not be empty")
        if self.dist.static_graph and self.train.accum_steps > 1:
            # DDP's static graph cannot skip gradient sync on accumulation micro-batches.
            raise ConfigError("dist.static_graph=true does not work with train.accum_steps > 1; turn one off")

    def __getattr__(self, name: str):
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"the config has no section {name!r}")

    def to_dict(self) -> dict:
        """Every value as YAML writes it: what a checkpoint stores."""
        return plain(self)


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {shown(value)}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    # Asked as "is it in range?", not "is it out of range?": NaN fails every comparison.
    if not (value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound}, got {shown(value)}")


# Beyond any real run, and within what timedelta and the step counts can hold.
MAX_MINUTES = 10**6  # about two years


def check_at_most(key: str, value: float, limit: float) -> None:
    if value > limit:
        raise ConfigError(f"{key} must be at most {limit:g}, got {shown(value)}")


class ShortRepr(reprlib.Repr):
    """repr with every part bounded: a few items and levels of a container, the middle of
    a long string left out, an integer too long to print by its size."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxother = self.maxlong = 60

    def repr_int(self, value: int, level: int) -> str:
        if value.bit_length() > 1000:  # repr refuses integers of more than 4300 digits
            return f"<an integer of {value.bit_length()} bits>"
        return super().repr_int(value, level)


SHOWN_LENGTH = 80


def shown(value) -> str:
    """`value` as config errors show it: its repr cut short. Bounded work too, not just a
    bounded line: a YAML alias bomb of 300 bytes is a list of 9**9 strings in full."""
    text = ShortRepr().repr(value)
    return text if len(text) <= SHOWN_LENGTH else text[: SHOWN_LENGTH - 3] + "..."


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None, **sections) -> Config:
    """The config from a YAML file with `a.b=value` overrides applied. `sections`: the
    project's own section classes by name (data=DataConfig, model=ModelConfig,
    optim=OptimConfig); the parts' are added (engine/parts).

    Without a file, start from `base` (e.g. a checkpoint's stored config) or the defaults.
    """
    sections = sections | parts.sections()
    schema = section_types(Config, sections)
    values = read_yaml(Path(path)) if path is not None else without_retired_keys(copy.deepcopy(base or {}), schema)
    given = {}
    for override in overrides:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {shown(override)} is not of the form section.key=value")
        if key in given:  # as a key written twice in the file: which one was meant?
            raise ConfigError(
                f"{key} is given twice on the command line ({shown(given[key])}, then {shown(raw)}); give it once"
            )
        given[key] = raw
        set_dotted(values, key, raw)
    for name, kind in schema.items():
        check_type(name, kind)
    try:
        return build(Config, values, prefix="", schema=schema)
    except UnknownKey as error:  # suggested from every key of the schema, the task's sections too
        raise ConfigError(unknown_key_message(error, all_keys(Config, sections))) from None


# Keys that moved (old: new), for a config written before: train.* went to optim:{% if cookiecutter.ema or cookiecutter.early_stopping or cookiecutter.freezing or cookiecutter.profiler or cookiecutter.tracking or cookiecutter.fsdp %} and to
# the parts' sections when those came{% if cookiecutter.fsdp %} (train.strategy=fsdp is fsdp.enabled=true now){% endif %}{% endif %}.
MOVED_KEYS = {
    **{f"train.{key}": f"optim.{key}" for key in ("lr", "momentum", "weight_decay", "scale_lr", "reference_batch")},
    **{f"train.{key}": f"optim.{key}" for key in ("schedule", "warmup_epochs", "step_every_epochs", "step_gamma")},
    "train.optimizer": "optim.name",
    "train.warmup_steps": "optim.warmup_steps",
{%- if cookiecutter.ema %}
    "train.ema_decay": "ema.decay",
    "train.ema_start_step": "ema.start_step",
{%- endif %}
{%- if cookiecutter.early_stopping %}
    "train.early_stopping_patience": "early_stopping.patience",
    "train.early_stopping_min_delta": "early_stopping.min_delta",
{%- endif %}
{%- if cookiecutter.freezing %}
    "train.freeze": "freeze.params",
    "train.freeze_epochs": "freeze.epochs",
{%- endif %}
{%- if cookiecutter.profiler %}
    "train.profile_steps": "profiler.steps",
    "train.profile_start_step": "profiler.start_step",
    "train.profile_all_ranks": "profiler.all_ranks",
{%- endif %}
{%- if cookiecutter.tracking %}
    "train.tensorboard": "tracking.tensorboard",
{%- endif %}
{%- if cookiecutter.fsdp %}
    "train.strategy": "fsdp.enabled",
    "train.fsdp_cpu_offload": "fsdp.cpu_offload",
{%- endif %}
}
# Moved keys whose values changed too: how to write the new one.
NEW_VALUES = {{ '{"train.strategy": "set fsdp.enabled=true for strategy fsdp, false for ddp"}' if cookiecutter.fsdp else '{}' }}


def unknown_key_message(error: "UnknownKey", known: list[str]) -> str:
    """Where a moved key went, or the known key closest to what was typed, if one is close."""
    moved = MOVED_KEYS.get(error.key)
    if moved is None:
        return f"{error}{suggestion(error.key, known)}"
    section = moved.split(".")[0]
    fix = NEW_VALUES.get(error.key, "rename it")
    fix = fix if moved in known else f"this project was generated without the {section} part"
    return f"config key {error.key!r} moved to {moved!r}; {fix}"


def without_retired_keys(values: dict, schema: dict[str, type]) -> dict:
    """A checkpoint's stored config without what this project's schema no longer has: keys
    of the machinery's sections (e.g. train.lr, now optim.lr) and the sections of parts it
    was generated without. The project's own sections (data, model, optim) stay as stored."""
    for name in list(values):
        kind = schema.get(name)
        if kind is None:
            del values[name]
        elif is_machinery_section(kind) and isinstance(values[name], dict):
            known = {f.name for f in dataclasses.fields(kind)}
            values[name] = {key: value for key, value in values[name].items() if key in known}
    return values


def is_machinery_section(kind) -> bool:
    return dataclasses.is_dataclass(kind) and kind.__module__.startswith("engine.")


def read_yaml(path: Path) -> dict:
    values = parse_yaml(read_text(path), path)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    return values


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (pass --config PATH)") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    try:
        return data.decode("utf-8")  # not the machine's locale: a config reads the same anywhere
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text: byte {data[error.start]:#04x} at position "
            f"{error.start} (line {line}) is not valid there; save the file as UTF-8"
        ) from None


def parse_yaml(text: str, path: Path):
    try:
        return load_yaml(text)
    except RefusedYaml as error:
        raise ConfigError(f"{path} line {error.problem_mark.line + 1}: {error.problem}") from None
    except yaml.reader.ReaderError as error:  # a control character, found before any parsing
        line = text.count("\n", 0, error.position) + 1
        raise ConfigError(f"{path} line {line}: character U+{error.character:04X} is not allowed in YAML") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}") from None


# YAML 1.2's core schema (yaml.org/spec/1.2.2, 10.3): how a plain (unquoted) scalar's text
# reads, by its tag; any other text is a string. PyYAML reads YAML 1.1 instead, where 010
# is 8, 1:00 is 60 and yes is true: the command line would not agree with the file.
def read_int(text: str) -> int:
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text)  # base 10, leading zeros too: 010 is 10


def read_float(text: str) -> float:
    if text.lstrip("+-.").lower() in ("inf", "nan"):  # .inf, -.inf, .nan: Python spells them without the dot
        return float(text.replace(".", "", 1))
    return float(text)


CORE_SCHEMA = {
    "tag:yaml.org,2002:null": (re.compile(r"null|Null|NULL|~|"), lambda text: None),
    "tag:yaml.org,2002:bool": (re.compile(r"true|True|TRUE|false|False|FALSE"), lambda text: text.lower() == "true"),
    "tag:yaml.org,2002:int": (re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+"), read_int),
    "tag:yaml.org,2002:float": (
        re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"),
        read_float,
    ),
}


def core_tag(text: str) -> str | None:
    """The tag YAML 1.2's core schema gives a plain scalar's text; None for a string."""
    return next((tag for tag, (pattern, _) in CORE_SCHEMA.items() if pattern.fullmatch(text)), None)


def read_scalar(text: str):
    """A plain scalar's value as YAML 1.2's core schema reads it; ValueError for an integer
    of more digits than Python converts (4300)."""
    tag = core_tag(text)
    return text if tag is None else CORE_SCHEMA[tag][1](text)


def load_yaml(text: str):
    loader = ConfigLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class RefusedYaml(yaml.constructor.ConstructorError):
    """Valid YAML that a config refuses (not a syntax error)."""


class ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load's reading, stricter where a config needs it, with YAML 1.2's core
    schema for plain scalars (merge keys, <<, still merge)."""

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0] and value != "<<":
            return core_tag(value) or "tag:yaml.org,2002:str"
        return super().resolve(kind, value, implicit)

    def construct_mapping(self, node, deep=False):
        # YAML keeps the last of two equal keys without a word: a section written twice
        # would lose the first one's values.
        first_lines = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged keys (<<) may be overridden: that is what they are for
            key = self.construct_object(key_node)
            first = first_lines.get(key)
            if first is not None:
                problem = f"key {shown(key)} is written twice in one section (first on line {first}); keep one"
                raise RefusedYaml(None, None, problem, key_node.start_mark)
            first_lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_core_scalar(self, node):
        text = self.construct_scalar(node)
        pattern, read = CORE_SCHEMA[node.tag]
        if not pattern.fullmatch(text):  # an explicit tag on other text: !!int 1:00
            problem = f"{shown(text)} is not a {node.tag.rsplit(':', 1)[-1]} in YAML 1.2"
            raise RefusedYaml(None, None, problem, node.start_mark)
        try:
            return read(text)
        except ValueError:  # more digits than Python converts (4300)
            problem = f"the number {shown(node.value)} is too long"
            raise RefusedYaml(None, None, problem, node.start_mark) from None

    yaml_constructors = {**yaml.SafeLoader.yaml_constructors, **dict.fromkeys(CORE_SCHEMA, construct_core_scalar)}


class ConfigDumper(yaml.SafeDumper):
    """yaml.safe_dump's writing, which also quotes text that YAML 1.2 reads as another type
    (1e5, 0o17): a saved config reads back the same here and in a YAML 1.1 reader."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == "tag:yaml.org,2002:str":
            return core_tag(value) or tag
        return tag


def set_dotted(values: dict, key: str, raw: str) -> None:
    """Store the raw override string at `key`; `build` converts it to the field's type."""
    *sections, leaf = key.split(".")
    node = values
    for depth, section in enumerate(sections):
        child = node.setdefault(section, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(sections[: depth + 1])} is a value, not a section")
        node = child
    node[leaf] = CliValue(raw)


class CliValue(str):
    """A value typed on the command line: converted from text to the field's type."""


def field_types(cls: type) -> dict[str, type]:
    """Each field's type (not ClassVars such as may_change_on_resume: they are no keys),
    but Config's `sections`, whose keys are the sections themselves."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not is_sections(cls, f.name)}


def is_sections(cls: type, name: str) -> bool:
    return cls is Config and name == "sections"


def section_types(cls: type, sections: dict[str, type]) -> dict[str, type]:
    """Each field's type; for Config, the project's and the parts' sections first."""
    return (sections | field_types(cls)) if cls is Config else field_types(cls)


class UnknownKey(ConfigError):
    def __init__(self, key: str):
        super().__init__(f"unknown config key {shown(key)}")
        self.key = key


def build(cls: type, values, prefix: str, schema: dict[str, type] | None = None):
    """An instance of the dataclass `cls` from nested dicts, checking every key and type;
    `schema`: its fields' types, where they are not its annotations (Config's task sections)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a section (key: value lines)")
    schema = schema or field_types(cls)
    for name in values:
        if name not in schema:
            raise UnknownKey(f"{prefix}{name}")
    kwargs = {}
    for name, kind in schema.items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(kind):  # a section: build it even when the file omits it
            kwargs[name] = convert(key, values.get(name, {}), kind)
        elif name in values:
            kwargs[name] = convert(key, values[name], kind)
    if cls is Config:
        kwargs["sections"] = {name: kwargs.pop(name) for name in list(kwargs) if name not in field_types(Config)}
    return cls(**kwargs)


SCALARS = (bool, int, float, str)


def optional_of(kind):
    """X for `X | None` and `Optional[X]`, else None."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(arg for arg in args if arg is not type(None))
    return None


def check_type(key: str, kind, field_kind=None) -> None:
    """Refuse a field of a type that a config cannot read or write, before any value is read
    (the field is wrong whatever the config says); `field_kind` is the whole type of the field
    that `kind` is part of."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        for name, sub in field_types(kind).items():
            check_type(f"{key}.{name}", sub)
    elif origin is typing.Literal and all(type(choice) in SCALARS for choice in args):
        pass
    elif (origin is list and len(args) == 1) or (origin is tuple and args) or optional_of(kind) is not None:
        for arg in args:
            if arg is not Ellipsis and arg is not type(None):
                check_type(key, arg, field_kind or kind)
    elif kind not in SCALARS:
        raise ConfigError(
            f"{key} has type {type_name(field_kind or kind)}, which a config cannot hold; use bool, int, float, "
            "str, list[T], tuple[T, ...], tuple[T1, T2], T | None, Literal[...] or a dataclass (a sub-section)"
        )


def type_name(kind) -> str:
    """`kind` as written in the schema: int, list[int], int | None."""
    if isinstance(kind, type) and typing.get_origin(kind) is None:
        return kind.__name__
    return repr(kind).replace("typing.", "")


def convert(key: str, value, kind):
    """`value` as `kind`, or a ConfigError naming the key (an item's as `key[i]`): every value
    of every section, the task's too, comes through here, from the file, the command line or a
    checkpoint's stored config."""
    origin = typing.get_origin(kind)
    if optional_of(kind) is not None:
        return None if is_null(value) else convert(key, value, optional_of(kind))
    if origin is typing.Literal:
        return as_choice(key, value, typing.get_args(kind))
    if kind in SCALARS:
        converted = as_kind(key, value, kind)
        check_sensible(key, converted)
        return converted
    if isinstance(value, CliValue):  # [32,64] or {a: 1}: read like the same value in the file
        value = parse_flow(key, value)
    if dataclasses.is_dataclass(kind):
        return build(kind, value, f"{key}.")
    pairs = enumerate(typed_items(key, value, kind))
    items = [convert(f"{key}[{i}]", item, item_kind) for i, (item, item_kind) in pairs]
    return items if origin is list else tuple(items)


def is_null(value) -> bool:
    return value is None or (isinstance(value, CliValue) and core_tag(value.strip()) == "tag:yaml.org,2002:null")


def parse_flow(key: str, text: str):
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        raise ConfigError(f"{key} must be a YAML value such as [1, 2], got {shown(str(text))}") from None


def typed_items(key: str, value, kind) -> list[tuple]:
    """Each item of a list or tuple value with the type it must have. Either is taken for
    either kind: YAML has only lists, a checkpoint's stored config has tuples."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be {type_name(kind)}, got {type(value).__name__} {shown(value)}")
    args = typing.get_args(kind)
    if typing.get_origin(kind) is list or args[-1] is Ellipsis:  # list[T], tuple[T, ...]
        return [(item, args[0]) for item in value]
    if len(value) != len(args):
        raise ConfigError(f"{key} must be {type_name(kind)}: {len(args)} items, got {len(value)}: {shown(value)}")
    return list(zip(value, args, strict=True))


def as_choice(key: str, value, choices: tuple):
    """One of a Literal's choices, of the choice's own type (1 is not True)."""
    for choice in choices:
        try:
            if as_kind(key, value, type(choice)) == choice:
                return choice
        except ConfigError:
            continue
    raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {shown(value)}")


def as_kind(key: str, value, kind: type):
    if isinstance(value, CliValue):
        return convert_text(key, str(value), kind)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if type(value) is kind:
        return value
    got = "null" if value is None else type(value).__name__
    raise ConfigError(f"{key} must be {kind.__name__}, got {got} {shown(value)}")


def check_sensible(key: str, value) -> None:
    """No setting means anything at NaN or infinity (and NaN slips through range checks
    written as `value < 0`), nor at an integer beyond 64 bits (torch refuses those later)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {shown(value)}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ConfigError(f"{key} must be between -2**63 and 2**63 - 1, got {shown(value)}")


def convert_text(key: str, text: str, kind: type):
    """Text typed for a str field as it is; for another, its value as in the file."""
    if kind is str:
        return text
    try:
        value = read_scalar(text.strip())
        return value if type(value) is kind else as_kind(key, value, kind)
    except (ConfigError, ValueError):
        raise ConfigError(f"{key} must be {kind.__name__}, got {shown(text)}") from None


def all_keys(cls: type, sections: dict[str, type], prefix: str = "") -> list[str]:
    keys = []
    for name, kind in section_types(cls, sections).items():
        kind = optional_of(kind) or kind
        if dataclasses.is_dataclass(kind):
            keys += all_keys(kind, sections, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def suggestion(key: str, known: list[str]) -> str:
    """A known key close to `key`: the one key of the same name in another section
    (model.lr: optim.lr), or one a typo or two away (optim.lrr: optim.lr); else nothing."""
    if "[" in key:  # in a list's item: the schema's keys do not name items
        return ""
    leaf = key.rsplit(".", 1)[-1]
    same_name = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    close = same_name if len(same_name) == 1 else difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def field_comments(cls: type) -> dict[str, str]:
    """The comment written beside each field of the dataclass `cls` in its source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = re.findall(r"^ +(\w+): [^#\n]*#\s*(.+)$", source, flags=re.M)
    return dict(found)


def render(section, indent: str = "") -> list[str]:
    """YAML lines for a config section, each value with its comment from the schema and,
    where it differs, the schema's default. Plain keys first, then sub-sections."""
    comments = field_comments(type(section))
    lines, sections = [], []
    for f in fields_of(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            sections += ["", f"{indent}{f.name}:", *render(value, indent + "  ")]
            continue
        notes = [comments.get(f.name, "")]
        default = field_default(f)
        if default is not dataclasses.MISSING and value != default:
            notes.append(f"(default {yaml_scalar(default)})")
        line = f"{indent}{f.name}: {yaml_scalar(value)}"
        note = " ".join(n for n in notes if n)
        lines.append(f"{line:<40} # {note}" if note else line)
    return lines + sections


def fields_of(section) -> list:
    """A section's fields; for Config, its sections as fields, first (data, model, optim...)."""
    fields = [f for f in dataclasses.fields(section) if not is_sections(type(section), f.name)]
    if type(section) is not Config:
        return fields
    own = [name for name, value in section.sections.items() if not is_part(value)]
    part_names = [name for name in section.sections if name not in own]
    return [SectionField(name) for name in own] + fields + [SectionField(name) for name in part_names]


def is_part(section) -> bool:
    return type(section).__module__.startswith(f"{parts.__name__}.")


@dataclass
class SectionField:
    """One of Config.sections, seen as a field: always there, no default to compare."""

    name: str
    default = dataclasses.MISSING
    default_factory = dataclasses.MISSING


def field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def yaml_scalar(value) -> str:
    """`value` as one line of YAML that reads back as the same value."""
    text = yaml.dump(plain(value), Dumper=ConfigDumper, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n...\n").strip()


def plain(value):
    """`value` in the types YAML writes, as a checkpoint may also hand it back: tuples as
    lists, dataclasses as mappings, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields_of(value)}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def format_config(cfg: Config) -> str:
    """The whole config as commented YAML: every key, its value, what it means."""
    return "\n".join(render(cfg)).lstrip("\n") + "\n"


def save_config(cfg: Config, path: Path, header: str = "") -> None:
    """`header`: comment lines above the settings (e.g. what produced the run)."""
    write_text_whole(path, header + format_config(cfg))
