"""How long `sleuth explain` takes against `sleuth diff` on the same dumps (goal: under 3x).

Two runs of the trainer's gpt model (vocab 512, 4 layers, d 256, seq 128, batch 8), one step
dumped at level op in tensor mode: A in float32, B in bf16 (`precision=bf16`). Each command runs
as the user runs it, in a subprocess, interleaved `--repeat` times; the median wall times and
their ratio are printed as one JSON object, with the verdict explain gave.

Run: python3 benchmarks/explain_speed.py [--model gpt|tiny] [--repeat 3] [--limit 20]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ranks_scale import MODELS, _env, _sleuth  # noqa: E402  (the same tools, one copy)


def make(work: Path, model: str, name: str, *extra: str) -> Path:
    run = work / name
    cfg = work / "ops.json"
    cfg.write_text(json.dumps({"level": "op", "mode": "tensor", "steps": "0"}))
    sets = [x for s in [*MODELS[model], "steps=1", "eval_every=0", "log_every=1000", *extra]
            for x in ("--set", s)]
    subprocess.run(_sleuth("train", "--preset", "tiny", *sets, "--dump", str(cfg),
                           "--run-dir", str(run)), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=work, env=_env())
    return run


def timed(cmd: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    return wall, p.returncode, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--limit", type=int, default=20)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sleuth-explain-"))
    try:
        a = make(work, args.model, "a")
        b = make(work, args.model, "b", "precision=bf16")
        size = sum(f.stat().st_size for f in (a / "dump").rglob("*.h5"))
        diffs, explains = [], []
        verdict = status = ""
        for _ in range(args.repeat):
            wall, _, _ = timed(_sleuth("diff", str(a), str(b), "--json"))
            diffs.append(wall)
            wall, _, out = timed(_sleuth("explain", str(a), str(b), "--json",
                                         "--limit", str(args.limit)))
            explains.append(wall)
            data = json.loads(out)
            status, verdict = data["status"], data["verdict"]
        diff_s, explain_s = statistics.median(diffs), statistics.median(explains)
        print(json.dumps({"benchmark": "explain_speed", "model": args.model,
                          "dump_mib_per_side": round(size / 2**20, 1), "limit": args.limit,
                          "repeat": args.repeat, "diff_s": round(diff_s, 2),
                          "explain_s": round(explain_s, 2),
                          "ratio": round(explain_s / diff_s, 2), "goal": 3.0,
                          "status": status, "verdict": verdict[:300]}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
