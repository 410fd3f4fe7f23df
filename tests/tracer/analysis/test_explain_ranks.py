"""Two ranks of one run: `sleuth explain --rank R --b-rank R2` (and `--b-step`), the commands
`sleuth diff` suggests carrying the pair it compared, and two rank folders compared as a pair.

The DDP run (torchrun, gloo, the same batch on both ranks, `h = h * 1.5` on rank 1 only) is
made once for the file; the other tests use small statistics dumps."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import tracer
import tracer.analysis
from sleuth.cli import main
from models import torchrun_ddp
from tests.tracer.analysis.test_diff_ranks import write_run

DDP_MUL = """
import sys
import torch, torch.distributed as dist
import tracer

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if rank == 1:
            h = h * 1.5  # the bug, on one rank
        return self.b(h)


model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100)  # the same batch on every rank
with tracer.Dumper(model, {"path": sys.argv[1], "level": "op", "mode": "tensor",
                           "writer": "sync"}):
    for step in range(2):
        x = torch.randn(4, 8, generator=data)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
# torch's gloo threads abort a rank now and then as the interpreter finalizes
# (docs/frameworks.md, "An abort at exit"): exit handlers, then no C++ teardown
import atexit, os, sys; atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)
"""
MUL_LINE = f"ddp.py:{DDP_MUL.splitlines().index('            h = h * 1.5  # the bug, on one rank') + 1}"
"""Where the script multiplies (its line 1 is the empty one after the quotes)."""


def _at_the_mul(source: str) -> bool:
    """The mul's line, as the script's folder on sys.path names it (or a longer path)."""
    return source == MUL_LINE or source.endswith("/" + MUL_LINE)


def _blames_the_mul(out: str) -> bool:
    first = out.split(" (", 1)[0]
    prefix = "bug: op added: B runs aten.mul at "
    return first.startswith(prefix) and _at_the_mul(first[len(prefix):])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    return torchrun_ddp(DDP_MUL, tmp_path_factory.mktemp("ddp_mul"))


def _run_as_printed(out: str, capsys) -> tuple[int, str, str]:
    """Run the `sleuth explain` command the report's verdict line names, as printed."""
    line = next(x for x in out.splitlines() if " the verdict: " in x)
    words = shlex.split(line.split(" the verdict: ", 1)[1])
    assert words[:2] == ["sleuth", "explain"], line
    code = main(words[1:])
    got = capsys.readouterr()
    return code, got.out, line


@pytest.mark.slow
@pytest.mark.parametrize("select", [["--rank", "0", "--b-rank", "1"],
                                    ["--rank", "0", "--b-rank", "1", "--step", "1",
                                     "--b-step", "1"]])
def test_the_explain_command_diff_suggests_compares_the_same_ranks(ddp, select, capsys):
    assert main(["diff", str(ddp), str(ddp), *select]) == 1
    code, out, line = _run_as_printed(capsys.readouterr().out, capsys)
    assert line.endswith(" ".join(select)), line
    assert code == 1, out
    assert _blames_the_mul(out), out


@pytest.mark.slow
def test_explain_pairs_two_ranks_of_one_run(ddp, capsys):
    res = tracer.analysis.explain(ddp, ddp, rank=0, b_rank=1)
    assert res.status == "bug" and res.blamed["fault"] == "added", res.verdict
    assert _at_the_mul(res.blamed["source"]) and res.first_divergence["b_rank"] == 1
    assert tracer.analysis.explain(ddp, ddp, rank=1).status == "same"
    assert main(["explain", str(ddp), str(ddp), "--step", "1", "--b-step", "0", "--rank", "0",
                 "--b-rank", "1", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    fd = doc["first_divergence"]
    assert (fd["step"], fd["b_step"], fd["rank"], fd["b_rank"]) == (1, 0, 0, 1)
    assert main(["explain", str(ddp), str(ddp), "--b-step", "0"]) == 2
    assert "--b-step needs --step" in capsys.readouterr().err


@pytest.mark.slow
def test_two_rank_folders_of_one_run_are_compared_as_a_pair(ddp, capsys):
    a, b = ddp / "dump" / "rank0", ddp / "dump" / "rank1"
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("status: DIVERGED   compared: tensor"), out
    assert "ranks: 0 compared" not in out and "rank 0 vs B step 0, rank 1" in out
    code, out, _ = _run_as_printed(out, capsys)
    assert code == 1 and _blames_the_mul(out), out


def test_two_rank_folders_of_statistics_dumps_are_one_pair(tmp_path, capsys):
    run = write_run(tmp_path / "run", 2, bump={(1, 2, 1): 0.5})
    a, b = run / "dump" / "rank0", run / "dump" / "rank1"
    assert main(["diff", str(a), str(b), "--json"]) == 1
    fd = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (fd["rank"], fd["b_rank"], fd["step"], fd["name"]) == (
        0, 1, 2, "layers.1.forward.0.output.0")
    assert main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.startswith("status: SAME   compared: statistics")


def test_dumps_that_share_no_rank_are_an_error_not_a_divergence(tmp_path, capsys):
    import shutil

    a = write_run(tmp_path / "a", 2)
    b = write_run(tmp_path / "b", 4)
    for r in (0, 1):
        shutil.rmtree(b / "dump" / f"rank{r}")
    assert main(["diff", str(a), str(b)]) == 2
    got = capsys.readouterr()
    assert got.out == "" and len(got.err.strip().splitlines()) == 1, got
    assert "no rank is on both sides (A ranks 0, 1, B ranks 2, 3)" in got.err
    assert "--rank 0 --b-rank 2" in got.err
    with pytest.raises(tracer.TracerError, match="nothing was compared"):
        tracer.diff_ranks(a, b, workers=1)
    assert main(["diff", str(a), str(b), "--rank", "0", "--b-rank", "2"]) == 0


def test_the_rank_report_command_for_all_of_it_runs_as_printed(tmp_path, capsys):
    a = write_run(tmp_path / "a", 2)
    b = write_run(tmp_path / "b", 2, bump={(1, 2, 1): 0.5})
    assert main(["diff", str(a), str(b), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  all of it: "))
    words = shlex.split(line.split(": ", 1)[1])
    assert words == ["sleuth", "diff", str(a), str(b), "--rank", "1", "--step", "2"], line
    assert f"the verdict: sleuth explain {a} {b} --rank 1 --step 2" in out
    assert main(words[1:]) == 1
    assert "first divergence (compute): layers.1.forward.0.output.0" in capsys.readouterr().out


def test_the_explain_command_names_every_selection_given():
    from sleuth._diff_report import explain_command

    assert explain_command("r", "r", 3, 0, None, 4, 1) == \
        "sleuth explain r r --rank 0 --b-rank 1 --step 3 --b-step 4"
    assert explain_command("r", "r", None, 2) == "sleuth explain r r --rank 2"
    assert explain_command("r", "r") == "sleuth explain r r"
