"""`sleuth run --dump CONFIG` / `--profile CONFIG` check the config before the child starts: a
bad one is one line and exit 2, with or without --strict, and the script never runs."""
from __future__ import annotations

import pytest

_CASES = {
    "dump_unknown_key": ("--dump", '{"levle": "op"}', "unknown key 'levle'; did you mean 'level'?"),
    "dump_duplicate": ("--dump", '{"mode": "tensor", "mode": "full"}', "key 'mode' appears twice"),
    "dump_absurd": ("--dump", '{"async_max_queued_mb": 1000000000000}',
                    "async_max_queued_mb: 1000000000000 is out of range"),
    "dump_nan_watch": ("--dump", '{"watch": [{"condition": "max_abs_gt", "threshold": NaN}]}',
                       "NaN is not a number"),
    "dump_syntax": ("--dump", '{"level": ', "invalid JSON"),
    "profile_bad": ("--profile", '{"active": 0}', "active must be a finite number from 1"),
    "profile_duplicate": ("--profile", '{"wait": 1, "wait": 2}', "key 'wait' appears twice"),
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_config_stops_before_the_child(tmp_path, sleuth_cli, case, strict):
    flag, text, message = _CASES[case]
    config = tmp_path / "config.json"
    config.write_text(text)
    run = tmp_path / "run"
    args = ["run", "--run-dir", str(run), flag, str(config), *(["--strict"] if strict else []),
            "--", "python", "-c", "print('the child ran')"]
    r = sleuth_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "the child ran" not in r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr and str(config) in r.stderr
    assert not run.exists()


def test_a_good_config_runs_the_child(tmp_path, sleuth_cli):
    config = tmp_path / "dump.json"
    config.write_text('{"level": "module", "steps": "0"}')
    r = sleuth_cli("run", "--run-dir", str(tmp_path / "run"), "--dump", str(config), "--",
                   "python", "-c", "print('the child ran')")
    assert r.returncode == 0 and "the child ran" in r.stdout, r.stderr
