"""A synthetic CUDA Chrome trace shaped like torch.profiler 2.x exports it, with known figures.

Writes (`python cuda_trace.py DIR`) the fixtures in tests/profiler/data/: one rank of a DDP run
of a two-layer model (`<root>` holding `fc1` and `fc2`), three steps, as torch.profiler 2.x
writes them: the top-level keys (schemaVersion, deviceProperties, distributedInfo,
baseTimeNanoseconds, displayTimeUnit ms), process and thread metadata, `cpu_op` events with
External id, Sequence number and Input Dims, `cuda_runtime` launches (cudaLaunchKernel, NCCL's
cudaLaunchKernelExC, cudaMemcpyAsync, cudaStreamSynchronize) whose `correlation` is in the
kernel's args and in `ac2g` flow events, kernels on compute stream 7 and NCCL stream 20,
`gpu_memcpy` events, ranges repeated on the GPU (`gpu_user_annotation`), the autograd engine's
backward on its own thread, `[memory]` instant events, and the profiler's own `Trace` span
with string pids. Timestamps are microseconds on a monotonic clock near 5.4e12, with decimals.

Per step (times from the step's start, us), `base`: data loading 0-60 (DataLoader range), an
H2D copy 85-105; forward: fc1's gemm 215-415, fc2's 415-515; backward (thread 4190): fc2's
gemm 520-620, fc1's 620-700; DDP's all-reduce (host 600-640) runs on stream 20 650-800; the
optimizer's two kernels 850-880 and 890-930; the step is 1000 long. `slow` (the straggler): the
loop calls `.item()` after the forward (host 350-560: a D2H copy 515-520 and a stream sync),
then Python work to 700; backward, all-reduce and optimizer run 300 later on the host, their
kernels at 720-820, 840-920, 950-1100 (comm), 1150-1180 and 1190-1230; the step is 1300 long.
The hand-computed figures are in test_profiler_gpu_time.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
BASE_US = 5393237463000.0  # torch's clock: microseconds, fractions of a ns kept
PID, MAIN, BWD = 4123, 4123, 4190
STEP_US = {"base": 1000.0, "slow": 1300.0}
LEAD_US = 250.0  # the profiler starts this long before the first step


class _Trace:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict] = []
        self.ext = 100
        self.corr = 1000

    def x(self, cat: str, name: str, ts: float, end: float, *, pid=PID, tid=MAIN, **args):
        ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
              "ts": round(BASE_US + ts, 3), "dur": round(end - ts, 3)}
        if args:
            ev["args"] = args
        self.events.append(ev)
        return ev

    def op(self, name: str, ts: float, end: float, *, tid=MAIN, dims=None, seq=None):
        self.ext += 1
        args = {"External id": self.ext, "Record function id": 0, "Ev Idx": len(self.events)}
        if seq is not None:
            args["Sequence number"] = seq
            args["Fwd thread id"] = 0
        if dims is not None:
            args["Input Dims"] = dims
            args["Input type"] = ["float"] * len(dims)
            args["Input Strides"] = [[d[1], 1] if len(d) == 2 else [] for d in dims]
            args["Concrete Inputs"] = [""] * len(dims)
        return self.x("cpu_op", name, ts, end, tid=tid, **args)

    def range(self, name: str, ts: float, end: float, *, tid=MAIN):
        self.ext += 1
        return self.x("user_annotation", name, ts, end, tid=tid,
                      **{"External id": self.ext, "Record function id": 0})

    def launch(self, runtime: str, ts: float, end: float, kernel: str, k0: float, k1: float, *,
               tid=MAIN, cat="kernel", stream=7, **kargs):
        """A runtime call at ts-end on the host and the device work it made at k0-k1, tied by
        the correlation id in both events' args and by an ac2g flow (torch 2.x writes both)."""
        self.corr += 1
        c, ext = self.corr, self.ext
        self.x("cuda_runtime", runtime, ts, end, tid=tid,
               **{"External id": ext, "cbid": 211 if runtime == "cudaLaunchKernel" else 41,
                  "correlation": c})
        if kernel:
            args = {"External id": ext, "queued": 0, "device": 0, "context": 1,
                    "stream": stream, "correlation": c, **kargs}
            if cat == "kernel":
                args.update({"registers per thread": 128, "shared memory": 49152,
                             "blocks per SM": 0.48, "warps per SM": 1.94, "grid": [64, 1, 1],
                             "block": [128, 1, 1], "est. achieved occupancy %": 3})
            self.x(cat, kernel, k0, k1, pid=0, tid=stream, **args)
            self.events.append({"ph": "s", "id": c, "pid": PID, "tid": tid,
                                "ts": round(BASE_US + ts, 3), "cat": "ac2g", "name": "ac2g"})
            self.events.append({"ph": "f", "id": c, "pid": 0, "tid": stream,
                                "ts": round(BASE_US + k0, 3), "cat": "ac2g", "name": "ac2g",
                                "bp": "e"})

    def memory(self, ts: float, nbytes: int, allocated: int) -> None:
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                            "pid": PID, "tid": MAIN, "ts": round(BASE_US + ts, 3),
                            "args": {"Total Reserved": 4 << 20, "Total Allocated": allocated,
                                     "Bytes": nbytes, "Addr": 139872000000000 + int(ts),
                                     "Device Id": 0, "Device Type": 1}})


