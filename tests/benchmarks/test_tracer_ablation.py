"""benchmarks/tracer_ablation.py at its smallest size: its JSON, its switches, its arithmetic."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tracer.storage import _stats

WHERE = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    sys.path.insert(0, str(WHERE))  # it imports tracer_overhead beside it
    try:
        spec = importlib.util.spec_from_file_location("tracer_ablation_under_test",
                                                      WHERE / "tracer_ablation.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(WHERE))
    return module


def _run(bench, capsys, *argv: str) -> dict:
    assert bench.main(["--rounds", "1", "--steps", "1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.skipif(not _stats.kernel_available(),
                    reason="the ablation of the kernel needs it built")
def test_smallest_run_reports_each_device_on_the_gpt_preset(capsys):
    bench = _load()
    out = _run(bench, capsys, "--workloads", "gpt", "--conditions", "module_statistics",
               "--devices", "c_kernel")
    assert out["benchmark"] == "tracer_ablation" and out["rounds"] == 1
    assert out["workloads"]["gpt"]["params"] > 0 and out["workloads"]["gpt"]["baseline_step_s"] > 0
    over = out["overhead"]["module_statistics"]["gpt"]
    assert over["ratio"] > 0 and over["spread"][0] <= over["ratio"] <= over["spread"][1]
    assert set(out["devices"]) == {"c_kernel"}
    for device in out["devices"].values():
        row = device["conditions"]["module_statistics"]["gpt"]
        assert row["on_off"] > 0 and row["on_off_sustained"] > 0
        assert row["gain_pct"] == pytest.approx(100 * (1 / row["on_off"] - 1), abs=0.1)
        assert device["earns_its_place"] == (device["best_gain_pct"] >= 5.0)


@pytest.mark.slow
def test_the_llama_workload_is_built_from_a_config_and_trains(capsys):
    pytest.importorskip("transformers")
    bench = _load()
    out = _run(bench, capsys, "--workloads", "llama", "--conditions", "attached_unselected",
               "--devices", "c_kernel")
    assert out["workloads"]["llama"]["params"] == 15_733_632
    assert out["overhead"]["attached_unselected"]["llama"]["ratio"] > 0
    # the kernel does not act on a step that is not selected: nothing is reported for it
    assert out["devices"]["c_kernel"] == {"conditions": {}}


@pytest.mark.slow
def test_a_device_that_acts_only_on_another_device_is_named_not_measured(capsys):
    bench = _load()
    out = _run(bench, capsys, "--workloads", "gpt", "--conditions", "attached_unselected",
               "--devices", "triton_stats")
    assert out["device"] == "cpu" and out["devices"] == {}
    assert out["not_measured"]["triton_stats"] == "acts on cuda tensors only (--device cpu)"


def test_switches_turn_devices_off_and_restore_them():
    bench = _load()
    before = (_stats._kernel, bench._h5_objects._pack_rows)
    with bench.switched(frozenset({"c_kernel"})):
        assert _stats._kernel is None and bench._h5_objects._pack_rows is None
    assert (_stats._kernel, bench._h5_objects._pack_rows) == before
    kernels = bench._cuda_stats._kernels
    with bench.switched(frozenset({"triton_stats"})):
        assert bench._cuda_stats._kernels is False and _stats._kernel is before[0]
    assert bench._cuda_stats._kernels is kernels
    assert bench.ARMS["no_file_process"] == (frozenset(), {"file_process": False})


def test_each_variant_is_divided_by_the_reference_blocks_around_it():
    bench = _load()
    times = {"ref": [1.0, 3.0, 1.0], "slow": [4.0], "fast": [1.0]}
    seen = []

    def run(arm):
        seen.append(arm)
        t = times[arm].pop(0)
        return bench.overhead.Block([t, t], 2 * t)

    ratios = bench.bracketed(run, "ref", ["fast", "slow"], rotate=1)
    assert seen == ["ref", "slow", "ref", "fast", "ref"]  # rotated by one
    assert ratios == {"ref": (1.0, 1.0), "slow": (2.0, 2.0), "fast": (0.5, 0.5)}
    groups = bench.groups_for("module_statistics", list(bench.DEVICES))
    assert groups["shipped"][0] == "no_dump" and "no_file_process" not in groups["shipped"]
    assert set(groups) == {"shipped"}
    assert "no_c_kernel" in groups["shipped"]


@pytest.mark.slow
def test_op_tensors_are_measured_against_the_disk_floor(capsys):
    bench = _load()
    out = _run(bench, capsys, "--workloads", "gpt", "--conditions", "op_tensor_async",
               "--devices", "file_process")
    row = out["overhead"]["op_tensor_async"]["gpt"]
    assert row["step_file_mb"] > 1 and row["disk_mb_s"] > 0 and row["disk_floor"] > 1
    step = out["workloads"]["gpt"]["baseline_step_s"]
    want = 1 + row["step_file_mb"] / row["disk_mb_s"] / step
    assert abs(row["disk_floor"] - want) < 0.01 * want
    assert abs(row["over_floor"] - row["sustained"] / row["disk_floor"]) < 0.01


@pytest.mark.slow
def test_features_report_what_their_records_cost(capsys):
    """With `--features`, the parameter records and the update record are each measured
    against the tracer without them, the live reference against the tracer without one;
    without an update record the step has no update rows."""
    bench = _load()
    out = _run(bench, capsys, "--workloads", "gpt", "--conditions", "module_statistics",
               "--devices", "file_process", "--features",
               "param_records,update_record,live_reference")
    for feature in ("param_records", "update_record", "live_reference"):
        row = out["features"][feature]["conditions"]["module_statistics"]["gpt"]
        assert row["with_without"] > 0
        assert row["cost_pct"] == pytest.approx(100 * (row["with_without"] - 1), abs=0.1)
    assert bench.groups_for("module_statistics", [], ["update_record"]) == {
        "shipped": ["no_dump", "no_update"]}


def test_without_the_pre_step_copy_a_step_has_no_update_records(tmp_path):
    import torch

    import tracer

    bench = _load()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bench.switched(frozenset({"update_record"})):
        with tracer.Dumper(model, {"path": str(tmp_path)}):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
    dump = tracer.open_dump(tmp_path)
    kinds = set(dump.stats(0, 0)["direction"])
    assert "param" in kinds and "grad" in kinds and "update" not in kinds
    assert tracer.capture.ParamRecords._snapshot is not bench._no_snapshot


@pytest.mark.slow
def test_statistics_rows_report_the_in_run_floor(capsys):
    """Beside each statistics ratio: one pass of the kernel over the tensors a dumped step
    records, no hooks, as a ratio to the step, and the overhead over it."""
    bench = _load()
    out = _run(bench, capsys, "--workloads", "gpt", "--conditions",
               "module_statistics,attached_unselected", "--devices", "file_process")
    row = out["overhead"]["module_statistics"]["gpt"]
    assert row["stats_floor"] > 1
    assert row["over_stats_floor"] == pytest.approx(row["ratio"] / row["stats_floor"], abs=0.01)
    assert "stats_floor" not in out["overhead"]["attached_unselected"]["gpt"]
