"""One run per run directory: `sleuth train` (and `trainer.train`) refuse another run's folder
before touching a file, `--overwrite` replaces only Sleuth's files, `--resume latest` with
nothing to resume says so, and every file of a run carries its run id."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

import trainer
from sleuth.cli import main


@pytest.fixture(autouse=True)
def _no_run_id(monkeypatch):
    monkeypatch.delenv("SLEUTH_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _data(corpus) -> list[str]:
    return ["--set", f"data.train_files={corpus[0]}", "--set", f"data.val_files={corpus[1]}",
            "--set", "eval_every=0"]


def _run_id(run: Path) -> str:
    return json.loads((run / "run.json").read_text())["run_id"]


@pytest.mark.slow
def test_a_second_run_is_refused_untouched_and_overwrite_replaces_it(sleuth_cli, tmp_path, corpus):
    run = tmp_path / "run"
    first = sleuth_cli("train", "--set", "steps=2", *_data(corpus), "--summary", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    old_id = _run_id(run)
    (run / "notes.txt").write_text("the user's own file")
    before = _snapshot(run)

    again = sleuth_cli("train", "--set", "steps=3", *_data(corpus), "--summary", "--run-dir", str(run))
    assert again.returncode == 2
    [line] = again.stderr.strip().splitlines()
    assert str(run) in line and old_id in line and "Traceback" not in line
    # no checkpoint there: --resume latest would fail, so it is not offered
    assert "--overwrite" in line and "--resume latest" not in line and "--run-dir" in line
    assert "training" not in again.stdout  # refused before training started
    assert _snapshot(run) == before  # no file touched: metrics not appended, run.json kept

    new = sleuth_cli("train", "--set", "steps=3", *_data(corpus), "--summary", "--overwrite",
                     "--run-dir", str(run))
    assert new.returncode == 0, new.stderr
    new_id = _run_id(run)
    assert new_id != old_id and "overwrite: removed" in new.stdout
    assert [m["step"] for m in trainer.read_metrics(run)] == [0, 1, 2]  # no saw-tooth
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["run_id"] == new_id
    assert json.loads((run / "run.json").read_text())["config"]["steps"] == 3
    assert [p.name for p in (run / "summary").iterdir()] == ["rank0.h5"]  # no old segment
    assert (run / "notes.txt").read_text() == "the user's own file"


@pytest.mark.slow
def test_resume_latest_with_nothing_to_resume_exits_2(sleuth_cli, tmp_path, corpus):
    run = tmp_path / "run"
    empty = sleuth_cli("train", "--set", "steps=2", *_data(corpus), "--resume", "latest",
                       "--run-dir", str(run))
    assert empty.returncode == 2
    [line] = empty.stderr.strip().splitlines()
    assert "holds no run to continue" in line and "drop --resume" in line
    assert not run.exists()

    assert sleuth_cli("train", "--set", "steps=2", *_data(corpus), "--run-dir",
                      str(run)).returncode == 0
    before = _snapshot(run)
    none = sleuth_cli("train", "--set", "steps=4", *_data(corpus), "--resume", "latest",
                      "--run-dir", str(run))
    assert none.returncode == 2
    [line] = none.stderr.strip().splitlines()
    assert f"holds run {_run_id(run)} but no checkpoint" in line
    assert "checkpoint_every" in line and "--overwrite" in line and "Traceback" not in line
    assert _snapshot(run) == before  # the old metrics.jsonl got no second step 0


def test_every_file_of_a_run_carries_its_run_id(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps({"steps": "0", "level": "module", "writer": "sync"}))
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"wait": 0, "warmup": 0, "active": 1}))
    assert main(["train", "--set", "steps=2", "--set", "checkpoint_every=2", *_data(corpus),
                 "--dump", str(dump), "--profile", str(prof), "--summary",
                 "--run-dir", str(run)]) == 0
    run_id = _run_id(run)
    ids = {"metrics": json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["run_id"],
           "checkpoint": json.loads((run / "checkpoints/step2/meta.json").read_text())["run_id"],
           "dump": json.loads((run / "dump/dump.json").read_text())["run_id"],
           "profile": json.loads((run / "profile/rank0/window0.json").read_text())["run_id"]}
    with h5py.File(run / "summary/rank0.h5", "r") as f:
        ids["summary"] = f.attrs["run_id"]
    with h5py.File(run / "dump/rank0/step0.h5", "r") as f:
        ids["step file"] = f.attrs["run_id"]
    assert run_id and ids == dict.fromkeys(ids, run_id)


def test_a_resumed_run_continues_its_id_and_a_foreign_checkpoint_is_refused(tmp_path, corpus,
                                                                             capsys):
    run = tmp_path / "run"
    common = ["train", "--set", "steps=3", *_data(corpus), "--run-dir", str(run)]
    assert main([*common, "--set", "stop_after=1"]) == 0
    run_id = _run_id(run)
    assert main([*common, "--resume", "latest"]) == 0
    assert _run_id(run) == run_id and [m["step"] for m in trainer.read_metrics(run)] == [0, 1, 2]
    capsys.readouterr()

    # a checkpoint of another run, copied into this run's folder
    meta = run / "checkpoints" / "step1" / "meta.json"
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "run_id": "someone-else"}))
    before = _snapshot(run)
    assert main([*common, "--resume", str(meta.parent)]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint of run someone-else" in err and f"names run {run_id}" in err
    assert _snapshot(run) == before


def test_the_python_entry_refuses_and_overwrites(make_config, tmp_path):
    first = trainer.train(make_config("steps=2"))
    (first.run_dir / "ir").mkdir()
    (first.run_dir / "ir" / "mine.txt").write_text("kept")
    old = _run_id(first.run_dir)
    with pytest.raises(trainer.OtherRunError, match=f"run {old}: run.json, metrics.jsonl"):
        trainer.train(make_config("steps=2"))
    trainer.train(make_config("steps=2", "overwrite=true"))
    assert _run_id(first.run_dir) != old
    assert (first.run_dir / "ir" / "mine.txt").read_text() == "kept"
    with pytest.raises(trainer.OtherRunError, match="holds no run to continue"):
        trainer.train(make_config("resume=latest", run="elsewhere"))


def test_a_reused_run_id_does_not_restart_a_run_at_step_0(make_config, monkeypatch):
    monkeypatch.setenv("SLEUTH_RUN_ID", "fixed-id")
    state = trainer.train(make_config("steps=2"))
    assert _run_id(state.run_dir) == "fixed-id"
    with pytest.raises(trainer.OtherRunError, match="holds run fixed-id already.*starts again "
                                                    "at step 0"):
        trainer.train(make_config("steps=2"))
    assert [m["step"] for m in trainer.read_metrics(state.run_dir)] == [0, 1]


def test_overwrite_refuses_to_remove_the_checkpoint_it_resumes(make_config):
    state = trainer.train(make_config("steps=2", "stop_after=1"))
    with pytest.raises(trainer.ConfigError, match="overwrite would remove"):
        trainer.train(make_config("steps=2", "resume=latest", "overwrite=true"))
    assert (state.run_dir / "checkpoints" / "step1" / "meta.json").is_file()


def test_read_metrics_refuses_another_runs_metrics(make_config, tmp_path):
    run = trainer.train(make_config("steps=1")).run_dir
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(run / "metrics.jsonl", other / "metrics.jsonl")
    (other / "run.json").write_text(json.dumps({"run_id": "another-run"}))
    with pytest.raises(trainer.OtherRunError, match="holds the metrics of run .* not of run "
                                                    "another-run"):
        trainer.read_metrics(other)
    assert [m["step"] for m in trainer.read_metrics(run)] == [0]


@pytest.mark.slow
def test_torchrun_ranks_refuse_together_and_overwrite_between_barriers(tmp_path, corpus):
    import os
    import socket
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"

    def torchrun(*extra: str) -> subprocess.CompletedProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
        env.pop("SLEUTH_RUN_ID", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "trainer",
               "--run-dir", str(run), "--set", "steps=1", "--set", "batch_size=2", *_data(corpus),
               *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)

    assert torchrun().returncode == 0
    old = _run_id(run)
    before = _snapshot(run)
    refused = torchrun()  # both ranks refuse (none waits at a barrier for the other)
    assert refused.returncode != 0
    # the refusal is printed once (local rank 0), and each rank exits 2 with it as the root
    # cause of torchrun's own report, not torchrun's pointer to @record
    said = [line for line in refused.stderr.splitlines()
            if line.startswith("trainer: error:")]
    assert len(said) == 1 and f"another run (run {old}" in said[0], refused.stderr[-3000:]
    assert refused.stderr.count("exitcode  : 2 ") == 2, refused.stderr[-3000:]
    assert refused.stderr.count(f"traceback : {said[0]}") == 2, refused.stderr[-3000:]
    # torchrun may still say it sends the other rank SIGTERM when the first exits (a race of
    # its monitor with that rank's own exit): both ranks' exit code 2 above says none was killed
    assert "To enable traceback" not in refused.stderr
    assert _snapshot(run) == before
    replaced = torchrun("--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    new = _run_id(run)
    assert new != old
    for name in ("metrics.jsonl", "metrics.rank1.jsonl"):
        assert json.loads((run / name).read_text().splitlines()[0])["run_id"] == new


def test_two_runs_started_into_one_new_dir_one_wins(tmp_path):
    """Both found the directory empty; the second run.json is refused, not written over the
    first (two `sleuth run`s started at once wrote one run.json and the other's dump)."""
    from trainer import OtherRunError, write_run_json

    kw = dict(name="x", argv=["a"], world_size=1, config={}, exclusive=True)
    write_run_json(tmp_path, run_id="first", **kw)
    with pytest.raises(OtherRunError, match="at the same time"):
        write_run_json(tmp_path, run_id="second", **kw)
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


_DAMAGED_RUN_JSON = {
    "truncated": b'{"run_id": "20261205T085733Z-8700d3c5cf07", "na',
    "not_json": b"hello\n",
    "deep": b"[" * 200_000 + b"]" * 200_000,
    "array": b'["run_id", "x"]',
    "empty": b"",
    "run_id_not_text": b'{"run_id": 7}',
}


@pytest.mark.parametrize("damage", list(_DAMAGED_RUN_JSON))
def test_a_damaged_run_json_is_named_damaged_not_taken_for_an_old_run(tmp_path, capsys, damage):
    """A run.json that cannot be read names no run: which run wrote the folder is unknown, so
    the refusal says the file is damaged, with the fixes, instead of guessing "a run written
    before run ids"."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_bytes(_DAMAGED_RUN_JSON[damage])
    (run / "metrics.jsonl").write_text('{"format_version": "1.0"}\n{"step": 0, "loss": 1.0}\n')
    before = _snapshot(run)
    found = trainer.scan_run_dir(run)
    assert found.damaged and found.owner == ""
    for extra in ([], ["--resume", "latest"]):
        code = main(["train", "--set", "steps=1", "--run-dir", str(run), *extra])
        err = capsys.readouterr().err
        assert code == 2
        [line] = err.strip().splitlines()
        assert f"{run / 'run.json'}" in line and "damaged" in line, line
        assert "--overwrite" in line and "--run-dir" in line and "before run ids" not in line
        assert _snapshot(run) == before
    with pytest.raises(trainer.OtherRunError, match="run.json is damaged"):
        trainer.claim_run_dir(run, "new")
    # --overwrite replaces it as it would any old run's files
    assert trainer.claim_run_dir(run, "new", overwrite=True).damaged
    trainer.remove_run_files(run)
    assert not (run / "run.json").exists() and trainer.scan_run_dir(run).empty


def test_a_sound_run_json_without_run_id_is_an_old_run(tmp_path):
    (tmp_path / "run.json").write_text('{"name": "old", "argv": []}')
    found = trainer.scan_run_dir(tmp_path)
    assert found.owner == "" and not found.damaged
    with pytest.raises(trainer.OtherRunError, match="a run written before run ids"):
        trainer.claim_run_dir(tmp_path, "new")


def test_run_json_as_a_folder(tmp_path):
    """An empty folder where run.json goes is damaged: --overwrite removes it. One holding files
    is a user's, which --overwrite never removes: both refusals say to move it away."""
    run = tmp_path / "run"
    (run / "run.json").mkdir(parents=True)
    with pytest.raises(trainer.OtherRunError, match="--overwrite"):
        trainer.claim_run_dir(run, "new")
    trainer.remove_run_files(run)
    assert not (run / "run.json").exists()
    (run / "run.json").mkdir()
    (run / "run.json" / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(trainer.OtherRunError, match="a folder holding files.*move") as e:
            trainer.claim_run_dir(run, "new", overwrite=overwrite)
            trainer.remove_run_files(run)
        assert "pass --overwrite" not in str(e.value)
    assert (run / "run.json" / "notes.txt").read_text() == "mine"


def test_overwrite_removes_every_ranks_demo_corpus(tmp_path):
    """A two-rank run's corpus (data/rank1) does not outlive an --overwrite by a one-rank run;
    a user's file beside it stays."""
    for rank in (0, 1):
        d = tmp_path / "data" / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "demo_pretrain_train.jsonl").write_text("{}\n")
        (d / "demo_pretrain_val.parquet").write_bytes(b"PAR1")
    (tmp_path / "data" / "mine.txt").write_text("mine")
    removed = trainer.remove_run_files(tmp_path)
    assert len(removed) == 4 and not (tmp_path / "data" / "rank1").exists()
    assert (tmp_path / "data" / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary/rank0.h5", "run.json",
                                  "checkpoints/step3/meta.json"])
def test_a_fifo_among_a_run_directorys_files_is_never_waited_on(tmp_path, name, answers_within):
    """The claim on a run directory reads the run id of every tool's files; a FIFO named
    metrics.jsonl or summary/rank0.h5 held `sleuth train` (and zero-code attach) forever in
    that read. Read through the door (sleuth.common): a FIFO is no run's file, the claim
    answers. A thread with a timeout, so that a hang fails instead of stalling."""
    import os

    run = tmp_path / "run"
    fifo = run / name
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    answered, answer = answers_within(lambda: trainer.claim_run_dir(run, "new-run"), 20, fifo)
    assert answered, f"the claim waited on a FIFO named {name}"
    if name == "run.json":  # run.json that is no file: which run wrote the folder is unknown
        assert isinstance(answer[0], trainer.OtherRunError), answer
        assert "not a regular file" in str(answer[0]), answer
