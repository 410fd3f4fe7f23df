"""The setup comparison's rules on setups and verdicts written by hand (tracer.analysis._setup):
what a difference says, and when it may stand for explain's verdict and when it may not."""
from __future__ import annotations

import json

import pytest

from tracer.analysis._explain import Explanation
from tracer.analysis._setup import (compare_inputs, compare_setups, differences, inputs_words,
                                    names_in_words, with_setup)


def _setup(**parts):
    base = {"version": 1, "optimizers": [], "clips": [],
            "model": {"config": {}, "modules": {}, "frozen": []}, "flags": {}, "env": {},
            "versions": {"torch": "2.13.0"}}
    return {**base, **parts}


def _opt(**hyper):
    return [{"class": "AdamW", "groups": [{"hyper": {"lr": 0.01, "eps": 1e-8, **hyper},
                                           "params": ["a.weight", "b.0.weight", "b.1.weight"]}]}]


def _change(a, b, step=0, b_step=0):
    return {"kind": "setup", "rank": 0, "step": step, "b_rank": 0, "b_step": b_step,
            "differences": differences(a, b)}


def _fd(name, phase, direction, kind="compute", step=0, b_step=0, source=""):
    return {"name": name, "phase": phase, "direction": direction, "kind": kind, "step": step,
            "b_step": b_step, "source": source, "op": ""}


def test_one_parameter_keeps_its_name_and_requires_grad_reads_per_side():
    a = _setup()
    b = _setup(model={"config": {}, "modules": {}, "frozen": ["b.1.weight"]})
    (d,) = differences(a, b)
    assert d["text"] == "B freezes b.1.weight (requires_grad False)"
    assert (d["a"], d["b"]) == (True, False)  # requires_grad in A, in B
    assert names_in_words(["b.0.weight", "b.1.weight", "c"]) == "b.*.weight (2) and c"


def test_weights_that_differ_as_step_0_ends_are_never_the_optimizer_setting():
    """An optimizer setting cannot change the weights before the first optimizer step (a hook
    that wrote into them during step 0 can): the records' verdict stands."""
    change = _change(_setup(optimizers=_opt()), _setup(optimizers=_opt(eps=1e-3)))
    fd = _fd("a.weight.optimizer.0.param.0", "optimizer", "param", kind="parameter")
    found = with_setup(Explanation("inputs", "inputs differ from the start", first_divergence=fd),
                       change)
    assert found.status == "inputs" and "eps" in found.notes[0]
    later = dict(fd, step=1, b_step=1)
    found = with_setup(Explanation("inputs", "inputs differ", first_divergence=later),
                       _change(_setup(optimizers=_opt()), _setup(optimizers=_opt(eps=1e-3)), 1, 1))
    assert found.status == "setup" and "AdamW eps 1e-08 in A, 0.001 in B" in found.verdict


def test_a_flag_never_stands_for_ops_one_run_does_not_run():
    change = _change(_setup(flags={"deterministic_algorithms": False}),
                     _setup(flags={"deterministic_algorithms": True}))
    fd = _fd("<none>::aten.nll_loss_forward.forward.0.input.0", "forward", "input")
    found = Explanation("unexplained", "ops replaced: ...", {"fault": "replaced", "module": ""},
                        first_divergence=fd)
    out = with_setup(found, change)
    assert out.status == "unexplained" and "deterministic_algorithms" in out.notes[0]
    # a config constant does pick the code path
    change = _change(_setup(model={"config": {"hidden_act": "silu"}, "modules": {},
                                   "frozen": []}),
                     _setup(model={"config": {"hidden_act": "gelu"}, "modules": {},
                                   "frozen": []}))
    out = with_setup(Explanation("unexplained", "ops replaced: ...",
                                 {"fault": "replaced", "module": ""}, first_divergence=fd), change)
    assert out.status == "setup" and "config hidden_act 'silu' in A, 'gelu' in B" in out.verdict


def test_two_steps_of_one_run_keep_the_records_verdict():
    change = _change(_setup(optimizers=_opt()), _setup(optimizers=_opt(lr=0.005)), 0, 1)
    fd = _fd("a.weight.optimizer.0.param.0", "optimizer", "param", kind="parameter", b_step=1)
    out = with_setup(Explanation("inputs", "inputs differ", first_divergence=fd), change)
    assert out.status == "inputs" and "the two steps were set up differently" in out.notes[0]


def test_the_ops_of_a_clipping_call_are_that_call():
    """A clipping call with another max_norm: its ops are the first divergence, at its line
    (A's line here: the two scripts put the call on other lines)."""
    clip = {"fn": "clip_grad_norm_", "params": ["a.weight"]}
    a = _setup(clips=[{**clip, "args": {"max_norm": 1.0}, "source": "train.py:148"}])
    b = _setup(clips=[{**clip, "args": {"max_norm": 0.01}, "source": "train.py:150"}])
    fd = _fd("<none>::aten.mul.forward.0.output.0", "forward", "output", source="train.py:148")
    out = with_setup(Explanation("unexplained", "no /calls", first_divergence=fd),
                     _change(a, b))
    assert out.status == "setup", out.verdict
    assert out.verdict.startswith("setup: the runs were set up differently: clip_grad_norm_ "
                                  "max_norm 1 in A, 0.01 in B (at train.py:148 in A, "
                                  "train.py:150 in B)")


