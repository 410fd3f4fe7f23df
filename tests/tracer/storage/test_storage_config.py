"""DumpConfig: validation messages, step/rank ranges, name filters, JSON and env loading."""
from __future__ import annotations

import json

import pytest

from tracer._config import DumpConfig, parse_ranges
from tracer._errors import ConfigError


@pytest.mark.parametrize("d, message", [
    ({"level": "modul"}, "level: 'modul' is not one of module, op, mix; did you mean 'module'?"),
    ({"mode": "stats"}, "mode: 'stats' is not one of statistics, tensor, full; did you mean "
                        "'statistics'?"),
    ({"writer": "asinc"}, "writer: 'asinc' is not one of sync, async; did you mean 'async'?"),
    ({"io": "inputs"}, "io: 'inputs' is not one of input, output, both; did you mean 'input'?"),
    ({"phases": "fwd"}, "phases: 'fwd' is not one of forward, backward, both"),
    ({"on_error": "ignore"}, "on_error: 'ignore' is not one of raise, warn"),
    ({"step": "1"}, "unknown key 'step'; did you mean 'steps'?"),
    ({"steps": "5-"}, "steps: '5-' has a bad part '5-'; write ranges like '0|5-8|100-120'"),
    ({"steps": "8-5"}, "steps: range '8-5' in '8-5' ends before it starts"),
    ({"ranks": "a"}, "ranks: 'a' has a bad part 'a'; write ranges like '0|1|4-7'"),
    ({"async_max_queued_mb": 0}, "async_max_queued_mb: 0 is out of range; use a finite number "
                                 "from 1 to 1048576 MiB"),
    ({"async_max_queued_mb": 10**12}, "async_max_queued_mb: 1000000000000 is out of range"),
    ({"async_max_queued_mb": 1e12}, "async_max_queued_mb: expected a whole number"),
    ({"async_max_queued_mb": True}, "async_max_queued_mb: expected a whole number"),
    ({"params": "yes"}, "params: expected true or false"),
    ({"modules": ["re:("]}, "modules: bad regular expression 're:('"),
    ({"ops": [3]}, "ops: expected a list of name patterns"),
    ({"exclude_modules": [""]}, "exclude_modules: empty pattern"),
    ({"watch": 3}, "watch: expected a list of watchpoint objects"),
])
def test_bad_values_name_key_value_and_fix(d, message):
    with pytest.raises(ConfigError) as e:
        DumpConfig.from_dict(d)
    assert message in str(e.value)


def test_ranges():
    assert parse_ranges("steps", "all") is None
    assert parse_ranges("steps", "0|5-8|100-120") == ((0, 0), (5, 8), (100, 120))
    c = DumpConfig(steps="0|5-8", ranks="1|4-5")
    assert [s for s in range(12) if c.wants_step(s)] == [0, 5, 6, 7, 8]
    assert [r for r in range(8) if c.wants_rank(r)] == [1, 4, 5]
    assert DumpConfig(steps=3).steps == "3" and DumpConfig(steps=3).wants_step(3)
    assert all(DumpConfig().wants_step(s) for s in (0, 10**9))


def test_module_and_op_filters():
    c = DumpConfig(modules=("layers.*",), exclude_modules=("re:drop",),
                   ops=["aten.mm", "aten.*softmax*"], exclude_ops="aten._log_softmax")
    assert c.modules == ("layers.*",) and c.exclude_ops == ("aten._log_softmax",)
    assert c.wants_module("layers.0.attn") and not c.wants_module("layers.0.dropout")
    assert not c.wants_module("head") and not c.wants_module("<root>")
    assert c.wants_op("aten.mm") and c.wants_op("aten._softmax") and not c.wants_op("aten.add")
    assert not c.wants_op("aten._log_softmax")
    assert c.wants_module("layers.1.mlp")  # cached path gives the same answer
    everything = DumpConfig()
    assert everything.wants_module("anything") and everything.wants_op("aten.anything")
    regex = DumpConfig(modules=["re:^layers\\.[01]\\.attn$"])
    assert regex.wants_module("layers.1.attn") and not regex.wants_module("layers.2.attn")


