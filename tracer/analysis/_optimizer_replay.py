"""The optimizer step re-run: does B's update follow from B's hyperparameters alone?

A first divergence at a parameter's `update` record (the optimizer step's change to it), while
its `param` and `grad` records agree, is made by the optimizer. When the two runs' setups
(tracer.analysis._setup) say its group's hyperparameters differ, the update is re-run here with
torch's own optimizer class, on one parameter: from A's recorded weights and gradients of every
step since the optimizer's state was empty (the setup's `state_step` 0: a state of no steps is
known without being recorded), once with A's hyperparameters of each step, which must give A's
own update back (else the re-run says nothing, and says why), and once with B's. B's update
given back means the hyperparameters alone make the difference; each hyperparameter that
differs is then tried alone (A's others), which names the one that does it.

Needs tensors (mode tensor or full) and the optimizer's records (level mix or module, with
`params`), every step from the state's first: a statistics dump says what would be needed.
"""
from __future__ import annotations

import inspect
from typing import Any

from tracer.analysis._replay import NotReplayable, recorded, rel_error
from tracer.analysis._setup import read

# group entries no re-run takes: a scheduler's bookkeeping, and how torch runs the update
# (the same arithmetic, one parameter at a time here)
_NOT_MATH = frozenset({"initial_lr", "foreach", "fused", "capturable", "differentiable",
                       "params", "decoupled_weight_decay"})
# how far a re-run of a run's own update may be off and still be that update: float32
# arithmetic in another order (one parameter at a time, not foreach)
_OWN = 1e-4


def _group(setup: dict[str, Any], param: str, call: int) -> tuple[str, dict, int]:
    """(optimizer class, group hyperparameters, state steps) of `param` in a step's setup."""
    opts = setup.get("optimizers") or []
    for opt in opts[call:] + opts[:call]:
        for group in opt.get("groups") or []:
            if param in (group.get("params") or []):
                return (str(opt.get("class")), dict(group.get("hyper") or {}),
                        int(group.get("state_step", -1)))
    raise NotReplayable(f"no optimizer group of the setup holds {param}")


def _setup(dump: Any, rank: int, step: int) -> dict[str, Any]:
    setup, why = read(dump.attrs(rank, step).get("setup"), "")
    if setup is None:
        raise NotReplayable(f"step {step} keeps no setup ({why})")
    return setup


class _Side:
    """One run's records and setups of one parameter, from the step its optimizer state was
    empty to the step of the divergence."""

    def __init__(self, dump: Any, rank: int, step: int, param: str, call: int) -> None:
        self.dump, self.rank, self.param, self.call = dump, rank, param, call
        dumped = set(dump.steps(rank))
        self.groups: list[tuple[str, dict, int]] = []
        s = step
        while True:
            if s not in dumped:
                raise NotReplayable(f"the optimizer's state at step {step} was built over step "
                                    f"{s}, which the dump does not hold: dump every step from "
                                    f"the optimizer's first")
            g = _group(_setup(dump, rank, s), param, call)
            self.groups.insert(0, g)
            if g[2] == 0:
                break
            if s == 0:
                raise NotReplayable("the optimizer's state when the dump began is not known")
            s -= 1  # a state of steps (counted, or one without a count: SGD's) before this
        self.first, self.last = s, step

    def record(self, step: int, what: str) -> Any:
        return recorded(self.dump, self.rank, step,
                        f"{self.param}.optimizer.{self.call}.{what}.0")


