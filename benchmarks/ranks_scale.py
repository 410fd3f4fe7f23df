"""Diff and check over many ranks: wall time and peak memory, and that the right rank is named.

A real data-parallel run (torchrun, gloo, the trainer's GPT with op-level statistics) is
replicated into `--ranks` ranks (rank r takes the files of real rank r mod procs), one rank is
perturbed at a known step and op (a NaN counted in one op's output record, its table checksum
rewritten as the writer would), and then, each as the user runs it (`sleuth` in a subprocess):

  diff_wN        `sleuth diff A B --workers N`         for N in --workers (1, 2, all cores)
  diff_dask      `sleuth diff A B --scheduler ADDR`     on a local Dask cluster (2 workers)
  check_wN       `sleuth check B --workers N`           watchpoints and the first NaN, likewise
  check_dask     `sleuth check B --scheduler ADDR`
  first_nan_wN   `sleuth check B --first-nan --workers N`  the first NaN only

Each row: wall seconds, the command's peak resident memory (the whole process tree, sampled
every 20 ms; the Dask workers' memory is theirs, listed apart), and whether the perturbed rank,
step and record were named. Prints one JSON object.

Run: python3 benchmarks/ranks_scale.py [--ranks 64] [--model gpt|tiny] [--steps 3] [--procs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))

MODELS = {
    # the tracer benchmarks' gpt: vocab 512, 4 layers, d 256, seq 128, batch 8
    "gpt": ["model.vocab_size=512", "model.n_layer=4", "model.n_head=4", "model.n_embd=256",
            "model.block_size=128", "data.seq_len=128", "batch_size=8"],
    "tiny": [],
}


def _sleuth(*args: str) -> list[str]:
    return [sys.executable, "-m", "sleuth", *args]


def _env() -> dict[str, str]:
    """The subprocesses run the sleuth this script imported (a checkout's or the installed)."""
    import tracer

    where = str(Path(tracer.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": where + (os.pathsep + path if path else "")}


def make_base(work: Path, model: str, steps: int, procs: int) -> Path:
    """A real run's op-level statistics dump, `procs` ranks."""
    run = work / "base"
    cfg = work / "dump.json"
    cfg.write_text(json.dumps({"level": "op", "mode": "statistics", "writer": "sync"}))
    sets = [x for s in [*MODELS[model], f"steps={steps}", "eval_every=0", "log_every=1000"]
            for x in ("--set", s)]
    train = ["-m", "sleuth", "train", "--preset", "tiny", *sets, "--dump", str(cfg),
             "--run-dir", str(run)]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
               "--master_port", str(_free_port()), *train]
    else:
        cmd = [sys.executable, *train]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=work,
                   env=_env())
    return run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicate(base: Path, out: Path, ranks: int) -> None:
    """`out`/dump/rank{r} for r < ranks, each a copy of real rank r mod procs, its `rank`
    attribute set to r (the reader identifies a lone step file by it)."""
    import h5py

    real = sorted(p for p in (base / "dump").iterdir() if p.name.startswith("rank"))
    (out / "dump").mkdir(parents=True)
    for f in (base / "dump").iterdir():
        if f.is_file():
            shutil.copy2(f, out / "dump" / f.name)
    for r in range(ranks):
        dst = out / "dump" / f"rank{r}"
        shutil.copytree(real[r % len(real)], dst)
        for step_file in dst.glob("step*.h5"):
            with h5py.File(step_file, "r+") as h:
                h.attrs["rank"] = r


def perturb(run: Path, rank: int, step: int) -> dict[str, Any]:
    """Count one NaN (and its changed checksum) in an op output record a third of the way through the step's forward:
    what a NaN made by that op on that rank looks like in a statistics dump."""
    import h5py
    import numpy as np

    from tracer.storage._format import records_crc32

    path = run / "dump" / f"rank{rank}" / f"step{step}.h5"
    with h5py.File(path, "r+") as f:
        table = f["records"][()]
        ops = [i for i in range(len(table))
               if table["op"][i] and table["direction"][i] == b"output"
               and table["phase"][i] == b"forward" and table["dtype"][i].startswith(b"float")]
        if not ops:
            raise SystemExit(f"{path}: no float op output record to perturb (level op?)")
        i = ops[len(ops) // 3]
        table["nan"][i] = 1
        table["max"][i] = np.nan
        table["checksum"][i] ^= 0x5A5A  # other values, other checksum
        f["records"][...] = table
        f.attrs["records_crc32"] = records_crc32(table)
        name = table["name"][i].decode()
    return {"rank": rank, "step": step, "name": name}


class Peak:
    """Peak resident memory of a process and its children, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            time.sleep(0.02)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


def timed(cmd: list[str]) -> tuple[float, int, int, str]:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env())
    peak = Peak(p.pid)
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    mem = peak.stop()
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}: {err.strip()[-2000:]}")
    return wall, mem, p.returncode, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps dumped (default 3)")
    ap.add_argument("--procs", type=int, default=2, help="real ranks (torchrun; 1: no torchrun)")
    ap.add_argument("--workers", default=f"1,2,{os.cpu_count() or 1}",
                    help="local process counts for diff (default: 1,2,all cores)")
    ap.add_argument("--no-dask", action="store_true", help="skip the Dask cluster row")
    args = ap.parse_args()
    if args.ranks < 2 or args.steps < 1:
        ap.error("--ranks must be >= 2 and --steps >= 1")
    work = Path(tempfile.mkdtemp(prefix="sleuth_ranks_"))
    try:
        print(json.dumps(run(args, work), indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = make_base(work, args.model, args.steps, args.procs)
    a, b = work / "a", work / "b"
    replicate(base, a, args.ranks)
    shutil.copytree(a, b)
    bad_rank, bad_step = (args.ranks * 37) // 64, min(2, args.steps) - 1
    planted = perturb(b, bad_rank, bad_step)
    import tracer

    d = tracer.open_dump(b)
    records = sum(len(d.stats(r, s)) for r in d.ranks[:args.procs] for s in d.steps(r))
    records = records * args.ranks // args.procs
    size = sum(f.stat().st_size for f in (b / "dump").rglob("*.h5"))
    d.close()
    rows: dict[str, Any] = {}
    for n in sorted({int(w) for w in args.workers.split(",")}):
        wall, mem, code, out = timed(_sleuth("diff", str(a), str(b), "--workers", str(n),
                                             "--json"))
        rows[f"diff_w{n}"] = _diff_row(wall, mem, code, out, planted)
        for name, extra in (("check", ()), ("first_nan", ("--first-nan",))):
            wall, mem, code, out = timed(_sleuth("check", str(b), *extra, "--workers", str(n),
                                                 "--json"))
            rows[f"{name}_w{n}"] = _check_row(wall, mem, code, out, planted)
    if not args.no_dask:
        from distributed import LocalCluster

        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None) as cluster:
            wall, mem, code, out = timed(_sleuth("diff", str(a), str(b), "--scheduler",
                                                 cluster.scheduler_address, "--json"))
            rows["diff_dask"] = _diff_row(wall, mem, code, out, planted)
            rows["diff_dask"]["workers"] = 2
            wall, mem, code, out = timed(_sleuth("check", str(b), "--scheduler",
                                                 cluster.scheduler_address, "--json"))
            rows["check_dask"] = _check_row(wall, mem, code, out, planted)
            rows["check_dask"]["workers"] = 2
    return {"benchmark": "ranks_scale", "model": args.model, "ranks": args.ranks,
            "real_ranks": args.procs, "steps": args.steps, "records": records,
            "dump_mib": round(size / 2**20, 1), "cores": os.cpu_count(), "planted": planted,
            "rows": rows, "all_right": all(r["right"] for r in rows.values()),
            "total_s": round(time.perf_counter() - t0, 1)}


def _check_row(wall: float, mem: int, code: int, out: str, planted: dict) -> dict[str, Any]:
    res = json.loads(out)
    origin = res.get("first_nan") or {}
    named = [origin.get("rank"), origin.get("step"), origin.get("name")]
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(mem / 2**20, 1), "exit": code,
            "engine": res.get("engine"), "named": named,
            "right": named == [planted["rank"], planted["step"], planted["name"]]}


def _diff_row(wall: float, mem: int, code: int, out: str, planted: dict) -> dict[str, Any]:
    res = json.loads(out)
    fd = res.get("earliest") or {}
    named = [fd.get("rank"), fd.get("step"), fd.get("name")]
    diverged = sorted(int(r["rank"]) for r in res["ranks"] if r["status"] != "same")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(mem / 2**20, 1), "exit": code,
            "engine": res.get("engine"), "named": named, "ranks_not_same": diverged,
            "right": named == [planted["rank"], planted["step"], planted["name"]]
            and diverged == [planted["rank"]]}


if __name__ == "__main__":
    main()
