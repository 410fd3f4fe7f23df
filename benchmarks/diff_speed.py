"""How fast `tracer.diff` compares two tensor dumps, against merely reading both with h5py.

Writes two step files of about 360 MB each (90 float32 tensors of 1M elements; B equals A on half
of the records and carries 1e-4 relative noise on the other half, so both the bit-identical fast
path and the full metric path run), then interleaves, in one process: reading every record of
both files with h5py, `tracer.diff` on the pair, and `tracer.diff` of A against itself. Prints one
JSON object: median seconds, the diff/read ratio (goal <= 3), records per second, and the
page-cache state (warm: every file read once before timing).

    python benchmarks/diff_speed.py [--mb 360] [--repeat 3] [--dir /tmp/x]
        [--msprobe-python /path/to/venv/bin/python]

With --msprobe-python (a Python that has `mindstudio-probe` and torch), the same model (15
Linear(1024, 1024) layers, forward and backward, inputs 1e-4 apart) is dumped by msprobe
(task tensor, level L1) and by sleuth (level op, mode tensor), and msprobe's `pt_compare` is
timed against `tracer.diff` on dumps of about the same size.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))


def write_dump(run: Path, tensors: list[np.ndarray], mode: str = "tensor") -> Path:
    from tracer.storage._format import RECORD_COLUMNS, root_attrs, step_path
    from tracer.storage._step_file import StepFile

    sf = StepFile(step_path(run, 0, 0), root_attrs(rank=0, world_size=1, step=0, level="module",
                                                   mode=mode, config={}),
                  spill_bytes=64 << 20)
    for seq, t in enumerate(tensors):
        f = t.astype(np.float64)
        off = sf.add_bytes(t.view(np.uint8)) if mode == "tensor" else -1
        row = dict(seq=seq, name=f"layers.{seq}.forward.0.output.0", module=f"layers.{seq}",
                   op="", phase="forward", direction="output", index=0, call=0, dtype="float32",
                   shape=str(t.size), numel=t.size, min=float(f.min()), max=float(f.max()),
                   mean=float(f.mean()), norm=float(np.sqrt(f @ f)), nan=0, posinf=0, neginf=0,
                   zeros=int((t == 0).sum()),  # checksum: the element bits summed, wrapping
                   checksum=int(t.view(np.int32).sum(dtype=np.int32)), source="bench.py:1",
                   data_offset=off, data_nbytes=t.nbytes if off >= 0 else 0, strides="")
        # a column this writer does not fill (one the format adds later) gets its empty value
        sf.add_row(tuple(row.get(k, "" if kind not in (np.int64, np.int32, np.float64) else 0)
                         for k, kind in RECORD_COLUMNS))
    return sf.finish()


def read_all(path: Path) -> int:
    """What any reader must do at least: every record's bytes through h5py."""
    import h5py

    total = 0
    with h5py.File(path, "r") as f:
        rec = f["records"][()]
        data = f["tensors"]
        for off, n in zip(rec["data_offset"], rec["data_nbytes"]):
            for lo in range(0, int(n), 16 << 20):
                total += data[int(off) + lo:int(off) + min(int(n), lo + (16 << 20))].nbytes
    return total


MSPROBE_SCRIPT = r"""
import glob, json, sys, time, torch
mode, path = sys.argv[1], sys.argv[2]
if mode == "dump":
    from msprobe.pytorch import PrecisionDebugger
    cfg = {"task": "tensor", "dump_path": path, "rank": [], "step": [0], "level": "L1",
           "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
    json.dump(cfg, open(path + ".json", "w"))
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(15)])
    x = torch.randn(1024, 1024) * (1 + float(sys.argv[3]))
    dbg = PrecisionDebugger(config_path=path + ".json")
    dbg.start(m); m(x).sum().backward(); dbg.stop(); dbg.step()
else:
    from msprobe.pytorch.compare.pt_compare import pt_compare
    a = glob.glob(path + "/step0/proc*/")[0]; b = glob.glob(sys.argv[3] + "/step0/proc*/")[0]
    p = {"npu_path": a + "dump.json", "bench_path": b + "dump.json",
         "stack_path": a + "stack.json", "is_print_compare_log": False}
    t = time.perf_counter(); pt_compare(p, sys.argv[4])
    print(json.dumps({"s": time.perf_counter() - t}))
"""