GEMM = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_kernel__5x_cublas"
GEMM_BWD = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x128x32_warpgroupsize1x1x1_execute_kernel__5x_cublas"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
FOREACH = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
           "(anonymous namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::"
           "BinaryOpScalarFunctor<float, 1, 1, 0>, std::plus<float>, float>(...)")
ADAMW = "void at::native::(anonymous namespace)::multi_tensor_apply_for_fused_optimizer_kernel<...>"


def _step(t: _Trace, k: int, s: float, slow: bool) -> None:
    d = 300.0 if slow else 0.0  # the host's delay after the forward, and where kernels moved
    t.range(f"ProfilerStep#{k}", s, s + STEP_US["slow" if slow else "base"])
    t.x("gpu_user_annotation", f"ProfilerStep#{k}", s + 85, s + (1230 if slow else 930), pid=0,
        tid=7, **{"External id": t.ext})
    t.range("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", s, s + 60)
    t.op("aten::to", s + 70, s + 100, dims=[[64, 256], []])
    t.op("aten::_to_copy", s + 72, s + 98, dims=[[64, 256], []])
    t.op("aten::copy_", s + 75, s + 95, dims=[[64, 256], [64, 256]])
    t.launch("cudaMemcpyAsync", s + 80, s + 90, "Memcpy HtoD (Pinned -> Device)", s + 85,
             s + 105, cat="gpu_memcpy", bytes=65536, **{"memory bandwidth (GB/s)": 3.28})
    t.memory(s + 76, 65536, 8 << 20)
    t.range("sleuth.module::<root>", s + 110, s + 350)
    for name, a, b, launch, k0, k1, seq in (("fc1", 110, 250, 200, 215, 415, 101),
                                            ("fc2", 250, 350, 300, 415, 515, 102)):
        t.range(f"sleuth.module::{name}", s + a, s + b)
        t.op("aten::linear", s + a + 5, s + b - 5, dims=[[64, 256], [256, 256], [256]])
        t.op("aten::t", s + a + 6, s + a + 10, dims=[[256, 256]])
        t.op("aten::addmm", s + a + 12, s + b - 10, dims=[[256], [64, 256], [256, 256]], seq=seq)
        t.launch("cudaLaunchKernel", s + launch, s + launch + 5 + (5 if name == "fc1" else 0),
                 GEMM, s + k0, s + k1)
    if slow:  # loss.item() after the forward: a D2H copy, and the host waits for the stream
        t.op("aten::item", s + 350, s + 560, dims=[[]])
        t.op("aten::_local_scalar_dense", s + 352, s + 558, dims=[[]])
        t.launch("cudaMemcpyAsync", s + 355, s + 360, "Memcpy DtoH (Device -> Pageable)",
                 s + 515, s + 520, cat="gpu_memcpy", bytes=4, **{"memory bandwidth (GB/s)": 0.001})
        t.x("cuda_runtime", "cudaStreamSynchronize", s + 360, s + 550,
            **{"External id": t.ext, "cbid": 131, "correlation": t.corr + 1})
        t.corr += 1
    # backward, on the autograd engine's device thread; fc2's node first
    for name, a, b, launch, k0, k1, seq in (("fc2", 400, 520, 410, 520, 620, 102),
                                            ("fc1", 520, 600, 530, 620, 700, 101)):
        if slow:
            a, b, launch = a + d, b + d, launch + d
            k0, k1 = {"fc2": (720, 820), "fc1": (840, 920)}[name]
        t.op("autograd::engine::evaluate_function: AddmmBackward0", s + a, s + b, tid=BWD,
             seq=seq)
        t.op("AddmmBackward0", s + a + 2, s + b - 2, tid=BWD, seq=seq)
        t.op("aten::mm", s + a + 5, s + b - 5, tid=BWD, dims=[[256, 64], [64, 256]])
        t.launch("cudaLaunchKernel", s + launch, s + launch + 5, GEMM_BWD, s + k0, s + k1,
                 tid=BWD)
    # DDP's bucket all-reduce, from the reducer's hook on the backward thread
    t.op("record_param_comms", s + 600 + d, s + 640 + d, tid=BWD, dims=[[131328]])
    t.events[-1]["args"].update({"Collective name": "allreduce", "dtype": "Float",
                                 "In msg nelems": 131328, "Out msg nelems": 131328,
                                 "Group size": 2, "Rank": t.rank,
                                 "Process Group Name": "0",
                                 "Process Group Description": "default_pg"})
    t.op("nccl:all_reduce", s + 605 + d, s + 635 + d, tid=BWD, dims=[[131328]])
    comm = (950, 1100) if slow else (650, 800)
    t.launch("cudaLaunchKernelExC", s + 610 + d, s + 620 + d, NCCL, s + comm[0], s + comm[1],
             tid=BWD, stream=20)
    t.x("cuda_runtime", "cudaStreamWaitEvent", s + 810 + d, s + 812 + d,
        **{"External id": t.ext, "cbid": 147, "correlation": t.corr + 1})
    t.corr += 1
    t.range("Optimizer.step#AdamW.step", s + 820 + d, s + 950 + d)
    opt = ((1150, 1180), (1190, 1230)) if slow else ((850, 880), (890, 930))
    t.op("aten::_foreach_add_", s + 830 + d, s + 860 + d, dims=[[], []])
    t.launch("cudaLaunchKernel", s + 840 + d, s + 845 + d, FOREACH, s + opt[0][0], s + opt[0][1])
    t.op("aten::_fused_adamw_", s + 870 + d, s + 940 + d, dims=[[], [], [], [], []])
    t.launch("cudaLaunchKernel", s + 880 + d, s + 885 + d, ADAMW, s + opt[1][0], s + opt[1][1])
    t.range("Optimizer.zero_grad#AdamW.zero_grad", s + 955 + d, s + 980 + d)


