"""The loop: resume bit-identity, accumulation, callbacks, bf16, recomputation, run files."""
from __future__ import annotations

import json

import pytest
import torch

from trainer import GPT, Callback, ModelConfig, RunDir, read_metrics, train
from trainer._checkpoint import load_model_state


def _losses(state):
    return [m["loss"] for m in state.history if "loss" in m]


def test_resume_continues_bit_identically(make_config, tmp_path):
    common = ("steps=6", "model.dropout=0.1", "eval_every=2", "optim.warmup_steps=1")
    full = train(make_config(*common, run="full"))
    first = train(make_config(*common, "stop_after=3", run="first"))
    ckpt = tmp_path / "first" / "checkpoints" / "step3"
    assert (ckpt / "meta.json").is_file() and not (tmp_path / "first" / "checkpoints" / "step6").exists()
    second = train(make_config(*common, f"resume={ckpt}", run="second"))
    assert _losses(first) == _losses(full)[:3]
    assert _losses(second) == _losses(full)[3:]  # exact float equality, not a tolerance
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, second.model.state_dict()[name]), name
    # 'latest' in the same run directory picks the step-3 checkpoint up as well
    again = train(make_config(*common, "resume=latest", run="first"))
    assert _losses(again) == _losses(full)[3:]
    assert len(read_metrics(tmp_path / "first")) == (3 + 1) + (3 + 2)  # both invocations: steps + evals


def test_a_resume_from_an_earlier_checkpoint_logs_each_step_once(make_config, tmp_path):
    """A run killed after its last checkpoint logged steps the resumed run logs again: those
    lines are dropped at the resume, so a curve never holds a step twice."""
    common = ("steps=6", "checkpoint_every=2", "eval_every=2")
    full = train(make_config(*common, run="r"))
    again = train(make_config(*common, f"resume={tmp_path / 'r' / 'checkpoints' / 'step2'}",
                              run="r"))
    lines = read_metrics(tmp_path / "r")
    keys = [(m["step"], "eval_loss" in m) for m in lines]
    assert len(keys) == len(set(keys)) and sorted({k[0] for k in keys}) == list(range(6))
    assert [m["loss"] for m in lines if "loss" in m][2:] == \
        _losses(again) and len(_losses(full)) == 6


def test_checkpoint_is_weights_only_loadable(make_config, tmp_path):
    train(make_config("steps=2", "checkpoint_every=1", run="c"))
    run = RunDir(tmp_path / "c")
    assert run.latest_checkpoint() == run.checkpoint(2)
    blob = torch.load(run.checkpoint(1) / "trainer.pt", weights_only=True)
    assert blob["step"] == 1 and blob["data_position"] == 8 and blob["rng"]["torch"].dtype == torch.uint8
    assert "transformer.wte.weight" in load_model_state(run.checkpoint(2))
    meta = json.loads((run.checkpoint(2) / "meta.json").read_text())
    assert meta["format_version"] == "1.0" and meta["step"] == 2
    assert not list((tmp_path / "c" / "checkpoints").glob("*.partial"))


def test_gradient_accumulation_matches_one_big_batch(make_config):
    big = train(make_config("steps=3", "batch_size=8", run="big"))
    acc = train(make_config("steps=3", "batch_size=2", "grad_accum=4", run="acc"))
    torch.testing.assert_close(torch.tensor(_losses(acc)), torch.tensor(_losses(big)), rtol=1e-5, atol=1e-6)
    gn = [m["grad_norm"] for m in big.history], [m["grad_norm"] for m in acc.history]
    torch.testing.assert_close(torch.tensor(gn[1]), torch.tensor(gn[0]), rtol=1e-5, atol=1e-6)
    # four micro-batches sum their gradients in another order than one batch does, and how
    # matmuls split their sums depends on the threads torch runs with: a weight near zero
    # can differ by a few ulps of the larger ones
    for name, p in big.model.state_dict().items():
        torch.testing.assert_close(acc.model.state_dict()[name], p, rtol=1e-5, atol=1e-5)


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(state, *rest):
                self.events.append((name, state.step, state.micro_step))
                if name == "on_run_start":
                    logits, _ = state.model(**state.example_batch)
                    assert logits.shape[:2] == state.example_batch["input_ids"].shape
            return record
        return object.__getattribute__(self, name)