def _du(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def msprobe_side_by_side(python: str, root: Path) -> dict:
    import subprocess

    import torch

    import tracer

    script = root / "msprobe_bench.py"
    script.write_text(MSPROBE_SCRIPT)
    for name, eps in (("ma", "0"), ("mb", "1e-4")):
        subprocess.run([python, str(script), "dump", str(root / name), eps], check=True,
                       capture_output=True)
    for name, eps in (("sa", 0.0), ("sb", 1e-4)):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(15)])
        x = torch.randn(1024, 1024) * (1 + eps)
        with tracer.Dumper(m, {"path": str(root / name), "level": "op", "mode": "tensor",
                               "writer": "sync", "params": False}):
            m(x).sum().backward()
    (root / "mout").mkdir(exist_ok=True)
    out = subprocess.run([python, str(script), "compare", str(root / "ma"), str(root / "mb"),
                          str(root / "mout")], check=True, capture_output=True, text=True)
    ms_s = json.loads(out.stdout.strip().splitlines()[-1])["s"]
    t0 = time.perf_counter()
    tracer.diff(root / "sa", root / "sb")
    ours = time.perf_counter() - t0
    ms_mb, our_mb = _du(root / "ma"), _du(root / "sa")
    # sleuth's op level records every aten op (backward too), so its dump is larger: compare
    # throughput, not only seconds
    return {"msprobe_dump_mb_each": round(ms_mb, 1), "sleuth_dump_mb_each": round(our_mb, 1),
            "msprobe_compare_s": round(ms_s, 2), "sleuth_diff_s": round(ours, 2),
            "msprobe_mb_per_s": round(2 * ms_mb / ms_s, 1),
            "sleuth_mb_per_s": round(2 * our_mb / ours, 1),
            "throughput_ratio": round((2 * our_mb / ours) / (2 * ms_mb / ms_s), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=360)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--stats-records", type=int, default=20000)
    ap.add_argument("--msprobe-python", default=None,
                    help="a Python with mindstudio-probe installed: also time msprobe compare")
    args = ap.parse_args()
    import tracer

    root = Path(args.dir or tempfile.mkdtemp(prefix="sleuth_diff_bench_"))
    n_rec = max(1, args.mb * (1 << 20) // (4 << 20))
    rng = np.random.default_rng(0)
    a_t, b_t = [], []
    for i in range(n_rec):
        t = rng.standard_normal(1 << 20, dtype=np.float32)
        a_t.append(t)
        b_t.append(t if i % 2 == 0 else
                   t * (1 + 1e-4 * rng.standard_normal(t.size, dtype=np.float32)))
    fa, fb = write_dump(root / "a", a_t), write_dump(root / "b", b_t)
    del a_t, b_t
    nbytes = fa.stat().st_size + fb.stat().st_size
    for p in (fa, fb):  # warm the page cache for every contender alike
        read_all(p)
    t_read, t_diff, t_same = [], [], []
    res = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        read_all(fa)
        read_all(fb)
        t_read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        res = tracer.diff(root / "a", root / "b")
        t_diff.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tracer.diff(root / "a", root / "a")
        t_same.append(time.perf_counter() - t0)
    assert res is not None and res.counts()["same"] + res.counts()["diverged"] == n_rec
    read_s, diff_s, same_s = (statistics.median(t) for t in (t_read, t_diff, t_same))
    # statistics dumps: many records, no bytes; measures alignment and per-record work
    n_stats = args.stats_records
    small = [rng.standard_normal(16, dtype=np.float32) for _ in range(n_stats)]
    write_dump(root / "sa", small, mode="statistics")
    write_dump(root / "sb", [t if i % 3 else t * 1.01 for i, t in enumerate(small)],
               mode="statistics")
    t_stats = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        tracer.diff(root / "sa", root / "sb")
        t_stats.append(time.perf_counter() - t0)
    stats_s = statistics.median(t_stats)
    side = msprobe_side_by_side(args.msprobe_python, root) if args.msprobe_python else None
    print(json.dumps({
        "benchmark": "diff_speed",
        "msprobe_side_by_side": side,
        "dump_mb_each": round(nbytes / 2 / 2**20, 1),
        "records_each": n_rec,
        "read_both_h5py_s": round(read_s, 3),
        "diff_s": round(diff_s, 3),
        "diff_identical_s": round(same_s, 3),
        "diff_over_read": round(diff_s / read_s, 2),
        "diff_identical_over_read": round(same_s / read_s, 2),
        "goal_diff_over_read": 3.0,
        "records_per_s": round(n_rec / diff_s, 1),
        "diff_mb_per_s": round(nbytes / diff_s / 2**20, 1),
        "page_cache": "warm",
        "statistics_records_each": n_stats,
        "statistics_diff_s": round(stats_s, 3),
        "statistics_records_per_s": round(n_stats / stats_s),
        "repeat": args.repeat,
        "status": res.status,
        "msprobe_reference_s": {"tensor_2x360MB": [21, 34], "statistics": 5.3},
    }))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
