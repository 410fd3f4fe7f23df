"""The trainer's exceptions: one base class, and messages that say how to fix the problem."""
from __future__ import annotations


class TrainerError(Exception):
    """Base class of every error the trainer raises on purpose."""


class ConfigError(TrainerError, ValueError):
    """A training config is invalid: the message names the key, the value and a fix."""


class DataError(TrainerError, ValueError):
    """A data file is missing or malformed: the message names the file, the line or row and the field."""


class CheckpointError(TrainerError):
    """A checkpoint or LoRA adapter file is missing, incomplete or does not fit the model."""


class OtherRunError(TrainerError):
    """The run directory holds another run's files (or nothing to resume): the message names
    the directory, the other run and the fixes (--overwrite, --resume latest, another --run-dir)."""
