"""A compact GPT trainer that reads top to bottom, with callbacks the Sleuth tools attach to.

Files: `config.py` (frozen configs and presets), `model.py` (the GPT), `data.py` (byte
tokenizer, json/jsonl/parquet, pretrain packing, SFT masks), `train.py` (the loop), `lora.py`,
`generate.py`. Public names are loaded lazily (PEP 562) so `import trainer` does not import torch;
a test pins this list.
"""
from __future__ import annotations

from sleuth.common import lazy_exports as _lazy_exports

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
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
