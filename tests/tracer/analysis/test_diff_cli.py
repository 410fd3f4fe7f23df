"""`sleuth diff` and `sleuth check` on synthetic dumps: exit codes, table, --json, --csv."""
from __future__ import annotations

import json
import os

import pytest
import numpy as np

from sleuth.cli import main
from test_diff_synthetic import model_records, rec, write_step


def _pair(tmp_path, **kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)
    write_step(tmp_path / "a", model_records(x, w=w))
    write_step(tmp_path / "b", model_records(x, w=w, **kw))
    return str(tmp_path / "a"), str(tmp_path / "b")


def test_same_exit_0(tmp_path, capsys):
    a, b = _pair(tmp_path)
    assert main(["diff", a, b]) == 0
    out = capsys.readouterr().out
    assert "status: SAME" in out and "first divergence" not in out


def test_diverged_table_json_csv(tmp_path, capsys):
    a, b = _pair(tmp_path, eps=0.5)
    csv = tmp_path / "rows.csv"
    assert main(["diff", a, b, "--csv", str(csv)]) == 1
    out = capsys.readouterr().out
    mask = os.umask(0o022)
    os.umask(mask)
    assert csv.stat().st_mode & 0o777 == 0o666 & ~mask  # as any file the user writes
    assert "status: DIVERGED" in out
    assert "first divergence (compute): layers.1::aten.rms.forward.0.output.0" in out
    assert "source model.py:11" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("order"))
    assert "layers.1::aten.rms.forward.0.output.0" in lines[header + 1]
    import pandas as pd

    rows = pd.read_csv(csv)
    assert {"name", "cosine", "max_abs_err", "verdict"} <= set(rows.columns)
    assert main(["diff", a, b, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "diverged"
    fd = doc["first_divergence"]
    assert (fd["name"], fd["module"], fd["op"], fd["phase"], fd["step"], fd["rank"],
            fd["source"]) == ("layers.1::aten.rms.forward.0.output.0", "layers.1", "aten.rms",
                              "forward", 0, 0, "model.py:11")
    assert len(doc["records"]) == len(rows)


def test_tolerance_flags(tmp_path, capsys):
    a, b = _pair(tmp_path, eps=0.5)
    assert main(["diff", a, b]) == 1
    assert main(["diff", a, b, "--rtol", "10", "--atol", "10", "--cosine-min", "-1"]) == 0
    assert main(["diff", a, b, "--rtol", "-1"]) == 2
    assert "rtol: must be >= 0" in capsys.readouterr().err


def test_errors_exit_2(tmp_path, capsys):
    a, b = _pair(tmp_path)
    assert main(["diff", a, str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["diff", a, b, "--b-rank", "3"]) == 2
    assert "no rank 3" in capsys.readouterr().err


def test_check_cli(tmp_path, capsys):
    x = np.array([1.0, -4.0, 9.0], np.float32)
    with np.errstate(invalid="ignore"):
        y = np.sqrt(x)
    write_step(tmp_path / "r", [
        rec("act", "forward", "input", x, op="aten.sqrt", source="m.py:3"),
        rec("act", "forward", "output", y, op="aten.sqrt", source="m.py:3"),
        rec("out", "forward", "input", y, op="aten.mul", source="m.py:4"),
        rec("out", "forward", "output", y * 2, op="aten.mul", source="m.py:4"),
        rec("big", "forward", "output", x * 1e6, op="aten.mul", source="m.py:5"),
    ])
    run = str(tmp_path / "r")
    assert main(["check", run, "--first-nan"]) == 1
    out = capsys.readouterr().out
    assert "act::aten.sqrt.forward.0.output.0" in out and "m.py:3" in out
    assert main(["check", run, "--condition", "max_abs_gt=1e5", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [h["name"] for h in doc["hits"]] == ["big::aten.mul.forward.0.output.0"]
    assert doc["first_nan"]["op"] == "aten.sqrt"
    assert main(["check", run, "--condition", "max_abs_gtt=1"]) == 2
    assert "did you mean 'max_abs_gt'" in capsys.readouterr().err
    write_step(tmp_path / "clean", [rec("m", "forward", "output", x)])
    assert main(["check", str(tmp_path / "clean")]) == 0


@pytest.mark.slow
def test_cli_subprocess_exit_codes(tmp_path, sleuth_cli):
    a, b = _pair(tmp_path, eps=0.5)
    res = sleuth_cli("diff", a, b, "--json")
    assert res.returncode == 1, res.stderr
    assert json.loads(res.stdout)["first_divergence"]["module"] == "layers.1"
    assert sleuth_cli("diff", a, a).returncode == 0


def test_progress_on_stderr_only_when_asked(tmp_path, capsys):
    a, b = _pair(tmp_path, eps=0.5)
    main(["diff", a, b])
    assert "diff:" not in capsys.readouterr().err  # not a terminal here
    main(["diff", a, b, "--progress"])
    assert "diff:" in capsys.readouterr().err


def test_streamed_cli_writes_what_the_whole_diff_holds(tmp_path, capsys):
    """`sleuth diff` streams step by step: its --json records, --csv rows and the table it prints
    are those of the diff that keeps every record; a diff that fails leaves a CSV already
    there as it was."""
    import math

    import pandas as pd

    import tracer
    from test_diff_ranks import write_run

    a = write_run(tmp_path / "a", 1, steps=(1, 2, 3))
    b = write_run(tmp_path / "b", 1, steps=(1, 2, 3), bump={(0, 2, 1): 0.5, (0, 3, 3): 9.0})
    whole = tracer.diff(a, b)
    assert main(["diff", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    want = whole.to_dict()
    assert len(doc["records"]) == len(want["records"]) == 12
    for got, ref in zip(doc["records"], want["records"]):
        for k, v in ref.items():
            same = (v == got[k] or (isinstance(v, float) and math.isnan(v) and got[k] is None)
                    or (v is None and got[k] is None))
            assert same, (k, v, got[k])
    assert [r["order"] for r in doc["records"]] == list(range(12))
    assert {k: v for k, v in doc.items() if k != "records"} == {
        k: v for k, v in want.items() if k != "records"}
    csv = tmp_path / "rows.csv"
    assert main(["diff", str(a), str(b), "--csv", str(csv)]) == 1
    text = capsys.readouterr().out
    got = pd.read_csv(csv)
    ref = whole.records.reset_index(drop=True)
    assert list(got.columns) == list(ref.columns) and len(got) == len(ref)
    assert list(got["name"]) == list(ref["name"]) and list(got["verdict"]) == list(ref["verdict"])
    # the table: the first divergence, then the worst others (step 3's larger error first)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("order"))
    assert lines[header + 1].split()[:3] == ["5", "2", "layers.1.forward.0.output.0"]
    assert lines[header + 2].split()[1] == "3"
    assert main(["diff", str(a), str(b), "--csv", str(tmp_path / "nowhere" / "r.csv")]) == 2
    assert "the folder" in capsys.readouterr().err
    csv.write_text("kept\n")
    assert main(["diff", str(a), str(tmp_path / "missing"), "--csv", str(csv)]) == 2
    assert csv.read_text() == "kept\n"
    assert not list(tmp_path.glob(".sleuth-diff-*"))


def test_a_streamed_diff_of_mixed_dtypes_over_steps(tmp_path, capsys):
    """float32 against float16 over several steps: the dtype note names the first step's
    record, once, and the streamed diff (the command line's) reads every step."""
    import torch

    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, make_writer

    for side, dtype in (("a", torch.float32), ("b", torch.float16)):
        w = make_writer(DumpConfig(path=str(tmp_path / side), writer="sync"), rank=0,
                        world_size=1)
        for step in (1, 2, 3):
            w.begin_step(step)
            for i in range(3):
                w.add(RecordMeta(f"layers.{i}.forward.0.output.0", f"layers.{i}", "",
                                 "forward", "output", 0, 0, f"model.py:{i}"),
                      torch.full((8,), 0.1 * (i + step)).to(dtype))
            w.end_step()
        w.close()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) in (0, 1)
    out = capsys.readouterr().out
    assert "9 matched records differ in dtype, the first at layers.0.forward.0.output.0" in out


def _llama_dump(path, *, bf16=False, seed=1):
    """One step of a Hugging Face Llama built from a config, dumped at level op (statistics)."""
    import logging

    import pytest
    import torch

    import tracer

    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    with tracer.Dumper(model, {"path": str(path), "level": "op", "mode": "statistics"}):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return str(path)


def test_the_first_lines_say_b_ran_in_bf16_and_name_the_verdicts_command(tmp_path, capsys):
    a, b = _llama_dump(tmp_path / "a"), _llama_dump(tmp_path / "b", bf16=True)
    assert main(["diff", a, b]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("status: DIVERGED")
    assert lines[1].startswith("B ran in bfloat16 where A ran in float32: "), lines[:3]
    assert lines[2].startswith(f"that change alone, or a bug too? the verdict: sleuth explain "
                               f"{a} {b}"), lines[:3]
    assert main(["diff", a, b, "--json"]) == 1
    change = json.loads(capsys.readouterr().out)["changes"][0]
    assert (change["kind"], change["a"], change["b"]) == ("dtype", "float32", "bfloat16")
    assert 0 < change["records"] <= change["paired"]


def test_token_ids_that_differ_are_named_as_the_data(tmp_path, capsys):
    # at level op no record holds the model's input: the first is the embedding's, token ids
    # that no recorded op made
    a, b = _llama_dump(tmp_path / "a"), _llama_dump(tmp_path / "b", seed=2)
    assert main(["diff", a, b, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    fd = doc["first_divergence"]
    assert fd["name"] == "model.embed_tokens::aten.embedding.forward.0.input.1", fd["name"]
    assert fd["kind"] == "data" and fd["dtype"] == "int64"
    assert [c["kind"] for c in doc["changes"]] == ["data"]
    assert main(["diff", a, b]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("the two runs were fed different data: model.embed_tokens::"
                               "aten.embedding.forward.0.input.1 (int64 2,8)"), lines[:3]


def test_the_explain_command_a_mapped_diff_suggests_keeps_the_map():
    from sleuth._diff_report import explain_command

    assert explain_command("runs/a", "runs/b", 0, None, "map.yaml") == \
        "sleuth explain --map map.yaml runs/a runs/b --step 0"
    assert explain_command("runs/a", "runs/b") == "sleuth explain runs/a runs/b"
