"""The run configuration (docs/config.md): one typed schema, each default written once,
beside its meaning. Its sections are dataclasses: `train`, `checkpoint` and `dist` here, the
project's `data`, `model` and `optim` (data.py, model.py, recipe.py) and each part's
(engine/parts). config.yaml holds what differs from the defaults, `section.key=value`
overrides follow; both read a value as YAML 1.2's core schema does."""

import contextlib
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
from typing import Literal

import yaml

from engine import hooks
from engine.errors import ConfigError
from engine.files import write_text_whole


@dataclass
class TrainConfig:
    epochs: int = 10  # the run's length, unless max_steps is set
    max_steps: int = 0  # the run's length in optimizer steps instead of epochs; 0 = epochs
    batch_size: int = 64  # per process; effective = batch_size x processes x accum_steps
    accum_steps: int = 1  # gradient accumulation: micro-batches per optimizer step
    grad_clip: float = 5.0  # max gradient norm: a guard against rare spikes, not a limit on normal steps; 0 = off
    max_bad_steps: int = 0  # steps with non-finite gradients to skip before stopping (>0: a host sync per step)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp32 | bf16 | fp16 (fp16 needs CUDA; uses a GradScaler)
    activation_checkpointing: bool = False  # recompute model.BLOCKS' activations in backward: less memory
    compile: bool = False  # torch.compile the model (slow first steps, faster later)
    channels_last: bool = False  # NHWC layout for 4-D batch tensors: faster convolutions on recent GPUs
    eval_batch_size: int = 256  # per process; fixed batches in dataset order: the same metrics on any world size
    sanity_check: bool = True  # before training: validation_step and the metrics on 2 batches per process
    num_workers: int = 2  # DataLoader worker processes per process
    log_every_steps: int = 10
    eval_every_steps: int = 0  # evaluate, write a metrics row and save every N steps; 0 = at each epoch's end
    stop_at_step: int = 0  # stop with a checkpoint at this optimizer step; 0 = run all epochs
    deterministic: bool = False  # torch.use_deterministic_algorithms

    def __post_init__(self):
        zero_allowed = ("max_steps", "eval_every_steps", "grad_clip", "max_bad_steps", "stop_at_step", "num_workers")
        for key in ("epochs", "batch_size", "accum_steps", "eval_batch_size", "log_every_steps", *zero_allowed):
            check_positive(f"train.{key}", getattr(self, key), allow_zero=key in zero_allowed)


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
    best_mode: Literal["min", "max"] = "min"  # min | max: whether a lower or a higher best_metric is better

    def __post_init__(self):
        if not self.resume:
            raise ConfigError("checkpoint.resume must be auto, none or a path, got ''")
        check_positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        check_positive("checkpoint.keep_last", self.keep_last)


MIN_TIMEOUT_MINUTES = 0.05


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto (nccl on CUDA, else gloo) | nccl | gloo
    timeout_minutes: float = 30.0  # until the first step: a collective waiting longer fails the run (>= 0.05)
    step_timeout_minutes: float = 10.0  # after it (a hang costs this long): cover a save and an evaluation (>= 0.05)
    sync_bn: bool = True  # BatchNorm -> SyncBatchNorm (CUDA with more than one process only)
    find_unused_parameters: bool = False  # DDP: allow parameters that get no gradient in a step
    static_graph: bool = False  # DDP: the graph never changes between steps (enables optimisations)
    bucket_cap_mb: float = 25.0  # DDP: gradient all-reduce bucket size

    def __post_init__(self):
        for key in ("timeout_minutes", "step_timeout_minutes"):
            minutes = getattr(self, key)
            # 3 s at least: below it a healthy collective "loses contact" (0.001 is not a second)
            if not minutes >= MIN_TIMEOUT_MINUTES:
                raise ConfigError(f"dist.{key} is in minutes: at least {MIN_TIMEOUT_MINUTES} (3 s), got {minutes!r}")
            # 10**6 minutes, about two years: beyond any real run, within what timedelta and step counts hold
            check_at_most(f"dist.{key}", minutes, 10**6)
        check_positive("dist.bucket_cap_mb", self.bucket_cap_mb)
        check_at_most("dist.bucket_cap_mb", self.bucket_cap_mb, 10**6)  # DDP takes int(MiB x 2**20) bytes


