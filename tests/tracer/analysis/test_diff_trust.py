"""The trust rule for `sleuth diff`: never "same" on data not fully read.

A fault matrix damages real dumps of a model we did not write (tests/tracer/models.py), on
either side: a missing step file, truncation at several offsets (inside the tensor data too),
bytes flipped in the HDF5 header, in its metadata and in the tensor data, a step left only as a
`*.partial`, an empty rank folder, an interrupted step. Every case must exit non-zero, name the
damaged file and print no traceback; undamaged dumps still exit 0.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import tracer
from sleuth.cli import main

sys.path.insert(0, str(Path(__file__).parents[1]))
from models import MLP, train_and_dump  # noqa: E402
from test_diff_synthetic import rec, write_step  # noqa: E402


def _batch():
    return (torch.randn(4, 8),)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Two identical three-step tensor dumps and two statistics dumps of an MLP."""
    root = tmp_path_factory.mktemp("trust")
    for name, mode in (("a", "tensor"), ("b", "tensor"), ("sa", "statistics"),
                       ("sb", "statistics")):
        train_and_dump(MLP, _batch, root / name, steps=3, level="module", mode=mode,
                       writer="sync")
    return root


def _layout(path: Path) -> dict[str, int]:
    """Byte offsets of a step file's regions: its /records table and /tensors data."""
    with h5py.File(path, "r") as f:
        out = {"records": int(f["records"].id.get_offset()), "size": path.stat().st_size,
               "row": f["records"].dtype.itemsize,
               "name": int(f["records"].dtype.fields["name"][1])}
        if "tensors" in f and f["tensors"].size:
            out["tensors"] = int(f["tensors"].id.get_offset())
            out["tensor_bytes"] = int(f["tensors"].shape[0])
    return out


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _metadata_offsets(path: Path) -> list[int]:
    """Offsets inside HDF5 object headers (checksummed metadata) and inside the /records
    table's record names."""
    raw = path.read_bytes()
    lay = _layout(path)
    heads = [raw.find(sig) for sig in (b"OHDR", b"OCHK")]
    return [h + 6 for h in heads if h >= 0] + [lay["records"] + 2 * lay["row"] + lay["name"] + 1]