def trace(rank: int, slow: bool = False, steps: int = 3) -> dict:
    """The trace of one rank: `slow` is the straggler (module docstring)."""
    t = _Trace(rank)
    step_us = STEP_US["slow" if slow else "base"]
    for k in range(steps):
        _step(t, k, LEAD_US + k * step_us, slow)
    end = LEAD_US + steps * step_us
    meta = [{"name": "process_name", "ph": "M", "ts": round(BASE_US, 3), "pid": PID, "tid": 0,
             "args": {"name": "python3"}},
            {"name": "process_labels", "ph": "M", "ts": round(BASE_US, 3), "pid": PID, "tid": 0,
             "args": {"labels": "CPU"}},
            {"name": "process_name", "ph": "M", "ts": round(BASE_US, 3), "pid": 0, "tid": 0,
             "args": {"name": "GPU 0"}},
            {"name": "process_labels", "ph": "M", "ts": round(BASE_US, 3), "pid": 0, "tid": 0,
             "args": {"labels": "NVIDIA H100 80GB HBM3"}},
            {"name": "thread_name", "ph": "M", "ts": round(BASE_US, 3), "pid": PID, "tid": MAIN,
             "args": {"name": "thread 4123 (python3)"}},
            {"name": "thread_name", "ph": "M", "ts": round(BASE_US, 3), "pid": PID, "tid": BWD,
             "args": {"name": "thread 4190 (pt_autograd_0)"}},
            *({"name": "thread_name", "ph": "M", "ts": round(BASE_US, 3), "pid": 0, "tid": s,
               "args": {"name": f"stream {s} "}} for s in (7, 20)),
            {"ph": "X", "cat": "Trace", "ts": round(BASE_US, 3), "dur": end + 50,
             "pid": "Spans", "tid": "PyTorch Profiler", "name": "PyTorch Profiler (0)",
             "args": {"Op count": 0}},
            {"name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g", "pid": "Traces",
             "tid": "Trace PyTorch Profiler", "ts": round(BASE_US + LEAD_US, 3)},
            {"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "",
             "ts": round(BASE_US + end + 40, 3)}]
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                              "totalGlobalMem": 85045379072, "computeMajor": 9,
                              "computeMinor": 0, "maxThreadsPerBlock": 1024,
                              "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536,
                              "regsPerMultiprocessor": 65536, "warpSize": 32,
                              "sharedMemPerBlock": 49152, "sharedMemPerMultiprocessor": 233472,
                              "numSms": 132, "sharedMemPerBlockOptin": 232448}],
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2, "pg_count": 1,
                            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                           "backend_config": "cuda:nccl", "pg_size": 2,
                                           "ranks": [0, 1]}], "nccl_version": "2.21.5"},
        "record_shapes": 1, "profile_memory": 1, "with_stack": 0,
        "cuda_runtime_version": 12040, "cuda_driver_version": 12040,
        "trace_id": f"4F8A{rank:04d}", "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 1733385000000000000,
        "traceEvents": meta + t.events,
        "traceName": f"rank{rank}.pt.trace.json",
    }


FIXTURES = {"base_rank0.trace.json": (0, False), "base_rank1.trace.json": (1, False),
            "slow_rank1.trace.json": (1, True)}
"""The checked-in traces: A = base ranks 0 and 1; B = base rank 0 and the slow rank 1."""


def main(out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, (rank, slow) in FIXTURES.items():
        (Path(out) / name).write_text(dumps(trace(rank, slow)))


def dumps(t: dict) -> str:
    """The trace as JSON with one event a line, as torch writes it (and a diff reads it)."""
    head = {k: v for k, v in t.items() if k != "traceEvents"}
    events = ",\n  ".join(json.dumps(e) for e in t["traceEvents"])
    return json.dumps(head)[:-1] + ',\n "traceEvents": [\n  ' + events + "\n ]\n}\n"


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(DATA))
