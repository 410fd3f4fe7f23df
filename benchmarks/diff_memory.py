"""Memory of `sleuth diff` and `sleuth check` against the size of the dump: it must stay bounded.

Two cases, each at two sizes so that the memory of the small and of the large can be read side
by side (the goal: under 2 GiB resident however large the dump):

  statistics   op-level statistics dumps (with sketches) of `--records` records in all, in step
               files of `--per-step` records over `--ranks` ranks; one record of one rank and
               step perturbed (a NaN counted in it, its checksum changed, as in ranks_scale).
               Timed: `sleuth diff A B` (every rank, local processes), `sleuth diff A B --rank
               R` (one rank in one process), `sleuth check B --first-nan` and `sleuth check B`.
  tensor       one rank's tensor dumps of `--tensor-gb` GiB per side in step files of 1 GiB
               (8 float32 tensors of 128 MiB), one tensor of one step perturbed (1e-3 added to
               a thousand elements). Timed: `sleuth diff A B`. At the default size each side is
               larger than this machine's memory (the page cache cannot hold it).

B's step files are hard links to A's except the perturbed one, so that a dump larger than
memory needs its disk space once; the diff does not know that and reads every byte of both.
Each row: wall seconds, the peak resident memory of the command's process tree (sampled every
20 ms; page cache is not resident memory), and whether the perturbed rank, step and record were
named. Prints one JSON object.

Run: python3 benchmarks/diff_memory.py [--records 10000000] [--per-step 50000] [--ranks 8]
                                       [--tensor-gb 26] [--step-mib 1024] [--dir /var/tmp/x]
                                       [--case all|statistics|tensor]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "tracer" / "__init__.py").is_file():  # run from a checkout: measure its code
    sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks_scale import _sleuth, perturb, timed  # noqa: E402  (the same tools, one copy)

GiB = 1 << 30


def _writer(root: Path, mode: str, rank: int = 0, world: int = 1):
    from tracer._config import DumpConfig
    from tracer.storage import make_writer

    return make_writer(DumpConfig(path=str(root), writer="sync", level="op", mode=mode),
                       rank=rank, world_size=world)


def _meta(i: int, layer: int):
    from tracer.storage import RecordMeta

    op = ("aten.mm", "aten.add", "aten.gelu", "aten.view")[i % 4]
    module = f"model.layers.{layer}.mlp"
    return RecordMeta(f"{module}::{op}.forward.{i}.output.0", module, op, "forward", "output", 0,
                      i, f"model.py:{100 + i % 50}")


def _set_attrs(path: Path, **attrs: Any) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        for k, v in attrs.items():
            f.attrs[k] = v


def make_statistics(work: Path, records: int, per_step: int, ranks: int) -> tuple[Path, Path,
                                                                                   dict]:
    """A and B, `records` records in all; one step file written by the real writer, the others
    copies of it with their rank and step attributes set (the reader names a file by them)."""
    import torch

    base = work / "stats_base"
    w = _writer(base, "statistics")
    w.begin_step(0)
    gen = torch.Generator().manual_seed(0)
    for i in range(per_step):
        w.add(_meta(i, i // 64), torch.randn(4096, generator=gen))
    w.end_step()
    w.close()
    src = next((base / "dump").rglob("step0.h5"))
    run_id = json.loads((base / "dump" / "dump.json").read_text())["run_id"]
    steps = max(1, records // (per_step * ranks))
    a = work / "stats_a"
    for r in range(ranks):
        (a / "dump" / f"rank{r}").mkdir(parents=True)
        for s in range(steps):
            dst = a / "dump" / f"rank{r}" / f"step{s}.h5"
            shutil.copyfile(src, dst)
            _set_attrs(dst, rank=r, step=s, world_size=ranks, run_id=run_id)
    body = json.loads((base / "dump" / "dump.json").read_text())
    body["world_size"] = ranks
    (a / "dump" / "dump.json").write_text(json.dumps(body))
    shutil.rmtree(base)
    b = _linked(a, work / "stats_b")
    rank, step = (ranks * 5) // 8, steps // 2
    bad = b / "dump" / f"rank{rank}" / f"step{step}.h5"
    bad.unlink()
    shutil.copyfile(a / "dump" / f"rank{rank}" / f"step{step}.h5", bad)
    planted = perturb(b, rank, step)
    return a, b, {**planted, "records": steps * ranks * per_step, "steps": steps,
                  "ranks": ranks, "per_step": per_step}


def make_tensor(work: Path, gib: float, step_mib: int = 1024) -> tuple[Path, Path, dict]:
    """A of `gib` GiB in step files of `step_mib` MiB written by the real writer; B links to
    them but for one step, written again with one tensor perturbed."""
    import torch

    n = (step_mib << 20) // 32  # an eighth of the step, in float32
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen) for _ in range(8)]
    a, scratch = work / "tensor_a", work / "tensor_scratch"
    w = _writer(a, "tensor")
    steps = max(2, round(gib * 1024 / step_mib))
    for s in range(steps):
        w.begin_step(s)
        for i, t in enumerate(tensors):
            w.add(_meta(i, i), t)
        w.end_step()
    w.close()
    b = _linked(a, work / "tensor_b")
    step, index = steps // 2, 5
    bad = tensors[index].clone()
    bad[1000:2000] += 1e-3
    w = _writer(scratch, "tensor")
    w.begin_step(step)
    for i, t in enumerate(tensors):
        w.add(_meta(i, i), bad if i == index else t)
    w.end_step()
    w.close()
    target = b / "dump" / "rank0" / f"step{step}.h5"
    target.unlink()
    shutil.move(str(next((scratch / "dump").rglob(f"step{step}.h5"))), target)
    shutil.rmtree(scratch)
    run_id = json.loads((a / "dump" / "dump.json").read_text())["run_id"]
    _set_attrs(target, run_id=run_id)
    return a, b, {"rank": 0, "step": step, "name": _meta(index, index).name,
                  "gib_per_side": round(steps * step_mib / 1024, 2), "steps": steps}


def _linked(a: Path, b: Path) -> Path:
    """B: A's folders, its step files hard-linked (no second copy on disk)."""
    for src in a.rglob("*"):
        dst = b / src.relative_to(a)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif src.suffix == ".h5":
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return b


