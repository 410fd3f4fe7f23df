"""The setup around the model, taken with each dumped step: what a step's records cannot show.

Two runs can compute every op of the model alike and still part: the optimizer was built with
another epsilon, a parameter sits in another group, one run clips its gradients, a config
constant or a module's plain attribute (an epsilon, a dropout probability, `training`) was set
otherwise, a buffer was filled differently, a parameter is frozen, a backend flag or a numerics
environment variable differs. `SetupRecorder` takes these for each dumped step and hands them
back as one JSON-ready dict (docs/dump-format.md, root attribute `setup`), which the diff
compares before any record (tracer.analysis._setup).

When each part is taken, and why:
- the model's part (its `config`, module attributes, buffers, frozen parameters) at the step's
  first record, before the forward has run: a buffer a forward updates (BatchNorm's running
  statistics) is taken as the step began, so a buffer that differs there is a cause, never a
  consequence of activations that differed. Where the model is not known yet then (the
  zero-code attach learns its roots from their first call) it is taken at that first call,
  before the model's own pre-hooks run, else at the optimizer step without the buffers;
- each optimizer's class and its groups' hyperparameters (the learning rate a scheduler set
  included) when its `step()` begins;
- each gradient-clipping call (`clip_grad_norm_`, `clip_grads_with_norm_`, `clip_grad_value_`)
  as it runs, with its arguments, the parameters it clips and the user's line;
- the gradient scaler's state after each `unscale_` (tracer.capture._scaler): the scale the
  gradients were divided by, its growth settings, whether it found Inf or NaN, and who called
  `unscale_` at which line, and the lines where it scaled a loss (`scaled_at`);
- the batch: a fingerprint of each tensor the model's top-level forward is called with, at each
  call (micro-batches in turn), read in place as the buffers are. It is no setup the diff
  compares as a cause (another batch is data, said as "inputs differ"); it says which of the
  data, the buffers or the weights an "inputs differ" is, so that a setup difference or an
  op's other argument never reads as "the batch differs";
- flags, numerics environment variables, seeds and library versions with the model's part.

Only dumped steps pay for this (a few milliseconds on a model of a hundred modules); an
unselected step costs one test of a flag in the clipping wrapper, if it clips.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import zlib
from typing import Any, Callable

import torch

from tracer.capture._listeners import Listeners
from tracer.capture._source import user_source

SETUP_VERSION = 2
"""The version of the setup dict's layout (its key `version`)."""

# environment variables that change what a run computes, or how it rounds
_NUMERICS_ENV = ("NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                 "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                 "NCCL_ALGO", "NCCL_PROTO", "TORCH_CUDNN_V8_API_DISABLED",
                 "CUDA_LAUNCH_BLOCKING", "PYTHONHASHSEED")
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")
# configuration keys that name where a model came from or what wrote it, not what it computes
_CONFIG_NOISE = frozenset({"transformers_version", "name_or_path", "_name_or_path",
                           "architectures", "auto_map", "_commit_hash", "_attn_implementation_autoset"})
_MAX_TEXT = 200  # a longer string attribute is a path or a prompt, not a constant
_MAX_ITEMS = 16  # a longer tuple of numbers is data, not a constant
# a buffer larger than this is fingerprinted by its dtype and shape only (a copy to the host
# would cost more than the step's other setup together)
_MAX_BUFFER_BYTES = 64 * 2**20
_MAX_BATCH_CALLS = 64  # a step that calls its model more often (an eval loop) keeps the first


def plain(value: Any) -> Any:
    """`value` as a JSON value when it is a constant a run is set up with (a number, a string,
    a bool, None, a short tuple of those, a torch.dtype or device), else `_SKIP`."""
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and len(value) > _MAX_TEXT:
            return _SKIP
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS:
        items = [plain(v) for v in value]
        if all(v is not _SKIP and not isinstance(v, list) for v in items):
            return items
    return _SKIP


_SKIP = object()


