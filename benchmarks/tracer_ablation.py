"""Speed-device ablation: what each of the tracer's speed devices gains on realistic training.

Each device is switched off in turn and its blocks of training
steps are timed against blocks with the tracer as shipped, on two workloads side by side in
one process, with torch's default threads unless `--threads` says otherwise:

  gpt    the "gpt" model of benchmarks/tracer_overhead.py (vocab 512, 4 layers, d 256, seq 128,
         batch 8)
  llama  a Hugging Face LlamaForCausalLM built from a config (vocab 8192, hidden 384, 6 layers,
         6 heads, 2 KV heads, intermediate 1024; batch 2 x 256 random token ids), AdamW

Devices (`DEVICES`): the C statistics kernel with its table packer
(tracer/storage/_stats_kernel.c and _table.c, what an install without a C compiler lacks; it
acts on CPU tensors), the Triton
statistics kernels for CUDA tensors (tracer/storage/_cuda_stats.py; torch ops without them) and
the helper file process of the async writer (tracer/storage/_file_process.py). `--device cuda` trains
on the GPU, each step synchronized, and measures the devices that act there. Three more
devices, deferred statistics, the kernel's second statistics thread and a statistics fast path
beside the writer's one record path, were measured here and removed by the rule below
(benchmarks/RESULTS.md).

Features (`FEATURES`, only with `--features`): what some records cost, measured the same way
against the tracer without them: `param_records` (`"params": false`: no param, grad and update
records) and `update_record` (no pre-step copy of the weights, so no update record; the param
record then reads the weight after the step, which costs the same read). `cost_pct` is 100 *
(time with / time without - 1).

Timing reuses tracer_overhead's blocks (`timed_block`: the first step untimed, the wall time
counted until the Dumper's close returns, so an async writer's drain is in it). Within one
round, for each workload and condition, each group's variant blocks are bracketed by blocks of
its reference: a variant's ratio is its median step time over the mean of the reference
medians right before and after it (and likewise with wall time per step: "sustained"). The
variants' order rotates from round to round. A device's `on_off` is the median over rounds of
(time with the device on / time with it off): below 1 it gains; `gain_pct` is 100 * (1 /
on_off - 1), from the sustained ratio for the async writer (its drain is only in the wall
time), from the median one otherwise; `spread` is the per-round range of the median ratio.
`overhead` is the tracer as shipped against no Dumper, measured the same way. For op tensors
with the async writer it also gives the disk floor: the least a step can take that writes its
step file, (step + file bytes / disk speed) / step, the disk speed measured in the same round by
writing and fsyncing a file as large as a block's (`disk_floor`, `step_file_mb`, `disk_mb_s`),
and the sustained ratio over it (`over_floor`, goal at most 1.3). For the statistics conditions
it gives the in-run floor: the time of one pass of the statistics kernel over the tensors one
dumped step records (kept from a step recorded in the same round), with no hooks and no writer,
as (step + that pass) / step (`stats_floor`; on CPU the C kernel, on CUDA the batched Triton
kernel, synchronized), and the median ratio over it (`over_stats_floor`, goal at most 1.3).
Prints one JSON object.

Run: PYTHONPATH=. python3 benchmarks/tracer_ablation.py [--rounds N] [--steps N]
[--workloads gpt,llama] [--conditions a,b] [--threads N] [--device cpu|cuda]
[--features param_records,update_record]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracer_overhead as overhead  # noqa: E402  (its model, blocks and repo path)

import tracer  # noqa: E402
from tracer.capture import ParamRecords  # noqa: E402
from tracer.storage import _cuda_stats, _device_stats, _h5_objects, _stats  # noqa: E402

CONDITIONS = {
    "module_statistics": {"level": "module", "mode": "statistics", "writer": "sync"},
    "op_statistics": {"level": "op", "mode": "statistics", "writer": "sync"},
    "op_tensor_async": {"level": "op", "mode": "tensor", "writer": "async"},
    "attached_unselected": {"level": "mix", "steps": "1000000"},
}
# arm -> (devices switched off, extra Dumper config); an arm of None is no Dumper at all
ARMS: dict[str, tuple[frozenset, dict] | None] = {
    "shipped": (frozenset(), {}),
    "no_c_kernel": (frozenset({"c_kernel"}), {}),
    "no_triton": (frozenset({"triton_stats"}), {}),
    "no_file_process": (frozenset(), {"file_process": False}),
    "no_params": (frozenset(), {"params": False}),
    "no_update": (frozenset({"update_record"}), {}),
    "reference": (frozenset(), {}),
    "no_dump": None,
}
# device -> (reference arm, arm with it on, arm with it off, conditions where it acts)
DEVICES = {
    "c_kernel": ("shipped", "shipped", "no_c_kernel",
                 ("module_statistics", "op_statistics", "op_tensor_async")),
    "triton_stats": ("shipped", "shipped", "no_triton",
                     ("module_statistics", "op_statistics", "op_tensor_async")),
    "file_process": ("shipped", "shipped", "no_file_process", ("op_tensor_async",)),
}
# feature -> (arm without it, or with it where the tracer as shipped has it off; conditions
# where it is measured)
FEATURES = {
    "param_records": ("no_params", ("module_statistics", "op_statistics")),
    "update_record": ("no_update", ("module_statistics", "op_statistics")),
    "live_reference": ("reference", ("module_statistics", "op_statistics")),
}
ADDED = {"live_reference"}
"""Features the tracer as shipped has off: their arm is the tracer with them."""
# device -> where it acts (a device does nothing for tensors elsewhere)
ACTS_ON = {"c_kernel": "cpu", "triton_stats": "cuda"}
GAIN_RULE_PCT = 5.0  # a device that gains less on both workloads goes
LLAMA = dict(vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
             num_key_value_heads=2, intermediate_size=1024)
LLAMA_BATCH, LLAMA_SEQ = 2, 256


class _LlamaLM(nn.Module):
    """A Hugging Face Llama under tracer_overhead's model interface: forward(ids, labels) ->
    (logits, loss)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.lm = LlamaForCausalLM(LlamaConfig(**LLAMA))

    def forward(self, ids, labels):
        out = self.lm(input_ids=ids, labels=labels)
        return out.logits, out.loss


