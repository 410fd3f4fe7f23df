"""Dashboard test helpers: run directories written in the documented formats and by the tools'
public writers, and a real headless Chromium. A uniquely named module (not `conftest`) so that
`from dashboard_helpers import ...` cannot pick up another package's conftest."""
from __future__ import annotations

import json
import math
import shutil
import socket
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--no-first-run", "--window-size=1400,1000")


def write_run(root: Path, *, name: str, steps: int = 400, lr: float = 1e-3, nan_at: int | None = None,
              world_size: int = 1) -> Path:
    """A run directory with run.json and metrics.jsonl as the trainer writes them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(json.dumps({
        "format_version": "1.0", "name": name, "created": "2026-11-29T12:00:00Z",
        "argv": ["sleuth", "train", "--preset", "tiny"], "world_size": world_size,
        "torch_version": "2.13.0", "sleuth_version": "0.1.0",
        "config": {"train": {"lr": lr, "steps": steps, "batch_size": 8}}}))
    with open(root / "metrics.jsonl", "w") as f:
        for s in range(steps):
            loss = 4.0 * math.exp(-s * lr * 2) + 0.1 * math.sin(s / 7) + 0.5
            if nan_at is not None and s >= nan_at:
                loss = float("nan")
            f.write(json.dumps({"step": s, "loss": loss, "lr": lr * min(1.0, (s + 1) / 50),
                                "grad_norm": 1.0 + 0.5 * math.cos(s / 11), "tokens_per_s": 1000.0 + s,
                                "wall_time": 1_700_000_000.0 + 0.25 * s}) + "\n")
    return root


def write_summary(root: Path, steps: int = 30) -> bool:
    """Scalars and histograms through the public profiler.SummaryWriter; False when absent."""
    try:
        import numpy as np
        from profiler import SummaryWriter
    except (ImportError, AttributeError):
        return False
    w = SummaryWriter(root, rank=0)
    rng = np.random.default_rng(0)
    try:
        for s in range(steps):
            w.add_scalar("weight_norm/layers.0", 1.0 + 0.01 * s, s)
            w.add_histogram("weights/layers.0.mlp.fc.weight", rng.normal(0, 1 + s / steps, 2000), s)
            w.add_histogram("grads/layers.0.mlp.fc.weight", rng.normal(0, 0.1, 2000), s)
    finally:
        w.close()
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_chromium() -> str | None:
    """None when the browser tests can run, else the reason they are skipped."""
    for p in (CHROMIUM, CHROMEDRIVER):
        if not Path(p).exists() and not shutil.which(Path(p).name):
            return f"{p} is not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'selenium>=4.15')"
    return None


def make_driver(profile_dir: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    for a in CHROME_ARGS:
        opts.add_argument(a)
    opts.add_argument(f"--user-data-dir={profile_dir}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver_path = CHROMEDRIVER if Path(CHROMEDRIVER).exists() else shutil.which("chromedriver")
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    driver.set_page_load_timeout(30)
    return driver


def severe_logs(driver) -> list[dict]:
    """SEVERE entries of the browser console since the last call (reading clears them)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_idle(driver, timeout: float = 20.0) -> None:
    """Wait until Dash has rendered and no callback is pending."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = driver.execute_script("return document.readyState") == "complete"
        entry = driver.find_elements(By.CSS_SELECTOR, "#page > div")
        loading = driver.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']")
        if ready and entry and not loading:
            time.sleep(0.3)  # let chained callbacks start before the final check
            if not driver.find_elements(By.CSS_SELECTOR, "[data-dash-is-loading='true']"):
                return
        time.sleep(0.1)
    raise AssertionError(f"page did not settle in {timeout}s: {driver.current_url}")


def screenshot(driver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def write_tool_data(root: Path, *, seed: int = 0, nan_step: int | None = None, steps: int = 4) -> dict[str, str]:
    """Train a tiny model for a few steps with every tool's PUBLIC writer on: tracer.Dumper
    (mix level, full mode; optimizer steps end its steps), profiler.Collector, profiler.SummaryWriter and irdump.save_graphs.
    Returns {tool: "ok" or the reason it could not write}, so a page's data test can skip with
    that reason while its empty state stays tested."""
    import torch

    done: dict[str, str] = {}
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(123))
    tools: dict[str, object] = {}
    try:
        import tracer

        tools["dump"] = tracer.Dumper(model, {"steps": "all", "level": "mix", "mode": "full",
                                              "path": str(root)}, rank=0, world_size=1)
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        done["dump"] = f"tracer.Dumper unavailable: {e}"
    try:
        import profiler

        tools["profile"] = profiler.Collector(root, config=profiler.CollectorConfig(
            wait=0, warmup=1, active=2, activities=("cpu",), tokens_per_step=48), rank=0)
        tools["profile"].start()
    except Exception as e:  # noqa: BLE001
        done["profile"] = f"profiler.Collector unavailable: {e}"
    try:
        import profiler

        tools["summary"] = profiler.SummaryWriter(root, rank=0)
    except Exception as e:  # noqa: BLE001
        done["summary"] = f"profiler.SummaryWriter unavailable: {e}"
    try:
        for step in range(steps):
            inp = x.clone()
            if nan_step is not None and step >= nan_step:
                inp[0, 0] = float("nan")
            loss = model(inp).pow(2).mean()
            loss.backward()
            if "summary" in tools:
                tools["summary"].add_scalar("train/loss", float(loss.detach()), step)
                tools["summary"].add_model_histograms(model, step, kinds=("weights", "grads"))
            opt.step()
            opt.zero_grad()
            if "profile" in tools:
                tools["profile"].step()
    finally:
        for name, tool in tools.items():
            try:
                tool.close()
                done[name] = "ok"
            except Exception as e:  # noqa: BLE001
                done[name] = f"{name} writer failed: {e}"
    try:
        import irdump

        irdump.save_graphs(model, (x,), root / "ir")
        done["ir"] = "ok"
    except Exception as e:  # noqa: BLE001
        done["ir"] = f"irdump.save_graphs failed: {e}"
    return done


def callback(client, outputs: list[tuple[str, str]], inputs: list[tuple[str, str, object]],
             state: list[tuple[str, str, object]] = (), changed: list[str] | None = None,
             ) -> tuple[int, dict | None, int]:
    """POST one Dash callback as the page does (through Flask's test client or any client with
    `.get(url)` and `.post(url, json=...)`): (HTTP status, the response's outputs by id,
    response bytes). `changed` ("id.prop") fired it; the first input when None."""
    def spec(items):
        return [{"id": i, "property": p, "value": v} for i, p, v in items]

    outs = [{"id": i, "property": p} for i, p in outputs]
    name = (f"{outputs[0][0]}.{outputs[0][1]}" if len(outputs) == 1
            else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..")
    deps = client.get("/_dash-dependencies")
    import json as _json

    deps = _json.loads(deps.get_data() if hasattr(deps, "get_data") else deps.content)
    # an output declared with allow_duplicate carries a suffix (`id.prop@hash`) in the name

    def bare(n: str) -> list[str]:
        return [part.split("@")[0] for part in n.strip(".").split("...")]

    name = next((d["output"] for d in deps if bare(d["output"]) == bare(name)), name)
    for out, part in zip(outs, name.strip(".").split("...")):
        if "@" in part:
            out["property"] = part.split(".", 1)[1]
    body = {"output": name, "outputs": outs[0] if len(outs) == 1 else outs,
            "inputs": spec(inputs), "changedPropIds": changed or [f"{i}.{p}" for i, p, _ in inputs[:1]],
            "state": spec(state)}
    resp = client.post("/_dash-update-component", json=body)
    status = getattr(resp, "status_code", None)
    data = resp.get_data() if hasattr(resp, "get_data") else resp.content
    if status != 200:
        return status, None, len(data)
    import json as _json

    return status, _json.loads(data)["response"], len(data)


def runs_page(client) -> tuple[int, str]:
    """The Runs page as the router callback renders it: (status, its JSON text)."""
    status, out, _ = callback(client, [("page", "children")], [("url", "pathname", "/")],
                              [("url", "search", "")])
    import json as _json

    return status, _json.dumps(out)


def write_big_export(run: Path, records: int, *, nan_every: int = 997) -> Path:
    """RUN/export.parquet (the documented `sleuth dump export` layout) holding one step of
    `records` records: a real one-record dump is written and exported by the tracer's public
    writers, and its Parquet part is then grown to `records` rows (every `nan_every`-th with a
    NaN), as a step of a model with that many records would export."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from tracer._config import DumpConfig
    from tracer.storage import RecordMeta, export_parquet, make_writer

    src = run.parent / f".{run.name}-dump"
    w = make_writer(DumpConfig(path=str(src), writer="sync"), rank=0, world_size=1)
    w.begin_step(0)
    w.add(RecordMeta("fc.forward.0.output.0", "fc", "", "forward", "output", 0, 0, "m.py:1"),
          torch.ones(2))
    w.end_step()
    w.close()
    out = run / "export.parquet"
    export_parquet(src, out)
    part = next(out.glob("rank=0/step=0/*.parquet"))
    table = pq.read_table(part)
    frame = table.to_pandas().iloc[[0] * records].reset_index(drop=True)
    frame["seq"] = range(records)
    frame["name"] = [f"layers.{i // 8}.fc.forward.{i % 8}.output.0" for i in range(records)]
    frame.loc[frame["seq"] % nan_every == nan_every - 1, "nan"] = 3
    pq.write_table(pa.Table.from_pandas(frame, schema=table.schema, preserve_index=False), part)
    return out