def _cases(step_file: Path) -> list[tuple[str, object]]:
    """(case id, damage function of the copied run's step file) for the tensor dumps."""
    lay = _layout(step_file)
    t0, tn = lay["tensors"], lay["tensor_bytes"]
    cases: list[tuple[str, object]] = [("missing", lambda p: p.unlink())]
    for cut in (64, 1500, lay["records"] + 10, t0 + 4, t0 + tn // 2, lay["size"] - 1):
        cases.append((f"truncated@{cut}", lambda p, cut=cut: _truncate(p, cut)))
    for off in (0, 9, 44):
        cases.append((f"flip-header@{off}", lambda p, off=off: _flip(p, off)))
    for off in _metadata_offsets(step_file):
        cases.append((f"flip-metadata@{off}", lambda p, off=off: _flip(p, off)))
    for off in (t0 + 1, t0 + tn // 2, t0 + tn - 1):
        cases.append((f"flip-data@{off}", lambda p, off=off: _flip(p, off)))
    cases.append(("partial-only", lambda p: p.rename(p.with_name(p.name + ".partial"))))
    cases.append(("partial-only-folder", _all_partial))
    cases.append(("empty-folder", _empty))
    cases.append(("interrupted", _interrupt))
    cases.append(("interrupted-old-complete-0", _complete_0))
    return cases


def _truncate(p: Path, size: int) -> None:
    with open(p, "r+b") as f:
        f.truncate(size)


def _all_partial(p: Path) -> None:
    for f in p.parent.glob("step*.h5"):
        f.rename(f.with_name(f.name + ".partial"))


def _empty(p: Path) -> None:
    for f in p.parent.iterdir():
        f.unlink()


def _interrupt(p: Path) -> None:
    with h5py.File(p, "r+") as f:
        f.attrs["status"] = "interrupted"
        f.attrs["status_reason"] = "RuntimeError: CUDA out of memory"


def _complete_0(p: Path) -> None:
    with h5py.File(p, "r+") as f:
        f.attrs["complete"] = 0
        for key in ("status", "status_reason"):  # a file written before those attributes
            if key in f.attrs:
                del f.attrs[key]


def _expected_code(case: str) -> int:
    return 1 if case == "missing" else 2


@pytest.mark.slow
@pytest.mark.parametrize("side", ["A", "B"])
def test_fault_matrix(dumps, tmp_path, capsys, side):
    ref = dumps / "a" / "dump" / "rank0" / "step1.h5"
    cases = _cases(ref)
    assert len(cases) >= 18
    failures = []
    for case, damage in cases:
        run = tmp_path / case
        shutil.copytree(dumps / ("b" if side == "B" else "a"), run)
        target = run / "dump" / "rank0" / "step1.h5"
        damage(target)
        a, b = (str(dumps / "a"), str(run)) if side == "B" else (str(run), str(dumps / "b"))
        try:
            code = main(["diff", a, b])
        except BaseException as e:  # noqa: BLE001 - a traceback is the failure we look for
            failures.append(f"{case}: raised {type(e).__name__}: {e}")
            continue
        out = capsys.readouterr()
        text = out.out + out.err
        named = str(target) if case not in ("empty-folder",) else str(target.parent)
        if code != _expected_code(case):
            failures.append(f"{case}: exit {code}, expected {_expected_code(case)}\n{text}")
        if named not in text:
            failures.append(f"{case}: {named} not named\n{text}")
        if "Traceback" in text or "status: SAME" in text:
            failures.append(f"{case}: traceback or SAME\n{text}")
    assert not failures, "\n\n".join(failures)


def test_fault_matrix_json_counts_problems(dumps, tmp_path, capsys):
    run = tmp_path / "b"
    shutil.copytree(dumps / "b", run)
    _truncate(run / "dump" / "rank0" / "step1.h5", 3000)
    (run / "dump" / "rank0" / "step2.h5").unlink()
    assert main(["diff", str(dumps / "a"), str(run), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "incomplete" and doc["exit_code"] == 2
    assert doc["problem_counts"] == {"truncated": 1, "missing": 1}
    by_state = {p["state"]: p for p in doc["problems"]}
    assert by_state["truncated"]["path"] == str(run / "dump" / "rank0" / "step1.h5")
    assert by_state["truncated"]["side"] == "B" and by_state["truncated"]["step"] == 1
    assert "3000 bytes" in by_state["truncated"]["reason"]
    assert by_state["missing"]["path"] == str(run / "dump" / "rank0" / "step2.h5")
    assert [s["step"] for s in doc["steps"]] == [0]
    # --allow-missing: only step 0, said so, and the records read agree
    assert main(["diff", str(dumps / "a"), str(run), "--allow-missing"]) == 0
    out = capsys.readouterr().out
    assert "left out by --allow-missing (2)" in out and "step1.h5" in out and "step2.h5" in out
    assert "on the steps both hold complete" in out.splitlines()[0]


def test_step_on_one_side_only_exits_1(dumps, tmp_path, capsys):
    run = tmp_path / "a"
    shutil.copytree(dumps / "a", run)
    (run / "dump" / "rank0" / "step2.h5").unlink()
    res = tracer.diff(run, dumps / "b")
    assert res.status == "diverged" and res.first_divergence is None and res.exit_code == 1
    assert [(p.side, p.step, p.state) for p in res.problems] == [("A", 2, "missing")]
    assert main(["diff", str(dumps / "b"), str(run)]) == 1
    assert "missing: no step 2 here, while A has it" in capsys.readouterr().out


def test_statistics_dumps_faults_and_same(dumps, tmp_path, capsys):
    assert main(["diff", str(dumps / "sa"), str(dumps / "sb")]) == 0
    assert "status: SAME" in capsys.readouterr().out
    for case, damage in (("truncated", lambda p: _truncate(p, _layout(p)["records"] + 8)),
                         ("missing", lambda p: p.unlink()), ("interrupted", _interrupt)):
        run = tmp_path / case
        shutil.copytree(dumps / "sb", run)
        target = run / "dump" / "rank0" / "step0.h5"
        damage(target)
        assert main(["diff", str(dumps / "sa"), str(run)]) == _expected_code(case), case
        out = capsys.readouterr().out
        assert str(target) in out and "status: SAME" not in out, out


def test_same_dumps_exit_0_and_every_way_of_naming_them(dumps, capsys):
    a, b = dumps / "a", dumps / "b"
    for args in ([a, b], [a / "dump", b / "dump"], [a / "dump" / "rank0", b / "dump" / "rank0"],
                 [a / "dump" / "rank0" / "step1.h5", b / "dump" / "rank0" / "step1.h5"]):
        assert main(["diff", *map(str, args)]) == 0, args
        assert capsys.readouterr().out.startswith("status: SAME")
    res = tracer.diff(a, b)
    assert res.problems == [] and res.exit_code == 0 and len(res.steps) == 3


def test_interrupted_step_is_compared_and_marked(dumps, tmp_path, capsys):
    run = tmp_path / "b"
    shutil.copytree(dumps / "b", run)
    _interrupt(run / "dump" / "rank0" / "step2.h5")
    res = tracer.diff(dumps / "a", run)
    assert res.status == "incomplete" and res.exit_code == 2
    step2 = next(s for s in res.steps if s["step"] == 2)
    assert step2["status"] == "interrupted" and step2["diverged"] == 0 and step2["same"] > 0
    assert "RuntimeError: CUDA out of memory" in step2["reason"]
    assert main(["diff", str(dumps / "a"), str(run)]) == 2
    out = capsys.readouterr().out
    assert "status: INCOMPLETE" in out and "status: SAME" not in out
    assert "step 2: no divergence in the records read" in out
    assert "INTERRUPTED: B interrupted: RuntimeError: CUDA out of memory" in out
    # chosen by name, it is compared and still marked; --allow-missing leaves it out otherwise
    assert main(["diff", str(dumps / "a"), str(run), "--step", "2"]) == 2
    assert "INTERRUPTED" in capsys.readouterr().out
    assert main(["diff", str(dumps / "a"), str(run), "--allow-missing"]) == 0
    assert "left out by --allow-missing (1)" in capsys.readouterr().out


def test_read_error_while_comparing_tensor_bytes(dumps, monkeypatch, capsys):
    import os

    real = os.preadv
    calls = {"n": 0}

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    assert main(["diff", str(dumps / "a"), str(dumps / "b"), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    (p,) = doc["problems"]
    assert p["state"] == "read_error" and "Input/output error" in p["reason"]
    assert p["path"].endswith("step0.h5")
    assert doc["status"] == "incomplete" and [s["step"] for s in doc["steps"]] == [1, 2]


def test_cli_subprocess_prints_no_traceback(dumps, tmp_path, sleuth_cli):
    run = tmp_path / "b"
    shutil.copytree(dumps / "b", run)
    target = run / "dump" / "rank0" / "step0.h5"
    _flip(target, 9)
    proc = sleuth_cli("diff", str(dumps / "a"), str(run))
    assert proc.returncode == 2
    assert str(target) in proc.stdout
    assert "Traceback" not in proc.stderr and "HDF5-DIAG" not in proc.stderr, proc.stderr


# -- NaN/Inf patterns and the table -------------------------------------------------------------
def test_nan_on_one_side_is_diverged_and_said_first(tmp_path, capsys):
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    y = x.copy()
    y[3] = np.nan
    y[7] = np.inf
    for mode in ("tensor", "statistics"):
        a, b = tmp_path / mode / "a", tmp_path / mode / "b"
        write_step(a, [rec("m", "forward", "output", x)], mode=mode)
        write_step(b, [rec("m", "forward", "output", y)], mode=mode)
        res = tracer.diff(a, b)
        row = res.records.iloc[0]
        assert row["verdict"] == "diverged", mode
        assert row["reason"].startswith("NaN/Inf differ: A has 0 NaN, 0 +Inf, 0 -Inf, B has "
                                        "1 NaN, 1 +Inf, 0 -Inf"), row["reason"]
        assert (row["nan"], row["b_nan"], row["b_posinf"]) == (0, 1, 1)
        if mode == "tensor":  # never cosine 1 and error 0 from the finite elements alone
            assert np.isnan(row["cosine"]) and row["max_abs_err"] == np.inf
            assert "(at 2 positions)" in row["reason"]
        assert main(["diff", str(a), str(b)]) == 1
        out = capsys.readouterr().out
        assert "0/0/0 | 1/1/0" in out, out


def test_table_has_steps_and_unpartnered_rows_last(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(16).astype(np.float32)
    recs = [rec("m", "forward", "output", x), rec("n", "forward", "output", x)]
    extra = rec("m", "forward", "output", x * 3, op="aten.mul", module="m")
    for step in (0, 1):
        write_step(tmp_path / "a", recs, step=step)
        write_step(tmp_path / "b", [recs[0], rec("n", "forward", "output", x * 2), extra],
                   step=step)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("order"))
    assert lines[head].split()[:3] == ["order", "step", "name"]
    body = [line.split() for line in lines[head + 1:] if line.strip()]
    assert [(r[1], r[2]) for r in body] == [("0", "n.forward.0.output.0"),
                                            ("1", "n.forward.0.output.0"),
                                            ("0", "m::aten.mul.forward.0.output.0"),
                                            ("1", "m::aten.mul.forward.0.output.0")]
    assert body[-1][-1] == "only_b"


def test_checksums_are_summed_chunk_by_chunk(dumps, tmp_path, monkeypatch, capsys):
    """Tensors read in many chunks: equal dumps stay SAME, one flipped byte is still found."""
    import tracer.analysis._diff_record as diff_module

    monkeypatch.setattr(diff_module, "CHUNK_ELEMENTS", 5)
    assert main(["diff", str(dumps / "a"), str(dumps / "b")]) == 0
    run = tmp_path / "b"
    shutil.copytree(dumps / "b", run)
    target = run / "dump" / "rank0" / "step2.h5"
    lay = _layout(target)
    _flip(target, lay["tensors"] + lay["tensor_bytes"] - 3)
    assert main(["diff", str(dumps / "a"), str(run)]) == 2
    out = capsys.readouterr().out
    assert str(target) in out and "do not match the checksum stored with them" in out