def test_versions_alone_never_change_a_verdict():
    change = _change(_setup(), _setup(versions={"torch": "2.12.0"}))
    fd = _fd("x.forward.0.output.0", "forward", "output")
    out = with_setup(Explanation("unexplained", "?", first_divergence=fd), change)
    assert out.status == "unexplained" and not out.setup
    assert change["differences"][0]["text"] == "version of torch '2.13.0' in A, '2.12.0' in B"


def test_how_each_side_ran_compiled_code_is_a_setup_difference():
    compiled = {"mode": "compiled", "regions": {"<root>::compiled": 1}, "graphs": 1,
                "breaks": 0, "break_reasons": [], "recompiles": 0, "recompile_reasons": []}
    eager = {**compiled, "mode": "eager", "regions": {}}
    (d,) = differences(_setup(compile=compiled), _setup(compile=eager))
    assert d["kind"] == "compile" and d["text"] == (
        "the dumped step ran torch.compile'd code as compiled in A, eagerly in B (dump config "
        "\"compiled\": \"compiled\" and \"eager\")")
    interpreted = {**compiled, "mode": "interpret"}
    (d,) = differences(_setup(compile=interpreted), _setup(compile=compiled))
    assert "through the interpreter in A, as compiled in B" in d["text"]
    (d,) = differences(_setup(), _setup(compile=compiled))
    assert d["text"] == "only B ran torch.compile'd code in the dumped step (as compiled)"
    broken = {**compiled, "breaks": 2, "break_reasons": ["Unsupported: call to print"]}
    (d,) = differences(_setup(compile=compiled), _setup(compile=broken))
    assert d["key"] == "breaks" and "0 in A, 2 in B (Unsupported: call to print)" in d["text"]
    assert not differences(_setup(compile=compiled), _setup(compile=dict(compiled)))


def _scaler(**over):
    return {"class": "GradScaler", "scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2000, "found_inf": False, "unscale": "in step",
            "source": "train.py:90", **over}


def test_the_scaler_is_named_by_what_differs_and_a_gradient_it_makes_is_its_own():
    a = _setup(scalers=[_scaler()])
    texts = [d["text"] for d in differences(a, _setup(scalers=[]))]
    assert texts == ["A scales the loss with a GradScaler (scale 65536, unscaled inside "
                     "scaler.step at train.py:90); B does not"]
    b = _setup(scalers=[_scaler(growth_interval=100, unscale="explicit", source="train.py:85")])
    texts = [d["text"] for d in differences(a, b)]
    assert texts == ["GradScaler growth_interval 2000 in A, 100 in B",
                     "gradients unscaled inside scaler.step at train.py:90 in A, "
                     "scaler.unscale_ at train.py:85 in B (what runs between, a clipping call, "
                     "sees scaled gradients in one run)"]
    # a setup written before scalers were recorded says nothing of them
    old = {k: v for k, v in a.items() if k != "scalers"}
    assert differences(old, _setup(scalers=[])) == []
    fd = _fd("a.weight.optimizer.0.grad.0", "optimizer", "grad")
    out = with_setup(Explanation("unexplained", "?", first_divergence=fd),
                     _change(a, _setup(scalers=[_scaler(found_inf=True)])))
    assert out.status == "setup", out.verdict
    assert "GradScaler found Inf or NaN gradients in B only, so B skipped its optimizer step" \
        in out.verdict


def _batch(*crcs):
    return [{"module": "<root>", "inputs": {"input_ids": ["int64", [2, 8], c]}} for c in crcs]


def test_inputs_say_which_of_the_batch_and_the_buffers_differ():
    buf = {"scale": ["float32", [4], 7]}
    same = compare_inputs(_setup(batch=_batch(1, 2), buffers=buf),
                          _setup(batch=_batch(1, 2), buffers=buf))
    assert inputs_words(same) == ("the batch and the buffers are the same in both runs as "
                                  "the step begins")
    other = compare_inputs(_setup(batch=_batch(1, 2), buffers=buf),
                           _setup(batch=_batch(1, 3), buffers={"scale": ["float32", [4], 8]}))
    assert inputs_words(other) == ("the batch differs: the model's call 1 is given input_ids "
                                   "(int64 2x8) with other values; buffer(s) scale differ as "
                                   "the step begins")
    # a side without a recorded batch (a dump of an older format) says nothing of it
    assert inputs_words(compare_inputs(_setup(), _setup(batch=_batch(1)))) == ""


