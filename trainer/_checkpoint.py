"""Checkpoints: `RUN/checkpoints/step{S}/` with model, optimizer and loop state, written atomically.

Layout of one checkpoint (S = optimizer steps completed):
  model.pt       the model's state dict (LoRA-wrapped layers included when LoRA is on)
  trainer.pt     {"optimizer": state dict, "step": int, "data_position": int, "rng": {...}}
  adapter.pt     LoRA adapters only (when LoRA is on), the format `trainer.load_lora` reads
  meta.json      format_version, step, the resolved config, each file's sha256 (checked at load); written last, so its presence
                 marks a complete checkpoint
Everything is tensors, ints, floats and strings, so `torch.load(weights_only=True)` reads it.
The directory is built as `step{S}.partial` and renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from sleuth.common import UntrustedFileError, kind_problem, read_bounded
from trainer._errors import CheckpointError
from trainer._rundir import FORMAT_VERSION, RunDir


def _save(obj: Any, path: Path) -> str:
    """Save `obj` to `path`, durably; return the file's sha256 (kept in meta.json)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return _sha256(path)


def _sha256(path: Path) -> str:
    # torch.load reads a zip without checking its members' CRCs: a flipped byte in a weight
    # would load as a different weight
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def rng_state() -> dict[str, torch.Tensor]:
    """RNG states as tensors (weights_only-safe)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def save_checkpoint(directory: Path, *, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                    step: int, data_position: int, config: dict[str, Any],
                    extra: dict[str, Any] | None = None, run_id: str = "") -> Path:
    """Write a complete checkpoint directory atomically and return its path.

    `extra` maps further file names (e.g. "adapter.pt") to objects saved alongside.
    """
    partial = directory.with_name(directory.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    files = {"model.pt": _save(model_state, partial / "model.pt"),
             "trainer.pt": _save({"optimizer": optimizer_state, "step": step,
                                  "data_position": data_position, "rng": rng_state()},
                                 partial / "trainer.pt")}
    for name, obj in (extra or {}).items():
        files[name] = _save(obj, partial / name)
    meta = {"format_version": FORMAT_VERSION, "step": step, "config": config,
            "sha256": files}
    if run_id:  # the run a resume continues (the tools' files carry it: SLEUTH_RUN_ID)
        meta["run_id"] = run_id
    with open(partial / "meta.json", "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if directory.exists():  # rewriting the same step (a resumed run); replace it whole
        shutil.rmtree(directory)
    os.replace(partial, directory)
    return directory


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, given it or a run directory (its latest checkpoint).

    Raises:
        CheckpointError: nothing complete is found there.
    """
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = RunDir(path).latest_checkpoint()
    if latest is None:
        raise CheckpointError(f"no complete checkpoint at {path} (expected {path}/meta.json or "
                              f"{path}/checkpoints/step<S>/meta.json); train with checkpoint_every > 0")
    return latest


_META_LIMIT = 1 << 20  # a checkpoint's meta.json is a few KB; a larger one is not the trainer's
_FIX = "pick another checkpoint (RUN/checkpoints/step<S>/) or train again to write a new one"


def read_meta(directory: Path) -> dict[str, Any]:
    """meta.json of a checkpoint, checked: a JSON object with a known format_version and the
    config it was trained with. Raises CheckpointError naming the file otherwise."""
    path = directory / "meta.json"
    try:
        meta = json.loads(read_bounded(path, _META_LIMIT).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError,
            UntrustedFileError) as e:
        raise CheckpointError(f"cannot read {path}: {e}; {_FIX}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, not a checkpoint's "
                              f"metadata object; {_FIX}")
    major = str(meta.get("format_version", "0")).split(".")[0]
    if major != FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(f"{directory} has checkpoint format {meta.get('format_version')}; "
                              f"this trainer reads {FORMAT_VERSION}")
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{path} lacks the model config it was trained with; {_FIX}")
    return meta


def _load(path: Path) -> Any:
    """torch.load of a checkpoint file, after checking it against the sha256 its meta.json
    recorded (checkpoints written before that have none: loaded as they are)."""
    problem = kind_problem(path)
    if problem:  # a FIFO would hold the hash and torch.load forever
        raise CheckpointError(f"{path}: {problem}; {_FIX}")
    want = _recorded_sha256(path)
    if want is not None and path.is_file() and _sha256(path) != want:
        raise CheckpointError(f"{path} is damaged: its sha256 differs from the one recorded in "
                              f"{path.parent / 'meta.json'} when it was written; {_FIX}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; {_FIX}") from e
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways inside torch.load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {first}): it is "
                              f"damaged or not a checkpoint file; {_FIX}") from e


def _recorded_sha256(path: Path) -> str | None:
    try:
        meta = json.loads(read_bounded(path.parent / "meta.json", _META_LIMIT).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError,
            UntrustedFileError):
        return None  # read_meta, called first by every loader, reports a bad meta.json
    files = meta.get("sha256") if isinstance(meta, dict) else None
    digest = files.get(path.name) if isinstance(files, dict) else None
    return digest if isinstance(digest, str) else None


def load_model_state(directory: Path) -> dict[str, torch.Tensor]:
    state = _load(directory / "model.pt")
    if not isinstance(state, dict):
        raise CheckpointError(f"{directory / 'model.pt'} holds a {type(state).__name__}, not a "
                              f"model state dict; {_FIX}")
    return state


def load_model_into(model: torch.nn.Module, directory: Path) -> None:
    """Load the checkpoint's weights into `model`, every key and shape matching."""
    try:
        model.load_state_dict(load_model_state(directory))
    except RuntimeError as e:
        raise CheckpointError(f"{directory}/model.pt does not fit this model config ({e}); "
                              f"use the model settings it was trained with") from e


def load_trainer_state(directory: Path) -> dict[str, Any]:
    path = directory / "trainer.pt"
    state = _load(path)
    missing = [k for k in ("optimizer", "step", "data_position", "rng")
               if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it is not a complete trainer "
                              f"state; {_FIX}")
    return state
