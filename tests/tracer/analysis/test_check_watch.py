"""Watchpoints (config validation, conditions, live checking through the Dumper) and the first
NaN origin, on real dumps."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tracer
from tracer.analysis._check import first_nan_origin
from tracer._errors import ConfigError, WatchpointHit
from tracer._watch_config import WatchConfig
from tracer.storage import Watcher


class SqrtNet(nn.Module):
    """sqrt of a negative number in forward; the NaN then meets a multiply whose backward is
    the first to produce NaN, so detect_anomaly blames MulBackward0, not the sqrt."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.fc(x)
        r = torch.sqrt(h - 10.0)  # negative: NaN
        return (r * self.w).sum()


def _sqrt_run(path, level="op", watch=()):
    torch.manual_seed(0)
    model = SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    config = {"path": str(path), "level": level, "mode": "statistics", "writer": "sync",
              "watch": list(watch)}
    with tracer.Dumper(model, config):
        model(x).backward()
        opt.step()
    return model, x


def test_watch_config_validation():
    with pytest.raises(ConfigError, match="did you mean 'nan_inf'"):
        WatchConfig.from_dict({"condition": "naninf"})
    with pytest.raises(ConfigError, match="did you mean 'threshold'"):
        WatchConfig.from_dict({"condition": "max_abs_gt", "treshold": 1})
    with pytest.raises(ConfigError, match="needs a threshold"):
        WatchConfig(condition="max_abs_gt")
    with pytest.raises(ConfigError, match="did you mean 'raise'"):
        WatchConfig(condition="nan_inf", on_hit="rise")
    with pytest.raises(ConfigError, match=r"watch\[0\]"):
        tracer.DumpConfig(watch=[{"condition": "bogus"}])


def _row(**kw):
    base = dict(name="m.forward.0.output.0", module="m", op="", phase="forward",
                direction="output", numel=4, min=-1.0, max=2.0, mean=0.5, norm=3.0, nan=0,
                posinf=0, neginf=0, zeros=0, seq=0, source="x.py:1")
    base.update(kw)
    return base


@pytest.mark.parametrize("cond,row,hit", [
    ({"condition": "nan_inf"}, _row(nan=1), 1.0),
    ({"condition": "nan_inf"}, _row(), None),
    ({"condition": "all_zero"}, _row(zeros=4), 4.0),
    ({"condition": "max_abs_gt", "threshold": 1.5}, _row(), 2.0),
    ({"condition": "max_abs_lt", "threshold": 1.5}, _row(), None),
    ({"condition": "mean_lt", "threshold": 1.0}, _row(), 0.5),
    ({"condition": "out_of_range", "low": -0.5, "high": 5}, _row(), -1.0),
    ({"condition": "grad_explode", "threshold": 2}, _row(direction="grad"), 3.0),
    ({"condition": "grad_explode", "threshold": 2}, _row(), None),
    ({"condition": "grad_vanish"}, _row(direction="grad", norm=1e-9), 1e-9),
    ({"condition": "unchanged_weight"}, _row(phase="optimizer", direction="update", zeros=4),
     0.0),
    ({"condition": "max_abs_gt", "threshold": 0, "names": ["other.*"]}, _row(), None),
])
def test_conditions(cond, row, hit):
    found = Watcher([WatchConfig.from_dict(cond)]).check(row)
    assert (found[0][1]["value"] if found else None) == (
        None if hit is None else pytest.approx(hit))


def test_weight_change_uses_the_weight_before_the_update():
    w = Watcher([WatchConfig(condition="weight_change_gt", threshold=0.1),
                 WatchConfig(condition="weight_change_lt", threshold=1e-6)])
    w.check(_row(name="fc.weight.optimizer.0.param.0", phase="optimizer", direction="param",
                 norm=10.0))
    hits = w.check(_row(name="fc.weight.optimizer.0.update.0", phase="optimizer",
                        direction="update", norm=2.0))
    assert [(h["condition"], h["value"]) for _, h in hits] == [("weight_change_gt", 0.2)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # detect_anomaly's own traceback warning
def test_first_nan_names_forward_sqrt_where_detect_anomaly_blames_backward(tmp_path):
    model, x = _sqrt_run(tmp_path / "run")
    origin = first_nan_origin(tmp_path / "run")
    assert origin["op"] == "aten.sqrt" and origin["phase"] == "forward"
    assert origin["name"] == "<root>::aten.sqrt.forward.0.output.0"
    assert origin["source"].startswith("tests/tracer/analysis/test_check_watch.py:")
    line = int(origin["source"].rsplit(":", 1)[1])
    assert "torch.sqrt" in open(__file__).read().splitlines()[line - 1]
    with pytest.raises(RuntimeError, match="MulBackward0"):
        with torch.autograd.detect_anomaly(check_nan=True):
            model(x).backward()
    hits = tracer.check(tmp_path / "run")
    assert hits.attrs["first_nan"]["name"] == origin["name"]
    assert (hits["condition"] == "nan_inf").all() and len(hits) > 1


def test_first_nan_module_level(tmp_path):
    _sqrt_run(tmp_path / "run", level="module")
    origin = first_nan_origin(tmp_path / "run")
    # the sqrt sits in the root's forward: the root is where finite inputs became NaN
    assert origin["module"] == "<root>" and origin["phase"] == "forward"


def test_live_watch_raise_names_op_module_source(tmp_path):
    with pytest.raises(WatchpointHit) as e:
        _sqrt_run(tmp_path / "run", watch=[{"condition": "nan_inf", "on_hit": "raise"}])
    msg = str(e.value)
    assert "aten.sqrt" in msg and "module <root>" in msg and "test_check_watch.py:" in msg
    assert e.value.hit["condition"] == "nan_inf"
    flight = tmp_path / "run" / "dump" / "rank0" / "flight_recorder.h5"
    assert flight.exists() and str(flight) in msg


def test_live_watch_record_stores_hits(tmp_path, capsys):
    from sleuth.cli import main

    _sqrt_run(tmp_path / "run", watch=[{"condition": "nan_inf"},
                                       {"condition": "max_abs_gt", "threshold": 1e9}])
    live = tracer.open_dump(tmp_path / "run").hits(0, 0)
    assert len(live) > 0 and set(live["condition"]) == {"nan_inf"}
    assert live["name"].iat[0] == "<root>::aten.sqrt.forward.0.output.0"
    assert main(["check", str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert "first NaN: <root>::aten.sqrt.forward.0.output.0" in out


def test_unchanged_weight_between_steps_without_update_records(tmp_path):
    """A hand-written update loop that misses a layer; no optimizer, so no update records: the
    weight is compared with its value at the previous dumped step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    config = {"path": str(tmp_path), "writer": "sync"}
    with tracer.Dumper(model, config) as d:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            with torch.no_grad():
                for p in model[1].parameters():  # bug: layer 0 is never updated
                    p -= 0.1 * p.grad
            model.zero_grad()
            d.step()
    hits = tracer.check(tmp_path, watch=[{"condition": "unchanged_weight"},
                                         {"condition": "weight_change_gt", "threshold": 1e-4}])
    unchanged = set(hits[hits.condition == "unchanged_weight"]["name"])
    assert unchanged == {"0.weight.optimizer.0.param.0", "0.bias.optimizer.0.param.0"}
    changed = set(hits[hits.condition == "weight_change_gt"]["name"])
    assert "1.weight.optimizer.0.param.0" in changed and not changed & unchanged
