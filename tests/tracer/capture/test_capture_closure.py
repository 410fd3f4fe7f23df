"""``optimizer.step(closure)``: the forward and backward that the closure runs (LBFGS,
Lightning's automatic optimization) are recorded at every level, in the step that the optimizer
step ends, one ``call`` per closure evaluation; the optimizer's own ops between evaluations are
not records, and the closure's return value, exceptions and gradients are the user's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tracer
from sleuth.cli import main
from tracer.analysis._check import first_nan_origin


def _line(marker: str) -> str:
    """'tests/tracer/capture/test_capture_closure.py:N' of the line of this file holding `marker`."""
    lines = open(__file__).read().splitlines()
    n = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"tests/tracer/capture/test_capture_closure.py:{n}"


class Shifted(nn.Module):
    """A model whose forward makes a NaN while `broken` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.broken:
            h = torch.sqrt(h - 2.0)  # the injected bug
        return self.fc2(h)


def _lbfgs_run(run, level=None, steps=3, nan_step=None, keyword=False):
    """LBFGS on a plain model; returns (losses, closure evaluations per step, final weights)."""
    torch.manual_seed(0)
    model = Shifted()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses, evaluations = [], []
    dumper = (tracer.Dumper(model, {"path": str(run), "level": level, "writer": "sync"})
              if level else None)
    for step in range(steps):
        model.broken = step == nan_step
        count = [0]

        def closure():
            count[0] += 1
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()  # the closure's forward
            loss.backward()
            return loss

        losses.append(opt.step(closure=closure) if keyword else opt.step(closure))
        evaluations.append(count[0])
    if dumper is not None:
        dumper.close()
    return losses, evaluations, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("level", ["op", "mix"])
@pytest.mark.parametrize("keyword", [False, True])
def test_lbfgs_closure_is_recorded_in_every_step(tmp_path, level, keyword):
    plain_losses, evaluations, plain = _lbfgs_run(None, keyword=keyword)
    losses, counts, weights = _lbfgs_run(tmp_path / "run", level, keyword=keyword)
    # the closure's return value and the gradients the optimizer saw are the user's
    assert counts == evaluations and all(n > 1 for n in counts)
    assert [loss.item() for loss in losses] == [loss.item() for loss in plain_losses]
    assert all(torch.equal(weights[k], plain[k]) for k in plain)
    d = tracer.open_dump(tmp_path / "run")
    assert d.steps(0) == [0, 1, 2]  # one step per optimizer step
    for step, n in enumerate(counts):
        df = d.stats(0, step)
        ops = df[df.op != ""]
        assert set(ops.phase) == {"forward", "backward"}, step
        # one call per closure evaluation: the step's names are those of n forwards
        addmm = ops[(ops.module == "fc1") & (ops.op == "aten.addmm")
                    & (ops.phase == "forward") & (ops.direction == "output")]
        assert sorted(addmm.call) == list(range(n)), step
        # the optimizer's own ops (LBFGS's line search, its updates) are not records
        assert set(ops.source) <= {_line("the closure's forward"), _line("the injected bug"),
                                   _line("h = torch.tanh"), _line("return self.fc2"),
                                   _line("loss.backward()")}, step
        assert (df[df.phase == "optimizer"].call == 0).all()
        assert {"fc1.weight.optimizer.0.update.0", "fc1.weight.optimizer.0.grad.0"} \
            <= set(df.name)
    assert torch._C._len_torch_dispatch_stack() == 0


def test_first_nan_in_a_closure_names_the_op_and_line(tmp_path, capsys):
    _lbfgs_run(tmp_path / "run", "op", nan_step=1)
    o = first_nan_origin(tmp_path / "run")
    assert (o["op"], o["module"], o["step"], o["kind"]) == ("aten.sqrt", "<root>", 1,
                                                            "computed")
    assert o["source"] == _line("the injected bug")
    assert main(["check", str(tmp_path / "run"), "--first-nan"]) == 1
    assert "aten.sqrt" in capsys.readouterr().out


def test_closure_exception_reaches_the_caller_unchanged(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    error = ValueError("bad batch")

    def closure():
        model(torch.ones(1, 2)).sum().backward()
        raise error

    with pytest.raises(ValueError) as caught:
        with tracer.Dumper(model, {"path": str(tmp_path / "run"), "level": "op",
                                   "writer": "sync"}):
            opt.step(closure)
    assert caught.value is error
    assert torch._C._len_torch_dispatch_stack() == 0
    d = tracer.open_dump(tmp_path / "run")
    assert d.status(0, 0) == ("interrupted", "ValueError: bad batch")
    assert (d.stats(0, 0).op == "aten.addmm").any()


class _Lookahead(torch.optim.SGD):
    """An optimizer whose step takes something other than a closure first."""

    def step(self, scale=None, closure=None):  # type: ignore[override]
        self.seen = scale
        return super().step(closure)


def test_a_callable_that_is_not_the_closure_is_passed_as_given(tmp_path):
    model = nn.Linear(2, 1)
    opt = _Lookahead(model.parameters(), lr=0.1)

    def scale():
        return 1.0

    with tracer.Dumper(model, {"path": str(tmp_path / "run"), "level": "op", "writer": "sync"}):
        model(torch.ones(1, 2)).sum().backward()
        opt.step(scale)
    assert opt.seen is scale


LIGHTNING_SCRIPT = """
import sys, warnings
import torch
from torch import nn
import lightning
import tracer


class Module(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
module = Module()
trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Lightning's advice (num_workers, ...)
    with tracer.Dumper(module, {"path": sys.argv[1], "level": "mix", "writer": "sync"}):
        trainer.fit(module, loader)
print(trainer.global_step)
"""


@pytest.mark.slow
def test_lightning_automatic_optimization_records_the_model(tmp_path):
    """In its own process: importing Lightning changes process-wide state that changes the
    float results of later tests in the same process (the tracer is not involved)."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    (tmp_path / "fit.py").write_text(LIGHTNING_SCRIPT)
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, str(tmp_path / "fit.py"), str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "3"  # Lightning's global_step
    d = tracer.open_dump(tmp_path / "run")
    assert d.steps(0) == [0, 1, 2]
    for step in d.steps(0):
        df = d.stats(0, step)
        for phase in ("forward", "backward"):
            ops = df[(df.phase == phase) & (df.op != "")]
            assert {"net.0", "net.2"} <= set(ops.module), (step, phase)
        assert "net.0.weight.optimizer.0.update.0" in set(df.name)
