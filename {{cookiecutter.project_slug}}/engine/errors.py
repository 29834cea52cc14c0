"""The errors that stop a run with one line instead of a traceback (engine/logs.py's
`report_errors`): each says what is wrong and what to do. Exit code 2."""


class UsageError(Exception):
    """Bad input from the user (config, data, checkpoint, task code): one line, exit 2."""


class ConfigError(UsageError):
    """A config key with a wrong type or value."""


class TaskError(UsageError):
    """model.py's steps or metrics used wrongly (e.g. a loss that is not one number)."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be read, written or continued from."""


class DivergedError(UsageError):
    """Non-finite gradients: the run stops with its last good checkpoint."""


class OutputDirInUse(UsageError):
    """Another live run holds the output_dir."""


class PeerFailed(UsageError):
    """Another process failed and reports why; this one just stops."""


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C during a training run's stop: it leaves without the stop's checkpoint."""