def test_round_trip_json_and_env(tmp_path, monkeypatch):
    c = DumpConfig(path=str(tmp_path), steps="1|3-4", level="mix", mode="full", modules=("a.*",),
                   writer="sync", async_max_queued_mb=16, on_error="warn")
    p = tmp_path / "dump.json"
    p.write_text(json.dumps(c.to_dict()))
    assert DumpConfig.from_json(p) == c
    monkeypatch.setenv("SLEUTH_DUMP_CONFIG", str(p))
    assert DumpConfig.from_env() == c
    monkeypatch.setenv("SLEUTH_DUMP_CONFIG", "")
    assert DumpConfig.from_env() is None
    monkeypatch.delenv("SLEUTH_DUMP_CONFIG")
    assert DumpConfig.from_env() is None
    monkeypatch.setenv("SLEUTH_DUMP_CONFIG", "1")
    assert DumpConfig.from_env() == DumpConfig()


def test_json_errors_name_file_line_column(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n  "steps": "0",\n  "level": module\n}')
    with pytest.raises(ConfigError, match=r"bad\.json:3:12: invalid JSON"):
        DumpConfig.from_json(p)
    p.write_text('{"levle": "op"}')
    with pytest.raises(ConfigError, match=r"bad\.json: unknown key 'levle'; did you mean 'level'"):
        DumpConfig.from_json(p)
    p.write_text('[1, 2]')
    with pytest.raises(ConfigError, match="must be a JSON object"):
        DumpConfig.from_json(p)
    with pytest.raises(ConfigError, match="cannot read dump config"):
        DumpConfig.from_json(tmp_path / "missing.json")


def test_run_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("SLEUTH_RUN_DIR", raising=False)
    assert str(DumpConfig().run_dir()) == "sleuth_run"
    monkeypatch.setenv("SLEUTH_RUN_DIR", str(tmp_path))
    assert DumpConfig().run_dir() == tmp_path
    assert DumpConfig(path="/x/run").run_dir().as_posix() == "/x/run"


def test_frozen_and_keyword_only():
    c = DumpConfig()
    with pytest.raises(Exception):
        c.level = "op"  # type: ignore[misc]
    with pytest.raises(TypeError):
        DumpConfig("run")  # type: ignore[misc]
    assert DumpConfig.keys()[0] == "path" and "watch" in DumpConfig.keys()


def test_watchpoints_are_validated_by_the_watch_module():
    pytest.importorskip("tracer._watch_config")
    with pytest.raises(ConfigError, match=r"watch\[1\]: .*'nan_in'.*did you mean 'nan_inf'"):
        DumpConfig(watch=[{"condition": "all_zero"}, {"condition": "nan_in"}])
    c = DumpConfig.from_dict({"watch": [{"condition": "nan_inf", "on_hit": "raise"}]})
    assert c.watch == ({"condition": "nan_inf", "on_hit": "raise"},)
    assert DumpConfig.from_dict(c.to_dict()) == c


def test_retired_tuning_variables_are_named_once_with_what_replaces_them(tmp_path, monkeypatch):
    """A user who still sets a variable the tracer no longer reads is told it does nothing,
    and what to do instead, once per process; a file-process switch is a config key now."""
    import warnings

    import torch

    import tracer
    import tracer._config as config_module

    monkeypatch.setattr(config_module, "_retired_warned", False)
    monkeypatch.setenv("SLEUTH_FILE_PROCESS", "0")
    monkeypatch.setenv("SLEUTH_STATS_THREADS", "2")
    model = torch.nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match=r"no longer read.*SLEUTH_FILE_PROCESS \(set "
                                            r"\"file_process\": false.*SLEUTH_STATS_THREADS"):
        tracer.Dumper(model, {"path": str(tmp_path / "a")}).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracer.Dumper(model, {"path": str(tmp_path / "b")}).close()
    assert DumpConfig.from_dict({"file_process": False}).file_process is False
    with pytest.raises(ConfigError, match="file_process"):
        DumpConfig.from_dict({"file_process": "no"})


