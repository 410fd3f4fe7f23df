"""The trainer's exceptions: one base class (a `sleuth.common.SleuthError`), and messages that
say how to fix the problem; its config and other-run errors are the shared kinds too."""
from __future__ import annotations

from sleuth.common import ConfigError as _SharedConfigError
from sleuth.common import OtherRunError as _SharedOtherRunError
from sleuth.common import SleuthError


class TrainerError(SleuthError):
    """Base class of every error the trainer raises on purpose."""


class ConfigError(TrainerError, _SharedConfigError):
    """A training config is invalid: the message names the key, the value and a fix."""


class DataError(TrainerError, ValueError):
    """A data file is missing or malformed: the message names the file, the line or row and the field."""


class CheckpointError(TrainerError):
    """A checkpoint or LoRA adapter file is missing, incomplete or does not fit the model."""


class OtherRunError(TrainerError, _SharedOtherRunError):
    """The run directory holds another run's files (or nothing to resume): the message names
    the directory, the other run and the fixes (--overwrite, --resume latest, another --run-dir)."""