@dataclass
class Config:
    seed: int = 0
    output_dir: str = "runs/default"  # checkpoints, metrics.jsonl, the resolved config
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    # The project's sections (data, model, optim) and the parts', by name; cfg.data too.
    sections: dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        vars(self).update(self.sections)
        check_positive("seed", self.seed, allow_zero=True)
        if not self.output_dir:
            raise ConfigError("output_dir must not be empty")
        if self.dist.static_graph and self.train.accum_steps > 1:
            # DDP's static graph cannot skip gradient sync on accumulation micro-batches.
            raise ConfigError("dist.static_graph=true does not work with train.accum_steps > 1; turn one off")

    def to_dict(self) -> dict:
        """Every value as YAML writes it: what a checkpoint stores."""
        return plain(self)


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {shown(value)}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    # Asked as "is it in range?", not "is it out of range?": NaN fails every comparison.
    if not (value > 0 or (allow_zero and value == 0)):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {shown(value)}")


def check_at_most(key: str, value: float, limit: float) -> None:
    if value > limit:
        raise ConfigError(f"{key} must be at most {limit:g}, got {shown(value)}")


class ShortRepr(reprlib.Repr):
    """A repr of bounded length and work: a YAML alias bomb of 300 bytes is 9**9 strings in full."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4
        self.maxstring = self.maxother = self.maxlong = 60

    def repr_int(self, value: int, level: int) -> str:
        if value.bit_length() > 1000:  # repr refuses integers of more than 4300 digits
            return f"<an integer of {value.bit_length()} bits>"
        return super().repr_int(value, level)


def shown(value) -> str:
    """`value` as config errors show it: its repr, cut short."""
    text = ShortRepr().repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None, **sections) -> Config:
    """The config from a YAML file, or else from `base` (a checkpoint's stored config) or the
    defaults, with `a.b=value` overrides applied. `sections`: the project's section classes
    by name (data=DataConfig, model=ModelConfig, optim=OptimConfig); the parts' are added."""
    sections = sections | hooks.sections()
    known = all_keys(Config, sections)
    moved = MOVED_KEYS | {old: new for part in hooks.modules() for old, new in getattr(part, "MOVED_KEYS", {}).items()}
    values = read_yaml(Path(path)) if path is not None else without_retired_keys(base, sections, moved)
    for override in overrides:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {shown(override)} is not of the form section.key=value")
        *names, leaf = key.split(".")
        node = values
        for depth, name in enumerate(names):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(names[: depth + 1])} is a value, not a section")
        if isinstance(node.get(leaf), CliValue):  # as a key written twice in the file: which one was meant?
            raise ConfigError(
                f"{key} is given twice on the command line ({shown(node[leaf])}, then {shown(raw)}); give it once"
            )
        node[leaf] = CliValue(raw)
    try:
        return build(Config, values, "", sections)
    except UnknownKey as error:
        raise ConfigError(unknown_key_message(error.args[0], known, moved)) from None
    except RecursionError:
        raise ConfigError(f"a value in the config or an override nests {TOO_DEEP}") from None


TOO_DEEP = "hundreds of levels deep, too deep to read; a config value is a few levels deep"


# Keys that moved (old: new), for a config written before: train.* went to optim. A part's module
# has its own MOVED_KEYS; where a value changed too, (new key, how to write its value).
MOVED_KEYS = {
    **{f"train.{key}": f"optim.{key}" for key in ("lr", "momentum", "weight_decay", "scale_lr", "reference_batch")},
    **{f"train.{key}": f"optim.{key}" for key in ("schedule", "warmup_epochs", "step_every_epochs", "step_gamma")},
    "train.optimizer": "optim.name",
    "train.warmup_steps": "optim.warmup_steps",
}