def make_workload(which: str, steps: int, device: str = "cpu"
                  ) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    """(model, AdamW, steps + 1 batches of random token ids) for "gpt" or "llama", on
    `device`."""
    torch.manual_seed(0)
    if which == "gpt":
        model, vocab, batch, seq = overhead.make_model(), overhead.VOCAB, overhead.BATCH, \
            overhead.SEQ
    else:
        model, vocab, batch, seq = _LlamaLM(), LLAMA["vocab_size"], LLAMA_BATCH, LLAMA_SEQ
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randint(0, vocab, (batch, seq), device=device),
                torch.randint(0, vocab, (batch, seq), device=device)) for _ in range(steps + 1)]
    return model, opt, batches


class switched:
    """The devices named in `off` switched off while inside; everything restored at exit."""

    def __init__(self, off: frozenset) -> None:
        self.off = off

    def __enter__(self) -> None:
        self.saved = (_stats._kernel, _h5_objects._pack_rows, _cuda_stats._kernels,
                      ParamRecords._snapshot)
        if "c_kernel" in self.off:
            _stats._kernel, _h5_objects._pack_rows = None, None
        if "triton_stats" in self.off:
            _cuda_stats._kernels = False
        if "update_record" in self.off:
            ParamRecords._snapshot = _no_snapshot

    def __exit__(self, *exc) -> None:
        (_stats._kernel, _h5_objects._pack_rows, _cuda_stats._kernels,
         ParamRecords._snapshot) = self.saved


def _no_snapshot(records, param, same_bytes) -> tuple[None, None]:
    """No pre-step copy of `param`: the step then has no update record of it."""
    return None, None


WRITTEN: dict[tuple[str, str], list[float]] = {}
"""(arm, mode) -> bytes of step files per dumped step, one entry per block (the disk floor)."""


def _dump_bytes(path: Path) -> tuple[int, int]:
    """(bytes, step files) of the dump under `path`."""
    files = list(path.glob("dump/rank*/step*.h5"))
    return sum(f.stat().st_size for f in files), len(files)


