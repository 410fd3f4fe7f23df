"""The optimizer step judged like the model's ops (tracer.analysis._optimizer_replay): an update
that differs while the weights and gradients agree is re-run with B's hyperparameters on A's
records, and the verdict names the hyperparameter that makes it, or says the hyperparameters do
not account for it, or what a statistics dump would need."""
from __future__ import annotations

import torch
from torch import nn

import tracer
from tracer.analysis import explain


def _run(path, cls, mode="tensor", nudge=False, clear_first=False, keep_grads=False,
         **hyper):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = cls(model.parameters(), lr=0.1, **hyper)
    if nudge:  # a step hook that moves the weights after the optimizer (no hyperparameter)
        def hook(optimizer, args, kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)
        opt.register_step_post_hook(hook)
    xs = [torch.randn(5, 4) for _ in range(2)]
    with tracer.Dumper(model, {"path": str(path), "level": "mix", "mode": mode,
                               "steps": "0-1"}):
        for x in xs:
            model(x).pow(2).mean().backward()
            if clear_first:
                opt.zero_grad()  # THE CLEAR: before the step, which then has no gradients
            opt.step()
            if not keep_grads:
                opt.zero_grad()


def test_the_hyperparameter_that_makes_a_later_update_is_named(tmp_path):
    """SGD's momentum leaves the first update alone; the second is re-run from an empty state
    over both steps' recorded weights and gradients, and gives B's."""
    _run(tmp_path / "a", torch.optim.SGD, momentum=0.9)
    _run(tmp_path / "b", torch.optim.SGD, momentum=0.5)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "setup", e.verdict
    assert "(step 1)" in e.verdict and "steps 0 to 1, from an empty state" in e.verdict
    assert "torch's SGD gives B's update" in e.verdict
    assert e.verdict.endswith("momentum alone makes it"), e.verdict


def test_an_update_the_hyperparameters_do_not_account_for_is_said(tmp_path):
    _run(tmp_path / "a", torch.optim.AdamW)
    _run(tmp_path / "b", torch.optim.AdamW, eps=1e-3, nudge=True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert "AdamW eps 1e-08 in A, 0.001 in B" in e.verdict, e.verdict
    assert "does not give B's update" in e.verdict, e.verdict
    assert "the hyperparameters do not account for all of it" in e.verdict


def test_a_statistics_dump_says_what_a_re_run_needs(tmp_path):
    _run(tmp_path / "a", torch.optim.AdamW, mode="statistics")
    _run(tmp_path / "b", torch.optim.AdamW, mode="statistics", eps=1e-3)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "setup", e.verdict
    assert "needs the optimizer's records with tensors: dump both runs with mode tensor" \
        in e.verdict


def test_gradients_cleared_before_the_step_are_named_not_inputs(tmp_path, capsys):
    """`zero_grad()` between the backward and `optimizer.step()`: B's step reads no gradient
    (its grad records have no partner) and leaves the weights alone; never "inputs differ"."""
    _run(tmp_path / "a", torch.optim.SGD)
    _run(tmp_path / "b", torch.optim.SGD, clear_first=True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug", e.verdict
    assert e.verdict.startswith("bug: B's optimizer step reads no gradient of 0.weight and 3 "
                                "more parameters, which A's reads"), e.verdict
    assert "cleared or set to None (a zero_grad before the step)" in e.verdict
    assert e.blamed["fault"] == "no_gradient"
    # the diff's pointer to explain asks for nothing these level-mix tensor dumps lack
    from sleuth.cli import main

    main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "the verdict: sleuth explain" in out and "it re-runs ops" not in out, out


def test_gradients_never_cleared_are_named_as_the_backward_adding_to_them(tmp_path):
    """No `zero_grad()` in B's loop: step 1's backward adds into step 0's gradients."""
    _run(tmp_path / "a", torch.optim.SGD)
    _run(tmp_path / "b", torch.optim.SGD, keep_grads=True)
    e = explain(tmp_path / "a", tmp_path / "b")
    assert e.status == "bug" and e.blamed["fault"] == "written", e.verdict
    assert "writing the gradient of " in e.verdict and "during step 1" in e.verdict
    assert "B does not clear gradients between steps, a zero_grad missing" in e.verdict