def unknown_key_message(key: str, known: list[str], moved: dict) -> str:
    """Where a moved key went, or the known key closest to the one typed: the one key of the
    same name in another section (model.lr: optim.lr), or one a typo or two away."""
    if key in moved:
        new, how = moved[key] if isinstance(moved[key], tuple) else (moved[key], "rename it")
        return f"config key {key!r} moved to {new!r}; {how}"
    leaf = key.rsplit(".", 1)[-1]
    same_name = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    close = same_name if len(same_name) == 1 else difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]!r}?)" if close and "[" not in key else ""  # the schema's keys name no items
    if not hint and "." not in key:  # a whole section, perhaps of a part the project was generated without
        hint = " (a part answered no at generation has no settings; .cookiecutter.json lists the answers)"
    return f"unknown config key {shown(key)}{hint}"


def without_retired_keys(values: dict | None, sections: dict[str, type], moved: dict) -> dict:
    """A checkpoint's stored config without what this project's schema no longer has: keys
    of the machinery's sections (e.g. train.lr, now optim.lr), the sections of parts it was
    generated without, and keys a part moved out of a section. A copy: the overrides go into it."""
    schema = sections | field_types(Config)
    kept = {name: copy.deepcopy(value) for name, value in (values or {}).items() if name in schema}
    for name, value in kept.items():
        if schema[name].__module__.startswith("engine.") and isinstance(value, dict):  # a machinery section
            kept[name] = {key: item for key, item in value.items() if key in schema[name].__dataclass_fields__}
    for section, _, key in (old.rpartition(".") for old in moved):
        if isinstance(kept.get(section), dict):
            kept[section].pop(key, None)
    return kept


def read_yaml(path: Path) -> dict:
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")  # not the machine's locale: a config reads the same anywhere
        values = yaml.load(text, ConfigLoader)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (pass --config PATH)") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests a value {TOO_DEEP}") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text: byte {data[error.start]:#04x} at position "
            f"{error.start} (line {line}) is not valid there; save the file as UTF-8"
        ) from None
    except yaml.reader.ReaderError as error:  # a control character, found before any parsing
        line = text.count("\n", 0, error.position) + 1
        raise ConfigError(f"{path} line {line}: character U+{error.character:04X} is not allowed in YAML") from None
    except yaml.MarkedYAMLError as error:
        syntax = "" if isinstance(error, RefusedYaml) else "YAML syntax error: "
        raise ConfigError(f"{path} line {error.problem_mark.line + 1}: {syntax}{error.problem}") from None
    if not isinstance(values, dict | None):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    return values or {}


# YAML 1.2's core schema (yaml.org/spec/1.2.2, 10.3): a plain (unquoted) scalar's tag by
# its text, and how to read it. PyYAML reads YAML 1.1 instead,
# where 010 is 8, 1:00 is 60 and yes is true: the command line would not agree with the file.
TAG = "tag:yaml.org,2002:"
CORE_SCHEMA = {
    TAG + "null": (r"null|Null|NULL|~|", lambda t: None),
    TAG + "bool": (r"true|True|TRUE|false|False|FALSE", lambda t: t.lower() == "true"),
    TAG + "int": (r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", lambda t: int(t, 0 if t[:2] in ("0o", "0x") else 10)),
    TAG + "float": (  # .inf, .nan: Python spells them without the dot
        r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)",
        lambda t: float(re.sub(r"\.(?=[iInN])", "", t)),
    ),
}


class RefusedYaml(yaml.constructor.ConstructorError):
    """Valid YAML that a config refuses (not a syntax error)."""


class ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load's reading with YAML 1.2's core schema (merge keys, <<, still merge),
    refusing a key written twice in a section: YAML would keep the last without a word."""

    yaml_implicit_resolvers = {"<": [(TAG + "merge", re.compile(r"<<\Z"))]}  # and the core schema's, below

    def construct_mapping(self, node, deep=False):
        first = {}  # each key's line
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == TAG + "merge":
                continue  # merged keys (<<) may be overridden: that is what they are for
            key = self.construct_object(key_node)
            if not isinstance(key, str):  # `1:`, `~:`, `1.5:`: YAML reads them as a number, null or a bool
                kind = "null" if key is None else "a boolean" if isinstance(key, bool) else "a number"
                problem = f"key {key_node.value or '~'!r} is read as {kind}, not a name; write a name"
                raise RefusedYaml(None, None, problem, key_node.start_mark)
            if key in first:
                problem = f"key {shown(key)} is written twice in one section (first on line {first[key]}); keep one"
                raise RefusedYaml(None, None, problem, key_node.start_mark)
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_core_scalar(self, node):
        text = self.construct_scalar(node)
        pattern, read = CORE_SCHEMA[node.tag]
        if not re.fullmatch(pattern, text):  # an explicit tag on other text: !!int 1:00
            problem = f"{shown(text)} is not a {node.tag.removeprefix(TAG)} in YAML 1.2"
            raise RefusedYaml(None, None, problem, node.start_mark)
        try:
            return read(text)
        except ValueError:  # more digits than Python converts (4300)
            raise RefusedYaml(None, None, f"the number {shown(text)} is too long", node.start_mark) from None

    yaml_constructors = {**yaml.SafeLoader.yaml_constructors, **dict.fromkeys(CORE_SCHEMA, construct_core_scalar)}


class ConfigDumper(yaml.SafeDumper):
    """yaml.safe_dump's writing, which also quotes text that YAML 1.2 reads as another type
    (1e5, 0o17): a saved config reads back the same here and in a YAML 1.1 reader."""


for tag, (pattern, _) in CORE_SCHEMA.items():  # plain scalars: text of no other type is a string
    ConfigLoader.add_implicit_resolver(tag, re.compile(rf"(?:{pattern})\Z"), None)
    ConfigDumper.add_implicit_resolver(tag, re.compile(rf"(?:{pattern})\Z"), None)


class CliValue(str):
    """An override's text, read as its field's type: as it is for a str field, else as YAML."""


def field_types(cls: type) -> dict[str, type]:
    """Each key's type: the fields __init__ takes (not a ClassVar), but Config.sections, a dict of them."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and (cls, f.name) != (Config, "sections")}