def _row(cmd: list[str], planted: dict, kind: str) -> dict[str, Any]:
    wall, mem, code, out = timed(cmd)
    res = json.loads(out)
    found = (res.get("earliest") if kind == "ranks" else
             res.get("first_nan") if kind == "check" else res.get("first_divergence")) or {}
    named = [found.get("rank"), found.get("step"), found.get("name")]
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(mem / 2**20), "exit": code,
            "named": named,
            "right": named == [planted["rank"], planted["step"], planted["name"]]}


def run_statistics(work: Path, records: int, per_step: int, ranks: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    a, b, planted = make_statistics(work, records, per_step, ranks)
    size = sum(f.stat().st_size for f in (a / "dump").rglob("*.h5"))
    made = time.perf_counter() - t0
    rows = {
        "diff": _row(_sleuth("diff", str(a), str(b), "--json"), planted, "ranks"),
        "diff_one_rank": _row(_sleuth("diff", str(a), str(b), "--rank", str(planted["rank"]),
                                      "--workers", "1", "--json"), planted, "one"),
        "check_first_nan": _row(_sleuth("check", str(b), "--first-nan", "--json"), planted,
                                "check"),
        "check": _row(_sleuth("check", str(b), "--json"), planted, "check"),
    }
    shutil.rmtree(a)
    shutil.rmtree(b)
    return {"planted": planted, "gib_per_side": round(size / GiB, 2),
            "make_s": round(made, 1), "rows": rows}


def run_tensor(work: Path, gib: float, step_mib: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    a, b, planted = make_tensor(work, gib, step_mib)
    made = time.perf_counter() - t0
    rows = {"diff": _row(_sleuth("diff", str(a), str(b), "--json"), planted, "one")}
    shutil.rmtree(a)
    shutil.rmtree(b)
    return {"planted": planted, "make_s": round(made, 1), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--per-step", type=int, default=50_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tensor-gb", type=float, default=26,
                    help="GiB of tensors per side (default 26: more than this machine's memory)")
    ap.add_argument("--step-mib", type=int, default=1024,
                    help="MiB of tensors in each tensor step file (default 1024)")
    ap.add_argument("--case", choices=("all", "statistics", "tensor"), default="all")
    ap.add_argument("--dir", help="where the dumps go (default: a temporary folder)")
    args = ap.parse_args()
    try:
        import psutil
        memory = round(psutil.virtual_memory().total / GiB, 1)
    except ImportError:
        memory = None
    out: dict[str, Any] = {"benchmark": "diff_memory", "cores": os.cpu_count(),
                           "memory_gib": memory, "cases": {}}
    work = Path(tempfile.mkdtemp(prefix="sleuth-diff-memory-", dir=args.dir))
    try:
        if args.case in ("all", "statistics"):
            small = max(args.per_step * args.ranks, args.records // 10)
            out["cases"]["statistics_small"] = run_statistics(work, small, args.per_step,
                                                              args.ranks)
            out["cases"]["statistics"] = run_statistics(work, args.records, args.per_step,
                                                        args.ranks)
        if args.case in ("all", "tensor"):
            out["cases"]["tensor_small"] = run_tensor(work, args.tensor_gb / 8, args.step_mib)
            out["cases"]["tensor"] = run_tensor(work, args.tensor_gb, args.step_mib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [r for c in out["cases"].values() for r in c["rows"].values()]
    out["all_right"] = all(r["right"] for r in rows)
    out["peak_rss_mib"] = max((r["peak_rss_mib"] for r in rows), default=0)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
