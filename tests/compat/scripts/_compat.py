"""What every compatibility script shares: where results go, and the NaN switch.

The scripts are trained as a user would train them, with nothing of Sleuth in them; the test
reads back what they leave in `$COMPAT_OUT`: `weights{rank}.pt` (the final state_dict, to
compare bit for bit with a run without Sleuth) and `steps{rank}.json` (how many optimizer
steps the framework itself says it took, and the model's leaf modules that hold parameters).
`COMPAT_NAN_STEP=K` makes the model's own code (a line marked `# compat: NaN`) produce a NaN
in optimizer step K, for `sleuth check --first-nan` to find.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

_STEP = {"now": -1}


def nan_step() -> int:
    """The optimizer step in which the model makes a NaN (-1: never)."""
    return int(os.environ.get("COMPAT_NAN_STEP", "-1"))


def set_step(step: int) -> None:
    """Tell the model which optimizer step the coming forward belongs to."""
    _STEP["now"] = step


def nan_now() -> bool:
    """Whether the model should make its NaN in this forward (the NaN step's)."""
    return _STEP["now"] == nan_step() >= 0


def save(model: torch.nn.Module, optimizer_steps: int, rank: int = 0) -> None:
    """Write the final weights and the framework's step count into $COMPAT_OUT."""
    out = Path(os.environ["COMPAT_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):  # FSDP2's shards: every rank takes part in the gather
            v = v.full_tensor()
        state[k] = v.detach().clone().cpu()
    torch.save(state, out / f"weights{rank}.pt")
    leaves = [name for name, m in model.named_modules()
              if not any(m.children()) and next(m.parameters(recurse=False), None) is not None]
    (out / f"steps{rank}.json").write_text(json.dumps({"optimizer_steps": optimizer_steps,
                                                       "leaf_modules": leaves}))
