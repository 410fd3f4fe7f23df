"""A compact GPT trainer that reads top to bottom, with callbacks the Sleuth tools attach to.

Files: `config.py` (frozen configs and presets), `model.py` (the GPT), `data.py` (byte
tokenizer, json/jsonl/parquet, pretrain packing, SFT masks), `train.py` (the loop), `lora.py`,
`generate.py`. Public names are loaded lazily (PEP 562) so `import trainer` does not import torch;
a test pins this list.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS: dict[str, str] = {
    # configuration
    "TrainConfig": "trainer.config",
    "ModelConfig": "trainer.config",
    "DataConfig": "trainer.config",
    "OptimConfig": "trainer.config",
    "LoRAConfig": "trainer.config",
    "tiny": "trainer.config",
    "small": "trainer.config",
    "load_config": "trainer.config",
    # errors
    "TrainerError": "trainer._errors",
    "ConfigError": "trainer._errors",
    "DataError": "trainer._errors",
    "CheckpointError": "trainer._errors",
    "OtherRunError": "trainer._errors",
    # model, data, loop
    "GPT": "trainer.model",
    "ByteTokenizer": "trainer.data",
    "train": "trainer.train",
    "exit_worker": "trainer._distributed",
    "report_refusal": "trainer._distributed",
    "check_run_dir": "trainer.train",
    "evaluate": "trainer.train",
    "Callback": "trainer._callbacks",
    "TrainState": "trainer._callbacks",
    # run directory
    "RunDir": "trainer._rundir",
    "write_run_json": "trainer._rundir",
    "new_run_id": "trainer._rundir",
    "read_metrics": "trainer._rundir",
    "read_run_id": "trainer._rundir",
    "claim_run_dir": "trainer._claim",
    "remove_run_files": "trainer._claim",
    "scan_run_dir": "trainer._claim",
    # LoRA
    "LoRALinear": "trainer.lora",
    "apply_lora": "trainer.lora",
    "lora_state_dict": "trainer.lora",
    "save_lora": "trainer.lora",
    "load_lora": "trainer.lora",
    "merge_lora": "trainer.lora",
    # generation
    "generate": "trainer.generate",
    "stream_generate": "trainer.generate",
    "load_model": "trainer.generate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


class _Package(types.ModuleType):
    # `train` and `generate` name both a submodule and the function it defines. Importing the
    # submodule binds it on the package; refusing that keeps `trainer.train(config)` the function.
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
