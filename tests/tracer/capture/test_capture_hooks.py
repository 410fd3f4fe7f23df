"""Capture logic tested against an in-memory writer: naming, calls, hard cases, filters, steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tracer
import tracer._dumper as dumper_module
from models import (MLP, CheckpointedMLP, CustomFnModel, FakeWriter, InplaceModel, SharedLayer,
                    SmallCNN, SmallLSTM, TinyCausalLM, TinyConfig)


@pytest.fixture
def writers(monkeypatch, tmp_path):
    made: list[FakeWriter] = []

    def make(config, rank, world_size):
        made.append(FakeWriter(config, rank, world_size))
        return made[-1]

    monkeypatch.setattr(dumper_module, "_make_writer", make)
    monkeypatch.chdir(tmp_path)
    return made


def cfg(**kw):
    return {"writer": "sync", **kw}


def train(model, make_batch, steps=1, micro=1, dumper=None, explicit=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        for _ in range(micro):
            out = model(*make_batch())
            loss = out.float().pow(2).mean() if isinstance(out, torch.Tensor) else out["loss"]
            loss.backward()
        opt.step()
        opt.zero_grad()
        if explicit:
            dumper.step()
    return opt


def mlp_batch():
    return (torch.randn(2, 8),)


def by_name(w):
    return {m.name: (m, t) for _, m, t in w.records}


def test_module_level_names_follow_the_format(writers):
    torch.manual_seed(0)
    model = MLP()
    # tensor mode: the writer gets the update's values (statistics mode: its statistics only)
    with tracer.Dumper(model, cfg(level="module", mode="tensor")) as d:
        train(model, mlp_batch)
    (w,) = writers
    assert w.steps == [0] and w.closed
    names = w.names()
    assert names[:8] == ["<root>.forward.0.input.0", "fc1.forward.0.input.0",
                         "fc1.forward.0.output.0", "act.forward.0.input.0",
                         "act.forward.0.output.0", "fc2.forward.0.input.0",
                         "fc2.forward.0.output.0", "<root>.forward.0.output.0"]
    assert "fc2.backward.0.output.0" in names and "fc2.backward.0.input.0" in names
    assert names[-3:] == ["fc2.bias.optimizer.0.param.0", "fc2.bias.optimizer.0.grad.0",
                          "fc2.bias.optimizer.0.update.0"]
    recs = by_name(w)
    meta, t = recs["fc1.forward.0.output.0"]
    assert (meta.module, meta.op, meta.phase, meta.direction, meta.index, meta.call) == \
        ("fc1", "", "forward", "output", 0, 0)
    assert meta.source.startswith("tests/tracer/models.py:") or meta.source.endswith(
        "models.py:" + meta.source.rsplit(":", 1)[1])
    # update = after - before, with SGD lr 0.1: -0.1 * grad
    _, grad = recs["fc1.weight.optimizer.0.grad.0"]
    _, update = recs["fc1.weight.optimizer.0.update.0"]
    torch.testing.assert_close(update, -0.1 * grad)
    _, before = recs["fc1.weight.optimizer.0.param.0"]
    torch.testing.assert_close(before + update, model.fc1.weight.detach())


def test_source_is_the_user_line(writers):
    model = MLP()
    with tracer.Dumper(model, cfg()) as d:
        x = torch.randn(2, 8)
        model(x).sum().backward()  # THIS LINE
        d.step()
    (w,) = writers
    src = by_name(w)["<root>.forward.0.input.0"][0].source
    path, line = src.rsplit(":", 1)
    assert path.endswith("test_capture_hooks.py")
    with open(__file__) as f:
        assert "THIS LINE" in f.read().splitlines()[int(line) - 1]
    assert by_name(w)["fc2.backward.0.output.0"][0].source == src


def _line_of(source: str) -> str:
    with open(__file__) as f:
        return f.read().splitlines()[int(source.rsplit(":", 1)[1]) - 1]


def test_backward_source_follows_each_backward_call(writers):
    """Backward records of one backward() call share its line (found once per backward pass);
    the next call, on another line, gets its own, and ops in a hand-written backward point at
    that backward."""
    torch.manual_seed(0)
    model = CustomFnModel()
    with tracer.Dumper(model, cfg(level="mix", params=False)) as d:
        model(torch.randn(3, 4)).sum().backward()  # FIRST BACKWARD
        model(torch.randn(3, 4)).sum().backward()  # SECOND BACKWARD
        d.step()
    records = [m for _, m, _ in writers[0].records if m.phase == "backward"]
    # fc's module records count its calls; its ops' records (fc::aten.*) follow them
    second_at = next(i for i, m in enumerate(records) if m.name == "fc.backward.1.output.0")
    first = [m for m in records[:second_at] if m.module == "fc"]
    second = [m for m in records[second_at:] if m.module == "fc"]
    assert len(first) > 5 and len(second) > 5
    assert {"FIRST BACKWARD" in _line_of(m.source) for m in first} == {True}
    assert {"SECOND BACKWARD" in _line_of(m.source) for m in second} == {True}
    custom = {m.source for m in records if m.module == "<root>" and m.op == "aten.mul"}
    assert custom and all(s.rsplit(":", 1)[0].endswith("models.py") for s in custom), custom


def test_module_called_twice_counts_calls(writers):
    model = SharedLayer()
    with tracer.Dumper(model, cfg(level="mix")) as d:
        train(model, lambda: (torch.randn(3, 4),))
    names = writers[0].names()
    for n in ["fc.forward.0.output.0", "fc.forward.1.output.0", "fc.backward.0.output.0",
              "fc.backward.1.output.0", "fc::aten.addmm.forward.0.output.0",
              "fc::aten.addmm.forward.1.output.0"]:
        assert n in names
    assert "fc.forward.2.output.0" not in names
    # the weight is recorded once per step even though the module ran twice
    assert names.count("fc.weight.optimizer.0.grad.0") == 1


def test_tied_parameters_recorded_once_under_first_name(writers):
    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig())
    ids = torch.randint(0, 64, (2, 8))
    with tracer.Dumper(model, cfg(level="module")):
        out = model(input_ids=ids, labels=ids)
        out["loss"].backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    names = writers[0].names()
    assert "embed_tokens.weight.optimizer.0.grad.0" in names
    assert not any(n.startswith("lm_head.weight.") for n in names)


def test_inplace_op_records_value_before_and_after(writers):
    torch.manual_seed(0)
    model = InplaceModel()
    x = torch.randn(2, 4)
    with tracer.Dumper(model, cfg(level="op", params=False)) as d:
        model(x)
        d.step()
    recs = by_name(writers[0])
    _, before = recs["<root>::aten.mul_.forward.0.input.0"]
    _, after = recs["<root>::aten.mul_.forward.0.output.0"]
    _, added = recs["<root>::aten.add_.forward.0.output.0"]
    expected = model.fc(x).detach()
    torch.testing.assert_close(before, expected)
    torch.testing.assert_close(after, expected * 2)
    torch.testing.assert_close(added, expected * 2 + 1)


def test_inplace_relu_module_input_recorded_before_modification(writers):
    torch.manual_seed(0)
    model = SmallCNN()
    with tracer.Dumper(model, cfg(level="module")):
        train(model, lambda: (torch.randn(2, 3, 8, 8),))
    recs = by_name(writers[0])
    _, relu_in = recs["features.2.forward.0.input.0"]
    _, relu_out = recs["features.2.forward.0.output.0"]
    assert relu_in.min() < 0 and relu_out.min() >= 0
    torch.testing.assert_close(relu_in.clamp(min=0), relu_out)
    assert "features.1.running_mean.optimizer.0.param.0" not in recs  # buffers are not params
    assert "features.1.weight.optimizer.0.update.0" in recs
    assert "features.0.backward.0.output.0" in recs


def test_hf_style_model_tuple_dict_and_kwargs(writers):
    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig())
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    with tracer.Dumper(model, cfg(level="mix")) as d:
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        d.step()
    recs = by_name(writers[0])
    # keyword inputs follow positional ones: input_ids, attention_mask, labels
    torch.testing.assert_close(recs["<root>.forward.0.input.0"][1], ids)
    torch.testing.assert_close(recs["<root>.forward.0.input.1"][1], mask)
    torch.testing.assert_close(recs["<root>.forward.0.input.2"][1], ids)
    # layer output is (hidden, None): the None is skipped
    assert "layers.0.forward.0.output.0" in recs and "layers.0.forward.0.output.1" not in recs
    # dict output: loss, logits, then the hidden-state tuple
    assert recs["<root>.forward.0.output.0"][1].dim() == 0
    assert recs["<root>.forward.0.output.1"][1].shape == (2, 8, 64)
    assert "<root>.forward.0.output.4" in recs  # 3 hidden states after loss and logits
    assert "layers.1.self_attn::aten.softmax.forward.0.output.0" in recs or \
        "layers.1.self_attn::aten._softmax.forward.0.output.0" in recs
    assert any(n.startswith("layers.0.self_attn.q_proj::aten.") and ".backward." in n
               for n in recs)
    assert recs["layers.0.self_attn.backward.0.output.0"][0].phase == "backward"


def test_lstm_model(writers):
    torch.manual_seed(0)
    model = SmallLSTM()
    with tracer.Dumper(model, cfg(level="mix")):
        train(model, lambda: (torch.randint(0, 32, (2, 5)),))
    recs = by_name(writers[0])
    # nn.LSTM returns (output, (h, c)): three tensors in pytree order
    assert recs["lstm.forward.0.output.0"][1].shape == (2, 5, 16)
    assert recs["lstm.forward.0.output.2"][1].shape == (1, 2, 16)
    assert "lstm.weight_ih_l0.optimizer.0.update.0" in recs
    assert any(n.startswith("lstm::aten.") and ".backward." in n for n in recs)


def test_custom_autograd_function_backward_is_scoped(writers):
    torch.manual_seed(0)
    model = CustomFnModel()
    with tracer.Dumper(model, cfg(level="op")):
        train(model, lambda: (torch.randn(3, 4),))
    names = writers[0].names()
    # Square's forward runs in <root>; its hand-written backward runs two muls in <root> too
    assert "<root>::aten.mul.forward.0.output.0" in names
    assert "<root>::aten.mul.backward.1.output.0" in names
    assert any(n.startswith("fc::aten.mm.backward.") for n in names)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_not_counted_as_new_calls(writers, reentrant):
    torch.manual_seed(0)
    model = CheckpointedMLP(reentrant=reentrant)
    x = torch.randn(2, 8, requires_grad=True)
    with tracer.Dumper(model, cfg(level="mix", params=False)) as d:
        model(x).sum().backward()
        d.step()
    names = writers[0].names()
    assert "blocks.0.0.forward.0.output.0" in names
    assert not any(".forward.1." in n for n in names), [n for n in names if ".forward.1." in n]
    assert names.count("blocks.0.0.forward.0.output.0") == 1
    assert "blocks.0.0.backward.0.output.0" in names
    assert "blocks.1.backward.0.input.0" in names
    fw_ops = [n for n in names if "::" in n and ".forward." in n]
    assert len(fw_ops) == len(set(fw_ops))
    assert any(n.startswith("blocks.1.1::aten.") and ".backward." in n for n in names)
    # every name once: the recomputed forward gets the very input tensor the first one hooked,
    # whose gradient must not be recorded twice under one name
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, twice


def test_bf16_autocast(writers):
    model = MLP()
    with tracer.Dumper(model, cfg(level="mix", params=False)) as d:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(2, 8))
        out.float().sum().backward()
        d.step()
    recs = by_name(writers[0])
    assert recs["fc1.forward.0.output.0"][1].dtype == torch.bfloat16
    assert recs["fc1.forward.0.input.0"][1].dtype == torch.float32
    assert recs["fc2.backward.0.output.0"][1].dtype == torch.bfloat16
    assert any(n.startswith("fc1::aten._to_copy.forward.") for n in recs)


def test_no_grad_eval_has_forward_records_only(writers):
    model = MLP()
    with tracer.Dumper(model, cfg(level="mix", params=False)) as d:
        with torch.no_grad():
            model(torch.randn(2, 8))
        d.step()
    phases = {m.phase for _, m, _ in writers[0].records}
    assert phases == {"forward"}


def test_gradient_accumulation_one_step_file_increasing_calls(writers):
    model = MLP()
    with tracer.Dumper(model, cfg(level="mix")):
        train(model, mlp_batch, steps=2, micro=3)
    w = writers[0]
    assert w.steps == [0, 1]
    names = w.names(step=0)
    for call in range(3):
        assert f"fc1.forward.{call}.output.0" in names
        assert f"fc1.backward.{call}.output.0" in names
        assert f"fc1::aten.addmm.forward.{call}.output.0" in names
    assert "fc1.forward.3.output.0" not in names
    assert names.count("fc1.weight.optimizer.0.grad.0") == 1
    assert w.names(step=1) == names  # same code, same names, next step


def test_names_are_stable_across_runs(writers):
    def run():
        torch.manual_seed(0)
        model = TinyCausalLM(TinyConfig())
        ids = torch.randint(0, 64, (2, 8))
        with tracer.Dumper(model, cfg(level="mix")):
            train(model, lambda: (ids, None, ids), steps=2)
        return writers[-1].names()

    first, second = run(), run()
    assert first == second and len(first) > 500


def test_optimizer_ops_are_not_records(writers):
    model = MLP()
    opt = torch.optim.Adam(model.parameters())
    with tracer.Dumper(model, cfg(level="op")):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    recs = writers[0].records
    assert not any("_foreach" in m.op or "addcdiv" in m.op for _, m, _ in recs)
    assert {m.phase for _, m, _ in recs} == {"forward", "backward", "optimizer"}


def test_filters_io_phases_modules(writers):
    model = MLP()
    with tracer.Dumper(model, cfg(modules=["fc*"], io="output", phases="forward",
                                  params=False)) as d:
        model(torch.randn(2, 8)).sum().backward()
        d.step()
    assert writers[0].names() == ["fc1.forward.0.output.0", "fc2.forward.0.output.0"]


def test_module_filter_matching_nothing_lists_close_matches(writers):
    with pytest.raises(tracer.ConfigError, match="fc1"):
        tracer.Dumper(MLP(), cfg(modules=["fc3"]))


def test_step_selection_and_hooks_only_in_selected_steps(writers):
    from torch.nn.modules import module as nn_module

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = []
    with tracer.Dumper(model, cfg(steps="1|3", level="op")) as d:
        for _ in range(4):
            hooked.append(bool(nn_module._global_forward_pre_hooks))
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        assert d.current_step == 4
    assert hooked == [False, True, False, True]
    assert writers[0].steps == [1, 3]
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert not torch._C._len_torch_dispatch_stack()


def test_explicit_step_stops_optimizer_counting(writers):
    model = MLP()
    with tracer.Dumper(model, cfg()) as d:
        opt = train(model, mlp_batch, steps=1, micro=1)  # counted by the optimizer hook: step 0
        # explicit from now on; the optimizer step just ended step 0, so this ends nothing (a
        # step of parameter records alone would put every later step one off the loop's)
        d.step()
        assert d.current_step == 1
        for _ in range(2):  # two optimizer steps inside step 1
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        assert d.current_step == 1
        d.step()
        assert d.current_step == 2
    w = writers[0]
    assert w.steps == [0, 1]
    names = w.names(step=1)
    assert "fc1.weight.optimizer.0.update.0" in names and "fc1.weight.optimizer.1.update.0" in names


def test_global_attach_without_model(writers):
    model = MLP()
    criterion = nn.MSELoss()
    with tracer.Dumper(None, cfg()) as d:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = criterion(model(torch.randn(2, 8)), torch.zeros(2, 4))
        loss.backward()
        opt.step()
    names = writers[0].names()
    assert names[0] == "<root>.forward.0.input.0" and "fc1.forward.0.output.0" in names
    assert "<root1>.forward.0.output.0" in names  # the loss module ran as a second top level
    assert "fc1.weight.optimizer.0.update.0" in names


def test_unselected_rank_writes_nothing(writers):
    with tracer.Dumper(MLP(), cfg(ranks="1"), rank=0) as d:
        assert not d.enabled
    assert writers == []


def test_hooks_removed_after_close_even_on_error(writers):
    from torch.nn.modules import module as nn_module

    model = MLP()
    with pytest.raises(RuntimeError):
        with tracer.Dumper(model, cfg(level="mix")):
            model(torch.randn(2, 3))  # wrong shape
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert not torch._C._len_torch_dispatch_stack()


def test_on_error_warn_stops_dumping_and_training_goes_on(writers, monkeypatch):
    from torch.nn.modules import module as nn_module

    class Broken(FakeWriter):
        def add(self, meta, tensor, stable=True, version=None, stats=None):
            raise OSError("disk full")

    monkeypatch.setattr(dumper_module, "_make_writer", lambda *a: Broken())
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="disk full"):
        with tracer.Dumper(model, cfg(level="mix", on_error="warn")) as d:
            for _ in range(2):
                model(torch.randn(2, 8)).sum().backward()
                opt.step()
            assert not d.enabled
    assert not nn_module._global_forward_pre_hooks and not torch._C._len_torch_dispatch_stack()


@pytest.mark.parametrize("how", ["on_error", "strict"])
def test_on_error_raise_names_the_fix(writers, monkeypatch, how):
    class Broken(FakeWriter):
        def add(self, meta, tensor, stable=True, version=None, stats=None):
            raise OSError("disk full")

    monkeypatch.setattr(dumper_module, "_make_writer", lambda *a: Broken())
    if how == "strict":
        monkeypatch.setenv("SLEUTH_STRICT", "1")
    model = MLP()
    with pytest.raises(tracer.TracerError, match="on_error"):
        with tracer.Dumper(model, cfg(level="op", **({"on_error": "raise"} if how == "on_error"
                                                      else {}))):
            model(torch.randn(2, 8))
    assert not torch._C._len_torch_dispatch_stack()


def _boom(*args, **kwargs):
    raise RuntimeError("a bug in the tracer")


# where the tracer's own code fails: (level, what to break, the attribute broken)
_BROKEN = {
    "module hook": ("module", "tracer.capture._module_hooks", "ModuleTracker._name_of"),
    "gradient hook": ("module", "tracer._dumper", "Dumper.emit"),
    "op mode before the op": ("op", "tracer.capture._op_mode", "op_scope"),
    "op mode after the op": ("op", "tracer.capture._op_mode", "OpMode._after"),
    "optimizer hook": ("module", "tracer.capture._param_records", "ParamRecords._snapshot"),
    "optimizer hook, after the step": ("module", "tracer.capture._param_records",
                                       "ParamRecords.records"),
    "flight recorder": ("mix", "tracer.storage._flight_writer", "FlightRecorder.add_row"),
}


def _train_losses(steps: int = 3, config: dict | None = None) -> tuple[list[float], object]:
    """Losses of a few SGD steps of the MLP, under a Dumper with `config` when given."""
    import contextlib

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dumper = tracer.Dumper(model, config) if config is not None else None
    losses = []
    with dumper if dumper is not None else contextlib.nullcontext():
        for _ in range(steps):
            loss = model(torch.randn(2, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, dumper


@pytest.mark.parametrize("where", list(_BROKEN))
def test_a_failure_inside_the_tracer_warns_once_and_training_goes_on(tmp_path, monkeypatch,
                                                                     where):
    """Observing never stops the observed run: whichever part of the tracer fails, the dump
    goes off with one `sleuth:` warning, the hooks come off, and the training computes what
    it computes without a dump."""
    import importlib
    import warnings

    from torch.nn.modules import module as nn_module

    monkeypatch.delenv("SLEUTH_STRICT", raising=False)
    expected, _ = _train_losses()
    level, module, attr = _BROKEN[where]
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, _boom)
    config = {"path": str(tmp_path), "writer": "sync", "level": level}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, dumper = _train_losses(config=config)
    assert losses == expected
    ours = [str(c.message) for c in caught if issubclass(c.category, tracer.SleuthWarning)]
    assert len(ours) == 1 and "a bug in the tracer" in ours[0], ours
    assert "the run goes on" in ours[0] and "SLEUTH_STRICT=1" in ours[0]
    assert not dumper.enabled
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert not torch._C._len_torch_dispatch_stack()
    # ... and where failures must stop the run (CI), the error comes out
    monkeypatch.setenv("SLEUTH_STRICT", "1")
    with pytest.raises((RuntimeError, tracer.TracerError), match="a bug in the tracer"):
        _train_losses(config={**config, "path": str(tmp_path / "strict")})
    assert not nn_module._global_forward_pre_hooks and not torch._C._len_torch_dispatch_stack()


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_op_mode_runs_without_dynamo_wrapper_and_under_torch_compile(writers):
    """OpMode opts out of torch's per-op dynamo `disable` wrapper (it costs ~10 us an op) and
    keeps torch.compile out itself: a compiled model dumped at op level with the eager fallback
    records what the plain model records."""
    import tracer.capture._op_mode as op_mode

    if op_mode._OWN_DYNAMO_GUARD:
        assert op_mode.OpMode.__dict__["__torch_dispatch__"].__module__ == "tracer.capture._op_mode"
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(2, 8)
    compiled = torch.compile(model, backend="eager")
    for run in (model, compiled):
        with tracer.Dumper(model, cfg(level="op", params=False, compiled="eager")) as d:
            run(x).sum().backward()
            d.step()
        model.zero_grad(set_to_none=True)
    plain, dumped = writers
    assert dumped.names() == plain.names() and len(plain.names()) > 20
    if op_mode._OWN_DYNAMO_GUARD:
        from torch._dynamo import trace_rules

        assert trace_rules.check(op_mode.OpMode.__dict__["__torch_dispatch__"].__code__)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
@pytest.mark.parametrize("level", ["module", "mix"])
def test_torch_compile_wrappers_are_transparent_to_names(writers, level):
    """A compiled model records under the eager model's names (no `_orig_mod`, no record of the
    wrapper itself), whether the wrapper, the plain model or nothing is given to the Dumper and
    whether the whole model or one submodule is compiled (the eager fallback, which records
    every module); and dynamo does not try to trace the tracer's hooks (it warned about each
    builtin they call)."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(4, 4))
    x = torch.randn(2, 8)
    whole = torch.compile(model, backend="eager")
    inner = nn.Sequential(torch.compile(model[0], backend="eager"), model[1])
    runs = [(model, None), (whole, None), (whole, whole), (whole, model), (inner, None),
            (inner, inner)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for run, given in runs:
            with tracer.Dumper(given, cfg(level=level, compiled="eager")) as d:
                run(x).sum().backward()
                d.step()
            model.zero_grad(set_to_none=True)
    eager = writers[0].names()
    assert "0.fc1.forward.0.output.0" in eager and "0.fc1.weight.optimizer.0.grad.0" in eager
    for (run, given), w in zip(runs[1:], writers[1:]):
        assert w.names() == eager, (run is whole, given)
    dynamo = [str(c.message) for c in caught if "Dynamo" in str(c.message)]
    assert not dynamo, dynamo[:2]


def _scaled_training(dumper, iterations, explicit=False, backoff=1e-36):
    """bf16 autocast with a GradScaler whose first scale overflows the gradients: the first
    iteration's optimizer step is skipped, the scale drops to ~3e2, and the rest step (with
    `backoff` 0.5 every step is skipped)."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=3e38, backoff_factor=backoff)
    skipped = []
    for _ in range(iterations):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(2, 8)).float().pow(2).mean() * 1e4
        scaler.scale(loss).backward()
        before = model.fc1.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped.append(torch.equal(before, model.fc1.weight))
        opt.zero_grad()
        if explicit:
            dumper.step()
    return model, skipped


def test_a_step_the_grad_scaler_skipped_is_a_step_of_its_own(writers):
    """GradScaler skips optimizer.step() on Inf/NaN gradients; its update() then ends the step,
    so each iteration has its own step and the same names (no call 1 from the next one)."""
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler.__dict__["update"]
    with tracer.Dumper(None, cfg(level="module")) as d:
        _, skipped = _scaled_training(d, 4)
        assert GradScaler.__dict__["update"] is not original
    assert GradScaler.__dict__["update"] is original  # unwrapped once no Dumper listens
    assert skipped == [True, False, False, False]
    (w,) = writers
    assert w.steps == [0, 1, 2, 3]
    steps = [[(m, t) for s, m, t in w.records if s == k] for k in range(4)]
    assert {m.call for step in steps for m, _ in step} == {0}
    forward = [[m.name for m, _ in step if m.phase == "forward"] for step in steps]
    assert forward[0] == forward[1] == forward[3] and len(forward[0]) == 8
    # the skipped step: parameters and their (non-finite) gradients at step end, no update
    grads = {m.name: t for m, t in steps[0] if m.direction == "grad"}
    assert grads and not any(m.direction == "update" for m, _ in steps[0])
    assert not all(torch.isfinite(t).all() for t in grads.values())
    assert any(m.direction == "update" for m, _ in steps[1])


def test_grad_scaler_leaves_explicit_steps_alone(writers):
    """Every optimizer step skipped; once the script calls d.step() only it ends steps. The
    first iteration ends at its scaler update, before the first d.step() call, as an optimizer
    step would (the step rule); that d.step() then ends nothing more, so the script's
    iterations and the steps stay one to one."""
    with tracer.Dumper(None, cfg(level="module")) as d:
        _, skipped = _scaled_training(d, 3, explicit=True, backoff=0.5)
    assert skipped == [True, True, True]
    (w,) = writers
    assert w.steps == [0, 1, 2]
    assert {m.call for _, m, _ in w.records if m.phase == "forward"} == {0}


def test_grad_scaler_subclass_calling_its_parent_notifies_once(writers):
    from torch.amp.grad_scaler import GradScaler

    class Scaler(GradScaler):
        def update(self, new_scale=None):
            super().update(new_scale)

    seen = []
    import tracer.capture._scaler as scaler_module

    handle = scaler_module.on_scaler_update(seen.append)
    try:
        scaler = Scaler("cpu", enabled=False)
        scaler.update()
    finally:
        handle.remove()
    assert seen == [scaler]
    assert not hasattr(Scaler.__dict__["update"], "__wrapped__")  # put back


def test_dataclass_outputs_are_recorded_in_field_order(writers):
    import dataclasses

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        note: str
        logits: torch.Tensor

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return Out(y.pow(2).mean(), "text", y)

    model = Head()
    with tracer.Dumper(model, cfg(level="module", params=False)) as d:
        model(torch.randn(2, 4)).loss.backward()
        d.step()
    recs = by_name(writers[0])
    loss, _ = recs["<root>.forward.0.output.0"]
    logits, t = recs["<root>.forward.0.output.1"]
    assert loss.direction == "output" and t.shape == (2, 4)
    assert "<root>.backward.0.output.0" in recs  # the loss's gradient, hooked like any output


def test_inference_mode_inside_a_dumped_op_level_step(writers):
    """Evaluation under torch.inference_mode() inside a dumped step: inference tensors have no
    version counter, which the op mode reads for view ops; the run goes on and records them."""
    model = SmallCNN()
    with tracer.Dumper(model, cfg(level="mix")) as d:
        train(model, lambda: (torch.randn(2, 3, 8, 8),))
        with torch.inference_mode():
            model.eval()
            model(torch.randn(2, 3, 8, 8))
            model.train()
        d.step()
    names = writers[0].names(1)  # the optimizer step ended step 0
    # Flatten: aten.flatten, a view op, undecomposed under inference mode
    assert any(n.startswith("<root>::aten.") and n.endswith("output.0") for n in names)
    assert "<root>.forward.0.output.0" in names


class _Buffered(nn.Module):
    """Builds its layer inside forward's first call (an empty weight filled by uniform_) and
    writes its output into an `empty` buffer with copy_."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        buf = torch.empty(x.shape[0], 4)
        buf.copy_(self.fc(x))
        return buf.relu()


def test_uninitialised_memory_is_not_recorded(writers):
    """What `aten.empty` & co return is whatever the allocator found: a different value in
    every run, which a diff would name as the first divergence. Their outputs are not records,
    nor is that memory when an op first reads or writes it (the detach inside
    Parameter(empty), uniform_'s input, copy_'s destination); the other inputs keep their
    indices, and the op writing the memory records its output."""
    torch.manual_seed(0)
    with tracer.Dumper(None, cfg(level="op", params=False)) as d:
        model = _Buffered()  # constructed inside the dumped step, as under the zero-code attach
        model(torch.randn(2, 4)).sum().backward()
        d.step()
    names = writers[0].names()
    assert not [n for n in names if "::aten.empty" in n], names
    uniform = [n for n in names if "::aten.uniform_." in n]
    assert uniform and all(".output." in n for n in uniform)  # inputs were uninitialised
    copy = [n for n in names if n.startswith("<root>::aten.copy_.forward.0.")]
    assert copy == ["<root>::aten.copy_.forward.0.input.1", "<root>::aten.copy_.forward.0.output.0"]


def test_two_runs_building_their_model_in_the_step_dump_the_same(tmp_path):
    """End to end: two op-level tensor dumps of the same seeded run, each building its model
    inside the dumped step, diff as the same (before, the uninitialised weights before
    uniform_ and the empty buffer diverged at random)."""
    for run in ("a", "b"):
        torch.manual_seed(0)
        with tracer.Dumper(None, {"path": str(tmp_path / run), "level": "op", "mode": "full",
                                  "writer": "sync"}) as d:
            model = nn.Sequential(_Buffered(), nn.Linear(4, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    result = tracer.diff(tmp_path / "a", tmp_path / "b")
    assert result.status == "same", result.first_divergence
    assert result.counts()["same"] > 50