SCALARS = (bool, int, float, str)


def optional_of(kind):
    """X for `X | None` and `Optional[X]`, else None."""
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else None


def all_keys(cls: type, sections: dict[str, type], prefix: str = "") -> list[str]:
    """Every key of the dataclass `cls` with `sections` besides its fields (Config's), each
    field's type checked: one a config cannot read or write is wrong whatever the config says."""
    return [key for name, kind in (sections | field_types(cls)).items() for key in key_of(f"{prefix}{name}", kind)]


def key_of(key: str, kind, whole=None) -> list[str]:
    """The keys of a field of type `kind` (a sub-section's, else `key`), or a ConfigError for a
    type a config cannot hold; `whole`: the field's type that `kind` is part of."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        return all_keys(kind, {}, f"{key}.")
    if optional_of(kind) is not None:
        return key_of(key, optional_of(kind), whole or kind)
    if (origin is list and len(args) == 1) or (origin is tuple and args):
        for arg in (arg for arg in args if arg is not Ellipsis):
            key_of(key, arg, whole or kind)  # an item's keys are not keys of the schema
    elif not (kind in SCALARS or (origin is typing.Literal and all(type(choice) in SCALARS for choice in args))):
        raise ConfigError(
            f"{key} has type {type_name(whole or kind)}, which a config cannot hold; use bool, int, float, "
            "str, list[T], tuple[T, ...], tuple[T1, T2], T | None, Literal[...] or a dataclass (a sub-section)"
        )
    return [key]


def type_name(kind) -> str:
    """`kind` as written in the schema: int, list[int], int | None."""
    if isinstance(kind, type) and typing.get_origin(kind) is None:
        return kind.__name__
    return repr(kind).replace("typing.", "")


class UnknownKey(ConfigError):
    """A key the schema does not have (its args: the key): load_config words the message."""


def build(cls: type, values, prefix: str, sections: dict[str, type] | None = None):
    """An instance of the dataclass `cls` from nested dicts, every key and type checked;
    `sections`: Config's besides its fields (data, model, optim, the parts')."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a section (key: value lines)")
    schema = (sections or {}) | field_types(cls)
    if unknown := [name for name in values if name not in schema]:
        raise UnknownKey(prefix + unknown[0])
    kwargs = {}
    for name, kind in schema.items():
        if name in values or dataclasses.is_dataclass(kind):  # a section is built even where not written
            kwargs[name] = convert(f"{prefix}{name}", values.get(name, {}), kind)
    own = {name: kwargs.pop(name) for name in field_types(cls) if name in kwargs}
    return cls(**own) if sections is None else cls(**own, sections=kwargs)  # Config's sections: the rest


