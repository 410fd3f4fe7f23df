"""torch.compile under a dump with "compiled": "eager": every dumped step runs the compiled model
eagerly and records what an eager run records, whenever torch.compile first traced it; steps not dumped run compiled,
with no graph break of the tracer's; one warning line says so; the compiler's stance is the
user's again once a dumped step ends."""
from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch import nn

import tracer
from tracer.capture import _compiled

pytestmark = pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 1))


def _train(run, level, steps_cfg, backend=None, steps=6):
    """A plain loop; `backend` None: eager. Returns (dump or None, caught warnings, counters of
    graphs compiled and graph breaks, final weights)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _net()
    call = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    batches = [torch.randn(4, 8) for _ in range(steps)]
    dumper = (tracer.Dumper(model, {"path": str(run), "level": level, "writer": "sync",
                                    "steps": steps_cfg, "compiled": "eager"})
                if level else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in batches:
            call(x).sum().backward()
            opt.step()
            opt.zero_grad()
        if dumper is not None:
            dumper.close()
    compiled = {"graphs": counters["stats"]["unique_graphs"],
                "breaks": sum(counters["graph_break"].values())}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return (tracer.open_dump(run) if level else None), caught, compiled, weights


def _notes(caught):
    return [str(w.message) for w in caught if "torch.compile'd code" in str(w.message)]


@pytest.mark.parametrize("level", ["module", "mix"])
@pytest.mark.parametrize("steps_cfg", ["2|4", "0|4"])
def test_dumped_steps_of_a_compiled_model_record_the_eager_model(tmp_path, level, steps_cfg):
    eager, _, _, eager_w = _train(tmp_path / "eager", level, steps_cfg)
    dump, caught, compiled, weights = _train(tmp_path / "compiled", level, steps_cfg,
                                             backend="eager")
    selected = [int(s) for s in steps_cfg.split("|")]
    assert dump.steps(0) == eager.steps(0) == selected
    for step in selected:
        a, b = eager.stats(0, step), dump.stats(0, step)
        assert list(b.name) == list(a.name) and (b.phase == "forward").any(), step
        assert (b.checksum == a.checksum).all(), step  # the eager backend computes the same
    # steps not dumped ran compiled, without graph breaks of the tracer's; told in one line
    assert compiled["graphs"] >= 1 and compiled["breaks"] == 0
    assert len(_notes(caught)) <= 1 and _notes(caught) == [_compiled.EAGER_NOTE] * len(
        _notes(caught))
    assert all(torch.equal(weights[k], eager_w[k]) for k in eager_w)
    from torch._dynamo import eval_frame

    assert eval_frame._stance.stance == "default"


def test_the_note_is_one_line_and_comes_once(tmp_path, monkeypatch):
    monkeypatch.setattr(_compiled, "_told", False)
    _, caught, _, _ = _train(tmp_path / "run", "module", "2|4", backend="eager")
    assert _notes(caught) == [_compiled.EAGER_NOTE] and "\n" not in _compiled.EAGER_NOTE


def test_a_users_stance_is_kept(tmp_path):
    torch.compiler.set_stance("eager_on_recompile")
    try:
        _train(tmp_path / "run", "module", "1", backend="eager", steps=3)
        from torch._dynamo import eval_frame

        assert eval_frame._stance.stance == "eager_on_recompile"
    finally:
        torch.compiler.set_stance("default")


@pytest.mark.slow
def test_inductor_steps_not_dumped_stay_compiled(tmp_path):
    start = time.time()
    eager, _, _, _ = _train(tmp_path / "eager", "mix", "0|3", steps=4)
    dump, _, compiled, _ = _train(tmp_path / "compiled", "mix", "0|3", backend="inductor",
                                  steps=4)
    assert compiled["graphs"] >= 1 and compiled["breaks"] == 0
    for step in (0, 3):
        assert list(dump.stats(0, step).name) == list(eager.stats(0, step).name)
    print(f"inductor test: {time.time() - start:.1f} s")
