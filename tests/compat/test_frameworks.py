"""Sleuth with every tool on changes nothing and misses nothing, under the frameworks users
train with: each trains a tiny model for a few optimizer steps under `sleuth run --dump
(mix, statistics) --profile --summary --save-graphs`, and the same script without Sleuth.

Checked per framework: final weights bit-identical to the run without Sleuth; dump steps equal
the framework's own optimizer steps; every step holds forward and backward op records of every
leaf module of the model; graphs exported; under a wrapper (DDP, FSDP, torch.compile) the same
record names as the unwrapped run; a NaN made in the model's code found by
`sleuth check --first-nan` at its op and source line.
"""
from __future__ import annotations

import pytest
import torch

from compat_kit import NAN_STEP, Framework, first_nan, nan_line, records, script_report, weights

pytestmark = [pytest.mark.compat, pytest.mark.slow]

FRAMEWORKS = [
    Framework("nanogpt", "nanogpt.py"),
    Framework("hf_trainer", "hf_trainer.py"),
    Framework("ddp", "nanogpt.py", ranks=2, unwrapped="nanogpt"),
    Framework("lightning", "lightning_cnn.py"),
    Framework("compile_eager", "nanogpt.py", ("--compile", "eager"), unwrapped="nanogpt",
              dump=(("compiled", "eager"),)),
    Framework("compile_inductor", "nanogpt.py", ("--compile", "inductor"), unwrapped="nanogpt"),
    Framework("fsdp2", "nanogpt.py", ("--fsdp",), ranks=2, unwrapped="nanogpt"),
]
BY_NAME = {fw.name: fw for fw in FRAMEWORKS}
_COMPILED = ("a dumped step runs compiled (dump config \"compiled\", the default): it records "
             "each compiled region and Inductor's external calls, not the modules and ops fused "
             "inside the region (\"compiled\": \"interpret\" records them, at the price of "
             "eager kernels)")
_NO_BACKWARD_GRAPH = ("the graph saver takes a compiled model's forward stages by torch.export; "
                      "its backward stage comes from the real call run under a dispatch mode, "
                      "which would run the compiled call eagerly")
XFAIL: dict[tuple[str, str], str] = {
    ("compile_inductor", "ops"): _COMPILED,
    ("compile_inductor", "names"): _COMPILED,
    ("compile_inductor", "nan"): _COMPILED,
    ("compile_inductor", "graphs"): _NO_BACKWARD_GRAPH,
}
"""(framework, check) -> the known tracer gap that makes that check fail"""


def _params(check: str, frameworks=FRAMEWORKS):
    out = []
    for fw in frameworks:
        reason = XFAIL.get((fw.name, check))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(fw, id=fw.name, marks=marks))
    return out


@pytest.mark.parametrize("fw", _params("weights"))
def test_final_weights_are_bit_identical_without_sleuth(fw, compat_run):
    plain, traced = compat_run(fw, "plain"), compat_run(fw, "traced")
    for rank in range(fw.ranks):
        want, got = weights(plain, rank), weights(traced, rank)
        assert sorted(got) == sorted(want)
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, f"rank {rank}: weights differ from the run without Sleuth: {differ}"


@pytest.mark.parametrize("fw", _params("steps"))
def test_dump_steps_are_the_frameworks_optimizer_steps(fw, compat_run):
    traced = compat_run(fw, "traced")
    for rank in range(fw.ranks):
        steps = script_report(traced, rank)["optimizer_steps"]
        assert steps >= 2
        assert sorted(records(traced, rank)) == list(range(steps)), f"rank {rank}"


@pytest.mark.parametrize("fw", _params("ops"))
def test_every_step_holds_the_models_op_records(fw, compat_run):
    traced = compat_run(fw, "traced")
    for rank in range(fw.ranks):
        leaves = script_report(traced, rank)["leaf_modules"]
        assert leaves
        for step, stats in records(traced, rank).items():
            ops = stats[stats["op"] != ""]
            for phase in ("forward", "backward"):
                have = set(ops.loc[ops["phase"] == phase, "module"])
                missing = [m for m in leaves if m not in have]
                assert not missing, (f"rank {rank} step {step}: no {phase} op records of "
                                     f"{len(missing)} of {len(leaves)} modules: {missing[:8]}")


@pytest.mark.parametrize("fw", _params("graphs"))
def test_graphs_are_exported(fw, compat_run):
    ir = compat_run(fw, "traced").run_dir / "ir"
    stages = {p.stem for p in ir.glob("*.ir") if p.stat().st_size > 0} if ir.is_dir() else set()
    assert any("forward" in s for s in stages), f"no forward graph in {ir}: {sorted(stages)}"
    assert any("backward" in s for s in stages), f"no backward graph in {ir}: {sorted(stages)}"


def _accumulation(stats, leaves: list[str]):
    """The records of gradient accumulation (AccumulateGrad's `aten.detach` of a new gradient,
    `aten.add_` onto the one there) in the modules that own parameters."""
    ops = stats["op"].isin(["aten.detach", "aten.add_"]) & (stats["phase"] == "backward")
    return ops & stats["module"].isin(leaves)


@pytest.mark.parametrize("fw", _params("names", [f for f in FRAMEWORKS if f.unwrapped]))
def test_record_names_equal_the_unwrapped_runs(fw, compat_run):
    wrapped = records(compat_run(fw, "traced"), 0)
    plain = records(compat_run(BY_NAME[fw.unwrapped], "traced"), 0)
    assert sorted(wrapped) == sorted(plain)
    leaves = script_report(compat_run(fw, "traced"), 0)["leaf_modules"]
    for step, stats in plain.items():
        theirs = wrapped[step]
        if fw.name == "fsdp2":
            # FSDP2 accumulates gradients itself, into the sharded gradient after each
            # reduce-scatter: every micro-step's unsharded gradient is new (a detach) where
            # the single process adds onto the one there (add_); every other record matches
            stats, theirs = stats[~_accumulation(stats, leaves)], \
                theirs[~_accumulation(theirs, leaves)]
            # its hooks on each sharded block run beside the tracer's module backward hooks,
            # so a module's backward record may come a record or two earlier: ops in order,
            # module records as a set
            ops_want = list(stats.loc[stats["op"] != "", "name"])
            assert list(theirs.loc[theirs["op"] != "", "name"]) == ops_want, f"step {step}"
            stats, theirs = stats.sort_values("name"), theirs.sort_values("name")
        want, got = list(stats["name"]), list(theirs["name"])
        extra = [n for n in got if n not in set(want)][:5]
        missing = [n for n in want if n not in set(got)][:5]
        assert got == want, (f"step {step}: {len(got)} records against {len(want)} unwrapped; "
                             f"only wrapped {extra}, only unwrapped {missing}")


@pytest.mark.parametrize("fw", _params("nan"))
def test_first_nan_names_the_op_and_line_that_made_it(fw, compat_run):
    found = first_nan(compat_run(fw, "nan"))
    origin = found["first_nan"]
    assert found["found"] and origin, found
    assert (origin["op"], origin["step"]) == ("aten.sqrt", NAN_STEP), origin
    assert origin["source"].endswith(nan_line(fw)), origin