def test_callbacks_are_called_in_order(make_config):
    rec = Recorder()
    state = train(make_config("steps=2", "grad_accum=2", "eval_every=2"), callbacks=[rec])
    names = [e[0] for e in rec.events]
    step = ["on_step_begin", "on_after_backward", "on_after_backward", "on_before_optimizer_step",
            "on_after_optimizer_step", "on_step_end"]
    assert names == ["on_run_start", *step, *step, "on_eval", "on_run_end"]
    assert [e[2] for e in rec.events if e[0] == "on_after_backward"] == [0, 1, 0, 1]
    assert set(state.metrics) >= {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}


def test_run_end_is_called_when_a_step_fails(make_config):
    class Boom(Callback):
        ended = False

        def on_after_backward(self, state):
            raise RuntimeError("boom")

        def on_run_end(self, state):
            Boom.ended = True

    with pytest.raises(RuntimeError, match="boom"):
        train(make_config(), callbacks=[Boom()])
    assert Boom.ended


def test_run_json_and_metrics(make_config, tmp_path):
    train(make_config("steps=2", "eval_every=1", "name=hello"), argv=["x", "--y"])
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["format_version"] == "1.0" and info["name"] == "hello" and info["argv"] == ["x", "--y"]
    assert info["world_size"] == 1 and info["config"]["steps"] == 2
    assert info["versions"]["torch"] == torch.__version__ and info["created"].endswith("+00:00")
    lines = read_metrics(tmp_path / "run")
    assert [sorted(m) for m in lines[:1]] == [sorted(["step", "loss", "lr", "grad_norm", "tokens_per_s",
                                                     "step_time_s", "tokens"])]
    assert lines[1]["eval_ppl"] == pytest.approx(torch.tensor(lines[1]["eval_loss"]).exp().item(), rel=1e-6)


def test_bf16_autocast_trains(make_config):
    state = train(make_config("steps=3", "precision=bf16"))
    losses = _losses(state)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in state.model.parameters())


def test_recompute_gives_same_loss_and_grads():
    cfg = ModelConfig(dropout=0.1)
    torch.manual_seed(0)
    plain = GPT(cfg)
    again = GPT(cfg, recompute=True)
    again.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 32))
    results = []
    for model in (plain, again):
        torch.manual_seed(5)  # same dropout masks in both
        _, loss = model(x, x)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7)


def test_phases_are_marked_for_the_profiler(make_config):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(make_config("steps=1"))
    names = {e.name for e in prof.events()}
    assert {"sleuth.data", "sleuth.forward", "sleuth.backward", "sleuth.optimizer"} <= names


def test_sft_accumulation_weights_every_response_token_equally(make_config):
    # SFT micro-batches hold different numbers of target tokens; the step loss is still the
    # mean over all of them, so accumulation matches the big batch
    sft = ("data.mode=sft", "data.train_files=[]", "data.val_files=[]", "steps=2")
    big = train(make_config(*sft, "batch_size=8", run="sft_big"))
    acc = train(make_config(*sft, "batch_size=2", "grad_accum=4", run="sft_acc"))
    torch.testing.assert_close(torch.tensor(_losses(acc)), torch.tensor(_losses(big)), rtol=1e-5, atol=1e-6)
    assert big.history[0]["tokens"] < 8 * 64  # prompts and padding are not counted


def test_micro_batch_without_targets_is_harmless(make_config, tmp_path):
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "x" * 100, "response": "cut off"}, {"prompt": "short", "response": "kept"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    state = train(make_config("data.mode=sft", f"data.train_files={data}", "data.val_files=[]",
                              "data.val_fraction=0", "batch_size=1", "grad_accum=2", "steps=2"))
    assert all(torch.isfinite(torch.tensor(_losses(state))))