def convert(key: str, value, kind):
    """`value` as `kind`, or a ConfigError naming the key (an item's as `key[i]`): every value
    of every section comes through here, from the file, the command line or a checkpoint."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if optional_of(kind) is not None:
        typed_null = isinstance(value, CliValue) and re.fullmatch(CORE_SCHEMA[TAG + "null"][0], value.strip())
        return None if value is None or typed_null else convert(key, value, optional_of(kind))
    if origin is typing.Literal:  # a choice of its own type: 1 is not True
        for choice in args:
            with contextlib.suppress(ConfigError):
                if scalar(key, value, type(choice)) == choice:
                    return choice
        raise ConfigError(f"{key} must be one of {', '.join(map(str, args))}; got {shown(value)}")
    if kind in SCALARS:
        return scalar(key, value, kind)
    if isinstance(value, CliValue):  # [32,64] or {a: 1}: read like the same value in the file
        try:
            value = yaml.load(value, ConfigLoader)
        except yaml.YAMLError:
            raise ConfigError(f"{key} must be a YAML value such as [1, 2], got {shown(str(value))}") from None
    if dataclasses.is_dataclass(kind):
        return build(kind, value, f"{key}.")
    if not isinstance(value, (list, tuple)):  # either for either: YAML has lists, a checkpoint tuples
        raise ConfigError(f"{key} must be {type_name(kind)}, got {type(value).__name__} {shown(value)}")
    fixed = origin is tuple and args[-1] is not Ellipsis  # tuple[T1, T2]
    if fixed and len(value) != len(args):
        raise ConfigError(f"{key} must be {type_name(kind)}: {len(args)} items, got {len(value)}: {shown(value)}")
    items = [convert(f"{key}[{i}]", item, args[i] if fixed else args[0]) for i, item in enumerate(value)]
    return items if origin is list else tuple(items)


def scalar(key: str, value, kind: type):
    """`value` as bool, int, float or str: typed text for a str field as it is, for another
    read as in the file; an int for a float. Never NaN, infinity (NaN slips through range
    checks written as `value < 0`) or an integer beyond 64 bits (torch refuses those)."""
    text = str(value) if isinstance(value, CliValue) else None
    if text is not None:
        with contextlib.suppress(yaml.YAMLError):  # unreadable: refused below, as text
            value = text if kind is str else yaml.load(text, ConfigLoader)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        got = shown(text) if text is not None else f"{'null' if value is None else type(value).__name__} {shown(value)}"
        raise ConfigError(f"{key} must be {kind.__name__}, got {got}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {shown(value)}")
    if type(value) is int and not -(2**63) <= value < 2**63:
        raise ConfigError(f"{key} must be between -2**63 and 2**63 - 1, got {shown(value)}")
    return value


def entries(section) -> list[tuple]:
    """(key, value, default) of each key of a section; Config's are the project's sections,
    then its own keys, then the parts' sections."""
    keys = field_types(type(section))
    own = [(f.name, getattr(section, f.name), field_default(f)) for f in dataclasses.fields(section) if f.name in keys]
    if type(section) is not Config:
        return own
    others = [(name, value, dataclasses.MISSING) for name, value in section.sections.items()]
    in_parts = [entry for entry in others if type(entry[1]).__module__.startswith(f"{hooks.PACKAGE}.")]
    return [entry for entry in others if entry not in in_parts] + own + in_parts


def field_default(f: dataclasses.Field):
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the schema's source: beside it, else the comment lines above it."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        if comment := re.match(r"^ +#\s*(.*)$", line):
            above.append(comment[1])
            continue
        if found := re.match(r"^ +(\w+): [^#\n]*?(?:#\s*(.+))?$", line):
            comments[found[1]] = found[2] or " ".join(above)
        above = []
    return comments


def render(section, indent: str = "") -> list[str]:
    """YAML lines for a section: each key with the comment beside it in the schema and, where
    it differs, its default; sub-sections last."""
    comments = field_comments(type(section))
    lines, sections = [], []
    for name, value, default in entries(section):
        if dataclasses.is_dataclass(value):
            sections += ["", f"{indent}{name}:", *render(value, indent + "  ")]
            continue
        line = f"{indent}{name}: {yaml_scalar(value)}"
        note = comments.get(name, "")
        if default is not dataclasses.MISSING and value != default:
            note = f"{note} (default {yaml_scalar(default)})".lstrip()
        lines.append(f"{line:<40} # {note}" if note else line)
    return lines + sections


def yaml_scalar(value) -> str:
    """`value` as one line of YAML that reads back as the same value."""
    text = yaml.dump(plain(value), Dumper=ConfigDumper, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n...\n").strip()


def plain(value):
    """`value` in the types YAML writes, as a checkpoint may also hand it back: tuples as
    lists, dataclasses as mappings, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: plain(item) for name, item, _ in entries(value)}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def format_config(cfg: Config) -> str:
    """The whole config as commented YAML: every key, its value, what it means."""
    return "\n".join(render(cfg)).lstrip("\n") + "\n"


def save_config(cfg: Config, path: Path, header: str = "") -> None:
    """`header`: comment lines above the settings (e.g. what produced the run)."""
    write_text_whole(path, header + format_config(cfg))