def _rerun(cls_name: str, hypers: list[dict], side: _Side) -> Any:
    """The update of the last step, re-run with torch's `cls_name` from an empty state over
    `side`'s recorded weights and gradients, with `hypers` (one per step)."""
    import torch

    cls = getattr(torch.optim, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise NotReplayable(f"{cls_name} is not one of torch's optimizers, which a re-run needs")
    accepted = set(inspect.signature(cls.__init__).parameters)
    p = torch.nn.Parameter(side.record(side.first, "param").clone())
    update = None
    for k, s in enumerate(range(side.first, side.last + 1)):
        math_ = {key: (tuple(v) if isinstance(v, list) else v) for key, v in hypers[k].items()
                 if key not in _NOT_MATH}
        if k == 0:
            unknown = sorted(set(math_) - accepted)
            opt = cls([p], **{key: v for key, v in math_.items() if key in accepted},
                      **({"foreach": False} if "foreach" in accepted else {}))
            if unknown:
                opt.param_groups[0].update({key: math_[key] for key in unknown})
        else:
            opt.param_groups[0].update(math_)
        with torch.no_grad():
            p.copy_(side.record(s, "param"))  # the weights as the run had them
        p.grad = side.record(s, "grad").clone()
        before = p.detach().clone()
        opt.step()
        update = p.detach() - before
    return update


def replay_update(da: Any, db: Any, fd: dict[str, Any], changed: list[str]) -> dict[str, Any]:
    """Re-run the optimizer update of first divergence `fd` (a parameter's `update` record)
    with B's hyperparameters on A's records (module doc). `changed`: the hyperparameters the
    setups say differ for it. Returns {"reproduced": bool, "error": B's update against the
    re-run, "own": A's against its own re-run, "alone": the hyperparameters that alone give
    B's update, "optimizer": its class, "steps": (first, last)}; NotReplayable says why it
    cannot be re-run."""
    name = str(fd["name"])
    head, sep, tail = name.rpartition(".optimizer.")
    if not sep or not tail.endswith(".update.0"):
        raise NotReplayable(f"{name} is no optimizer update record")
    call = int(tail.split(".")[0])
    a = _Side(da, int(fd["rank"]), int(fd["step"]), head, call)
    b = _Side(db, int(fd["b_rank"]), int(fd["b_step"]), head, call)
    if (a.first, a.last) != (b.first, b.last) or a.groups[0][0] != b.groups[0][0]:
        raise NotReplayable("the two runs' optimizers began from their state at other steps, "
                            "or are of other classes")
    cls_name = a.groups[0][0]
    hyper_a = [g[1] for g in a.groups]
    hyper_b = [g[1] for g in b.groups]
    own = rel_error(_rerun(cls_name, hyper_a, a), a.record(a.last, "update"))
    if not own <= _OWN:
        raise NotReplayable(f"re-running {cls_name} with A's own hyperparameters does not give "
                            f"A's update back (off by {own:.3g}): its step is not torch's "
                            f"{cls_name} alone (a hook on the step, or state not known)")
    target = b.record(b.last, "update")
    error = rel_error(_rerun(cls_name, hyper_b, a), target)
    reproduced = error <= max(_OWN, 4 * own)
    alone = []
    if reproduced and len(changed) > 1:
        for key in changed:
            mixed = [{**ha, key: hb.get(key)} for ha, hb in zip(hyper_a, hyper_b)]
            if rel_error(_rerun(cls_name, mixed, a), target) <= max(_OWN, 4 * own):
                alone.append(key)
    elif reproduced:
        alone = list(changed)
    return {"reproduced": reproduced, "error": error, "own": own, "alone": alone,
            "optimizer": cls_name, "steps": (a.first, a.last)}


def replay_words(found: dict[str, Any]) -> str:
    """What the re-run found (`replay_update`), in words."""
    first, last = found["steps"]
    since = f"step {first}" if first == last else f"steps {first} to {last}"
    how = (f"re-run with A's recorded weights and gradients ({since}, from an empty state) and "
           f"B's hyperparameters, torch's {found['optimizer']}")
    if not found["reproduced"]:
        return (f"{how} does not give B's update (off by {found['error']:.3g}): the "
                f"hyperparameters do not account for all of it")
    which = found["alone"]
    named = (f": {' or '.join(which)} alone makes it" if which else
             ": only the changed hyperparameters together make it")
    return f"{how} gives B's update (off by {found['error']:.3g}){named}"
