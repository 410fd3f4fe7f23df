"""The CLI wiring the packages together: `sleuth train` tool flags, `sleuth run` on a stranger's
script, and the demo, each checked through the public readers of what they wrote."""
from __future__ import annotations

import json
import textwrap

import pytest

from sleuth.cli import main

# A training script Sleuth never saw: plain nn.Module, plain loop, no Sleuth import.
_STRANGER = textwrap.dedent("""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(6):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("done", float(loss))
""")


@pytest.mark.slow
def test_sleuth_run_attaches_every_tool_to_an_unmodified_script(tmp_path, sleuth_cli):
    import irdump
    import profiler
    import tracer

    script = tmp_path / "train.py"
    script.write_text(_STRANGER)
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"steps": "0|3", "level": "mix", "mode": "statistics"}))
    run = tmp_path / "run"
    proc = sleuth_cli("run", "--run-dir", str(run), "--dump", str(cfg), "--profile", "--summary",
                      "--save-graphs", "--strict", "--", "python", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout

    assert json.loads((run / "run.json").read_text())["argv"][-1] == str(script)
    dump = tracer.open_dump(run)
    assert dump.steps(rank=0) == [0, 3]
    stats = dump.stats(rank=0, step=3)
    assert {"forward", "backward", "optimizer"} <= set(stats["phase"])
    assert "0.forward.0.output.0" in set(stats["name"])        # the first Linear, by its name
    assert (stats["source"].str.startswith("train.py:")).any()  # the user's own line
    assert not profiler.read_profile(run).ops.empty
    assert not profiler.read_scalars(run).empty
    assert len(irdump.list_graphs(run)) >= 1


def test_train_flags_reject_a_bad_dump_config_before_training(tmp_path, capsys):
    bad = tmp_path / "dump.json"
    bad.write_text('{"stepz": "0"}')
    code = main(["train", "--set", "steps=1", "--run-dir", str(tmp_path / "r"), "--dump", str(bad)])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown key 'stepz'; did you mean 'steps'?" in err
    assert not (tmp_path / "r" / "run.json").exists()


@pytest.mark.slow
def test_train_with_tools_then_diff(tmp_path, capsys):
    import profiler
    import tracer

    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"steps": "0|2", "level": "module", "mode": "full", "writer": "sync"}))
    runs = []
    for name, extra in (("a", []), ("b", ["--set", "optim.lr=0.5"])):
        run = tmp_path / name
        code = main(["train", "--set", "steps=3", "--set", "eval_every=0", "--run-dir", str(run),
                     "--dump", str(cfg), "--summary", *extra])
        assert code == 0
        runs.append(run)
    assert tracer.open_dump(runs[0]).steps(rank=0) == [0, 2]
    tags = set(profiler.read_scalars(runs[0])["tag"])
    assert {"train/loss", "train/lr", "train/grad_norm"} <= tags
    # Same seed and data, another learning rate: step 0 agrees until the optimizer's update;
    # by step 2 the weights the step starts from differ, and the diff blames them, not the
    # forward activations they cause.
    for step, kind in (("0", ".update.0"), ("2", ".param.0")):
        capsys.readouterr()
        assert main(["diff", str(runs[0]), str(runs[1]), "--step", step, "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "diverged"
        assert report["first_divergence"]["phase"] == "optimizer"
        assert report["first_divergence"]["name"].endswith(kind), report["first_divergence"]
    capsys.readouterr()
    assert main(["diff", str(runs[0]), str(runs[0]), "--step", "2"]) == 0