def test_a_scheduled_learning_rate_and_eval_mode_read_as_what_they_are():
    def sched(lr):
        return [{"class": "SGD", "groups": [{"hyper": {"lr": lr, "initial_lr": 0.01},
                                             "params": ["a.weight", "b.weight"]}]}]

    (d,) = differences(_setup(optimizers=sched(0.01)), _setup(optimizers=sched(0.005)))
    assert d["text"] == ("SGD lr 0.01 in A, 0.005 in B (every parameter): the learning rate "
                         "the scheduler set, from the same initial_lr 0.01 (a scheduler a step "
                         "apart, or another schedule)")
    modules = {"<root>": {"class": "Net", "training": True},
               "fc": {"class": "Linear", "training": True}}
    evals = {k: {**v, "training": False} for k, v in modules.items()}
    (d,) = differences(_setup(model={"config": {}, "modules": modules, "frozen": []}),
                       _setup(model={"config": {}, "modules": evals, "frozen": []}))
    assert d["text"].startswith("the whole model (every module) in eval mode in B, train mode "
                                "in A")
    half = {**modules, "fc": evals["fc"]}
    (d,) = differences(_setup(model={"config": {}, "modules": modules, "frozen": []}),
                       _setup(model={"config": {}, "modules": half, "frozen": []}))
    assert d["text"].startswith("fc in eval mode in B, train mode in A")


def test_a_config_that_picks_the_code_path_stands_for_a_bug_the_records_name():
    """Hugging Face's attention kernel (eager in A, sdpa in B): the mask one passes and the
    other does not shifts a layer's inputs, which the records alone call a value passed
    otherwise. The config is the cause; a constant entering an op as an argument stays a bug
    (its op and line), with the config said beside it."""
    config = {"modules": {}, "frozen": []}
    change = _change(_setup(model={"config": {"attn_implementation": "eager"}, **config}),
                     _setup(model={"config": {"attn_implementation": "sdpa"}, **config}))
    fd = _fd("model.layers.0.forward.0.input.2", "forward", "input")
    passed = Explanation("bug", "bug: module model.layers.0 passes on another value: ...",
                         {"fault": "passed", "module": "model.layers.0"}, first_divergence=fd)
    out = with_setup(passed, change)
    assert out.status == "setup", out.verdict
    assert out.verdict.startswith("setup: the runs were set up differently: config "
                                  "attn_implementation 'eager' in A, 'sdpa' in B. The first "
                                  "divergence, model.layers.0.forward.0.input.2 (step 0), "
                                  "follows from it"), out.verdict
    called = Explanation("bug", "bug: op aten.pow at m.py:3 is called with other arguments",
                         {"fault": "arguments", "module": "model.rotary_emb"},
                         first_divergence=fd)
    assert with_setup(called, change).status == "bug"


def test_the_attention_kernel_of_a_hugging_face_config_is_part_of_its_setup():
    transformers = pytest.importorskip("transformers")
    from tracer.capture._setup import model_config

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, attn_implementation="sdpa"))
    assert model_config(model)["attn_implementation"] == "sdpa"


def test_a_config_that_skips_a_layer_is_the_setup_even_where_a_module_holds_it_too():
    """OPT's layerdrop in the config and as the decoder's attribute: a layer's ops removed
    follow from the config, which heads the verdict, never "bug" with the constant beside."""
    config = {"frozen": []}
    change = _change(
        _setup(model={"config": {"layerdrop": 0.0},
                      "modules": {"model.decoder": {"layerdrop": 0.0}}, **config}),
        _setup(model={"config": {"layerdrop": 0.5},
                      "modules": {"model.decoder": {"layerdrop": 0.5}}, **config}))
    fd = _fd("model.decoder.layers.1.self_attn.out_proj::aten.addmm.forward.0.output.0",
             "forward", "output")
    removed = Explanation("bug", "bug: op removed: A runs 7 ops ...",
                          {"fault": "removed", "module": "model.decoder.layers.1.self_attn"},
                          first_divergence=fd)
    out = with_setup(removed, change)
    assert out.status == "setup", out.verdict
    assert out.verdict.startswith("setup: the runs were set up differently: config layerdrop "
                                  "0 in A, 0.5 in B"), out.verdict


def test_an_interrupted_step_is_not_said_to_lack_what_it_never_reached():
    # B crashed in its forward: no optimizer step, no clipping call taken; a config still reads
    a = _setup(optimizers=_opt(), clips=[{"fn": "clip_grad_norm_", "max_norm": 1.0}],
               model={"config": {"eps": 1e-5}, "modules": {}, "frozen": []})
    b = _setup(model={"config": {"eps": 1e-2}, "modules": {}, "frozen": []})
    text_a, text_b = json.dumps(a), json.dumps(b)
    whole = compare_setups(text_a, text_b, (0, 0, 0, 0))
    assert {d["kind"] for d in whole["differences"]} >= {"optimizer", "clipping", "config"}
    cut = compare_setups(text_a, text_b, (0, 0, 0, 0), interrupted=(False, True))
    assert [d["kind"] for d in cut["differences"]] == ["config"], cut["differences"]
    assert any(m.startswith("B: step 0 was interrupted") for m in cut["missing"]), cut["missing"]