def write_gpu_profile(root: Path, *, steps: int = 4, sync_us: float = 0.0) -> Path:
    """A run whose profile is a hand-made Chrome trace of a GPU run, as torch.profiler writes it
    (kernels with correlation ids, an NCCL kernel on its own stream under a compute kernel).
    Each 1000 us step: data 0-100 (GPU idle), module `fc` launches gemm 100-400, the all-reduce
    500-700 overlaps bwd_gemm 450-600; with `sync_us`, B's `.item()` (aten::item in module fc)
    holds the host that much longer, and the GPU idles through it."""
    u = "user_annotation"

    def ev(name, ts, dur, cat="cpu_op", pid=1, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    events, t0 = [], 0.0
    for s in range(steps):
        length = 1000 + sync_us
        events += [ev(f"ProfilerStep#{s}", t0, length, cat=u), ev("sleuth.data", t0, 100, cat=u),
                   ev("sleuth.forward", t0 + 100, 300 + sync_us, cat=u),
                   ev("sleuth.module::fc", t0 + 100, 300 + sync_us, cat=u),
                   ev("aten::addmm", t0 + 100, 50, **{"External id": 10 * s + 1}),
                   ev("cudaLaunchKernel", t0 + 110, 5, cat="cuda_runtime", correlation=10 * s + 1),
                   ev("sleuth.backward", t0 + 400 + sync_us, 300, cat=u),
                   ev("nccl:all_reduce", t0 + 500 + sync_us, 20),
                   ev("sleuth.optimizer", t0 + 700 + sync_us, 300, cat=u),
                   ev("gemm", t0 + 100, 300, cat="kernel", pid=0, tid=7, correlation=10 * s + 1),
                   ev("bwd_gemm", t0 + 450 + sync_us, 150, cat="kernel", pid=0, tid=7),
                   ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t0 + 500 + sync_us, 200,
                      cat="kernel", pid=0, tid=8)]
        if sync_us:
            events.append(ev("aten::item", t0 + 200, sync_us + 100))
        t0 += length
    d = root / "profile" / "rank0"
    d.mkdir(parents=True, exist_ok=True)
    (d / "window0.trace.json").write_text(json.dumps({"traceEvents": events}))
    return root


def wait_for(fn, timeout: float = 15.0):
    """Poll `fn()` until it returns something truthy (Plotly draws after Dash settles; a
    re-render can replace an element between finding and reading it)."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except StaleElementReferenceException:
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
