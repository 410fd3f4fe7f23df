"""The setup a dumped step keeps beside its records (tracer.capture._setup): the gradient
scaler's state at each unscale_, who called it and where, and the batch's fingerprint at each
top-level call of the model, as a user's mixed-precision loop produces them."""
from __future__ import annotations

import json

import torch
from torch import nn

import tracer


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc(x)
        return out if mask is None else out * mask


def _run(path, explicit_unscale: bool, batches: list[torch.Tensor]) -> list[dict]:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7)
    with tracer.Dumper(model, {"path": str(path), "level": "module", "mode": "statistics",
                               "steps": "all"}):
        for x in batches:
            loss = model(x, mask=torch.ones(2)).pow(2).mean()
            scaler.scale(loss).backward()
            if explicit_unscale:
                scaler.unscale_(opt)  # LINE: unscale
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)  # LINE: step
            scaler.update()
            opt.zero_grad()
    d = tracer.open_dump(path)
    return [json.loads(d.attrs(0, s)["setup"]) for s in d.steps(0)]


def _line(tag: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# LINE: {tag}"))


def test_the_scaler_is_recorded_with_who_unscaled_and_where(tmp_path):
    from torch.amp.grad_scaler import GradScaler

    original = GradScaler.__dict__["unscale_"]
    x = torch.randn(3, 4)
    (inside,) = _run(tmp_path / "a", False, [x])
    (explicit,) = _run(tmp_path / "b", True, [x])
    assert GradScaler.__dict__["unscale_"] is original  # unwrapped once no Dumper listens
    (s,) = inside["scalers"]
    assert (s["scale"], s["growth_interval"], s["found_inf"], s["unscale"]) == \
        (256.0, 7, False, "in step")
    assert s["source"].endswith(f"test_capture_setup.py:{_line('step')}")
    (s,) = explicit["scalers"]
    assert s["unscale"] == "explicit"
    assert s["source"].endswith(f"test_capture_setup.py:{_line('unscale')}")


def test_the_batch_is_fingerprinted_at_each_call_by_position_and_keyword(tmp_path):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    first = _run(tmp_path / "a", False, [x, y])
    again = _run(tmp_path / "b", False, [x.clone(), y + 1])
    assert [list(s["batch"][0]["inputs"]) for s in first] == [["0", "mask"], ["0", "mask"]]
    assert first[0]["batch"][0]["inputs"]["0"][:2] == ["float32", [3, 4]]
    assert first[0]["batch"] == again[0]["batch"]  # the same bits, another tensor
    assert first[1]["batch"][0]["inputs"]["0"] != again[1]["batch"][0]["inputs"]["0"]
    assert first[1]["batch"][0]["inputs"]["mask"] == again[1]["batch"][0]["inputs"]["mask"]