@pytest.mark.parametrize("text, message", [
    ('{"level": "op", "level": "module"}', "key 'level' appears twice; keep one of them"),
    ('{"watch": [{"condition": "nan_inf", "on_hit": "raise", "on_hit": "record"}]}',
     "key 'on_hit' appears twice"),
    ('{"async_max_queued_mb": Infinity}', "Infinity is not a number a config accepts"),
    ('{"watch": [{"condition": "max_abs_gt", "threshold": NaN}]}', "NaN is not a number"),
    ("\udcff\udcfe garbage", "not UTF-8 text"),
])
def test_json_duplicate_keys_and_non_finite_numbers_are_refused(tmp_path, text, message):
    path = tmp_path / "dump.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError) as e:
        DumpConfig.from_json(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


@pytest.mark.parametrize("watch, message", [
    ({"condition": "max_abs_gt", "threshold": float("nan")},
     "watch[0]: threshold: nan is out of range; use a finite number >= 0"),
    ({"condition": "grad_explode", "threshold": float("inf")}, "threshold: inf is out of range"),
    ({"condition": "max_abs_lt", "threshold": -1}, "threshold: -1 is out of range"),
    ({"condition": "out_of_range", "low": float("-inf")}, "low: -inf is out of range"),
    ({"condition": "out_of_range", "low": 2, "high": 1}, "low=2 must be below high=1"),
])
def test_watch_limits_that_could_never_fire_are_refused(watch, message):
    with pytest.raises(ConfigError) as e:
        DumpConfig.from_dict({"watch": [watch]})
    assert message in str(e.value)


def test_inline_json_configs_are_as_strict_as_files(monkeypatch):
    from tracer._attach import _attach
    from tracer._dumper import resolve_config

    with pytest.raises(ConfigError, match="inline dump config: key 'level' appears twice"):
        resolve_config('{"level": "op", "level": "module"}')
    monkeypatch.setenv("SLEUTH_STRICT", "1")  # else the attach warns and the run goes on
    with pytest.raises(ConfigError, match=r"SLEUTH_DUMP_CONFIG \(inline JSON\): NaN is not a number"):
        _attach('{"async_max_queued_mb": NaN}')


@pytest.mark.parametrize("value", ["auto", "dispatch"])
def test_op_capture_values_of_the_one_path_are_accepted_and_dropped(tmp_path, value):
    """"op_capture" named a choice between the dispatch mode and a compiled op observer; the
    dispatch mode is the one path, so configs that spell it keep working and say nothing."""
    d = DumpConfig.from_dict({"level": "op", "op_capture": value})
    assert d == DumpConfig(level="op") and "op_capture" not in d.to_dict()
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"op_capture": value}))
    assert DumpConfig.from_json(path) == DumpConfig()


def test_op_capture_observer_is_refused_with_the_fix(tmp_path):
    """A config asking for the compiled observer gets no other capture in silence: it is told
    the observer is gone and what to change, before the run starts."""
    with pytest.raises(ConfigError, match=r'op_capture: "observer".*Remove "op_capture" from '
                                          r'the config'):
        DumpConfig.from_dict({"level": "module", "op_capture": "observer"})
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"op_capture": "observer"}))
    with pytest.raises(ConfigError, match=r"dump\.json: op_capture"):
        DumpConfig.from_json(path)
    with pytest.raises(ConfigError, match="remove it from the config"):
        DumpConfig.from_dict({"op_capture": "compiled"})


def test_one_rule_reads_the_env_variable(tmp_path, monkeypatch):
    """DumpConfig.from_env is the one parser of $SLEUTH_DUMP_CONFIG: the zero-code attach and
    `sleuth run` both take its answer, inline JSON included."""
    monkeypatch.setenv("SLEUTH_DUMP_CONFIG", ' {"level": "op", "steps": "1"} ')
    assert DumpConfig.from_env() == DumpConfig(level="op", steps="1")
    assert DumpConfig.from_env('{"path": "x"}').path == "x"
    with pytest.raises(ConfigError, match=r"SLEUTH_DUMP_CONFIG \(inline JSON\).*levle"):
        DumpConfig.from_env('{"levle": "op"}')