def disk_bandwidth(nbytes: int, work: Path) -> float:
    """Bytes a second this disk takes for one file of `nbytes` (at most 512 MiB), written in 16
    MiB pieces and fsynced, as the async writer writes a step file: the disk floor's divisor."""
    nbytes = max(1 << 20, min(nbytes, 512 << 20))
    piece = b"\x5a" * (16 << 20)
    path = work / "bandwidth.probe"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, piece[:min(left, len(piece))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


REFERENCES: dict[tuple[int, str], Path] = {}
"""(model, config) -> the dump the "reference" arm's live reference reads."""


def _reference(config: dict, model, opt, batches, work: Path) -> tracer.LiveReference:
    """A live reference over a dump of `model` under `config`, made (untimed) at its first use,
    with tolerances no record exceeds: the training goes on between blocks, so the weights
    differ from the reference's, and a divergence would end the comparing that is measured."""
    key = (id(model), json.dumps(config, sort_keys=True))
    if key not in REFERENCES:
        REFERENCES[key] = work / f"reference{len(REFERENCES)}"
        with tracer.Dumper(model, {**config, "path": str(REFERENCES[key])}):
            overhead.train_steps(model, opt, batches)
    wide = tracer.Tolerance(rtol=1e30, atol=1e30, cosine_min=-1.0)
    return tracer.LiveReference(REFERENCES[key], tolerance=wide)


def arm_block(arm: str, config: dict, model, opt, batches, work: Path) -> overhead.Block:
    """One timed block of `arm` under the Dumper `config` (none for "no_dump")."""
    spec = ARMS[arm]
    if spec is None:
        return overhead.timed_block(model, opt, batches)
    off, extra = spec
    path = work / arm
    reference = _reference(config, model, opt, batches, work) if arm == "reference" else None
    with switched(off):
        block = overhead.timed_block(
            model, opt, batches,
            lambda: tracer.Dumper(model, {**config, **extra, "path": str(path)},
                                  reference=reference))
    if config.get("mode") in ("tensor", "full"):
        nbytes, files = _dump_bytes(path)
        WRITTEN.setdefault((arm, config["mode"]), []).append(nbytes / max(files, 1))
    shutil.rmtree(path, ignore_errors=True)
    # untimed: write back what the block left dirty in the page cache before the next one
    if hasattr(os, "sync"):
        os.sync()
    return block


def recorded_tensors(config: dict, model, opt, batches, work: Path) -> list[torch.Tensor]:
    """The tensors one dumped step hands its writer under `config` (references, kept)."""
    from tracer.storage import _async, _writer

    kept: list[torch.Tensor] = []
    saved = [(cls, cls.add) for cls in (_writer.SyncWriter, _async.AsyncWriter)]
    for cls, real in saved:
        def add(self, meta, tensor, *args, _real=real, **kwargs):
            kept.append(tensor)
            return _real(self, meta, tensor, *args, **kwargs)
        cls.add = add
    path = work / "floor"
    try:
        with tracer.Dumper(model, {**config, "path": str(path)}):
            overhead.train_steps(model, opt, batches[:1])
    finally:
        for cls, real in saved:
            cls.add = real
        shutil.rmtree(path, ignore_errors=True)
    return kept


def stats_pass_s(tensors: list[torch.Tensor]) -> float:
    """Seconds of one pass of the statistics kernel over `tensors`, no hooks: the C kernel for
    CPU tensors, the batched Triton kernel (512 records a launch, then one sync) for CUDA
    ones, torch ops where neither reads them."""
    from tracer.storage import _batched_stats

    start = time.perf_counter()
    on_device = []
    for t in tensors:
        if t.is_cuda and t.dtype in _batched_stats.DTYPES and t.numel():
            d = _batched_stats.describe(t.detach())
            if d is not None:
                on_device.append(d)
                continue
        if t.is_cpu:
            _stats.host_stats(t)
        else:
            _device_stats.device_stats(t)
    for i in range(0, len(on_device), 512):
        _batched_stats.launch(on_device[i:i + 512], torch.device("cuda"), True)
    if on_device:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def groups_for(condition: str, devices: list[str], features: list[str] = ()
               ) -> dict[str, list[str]]:
    """reference arm -> the variant arms one round measures against it for `condition`."""
    groups: dict[str, list[str]] = {"shipped": ["no_dump"]}
    for feature in features:
        arm, conditions = FEATURES[feature]
        if condition in conditions:
            groups["shipped"].append(arm)
    for device in devices:
        ref, on, off, conditions = DEVICES[device]
        if condition in conditions:
            for arm in (on, off):
                if arm != ref and arm not in groups.setdefault(ref, []):
                    groups[ref].append(arm)
    return groups


def bracketed(run: Callable[[str], overhead.Block], ref: str, variants: list[str],
              rotate: int) -> dict[str, tuple[float, float]]:
    """One round of `variants`, each between two blocks of `ref`: arm -> (median ratio,
    sustained ratio) to the mean of its two reference blocks (the reference itself: 1, 1)."""
    out = {ref: (1.0, 1.0)}
    order = variants[rotate % len(variants):] + variants[:rotate % len(variants)]
    before = run(ref)
    for arm in order:
        block = run(arm)
        after = run(ref)
        out[arm] = (block.median / ((before.median + after.median) / 2),
                    block.per_step / ((before.per_step + after.per_step) / 2))
        before = after
    return out


def summary(per_round: list[tuple[float, float]]) -> dict[str, Any]:
    """Per-round (median, sustained) ratios -> their medians and the median ratios' range."""
    medians = [m for m, _ in per_round]
    return {"ratio": round(statistics.median(medians), 3),
            "sustained": round(statistics.median([s for _, s in per_round]), 3),
            "spread": [round(min(medians), 3), round(max(medians), 3)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--workloads", default="gpt,llama", help="comma-separated: gpt, llama")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma-separated subset of: " + ", ".join(CONDITIONS))
    ap.add_argument("--devices", default=",".join(DEVICES),
                    help="comma-separated subset of: " + ", ".join(DEVICES))
    ap.add_argument("--features", default="",
                    help="comma-separated subset of: " + ", ".join(FEATURES) + " (default none)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the workloads train (cuda: each step synchronized)")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    conditions = args.conditions.split(",")
    devices = args.devices.split(",")
    features = [f for f in args.features.split(",") if f]
    for given, known, flag in ((features, FEATURES, "--features"),
                               (workloads, ("gpt", "llama"), "--workloads"),
                               (conditions, CONDITIONS, "--conditions"),
                               (devices, DEVICES, "--devices")):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    absent: dict[str, str] = {}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device here")
        overhead.step_sync = torch.cuda.synchronize
    for device in list(devices):
        if ACTS_ON.get(device, args.device) != args.device:
            devices.remove(device)
            absent[device] = f"acts on {ACTS_ON[device]} tensors only (--device {args.device})"
    result: dict[str, Any] = {
        "benchmark": "tracer_ablation", "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "rounds": args.rounds, "steps_per_block": args.steps,
        "c_kernel_built": _stats._kernel is not None, "not_measured": absent,
        "workloads": {}, "overhead": {}, "devices": {}, "features": {}}
    work = Path(tempfile.mkdtemp(prefix="sleuth_ablation_"))
    # (workload, condition) -> arm -> per-round (median, sustained) ratios to its reference
    ratios: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    try:
        loaded = {w: make_workload(w, args.steps, args.device) for w in workloads}
        for w, (model, opt, batches) in loaded.items():
            overhead.train_steps(model, opt, batches[:2])  # kernels and optimizer state warm
            base = overhead.timed_block(model, opt, batches)
            result["workloads"][w] = {
                "params": sum(p.numel() for p in model.parameters()),
                "baseline_step_s": round(base.median, 4)}
        disk_floors: dict[str, dict[str, Any]] = {}
        stats_floors: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for w, (model, opt, batches) in loaded.items():  # side by side, round by round
                for c in conditions:
                    config = dict(CONDITIONS[c])
                    run = functools.partial(arm_block, config=config, model=model, opt=opt,
                                            batches=batches, work=work)
                    table = ratios.setdefault((w, c), {})
                    WRITTEN.clear()
                    for ref, variants in groups_for(c, devices, features).items():
                        for arm, pair in bracketed(run, ref, variants, r).items():
                            table.setdefault(arm, []).append(pair)
                    if CONDITIONS[c].get("mode") == "statistics":
                        # the in-run floor: the kernel's pass over what the step records
                        kept = recorded_tensors(config, model, opt, batches, work)
                        stats_pass_s(kept)  # warm (the kernels' first compile)
                        stats_floors.setdefault((w, c), []).append(stats_pass_s(kept))
                        del kept
                    if c == "op_tensor_async" and WRITTEN.get(("shipped", "tensor")):
                        # the disk floor of this workload: its step files' bytes over what the
                        # disk takes a second, measured now, beside the blocks
                        per_step = statistics.median(WRITTEN[("shipped", "tensor")])
                        speed = disk_bandwidth(int(per_step * len(batches)), work)
                        disk_floors.setdefault(w, {"step_file_mb": [], "disk_mb_s": []})
                        disk_floors[w]["step_file_mb"].append(per_step / 2**20)
                        disk_floors[w]["disk_mb_s"].append(speed / 2**20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for (w, c), table in ratios.items():
        # shipped against no Dumper: invert the per-round ratios of no_dump to shipped
        result["overhead"].setdefault(c, {})[w] = summary(
            [(1 / m, 1 / s) for m, s in table["no_dump"]])
    for (w, c), seconds in stats_floors.items():
        row = result["overhead"][c][w]
        row["stats_floor"] = round(1 + statistics.median(seconds)
                                   / result["workloads"][w]["baseline_step_s"], 3)
        row["over_stats_floor"] = round(row["ratio"] / row["stats_floor"], 3)
    for w, floor in disk_floors.items():
        mb, speed = statistics.median(floor["step_file_mb"]), statistics.median(floor["disk_mb_s"])
        base = result["workloads"][w]["baseline_step_s"]
        row = result["overhead"]["op_tensor_async"][w]
        # the least a step can take that writes its file: the step, then the file at disk speed
        row["disk_floor"] = round(1 + mb / speed / base, 3)
        row["over_floor"] = round(row["sustained"] / row["disk_floor"], 3)
        row["step_file_mb"], row["disk_mb_s"] = round(mb, 1), round(speed, 1)
    for device in devices:
        ref, on, off, acts = DEVICES[device]
        entry: dict[str, Any] = {"conditions": {}}
        best = float("-inf")
        for c in conditions:
            if c not in acts:
                continue
            for w in workloads:
                table = ratios[(w, c)]
                pairs = [(a_m / b_m, a_s / b_s) for (a_m, a_s), (b_m, b_s)
                         in zip(table[on], table[off])]
                s = summary(pairs)
                s["on_off"] = s.pop("ratio")
                s["on_off_sustained"] = s.pop("sustained")
                # the async writer's drain is in the wall time only (see the docstring)
                judged = s["on_off_sustained"] if CONDITIONS[c].get("writer") == "async" \
                    else s["on_off"]
                s["gain_pct"] = round(100 * (1 / judged - 1), 1)
                best = max(best, s["gain_pct"])
                entry["conditions"].setdefault(c, {})[w] = s
        if entry["conditions"]:
            entry["best_gain_pct"] = best
            entry["earns_its_place"] = best >= GAIN_RULE_PCT
        result["devices"][device] = entry
    for feature in features:
        arm, measured = FEATURES[feature]
        rows: dict[str, Any] = {}
        for c in conditions:
            if c not in measured:
                continue
            for w in workloads:
                s = summary(ratios[(w, c)][arm] if feature in ADDED
                            else [(1 / m, 1 / s) for m, s in ratios[(w, c)][arm]])
                s["with_without"] = s.pop("ratio")
                s["with_without_sustained"] = s.pop("sustained")
                s["cost_pct"] = round(100 * (s["with_without"] - 1), 1)
                rows.setdefault(c, {})[w] = s
        result["features"][feature] = {"conditions": rows}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
