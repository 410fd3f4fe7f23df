"""`sleuth check --headroom RUN` and the headroom watch conditions on the command line, on Hugging
Face models trained with a fault injected (tests/tracer/headroom_runs.py)."""
from __future__ import annotations

import json

import pytest

from sleuth.cli import main

pytest.importorskip("transformers")
from tests.tracer.headroom_runs import (DYING, DYING_MODULE, GROWING,  # noqa: E402
                                        GROWING_MODULE, bert_dying_relu, gpt2_growing)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_headroom")
    return {"growing": str(gpt2_growing(root / "growing")),
            "dying": str(bert_dying_relu(root / "dying")),
            "healthy": str(bert_dying_relu(root / "healthy", fault=False)),
            "short": str(gpt2_growing(root / "short", steps=2))}


def _lines_after(out: str, heading: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    return lines[start + 1:]


def test_headroom_names_the_growing_layer_first(runs, capsys):
    assert main(["check", "--headroom", runs["growing"]]) == 1
    out = capsys.readouterr().out
    table = _lines_after(out, "heading toward overflow within 100 steps:")
    assert table[0].split() == ["at", "step", "steps", "left", "headroom", "growth/step", "dtype",
                                "module", "record"]
    row = table[1].split()
    assert row[0] == "17" and row[4:7] == ["+1.03", "bits", "float16"]
    assert row[-2:] == [GROWING_MODULE, GROWING]
    assert f"the usual first Inf): {GROWING} in 4.2 steps, at step 10\n" in out
    assert "fitted 202 of 202 floating-point record(s) (rank 0: steps 0-5)" in out


def test_headroom_json(runs, capsys):
    assert main(["check", "--headroom", runs["growing"], "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["exit_code"], out["found"]) == ("hit", 1, True)
    first = out["overflow"][0]
    assert (first["name"], first["module"], first["dtype"], first["at_step"]) == (
        GROWING, GROWING_MODULE, "float16", 17)
    assert first["headroom_bits"] == pytest.approx(12.33, abs=0.05)
    assert first["growth_bits"] == pytest.approx(1.0, abs=0.1)
    assert out["steps"] == {"0": [0, 1, 2, 3, 4, 5]} and out["horizon"] == 100
    assert out["nonfinite"] == [] and out["unread"] == []


def test_headroom_names_the_dying_relu_toward_underflow(runs, capsys):
    assert main(["check", "--headroom", runs["dying"]]) == 1
    out = capsys.readouterr().out
    assert "heading toward overflow" not in out
    row = _lines_after(out, "heading toward underflow within 100 steps:")[1].split()
    assert row[:5] == ["9", "3.1", "79.8%", "zeros", "+6.5%"]
    assert row[-2:] == [DYING_MODULE, DYING]


def test_one_worker_is_this_process_and_goes_with_headroom(runs, capsys):
    assert main(["check", "--headroom", runs["growing"], "--workers", "1"]) == 1
    assert GROWING in capsys.readouterr().out


def test_healthy_run_exits_0(runs, capsys):
    assert main(["check", "--headroom", runs["healthy"]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing heading toward overflow or underflow within 100 steps\n")


def test_horizon_narrows_the_list(runs, capsys):
    assert main(["check", "--headroom", runs["growing"], "--horizon", "5", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["overflow"] == []  # the growing layer has 12 steps left
    assert main(["check", "--headroom", runs["growing"], "--window", "3", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["overflow"][0]["name"] == GROWING


def test_two_steps_project_nothing_and_exit_2(runs, capsys):
    assert main(["check", "--headroom", runs["short"]]) == 2
    captured = capsys.readouterr()
    assert ("no trend can be projected: no record holds 3 or more dumped steps without NaN/Inf "
            "(the most steps a rank holds: 2); dump more steps") in captured.out
    assert "not projected" in captured.out
    assert captured.err.startswith("sleuth check: no trend can be projected")


@pytest.mark.parametrize("argv,message", [
    (["--headroom", "--step", "3"], "--headroom and --step do not go together: a trend needs "
                                    "every dumped step"),
    (["--headroom", "--first-nan"], "--headroom and --first-nan do not go together"),
    (["--headroom", "--workers", "2"], "--headroom and --workers do not go together: the "
                                       "trends are fitted in this process"),
    (["--horizon", "5"], "--horizon goes with --headroom"),
    (["--headroom", "--horizon", "0"], "horizon: 0.0 is out of range"),
    (["--headroom", "--window", "2"], r"window: 2 is out of range"),
    (["--condition", "zero_share_gt=90"], "for 90% use 0.9"),
    (["--condition", "overflow_headroom_lt=-1"], "in bits"),
])
def test_bad_options_exit_2_with_the_fix(runs, capsys, argv, message):
    assert main(["check", runs["growing"], *argv]) == 2
    assert message in capsys.readouterr().err


def test_conditions_offline_name_the_records(runs, capsys):
    assert main(["check", runs["growing"], "--condition", "overflow_headroom_lt=13",
                 "--json"]) == 1
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert (hits[0]["name"], hits[0]["step"], hits[0]["condition"]) == (
        GROWING, 5, "overflow_headroom_lt")
    watch = '[{"condition": "zero_share_gt", "threshold": 0.72, "names": ["*.forward.*"]}]'
    assert main(["check", runs["dying"], "--watch", watch, "--json"]) == 1
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert (hits[0]["name"], hits[0]["step"]) == (DYING, 4)


def test_several_ranks_get_a_rank_column(tmp_path, capsys):
    from tests.tracer.analysis.test_check_headroom import write_ranks

    run = write_ranks(tmp_path / "run")
    assert main(["check", "--headroom", str(run)]) == 1
    out = capsys.readouterr().out
    table = _lines_after(out, "heading toward overflow within 100 steps: 1 record(s)")
    assert table[0].split()[:3] == ["rank", "at", "step"]
    assert table[1].split() == ["1", "16", "11.0", "11.0", "bits", "+1.00", "bits", "float16",
                                "layer", "layer.forward.0.output.0"]
    assert "(rank 0: steps 0-5; rank 1: steps 0-5)" in out
    assert main(["check", "--headroom", str(run), "--rank", "0"]) == 0