def _flatten(prefix: str, d: dict, out: dict[str, Any], depth: int = 0) -> None:
    for key, value in d.items():
        key = str(key)
        if key in _CONFIG_NOISE or key.startswith("_"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth < 4:
            _flatten(f"{name}.", value, out, depth + 1)
            continue
        value = plain(value)
        if value is not _SKIP:
            out[name] = value


def model_config(root: torch.nn.Module) -> dict[str, Any]:
    """A model's configuration (a Hugging Face `config`, or any object with `to_dict()`), as
    flat dotted keys of constant values; {} without one."""
    config = getattr(root, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return {}
    try:
        d = to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot say itself is no setup to compare
        return {}
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        _flatten("", d, out)
    # which attention kernel the model runs (eager, sdpa, flash): kept out of `to_dict()` by
    # Hugging Face, it changes the ops a layer calls and what they are given
    attention = getattr(config, "_attn_implementation", None)
    if isinstance(attention, str):
        out["attn_implementation"] = attention
    return out


def module_attributes(modules: list[tuple[str, torch.nn.Module]]) -> dict[str, dict[str, Any]]:
    """Each module's public attributes that are constants (eps, p, scaling, `training`,
    in_features ...), by module name."""
    out: dict[str, dict[str, Any]] = {}
    for name, module in modules:
        attrs: dict[str, Any] = {"class": type(module).__name__}
        for key, value in vars(module).items():
            if key.startswith("_"):
                continue
            value = plain(value)
            if value is not _SKIP:
                attrs[key] = value
        out[name] = attrs
    return out


def fingerprint(t: torch.Tensor) -> list[Any]:
    """[dtype, shape, CRC-32 of its bytes] of a tensor (the CRC None when it is too large, not
    dense, or its bytes cannot be read); two equal fingerprints mean the same bits. A dense
    host tensor's bytes are read in place, dispatching no op (a profile of the run sees none)."""
    shape = list(t.shape)
    crc = None
    try:
        nbytes = t.numel() * t.element_size()
        if not t.is_sparse and t.layout == torch.strided and nbytes <= _MAX_BUFFER_BYTES:
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().cpu().contiguous()
            crc = zlib.crc32(ctypes.string_at(t.data_ptr(), nbytes)) if nbytes else 0
    except (RuntimeError, TypeError, ValueError):
        crc = None
    return [str(t.dtype).removeprefix("torch."), shape, crc]


def backend_flags() -> dict[str, Any]:
    """torch's global numerics switches: TF32, reduced-precision reductions, cuDNN,
    determinism, the float32 matmul precision, the default dtype and the thread count."""
    b = torch.backends
    flags: dict[str, Any] = {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "cudnn.enabled": bool(b.cudnn.enabled),
        "cudnn.deterministic": bool(b.cudnn.deterministic),
        "cudnn.benchmark": bool(b.cudnn.benchmark),
    }
    matmul = getattr(getattr(b, "cuda", None), "matmul", None)
    for key in ("allow_tf32", "allow_fp16_reduced_precision_reduction",
                "allow_bf16_reduced_precision_reduction"):
        try:
            flags[f"cuda.matmul.{key}"] = plain(getattr(matmul, key))
        except (AttributeError, RuntimeError, TypeError):
            continue
    try:
        flags["cudnn.allow_tf32"] = bool(b.cudnn.allow_tf32)
    except (AttributeError, RuntimeError):
        pass
    return flags


def numerics_env() -> dict[str, str]:
    """The environment variables that change what a run computes or how it rounds."""
    return {k: v for k, v in sorted(os.environ.items())
            if k in _NUMERICS_ENV or (k.startswith(_ENV_PREFIXES) and not k.endswith("_DIR"))}


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[tuple[str, str], ...]:
    from importlib import metadata

    out = []
    for name in ("numpy", "transformers", "accelerate", "triton", "lightning"):
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(out)


def versions() -> dict[str, str]:
    """Python's, torch's and the installed numerics libraries' versions (installed, whether
    or not this process imported them: two runs of one environment say the same)."""
    return {"python": sys.version.split()[0], "torch": str(torch.__version__),
            **dict(_installed())}


def rng() -> dict[str, Any]:
    """The seed torch's CPU generator was given."""
    return {"seed": int(torch.initial_seed())}


def _state_step(opt: torch.optim.Optimizer, params: list[Any]) -> int:
    """How many steps the optimizer's state of a group has taken (its first parameter's
    `step`, 0 while it holds no state): a state of 0 steps is known without being recorded,
    so an update can be re-run from there (tracer.analysis._optimizer_replay)."""
    for p in params[:1]:
        step = (opt.state.get(p) or {}).get("step")
        if step is None:  # no state yet, or one without a count (SGD's momentum buffer)
            return 0 if not opt.state.get(p) else -1
        return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


def tied(modules: list[tuple[str, torch.nn.Module]]) -> dict[str, str]:
    """Parameters that are one tensor under two names (an output head tied to the input
    embedding): each later name -> the first, in the modules' order."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, module in modules:
        for pname, p in module.named_parameters(recurse=False):
            full = pname if name.startswith("<root") else f"{name}.{pname}"
            if id(p) in first:
                out[full] = first[id(p)]
            else:
                first[id(p)] = full
    return out


class SetupRecorder:
    """The setup of one Dumper's open step: begun with the step, filled as the step runs,
    taken (`take`) when the step is written.

    `names` gives (parameter name, module name, parameter) of the model's roots and
    `modules` (module name, module) of every module under them: the Dumper's module tracker,
    so the setup names parameters and modules as the records do."""

    def __init__(self, names: Callable[[], list[tuple[str, str, Any]]],
                 modules: Callable[[], list[tuple[str, torch.nn.Module]]]) -> None:
        self._names = names
        self._modules = modules
        self._setup: dict[str, Any] | None = None
        self._param_names: dict[int, str] = {}

    def begin(self) -> None:
        """A dumped step begins: nothing of it is taken yet."""
        self._setup = {"version": SETUP_VERSION, "optimizers": [], "clips": [], "batch": [],
                       "scalers": [], "scaled_at": []}
        self._param_names = {}

    def end(self) -> None:
        """The step was written, or dropped: nothing more is taken until the next begins."""
        self._setup = None

    @property
    def open(self) -> bool:
        return self._setup is not None

    def take_model(self, buffers: bool = True) -> None:
        """The model's part, the flags, environment, seeds and versions, once a step: at its
        first record, buffers as the step began; where no model is known then, at the
        optimizer step or the step's end, without the buffers (a forward may have changed
        them by then)."""
        setup = self._setup
        if setup is None or "model" in setup:
            return
        modules = self._modules()
        if not modules and buffers:
            return  # the roots are learnt at their first call: taken later
        roots = [m for name, m in modules if name.startswith("<root")]
        config: dict[str, Any] = {}
        for root in roots:
            config.update(model_config(root))
        params = self._names()
        setup["model"] = {
            "config": config,
            "modules": module_attributes(modules),
            "frozen": [name for name, _, p in params if not p.requires_grad],
            "tied": tied(modules),
        }
        if buffers:  # as the step began: later, a forward (or its dropout) changed them
            setup["buffers"] = {f"{m}.{b}" if m != "<root>" else b: fingerprint(t)
                                for m, module in modules
                                for b, t in module.named_buffers(recurse=False)
                                if t is not None}
            setup["rng"] = rng()
        setup["flags"] = backend_flags()
        setup["env"] = numerics_env()
        setup["versions"] = versions()

    def _name(self, p: Any) -> str:
        if not self._param_names:
            self._param_names = {id(t): name for name, _, t in self._names()}
        name = self._param_names.get(id(p))
        if name is None:
            shape = "x".join(str(d) for d in getattr(p, "shape", ()))
            name = f"<a parameter outside the model, {shape}>"
        return name

    def optimizer(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer's class and its groups' hyperparameters, as its `step()` begins."""
        setup = self._setup
        if setup is None:
            return
        self.take_model(buffers=False)
        groups = []
        for group in opt.param_groups:
            hyper = {}
            for key, value in group.items():
                if key == "params":
                    continue
                value = plain(value.item() if isinstance(value, torch.Tensor)
                              and value.numel() == 1 else value)
                if value is not _SKIP:
                    hyper[key] = value
            groups.append({"hyper": hyper, "params": [self._name(p) for p in group["params"]],
                           "state_step": _state_step(opt, group["params"])})
        entry = {"class": type(opt).__name__, "groups": groups}
        known = setup["optimizers"]
        if entry not in known:  # a closure's repeated steps, or two calls of one step
            known.append(entry)

    def clip(self, fn: str, args: dict[str, Any], params: list[Any], source: str) -> None:
        """A gradient-clipping call: which, its arguments, the parameters it is given (with a
        gradient or not: which have one this step is the step's doing, a detach or a frozen
        parameter, not the call's), where."""
        setup = self._setup
        if setup is None:
            return
        names = [self._name(p) for p in params]
        setup["clips"].append({"fn": fn, "args": args, "params": names, "source": str(source)})

    def compiled(self, mode: str, regions: dict[str, int], wrapper_ran: bool = False,
                 kernels: dict[str, dict[str, Any]] | None = None) -> None:
        """How the step ran torch.compile'd code (`mode`, the dump config's "compiled"), the
        compiled regions that ran (scope -> calls) and what the compiler did so far; nothing
        where no compiled code ran and none was compiled (`wrapper_ran`: a torch.compile
        wrapper was called, eagerly in mode "eager"), though torch.compile be loaded.
        `kernels`: what each of Inductor's kernels recorded in the step fused (``{scope}.{phase}``
        -> kernel name and its nodes' ``[op, module, file:line]``)."""
        from tracer.capture._regions import compile_summary

        setup = self._setup
        summary = compile_summary()
        if setup is None or not (regions or wrapper_ran or summary and summary["graphs"]):
            return
        setup["compile"] = {"mode": mode, "regions": dict(regions), **(summary or {})}
        if kernels:
            setup["compile"]["kernels"] = {k: dict(v) for k, v in kernels.items()}

    def batch(self, root: str, args: tuple, kwargs: dict[str, Any] | None) -> None:
        """A top-level call of the model (`root`, its record name): a fingerprint of each
        tensor it is given, positional by index, keyword by name."""
        setup = self._setup
        if setup is None or len(setup["batch"]) >= _MAX_BATCH_CALLS:
            return
        # the zero-code attach learns the model at this call: its buffers as the step began
        # are still there to take (the model's own pre-hooks run after this one)
        self.take_model()
        inputs = {str(i): fingerprint(a) for i, a in enumerate(args)
                  if isinstance(a, torch.Tensor)}
        inputs.update({str(k): fingerprint(v) for k, v in (kwargs or {}).items()
                       if isinstance(v, torch.Tensor)})
        setup["batch"].append({"module": root, "inputs": inputs})

    def scaler(self, scaler: Any, optimizer: torch.optim.Optimizer, explicit: bool,
               source: str) -> None:
        """A gradient scaler's `unscale_` of `optimizer`'s gradients (tracer.capture._scaler):
        the scale they were divided by, its growth settings, whether Inf or NaN was found, who
        called it (`explicit`: the user, else `scaler.step`) and at which line."""
        setup = self._setup
        if setup is None:
            return
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
        found = state.get("found_inf_per_device") or {}
        entry = {"class": type(scaler).__name__,
                 "scale": plain(float(scaler.get_scale())),
                 "growth_factor": plain(float(scaler.get_growth_factor())),
                 "backoff_factor": plain(float(scaler.get_backoff_factor())),
                 "growth_interval": int(scaler.get_growth_interval()),
                 "found_inf": bool(sum(float(v.item()) for v in found.values())),
                 "unscale": "explicit" if explicit else "in step",
                 "source": str(source)}
        setup["scalers"].append(entry)

    def scaled(self, source: str) -> None:
        """A gradient scaler scaled a loss at `source` (the user's line)."""
        setup = self._setup
        if setup is not None and str(source) not in setup["scaled_at"]:
            setup["scaled_at"].append(str(source))

    def failed(self, reason: str) -> None:
        """Part of the step's setup could not be taken: said in it (`errors`)."""
        if self._setup is not None:
            self._setup.setdefault("errors", []).append(reason)

    def finish(self) -> None:
        """The step ends: what was not taken yet is taken now (without buffers)."""
        self.take_model(buffers=False)

    @property
    def taken(self) -> dict[str, Any] | None:
        """The step's setup, or None when no step is open."""
        return self._setup


# -- gradient clipping ---------------------------------------------------------------------------
# torch has no hook for clipping: while a Dumper listens, the clipping functions of
# torch.nn.utils are wrapped, where both the module's own calls (clip_grad_norm_ calls
# _get_total_norm and _clip_grads_with_norm_ through the module's globals) and a user's
# `torch.nn.utils.clip_grad_norm_(...)` find them
_originals: dict[tuple[Any, str], Any] = {}
_state = threading.local()  # norm_type of the running clip_grad_norm_; one report per call


def _unwrap() -> None:
    for (owner, attr), original in _originals.items():
        setattr(owner, attr, original)
    _originals.clear()


_listeners = Listeners(lambda: _originals or _wrap(), _unwrap)


def on_clip(callback: Callable[[str, dict, list, str], None]) -> Any:
    """Call ``callback(fn, args, params, source)`` at every gradient-clipping call of
    torch.nn.utils; returns a handle whose ``remove()`` stops it."""
    return _listeners.add(callback)


def _listed(parameters: Any) -> Any:
    """The parameters a clipping function was given, as a list it can still iterate (a
    generator would be spent by the report)."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return parameters if isinstance(parameters, (list, tuple)) else list(parameters)


def _report(fn: str, args: dict[str, Any], params: Any) -> None:
    """Tell the listeners of one clipping call; nothing of it stops the user's clipping."""
    if not _listeners:
        return
    try:
        args = {k: plain(float(v)) for k, v in args.items()}
        source = user_source(2)
        for callback in _listeners.callbacks():
            callback(fn, args, list(params), source)
    except Exception:  # noqa: BLE001 - a setup record never stops the user's clipping
        return


def _wrap() -> None:
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    total_norm = clip_grad._get_total_norm
    with_norm = clip_grad._clip_grads_with_norm_
    by_value = clip_grad.clip_grad_value_

    @functools.wraps(total_norm)
    def get_total_norm(tensors: Any, norm_type: Any = 2.0, *args: Any, **kwargs: Any) -> Any:
        _state.norm_type = norm_type
        return total_norm(tensors, norm_type, *args, **kwargs)

    @functools.wraps(with_norm)
    def clip_grads_with_norm_(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = _listed(parameters)
        norm_type = getattr(_state, "norm_type", None)
        _state.norm_type = None
        if norm_type is None:
            _report("clip_grads_with_norm_", {"max_norm": max_norm}, parameters)
        else:
            _report("clip_grad_norm_", {"max_norm": max_norm, "norm_type": norm_type},
                    parameters)
        return with_norm(parameters, max_norm, *args, **kwargs)

    @functools.wraps(by_value)
    def clip_grad_value_(parameters: Any, clip_value: Any, *args: Any, **kwargs: Any) -> Any:
        parameters = _listed(parameters)
        _report("clip_grad_value_", {"clip_value": clip_value}, parameters)
        return by_value(parameters, clip_value, *args, **kwargs)

    for owner, attr, wrapped in ((clip_grad, "_get_total_norm", get_total_norm),
                                 (utils, "get_total_norm", get_total_norm),
                                 (clip_grad, "_clip_grads_with_norm_", clip_grads_with_norm_),
                                 (utils, "clip_grads_with_norm_", clip_grads_with_norm_),
                                 (clip_grad, "clip_grad_value_", clip_grad_value_),
                                 (utils, "clip_grad_value_", clip_grad_value_)):
        if hasattr(owner, attr):
            _originals[(owner, attr)] = getattr(owner, attr)
            setattr(owner, attr, wrapped)
