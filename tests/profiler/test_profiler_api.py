"""Public API, configuration and the pure schedule of the profiler package."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import profiler
from profiler import CollectorConfig, schedule_action

REPO = Path(__file__).resolve().parents[2]


def test_all_is_pinned():
    assert profiler.__all__ == [
        "Collector", "CollectorConfig", "ConfigError", "Profile", "ProfileDiff",
        "ProfileFormatError", "ProfilerError", "SummaryCapReached", "SummaryWriter",
        "attach_from_env", "diff_profiles", "read_histograms", "read_profile", "read_scalars", "schedule_action", "summary_lines"]
    for name in profiler.__all__:
        assert getattr(profiler, name) is not None


def test_import_is_light():
    code = ("import sys, profiler; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'pandas' not in sys.modules, 'pandas'; profiler.CollectorConfig(); "
            "assert 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
@pytest.mark.parametrize("kw", [
    dict(wait=1, warmup=1, active=3, repeat=1),
    dict(wait=0, warmup=0, active=1, repeat=0),
    dict(wait=2, warmup=1, active=2, repeat=2, skip_first=3),
    dict(wait=0, warmup=2, active=4, repeat=0, skip_first=1),
])
def test_schedule_matches_torch(kw):
    import torch.profiler as tp
    ref = tp.schedule(**kw)
    for step in range(40):
        assert schedule_action(step, **kw) == ref(step).name.lower(), step


def test_schedule_semantics():
    cfg = CollectorConfig(wait=1, warmup=1, active=2, repeat=2, skip_first=1)
    got = [cfg.schedule_action(s) for s in range(12)]
    assert got == ["none",                                   # skip_first
                   "none", "warmup", "record", "record_and_save",   # window 0
                   "none", "warmup", "record", "record_and_save",   # window 1
                   "none", "none", "none"]                   # repeat exhausted
    with pytest.raises(profiler.ConfigError):
        schedule_action(-1, wait=0, warmup=0, active=1)


def test_config_validation_and_json(tmp_path):
    with pytest.raises(profiler.ConfigError, match="did you mean 'warmup'"):
        CollectorConfig.from_dict({"warmpu": 2})
    with pytest.raises(profiler.ConfigError, match="active"):
        CollectorConfig(active=0)
    with pytest.raises(profiler.ConfigError, match="activities"):
        CollectorConfig(activities=("tpu",))
    with pytest.raises(profiler.ConfigError, match="table_format"):
        CollectorConfig(table_format="xlsx")
    with pytest.raises(TypeError):
        CollectorConfig(1)  # keyword-only
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"wait": 0, "active": 2, "activities": ["cpu"], "peak_tflops": 2.5}))
    cfg = CollectorConfig.from_json(path)
    assert (cfg.wait, cfg.active, cfg.activities, cfg.peak_tflops) == (0, 2, ("cpu",), 2.5)
    assert CollectorConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(Exception):
        cfg.wait = 3  # frozen


def test_disabled_collector_creates_nothing(tmp_path, monkeypatch):
    import torch.profiler
    created = []
    monkeypatch.setattr(torch.profiler, "profile", lambda *a, **k: created.append(1))
    with profiler.Collector(tmp_path, config=CollectorConfig(enabled=False)) as c:
        for _ in range(5):
            c.step()
    assert created == [] and c._prof is None
    assert not (tmp_path / "profile").exists()


def test_attach_from_env_unset_is_none(monkeypatch):
    for var in ("SLEUTH_PROFILE", "SLEUTH_SUMMARY"):
        monkeypatch.delenv(var, raising=False)
    assert profiler.attach_from_env() is None
    monkeypatch.setenv("SLEUTH_PROFILE", "0")
    assert profiler.attach_from_env() is None


@pytest.mark.parametrize("d, message", [
    ({"enabled": "no"}, "enabled must be true or false, got 'no'"),
    ({"wait": 10**9}, "wait must be a finite number from 0 to 1000000, got 1000000000"),
    ({"active": 0}, "active must be a finite number from 1 to 100000, got 0"),
    ({"peak_tflops": float("inf")}, "peak_tflops must be a finite number from 1e-06 to 1000000"),
    ({"peak_tflops": float("nan")}, "peak_tflops must be a finite number"),
    ({"tokens_per_step": 1.5}, "tokens_per_step must be an integer, got 1.5"),
])
def test_config_refuses_non_finite_absurd_and_mistyped_values(d, message):
    with pytest.raises(profiler.ConfigError) as e:
        CollectorConfig.from_dict(d)
    assert message in str(e.value)


@pytest.mark.parametrize("text, message", [
    ('{"wait": 1, "wait": 2}', "key 'wait' appears twice; keep one of them"),
    ('{"peak_tflops": NaN}', "NaN is not a number a config accepts"),
    ('{"wait": 1,', "invalid JSON"),
    ('{"wiat": 1}', "unknown key 'wiat'; did you mean 'wait'?"),
])
def test_config_json_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "collector.json"
    path.write_text(text)
    with pytest.raises(profiler.ConfigError) as e:
        CollectorConfig.from_json(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
