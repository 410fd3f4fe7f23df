"""benchmarks/tracer_overhead.py's timing: what a block of steps counts, and the two ratios."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tracer


def _load():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tracer_overhead.py"
    spec = importlib.util.spec_from_file_location("tracer_overhead_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Tiny(nn.Module):
    """The benchmark's model interface: forward(ids, labels) -> (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, ids, labels):
        out = self.fc(ids)
        return out, (out - labels).pow(2).mean()


class _Draining:
    """Stands in for a Dumper whose writer still has work when the steps are done."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)


def test_a_block_counts_the_drain_at_close_in_its_wall_time_only():
    bench = _load()
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(5)]
    block = bench.timed_block(model, opt, batches, _Draining)
    assert len(block.steps) == 4  # the first step is untimed
    assert block.median < 0.05  # no step waits for the drain
    assert block.wall >= 0.2 and block.per_step >= 0.05


def test_sustained_ratios_follow_wall_time_and_medians_follow_steps():
    bench = _load()
    fast = bench.Block([0.01, 0.01, 0.01], 0.03)
    drained = bench.Block([0.01, 0.01, 0.01], 0.09)  # same steps, three times the wall
    medians, sustained = bench.bracketed_rounds(2, lambda: fast, {"async": lambda: drained})
    assert medians["async"] == pytest.approx([1.0, 1.0])
    assert sustained["async"] == pytest.approx([3.0, 3.0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_device_cuda_without_a_gpu_is_refused_by_name(capsys):
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--models", "tiny"])
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_the_step_file_floor_writes_one_durable_file_per_optimizer_step():
    bench = _load()
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    with bench.floor("floor_step_file") as folder:
        bench.train_steps(model, opt, batches)
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["step0.h5", "step1.h5", "step2.h5"]  # renamed: no partial is left
        assert (folder / "step2.h5").stat().st_size == bench.FLOOR_FILE_BYTES
    assert not folder.exists()
    # a hook left behind would raise here, writing into the removed folder
    bench.train_steps(model, opt, batches[:1])


def test_the_minimal_condition_dumps_the_last_module_alone(tmp_path):
    bench = _load()
    model = _Tiny()
    config = bench.one_module(model, bench.CONDITIONS["module_statistics_minimal"])
    assert config["modules"] == ["fc"] and "_one_module" not in config
    assert bench.one_module(model, {"level": "op"}) == {"level": "op"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    bench.timed_block(model, opt, batches, lambda: tracer.Dumper(model, {**config,
                                                                         "path": str(tmp_path)}))
    dump = tracer.open_dump(tmp_path)
    stats = dump.stats(0, dump.steps(0)[-1])
    assert list(stats["name"].str.split(".").str[0].unique()) == ["fc"]
    assert len(stats) == 1
