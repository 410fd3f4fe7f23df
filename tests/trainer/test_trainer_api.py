"""The trainer's public API is pinned, and importing it stays light."""
from __future__ import annotations

import subprocess
import sys

import trainer

EXPECTED = [
    "ByteTokenizer", "Callback", "CheckpointError", "ConfigError", "DataConfig", "DataError", "GPT",
    "LoRAConfig", "LoRALinear", "ModelConfig", "OptimConfig", "OtherRunError", "RunDir",
    "TrainConfig", "TrainState", "TrainerError", "apply_lora", "check_run_dir", "claim_run_dir",
    "evaluate",
    "exit_worker", "generate", "load_config",
    "load_lora", "load_model", "lora_state_dict", "merge_lora", "new_run_id", "read_metrics",
    "read_run_id", "remove_run_files", "report_refusal", "save_lora", "scan_run_dir",
    "small", "stream_generate", "tiny", "train", "write_run_json",
]


def test_all_is_pinned_and_sorted():
    assert trainer.__all__ == sorted(EXPECTED)
    for name in trainer.__all__:
        assert getattr(trainer, name) is not None


def test_import_does_not_import_torch():
    code = "import sys, trainer; trainer.__all__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(trainer.__file__).parent.parent))
    assert out.stdout.strip() == "False", out.stderr


def test_train_and_generate_stay_functions_after_submodule_import():
    import trainer.generate  # noqa: F401  binds nothing over the function
    import trainer.train  # noqa: F401

    assert callable(trainer.train) and trainer.train.__name__ == "train"
    assert trainer.generate.__name__ == "generate"
