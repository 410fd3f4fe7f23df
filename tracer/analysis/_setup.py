"""How two runs were set up differently: the setup a dump keeps with each step, compared.

A step file's root attribute `setup` (tracer.capture._setup, docs/dump-format.md) holds what
the records cannot show: the optimizers with each group's hyperparameters and parameters, the
gradient-clipping calls, the model's config, its modules' constant attributes, its buffers as
the step began, frozen parameters, torch's numerics flags, numerics environment variables,
seeds and versions. `differences` compares two of them and returns each difference as data,
likeliest cause of a divergence first; `describe` words one. The diff reports them before any
record (they come first in a run: whatever diverges afterwards may follow from them), and
explain names them where no recorded op made the difference.
"""
from __future__ import annotations

import dataclasses
import re
from itertools import zip_longest
from typing import Any

from tracer.storage import JsonLimitError, loads_bounded

# the order differences are reported in: what most often makes two runs part, first
KINDS = ("optimizer", "hyperparameter", "group", "clipping", "scaler", "frozen", "tied",
         "config", "module", "buffer", "compile", "flag", "env", "rng", "version")
_RANK = {k: i for i, k in enumerate(KINDS)}
_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)")


def read(text: Any, source: str) -> tuple[dict[str, Any] | None, str]:
    """A step file's `setup` attribute as a dict, or (None, why) when it has none or it does
    not read."""
    if text is None:
        return None, "no setup recorded"
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        setup = loads_bounded(str(text), f"{source}: setup")
    except JsonLimitError as e:
        return None, str(e)
    if not isinstance(setup, dict):
        return None, f"{source}: setup is not a JSON object"
    return setup, ""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return repr(value) if isinstance(value, str) else str(value)


def names_in_words(names: list[str], total: int | None = None, limit: int = 2) -> str:
    """A list of parameter or module names, short: the pattern they share (block numbers as
    `*`), the first `limit` patterns and how many more; "every parameter" when they are all
    `total` of them."""
    if total is not None and len(names) == total and total > 1:
        return "every parameter"
    patterns: dict[str, list[str]] = {}
    for n in names:
        patterns.setdefault(_DIGITS.sub("*", n), []).append(n)
    shown = list(patterns)[:limit]
    rest = len(names) - sum(len(patterns[p]) for p in shown)
    # a pattern only where several names share it: one layer's parameter keeps its number
    text = " and ".join(f"{p} ({len(patterns[p])})" if len(patterns[p]) > 1 else patterns[p][0]
                        for p in shown)
    return text + (f" and {rest} more" if rest else "")


def _diff(kind: str, key: str, a: Any, b: Any, text: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "key": key, "a": a, "b": b, "text": text, **extra}


def _per_param(opt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, group in enumerate(opt.get("groups") or []):
        for name in group.get("params") or []:
            out[str(name)] = {"group": i, **(group.get("hyper") or {})}
    return out


def _optimizers(a: list, b: list, named: bool) -> list[dict[str, Any]]:
    out = []
    for i, (oa, ob) in enumerate(zip_longest(a, b)):
        if oa is None or ob is None:
            has, side = ("B", ob) if oa is None else ("A", oa)
            out.append(_diff("optimizer", f"optimizer.{i}", oa and oa.get("class"),
                             ob and ob.get("class"),
                             f"only {has} steps a {side.get('class')} optimizer (its optimizer "
                             f"{i})"))
            continue
        ca, cb = oa.get("class"), ob.get("class")
        if ca != cb:
            out.append(_diff("optimizer", f"optimizer.{i}", ca, cb,
                             f"optimizer {ca} in A, {cb} in B"))
            continue
        label = ca if len(a) == 1 else f"{ca} (optimizer {i})"
        if named:
            out += _hyper_by_param(label, i, oa, ob)
        else:
            out += _hyper_by_group(label, i, oa, ob)
    return out


def _hyper_by_param(label: str, i: int, oa: dict, ob: dict) -> list[dict[str, Any]]:
    """Each hyperparameter as each parameter sees it (its group's), so a parameter moved to
    another group is named with the hyperparameter that changed for it."""
    pa, pb = _per_param(oa), _per_param(ob)
    out = []
    both = [n for n in pa if n in pb]
    only_a = [n for n in pa if n not in pb]
    only_b = [n for n in pb if n not in pa]
    if only_a:
        out.append(_diff("group", f"optimizer.{i}.params", len(only_a), 0,
                         f"{label} steps {names_in_words(only_a)} in A, not in B",
                         params=only_a))
    if only_b:
        out.append(_diff("group", f"optimizer.{i}.params", 0, len(only_b),
                         f"{label} steps {names_in_words(only_b)} in B, not in A",
                         params=only_b))
    keys = list(dict.fromkeys([k for n in both for k in (*pa[n], *pb[n]) if k != "group"]))
    for key in keys:
        by_values: dict[tuple[str, str], list[str]] = {}
        values: dict[tuple[str, str], tuple[Any, Any]] = {}
        for n in both:
            va, vb = pa[n].get(key), pb[n].get(key)
            if va != vb:
                k = (repr(va), repr(vb))
                by_values.setdefault(k, []).append(n)
                values[k] = (va, vb)
        for k, names in by_values.items():
            va, vb = values[k]
            where = names_in_words(names, len(both))
            out.append(_diff("hyperparameter", f"optimizer.{i}.{key}", va, vb,
                             f"{label} {key} {_fmt(va)} in A, {_fmt(vb)} in B "
                             f"({where if where == 'every parameter' else 'for ' + where})"
                             + _scheduled(key, [pa[n] for n in names], [pb[n] for n in names]),
                             params=names))
    return out


def _scheduled(key: str, ga: list[dict[str, Any]], gb: list[dict[str, Any]]) -> str:
    """What a learning rate that differs is: the one a scheduler set, where both runs' groups
    carry the `initial_lr` a scheduler keeps (said with it: the same start, so the schedule or
    its step differs)."""
    if key != "lr" or not all("initial_lr" in g for g in (*ga, *gb)):
        return ""
    starts = {g["initial_lr"] for g in (*ga, *gb)}
    if len(starts) == 1:
        return (f": the learning rate the scheduler set, from the same initial_lr "
                f"{_fmt(ga[0]['initial_lr'])} (a scheduler a step apart, or another schedule)")
    return ": the learning rate the scheduler set, from another initial_lr"


def _hyper_by_group(label: str, i: int, oa: dict, ob: dict) -> list[dict[str, Any]]:
    """Hyperparameters group by group: two codebases name their parameters differently."""
    out = []
    ga, gb = oa.get("groups") or [], ob.get("groups") or []
    if len(ga) != len(gb):
        out.append(_diff("group", f"optimizer.{i}.groups", len(ga), len(gb),
                         f"{label} has {len(ga)} parameter group(s) in A, {len(gb)} in B"))
    for g, (xa, xb) in enumerate(zip(ga, gb)):
        ha, hb = xa.get("hyper") or {}, xb.get("hyper") or {}
        for key in dict.fromkeys([*ha, *hb]):
            if ha.get(key) != hb.get(key):
                out.append(_diff("hyperparameter", f"optimizer.{i}.{key}", ha.get(key),
                                 hb.get(key), f"{label} {key} {_fmt(ha.get(key))} in A, "
                                 f"{_fmt(hb.get(key))} in B (group {g})"
                                 + _scheduled(key, [ha], [hb])))
    return out


def _clip_words(c: dict[str, Any]) -> str:
    args = ", ".join(f"{k} {_fmt(v)}" for k, v in (c.get("args") or {}).items())
    return f"{c.get('fn')}, {args}, at {c.get('source') or 'an unknown line'}"


def _lines(ca: dict[str, Any], cb: dict[str, Any]) -> str:
    """Where two paired clipping calls run: one line, or each side's."""
    la, lb = ca.get("source") or "?", cb.get("source") or "?"
    return f"at {lb}" if la == lb else f"at {la} in A, {lb} in B"


def _clips(a: list, b: list, named: bool) -> list[dict[str, Any]]:
    out = []
    for i, (ca, cb) in enumerate(zip_longest(a, b)):
        if ca is None or cb is None:
            side, c, other = ("B", cb, "A") if ca is None else ("A", ca, "B")
            out.append(_diff("clipping", f"clip.{i}", ca and ca.get("args"),
                             cb and cb.get("args"),
                             f"{side} clips gradients ({_clip_words(c)}); {other} does not"
                             + ("" if i == 0 else f" a {i + 1}th time"),
                             source=c.get("source", "")))
            continue
        if ca.get("fn") != cb.get("fn"):
            out.append(_diff("clipping", f"clip.{i}", ca.get("fn"), cb.get("fn"),
                             f"A clips gradients with {_clip_words(ca)}, B with "
                             f"{_clip_words(cb)}", source=cb.get("source", ""),
                             a_source=ca.get("source", "")))
            continue
        aa, ab = ca.get("args") or {}, cb.get("args") or {}
        at = _lines(ca, cb)
        for key in dict.fromkeys([*aa, *ab]):
            if aa.get(key) != ab.get(key):
                out.append(_diff("clipping", f"clip.{i}.{key}", aa.get(key), ab.get(key),
                                 f"{ca.get('fn')} {key} {_fmt(aa.get(key))} in A, "
                                 f"{_fmt(ab.get(key))} in B ({at})",
                                 source=cb.get("source", ""), a_source=ca.get("source", "")))
        na, nb = ca.get("params") or [], cb.get("params") or []
        if named and set(na) != set(nb):
            out.append(_diff("clipping", f"clip.{i}.params", len(na), len(nb),
                             f"{ca.get('fn')} clips {len(na)} parameter gradient(s) in A, "
                             f"{len(nb)} in B ({at})", source=cb.get("source", ""),
                             a_source=ca.get("source", "")))
    return out


_SCALER_SETTINGS = ("scale", "growth_factor", "backoff_factor", "growth_interval")


def _unscaled_at(c: dict[str, Any]) -> str:
    """Who unscaled the gradients, where: the user before the optimizer step (a clipping call
    after it sees unscaled gradients), or `scaler.step` itself."""
    at = c.get("source") or "an unknown line"
    return (f"scaler.unscale_ at {at}" if c.get("unscale") == "explicit" else
            f"inside scaler.step at {at}")


def _scalers(a: list, b: list, scaled_a: list, scaled_b: list) -> list[dict[str, Any]]:
    """The gradient scalers' unscale_ calls of a step, paired in order (one an optimizer);
    `scaled_a`, `scaled_b`: the lines where each run scaled its loss (the scaler's own ops
    run there, so a scaler one run alone has is that line's, `source`)."""
    out = []
    for i, (ca, cb) in enumerate(zip_longest(a, b)):
        if ca is None or cb is None:
            side, c, other = ("B", cb, "A") if ca is None else ("A", ca, "B")
            lines = scaled_b if ca is None else scaled_a
            at = f", the loss scaled at {', '.join(lines[:2])}" if lines else ""
            out.append(_diff("scaler", f"scaler.{i}", ca and ca.get("scale"),
                             cb and cb.get("scale"),
                             f"{side} scales the loss with a {c.get('class', 'GradScaler')} "
                             f"(scale {_fmt(c.get('scale'))}{at}, unscaled {_unscaled_at(c)}); "
                             f"{other} does not",
                             source=lines[0] if lines else c.get("source", ""),
                             lines=[*lines, c.get("source", "")]))
            continue
        label = ca.get("class", "GradScaler")
        for key in _SCALER_SETTINGS:
            if ca.get(key) != cb.get(key):
                out.append(_diff("scaler", f"scaler.{i}.{key}", ca.get(key), cb.get(key),
                                 f"{label} {key} {_fmt(ca.get(key))} in A, "
                                 f"{_fmt(cb.get(key))} in B"))
        if ca.get("found_inf") != cb.get("found_inf"):
            side = "B" if cb.get("found_inf") else "A"
            out.append(_diff("scaler", f"scaler.{i}.found_inf", ca.get("found_inf"),
                             cb.get("found_inf"),
                             f"{label} found Inf or NaN gradients in {side} only, so {side} "
                             f"skipped its optimizer step"))
        if ca.get("unscale") != cb.get("unscale"):
            out.append(_diff("scaler", f"scaler.{i}.unscale", ca.get("unscale"),
                             cb.get("unscale"),
                             f"gradients unscaled {_unscaled_at(ca)} in A, {_unscaled_at(cb)} "
                             f"in B (what runs between, a clipping call, sees scaled gradients "
                             f"in one run)", source=cb.get("source", ""),
                             a_source=ca.get("source", "")))
    return out


def _keyed(kind: str, what: str, a: dict, b: dict) -> list[dict[str, Any]]:
    out = []
    for key in dict.fromkeys([*a, *b]):
        if key not in a:
            out.append(_diff(kind, key, None, b[key], f"{what} {key} only in B "
                             f"({_fmt(b[key])})"))
        elif key not in b:
            out.append(_diff(kind, key, a[key], None, f"{what} {key} only in A "
                             f"({_fmt(a[key])})"))
        elif a[key] != b[key]:
            out.append(_diff(kind, key, a[key], b[key], f"{what} {key} {_fmt(a[key])} in A, "
                             f"{_fmt(b[key])} in B"))
    return out


def _modules(a: dict, b: dict) -> list[dict[str, Any]]:
    """Module attributes that differ, modules alike in one line (`eps 1e-05 in A, 0.01 in
    B at layers.*.norm (4)`)."""
    grouped: dict[tuple, list[str]] = {}
    values: dict[tuple, tuple[Any, Any]] = {}
    for module in a:
        if module not in b:
            continue
        ma, mb = a[module] or {}, b[module] or {}
        for key in dict.fromkeys([*ma, *mb]):
            if ma.get(key) != mb.get(key):
                k = (key, repr(ma.get(key)), repr(mb.get(key)))
                grouped.setdefault(k, []).append(module)
                values[k] = (ma.get(key), mb.get(key))
    out = []
    common = [m for m in a if m in b]
    for k, modules in grouped.items():
        va, vb = values[k]
        if k[0] == "training" and isinstance(va, bool) and isinstance(vb, bool):
            # `model.eval()` or `.train()` in one run: said as the mode, not the attribute
            where = ("the whole model (every module)" if len(modules) == len(common) > 1
                     else names_in_words(modules))
            mode = {True: "train", False: "eval"}
            text = (f"{where} in {mode[vb]} mode in B, {mode[va]} mode in A (module "
                    f"attribute training {va} in A, {vb} in B)")
        else:
            text = (f"module attribute {k[0]} {_fmt(va)} in A, {_fmt(vb)} in B at "
                    f"{names_in_words(modules)}")
        out.append(_diff("module", k[0], va, vb, text, modules=modules))
    return out


def _buffers(a: dict, b: dict) -> list[dict[str, Any]]:
    differ = [n for n in a if n in b and a[n] != b[n]]
    if not differ:
        return []
    shapes = [n for n in differ if list(a[n][:2]) != list(b[n][:2])]
    how = "dtype or shape" if shapes else "values"
    which = f"buffers {names_in_words(differ)} hold" if len(differ) > 1 else \
        f"buffer {differ[0]} holds"
    return [_diff("buffer", differ[0], a[differ[0]], b[differ[0]],
                  f"{which} other {how} as the step begins", buffers=differ)]


_REASONS = {"breaks": "break_reasons", "recompiles": "recompile_reasons"}


_HOW = {"compiled": "as compiled", "interpret": "through the interpreter", "eager": "eagerly"}
"""Each "compiled" mode of the dump config in words."""


def _compile(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[dict[str, Any]]:
    """How each side ran torch.compile'd code (the dump config's "compiled"), which compiled
    regions ran, and graph breaks and recompiles so far."""
    if not a and not b:
        return []
    if not a or not b:
        side, c = ("B", b) if b else ("A", a)
        how = _HOW.get(c.get("mode"), "compiled")
        return [_diff("compile", "compiled", bool(a), bool(b),
                      f"only {side} ran torch.compile'd code in the dumped step ({how})")]
    out = []
    if a.get("mode") != b.get("mode"):
        out.append(_diff("compile", "mode", a.get("mode"), b.get("mode"),
                         f"the dumped step ran torch.compile'd code "
                         f"{_HOW.get(a.get('mode'), '?')} in A, {_HOW.get(b.get('mode'), '?')} "
                         f"in B (dump config \"compiled\": \"{a.get('mode')}\" and "
                         f"\"{b.get('mode')}\")"))
    ra, rb = a.get("regions") or {}, b.get("regions") or {}
    for side, names in (("A", [r for r in ra if r not in rb]), ("B", [r for r in rb if r not in ra])):
        if names and a.get("mode") == b.get("mode"):
            out.append(_diff("compile", "regions", sorted(ra), sorted(rb),
                             f"compiled regions {names_in_words(names)} ran in {side} only"))
    for key, what in (("breaks", "graph breaks"), ("recompiles", "recompiles")):
        if (a.get(key) or 0) != (b.get(key) or 0):
            ka, kb = a.get(_REASONS[key]) or [], b.get(_REASONS[key]) or []
            why = [r for r in kb if r not in ka] or [r for r in ka if r not in kb]
            out.append(_diff("compile", key, a.get(key), b.get(key),
                             f"{what} so far: {a.get(key) or 0} in A, {b.get(key) or 0} in B"
                             + (f" ({why[0]})" if why else "")))
    return out


def differences(a: dict[str, Any], b: dict[str, Any], *, named: bool = True
                ) -> list[dict[str, Any]]:
    """What differs between two steps' setups (`read`), likeliest cause first: each a dict of
    kind (`KINDS`), key, a, b, text (in words) and, where they apply, params, modules, buffers
    or source. `named` False (two codebases, whose names differ) compares only what has no
    parameter or module name in it, and of the model configs only the keys both hold."""
    out: list[dict[str, Any]] = []
    out += _optimizers(a.get("optimizers") or [], b.get("optimizers") or [], named)
    out += _clips(a.get("clips") or [], b.get("clips") or [], named)
    if "scalers" in a and "scalers" in b:  # setups of version 2 on
        out += _scalers(a["scalers"] or [], b["scalers"] or [], a.get("scaled_at") or [],
                        b.get("scaled_at") or [])
    ma, mb = a.get("model") or {}, b.get("model") or {}
    if named:
        fa, fb = ma.get("frozen"), mb.get("frozen")
        if fa is not None and fb is not None and set(fa) != set(fb):
            for side, names in (("B", [n for n in fb if n not in fa]),
                                ("A", [n for n in fa if n not in fb])):
                if names:
                    # requires_grad on each side: the side that freezes has it False
                    out.append(_diff("frozen", "requires_grad", side == "B", side == "A",
                                     f"{side} freezes {names_in_words(names)} "
                                     f"(requires_grad False)", params=names))
        ta, tb = ma.get("tied"), mb.get("tied")
        if ta is not None and tb is not None and ta != tb:
            for side, mine, theirs in (("B", tb, ta), ("A", ta, tb)):
                for alias, owner in sorted(mine.items()):
                    if theirs.get(alias) != owner:
                        out.append(_diff("tied", f"tied.{alias}", side == "A", side == "B",
                                         f"{side} ties {alias} to {owner} (one tensor under "
                                         f"both names); {'A' if side == 'B' else 'B'} does "
                                         f"not", params=[alias, owner]))
    ca, cb = ma.get("config") or {}, mb.get("config") or {}
    if not named:
        # two codebases: a key one config class has and the other's lacks (or a port that
        # keeps its constants in code, with no config at all) is the code's shape, not a setup
        # that differs; a key both have with other values is
        ca, cb = ({k: v for k, v in c.items() if k in ca and k in cb} for c in (ca, cb))
    out += _keyed("config", "config", ca, cb)
    if named:
        out += _modules(ma.get("modules") or {}, mb.get("modules") or {})
        if "buffers" in a and "buffers" in b:
            out += _buffers(a["buffers"] or {}, b["buffers"] or {})
    out += _compile(a.get("compile"), b.get("compile"))
    out += _keyed("flag", "torch flag", a.get("flags") or {}, b.get("flags") or {})
    out += _keyed("env", "environment variable", a.get("env") or {}, b.get("env") or {})
    if "rng" in a and "rng" in b:
        ra, rb = a["rng"] or {}, b["rng"] or {}
        if ra.get("seed") != rb.get("seed"):
            out.append(_diff("rng", "seed", ra.get("seed"), rb.get("seed"),
                             f"seed {ra.get('seed')} in A, {rb.get('seed')} in B"))
    out += _keyed("version", "version of", a.get("versions") or {}, b.get("versions") or {})
    out.sort(key=lambda d: _RANK.get(d["kind"], len(KINDS)))
    return out


def _batch(a: list, b: list) -> tuple[str, str]:
    """("same" or "differs", the first difference in words) of two steps' batches (each
    top-level call of the model, the fingerprint of each tensor it was given)."""
    if len(a) != len(b):
        return "differs", f"the model is called {len(a)} time(s) in A's step, {len(b)} in B's"
    for i, (ca, cb) in enumerate(zip(a, b)):
        ia, ib = ca.get("inputs") or {}, cb.get("inputs") or {}
        for key in dict.fromkeys([*ia, *ib]):
            fa, fb = ia.get(key), ib.get(key)
            if fa is None or fb is None or list(fa) != list(fb):
                what = f"argument {key}" if key.isdigit() else key
                shown = fb or fa
                shape = "x".join(str(d) for d in shown[1]) if shown and len(shown) > 1 else ""
                how = "only in one run" if fa is None or fb is None else \
                    ("of another dtype or shape" if list(fa[:2]) != list(fb[:2]) else
                     "with other values")
                dtype = shown[0] if shown else "?"
                return "differs", (f"the model's call {i} is given {what} ({dtype}"
                                   f"{' ' + shape if shape else ''}) {how}")
    return "same", ""


def compare_inputs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """What the model was given as a step began, compared (two setups, `read`): `batch` and
    `buffers` each "same", "differs" or None (not recorded on both sides), with the first
    batch difference in words (`batch_detail`) and the buffers that differ."""
    out: dict[str, Any] = {"batch": None, "batch_detail": "", "buffers": None,
                           "buffer_names": []}
    if a is None or b is None:
        return out
    if isinstance(a.get("batch"), list) and isinstance(b.get("batch"), list) \
            and (a["batch"] or b["batch"]):
        out["batch"], out["batch_detail"] = _batch(a["batch"], b["batch"])
    if isinstance(a.get("buffers"), dict) and isinstance(b.get("buffers"), dict):
        differ = [n for n in dict.fromkeys([*a["buffers"], *b["buffers"]])
                  if a["buffers"].get(n) != b["buffers"].get(n)]
        out["buffers"] = "differs" if differ else "same"
        out["buffer_names"] = differ
    return out


def inputs_words(inputs: dict[str, Any]) -> str:
    """Which of the batch and the buffers differ as the step began (`compare_inputs`), in
    words; "" when neither was recorded on both sides."""
    batch, buffers = inputs.get("batch"), inputs.get("buffers")
    if batch == "same" and buffers == "same":
        return "the batch and the buffers are the same in both runs as the step begins"
    parts = []
    if batch == "differs":
        parts.append(f"the batch differs: {inputs['batch_detail']}")
    elif batch == "same":
        parts.append("the batch is the same in both runs")
    if buffers == "differs":
        parts.append(f"buffer(s) {names_in_words(inputs['buffer_names'])} differ as the step "
                     f"begins")
    elif buffers == "same":
        parts.append("the buffers agree as the step begins")
    return "; ".join(parts)


def numerics_differences(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of `differences`, those that can change what the step computes: all but versions,
    whose effect is the library's to say."""
    return [d for d in found if d["kind"] != "version"]


_LATE = ("optimizer", "hyperparameter", "group", "clipping", "scaler")
"""What a step's setup takes after its forward: an interrupted step may never have got there."""


def compare_setups(text_a: Any, text_b: Any, pl: tuple[int, int, int, int], *,
                   named: bool = True, interrupted: tuple[bool, bool] = (False, False)
                   ) -> dict[str, Any]:
    """One compared step pair's setups (each side's `setup` attribute as stored): its rank
    and step on each side, the `differences`, and `missing`, why a side's setup could not be
    compared (none recorded, it does not read, a part failed to be taken). `interrupted`: of
    each side, whether its step was cut short (a crash, a signal): what it takes late in the
    step (`_LATE`) is then not compared, since the step may never have reached it."""
    a, why_a = read(text_a, "A")
    b, why_b = read(text_b, "B")
    # neither side keeping one (a dump written by the writer alone) is nothing to compare
    missing = [f"{side}: {why}" for side, why in (("A", why_a), ("B", why_b))
               if why and (a is not None or b is not None or text_a or text_b)]
    for side, s in (("A", a), ("B", b)):
        missing += [f"{side}: {e}" for e in (s or {}).get("errors") or []]
    found = differences(a, b, named=named) if a is not None and b is not None else []
    cut = [side for side, was in zip("AB", interrupted) if was]
    if cut and any(d["kind"] in _LATE for d in found):
        found = [d for d in found if d["kind"] not in _LATE]
        missing.append(f"{' and '.join(cut)}: step {pl[1] if cut == ['A'] else pl[3]} was "
                       f"interrupted, so its optimizer, clipping and scaler were not compared "
                       f"(the step may never have reached them)")
    return {"rank": pl[0], "step": pl[1], "b_rank": pl[2], "b_step": pl[3],
            "differences": found, "missing": missing, "inputs": compare_inputs(a, b)}


def step_inputs(setups: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Of the compared step pairs' setups (`compare_setups`), which of the batch and the
    buffers differ as each began (`compare_inputs`), by A's (rank, step)."""
    return {(s["rank"], s["step"]): s["inputs"] for s in setups}


def first_setup(setups: list[dict[str, Any]], notes: list[str]) -> dict[str, Any] | None:
    """Of the compared step pairs' setups (`compare_setups`, in plan order), the earliest step
    pair whose setups differ, or None; a side whose setup could not be compared is said in
    `notes`."""
    missing = sorted({m for s in setups for m in s["missing"]})
    if missing:
        notes.append("the setup around the model (optimizer, clipping, config, buffers, flags) "
                     "was not compared for every step: " + "; ".join(missing[:3]))
    first: dict[int, int] = {}
    for s in setups:
        first[s["rank"]] = min(first.get(s["rank"], s["step"]), s["step"])
    found = []
    for s in setups:
        if s["step"] != first[s["rank"]]:
            # buffers as a later step begins are what the steps before made of them (running
            # statistics trained, or rounded otherwise): the records of those steps say where
            # the runs parted; only the first step's buffers are the run's setup
            s = {**s, "differences": [d for d in s["differences"] if d.get("kind") != "buffer"]}
        if s["differences"]:
            found.append(s)
    return min(found, key=lambda s: (s["step"], s["rank"])) if found else None


# which setup differences can make a first divergence of each kind, likeliest first
_OPTIMIZER_KINDS = ("hyperparameter", "optimizer", "group", "clipping", "scaler", "frozen")
_MAKES = {
    # the optimizer's gradient records: clipping (and unscaling) edits them before the step
    "grad": ("clipping", "scaler", "frozen", "hyperparameter", "optimizer", "group"),
    "update": _OPTIMIZER_KINDS,
    # the model's input: how it was drawn or built
    "data": ("rng", "config", "buffer"),
    # the weights as a step begins: the steps before it (their optimizer), or the initial ones
    "parameter": (*_OPTIMIZER_KINDS, "tied", "rng", "config", "module"),
    # a forward or backward op: the model's constants and state, the numerics switches
    # (a scaler's other scale multiplies the loss the backward begins from)
    "compute": ("tied", "config", "module", "buffer", "frozen", "rng", "flag", "env", "scaler"),
}


def setup_of(changes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The setup change of a diff's `changes` (kind "setup"), or None."""
    return next((c for c in changes if c.get("kind") == "setup"), None)


_PATHS = ("frozen", "tied", "config", "module", "optimizer", "group", "scaler")
"""Setup differences that change which ops a step runs (a frozen weight has no gradient to
compute, a config or a module's constant picks a code path), likeliest first."""
_CODE_PATH = {
    "frozen": "a frozen weight has no gradient, so the backward and what reads the gradients "
              "run other ops",
    "tied": "the tied names read one tensor where the other run has two",
    "config": "the model takes another code path"}
"""Setup differences that stand for ops run otherwise (a structural fault) wherever the
records name it, likeliest first, with how they make it (a frozen weight only where `_relevant`
keeps it: in or after the backward)."""
_STRUCTURAL = ("added", "removed", "replaced", "swapped", "argument", "passed")
"""Faults explain names where the two runs ran other ops, or passed other values."""


def _relevant(found: list[dict[str, Any]], fd: dict[str, Any], structural: bool = False,
              after_backward: bool = False) -> list[dict[str, Any]]:
    """The differences that can make first divergence `fd`, likeliest first; `structural`:
    the records say the runs ran other ops there; `after_backward`: `fd` is in or after its
    step's backward, where a frozen weight runs fewer ops."""
    if fd["phase"] == "optimizer":
        kinds = _MAKES["grad" if fd.get("direction") == "grad" else "update"]
        if fd.get("direction") == "param":
            kinds = _MAKES["parameter"]
    else:
        kinds = _MAKES["data" if fd.get("kind") == "data" else "compute"]
        if int(fd.get("step") or 0) > 0 or int(fd.get("b_step") or 0) > 0:
            # the weights of a later step are what the optimizer made of the earlier ones
            kinds = (*kinds, *_OPTIMIZER_KINDS)
    if fd.get("kind") == "parameter" and not (int(fd.get("step") or 0) > 0
                                              or int(fd.get("b_step") or 0) > 0):
        # weights that differ as step 0 ends were made before any optimizer step
        kinds = tuple(k for k in kinds if k not in _OPTIMIZER_KINDS)
    if structural:
        # ops one run runs and the other does not: a config or a module's constant picks the
        # code path (an activation, a dropout); a flag, a seed or a hyperparameter does not
        # (a scaler in one run only adds its scaling and unscaling ops)
        kinds = tuple(k for k in kinds if k in ("tied", "config", "module", "scaler")
                      or (k == "frozen" and after_backward))
    rank = {k: i for i, k in enumerate(kinds)}
    return sorted((d for d in found if d["kind"] in rank), key=lambda d: rank[d["kind"]])


def can_make(change: dict[str, Any] | None, fd: dict[str, Any] | None) -> bool:
    """Whether a setup difference of `change` (a diff's setup change) can make first
    divergence `fd` (an optimizer hyperparameter an update, a module's constant an op)."""
    if change is None or fd is None:
        return False
    return bool(_relevant(numerics_differences(change["differences"]), fd))


def _words(found: list[dict[str, Any]], most: int = 3) -> str:
    text = "; ".join(d["text"] for d in found[:most])
    return text + (f"; and {len(found) - most} more (see `sleuth diff`)"
                   if len(found) > most else "")


def _held_by(found: list[dict[str, Any]], module: str | None) -> list[dict[str, Any]]:
    """The module-attribute differences of `module` or a module above it."""
    if not module:
        return []
    return [d for d in found if d["kind"] == "module" and any(
        module == m or module.startswith(m + ".") for m in d.get("modules") or [])]


def with_setup(found: Any, change: dict[str, Any] | None, replayed: str = "",
               after_backward: bool = False, updates: str = "") -> Any:
    """An explain verdict (`Explanation`) with the runs' setup differences (`change`, a diff's
    setup change) taken into account: where the records alone say the inputs differ, or
    cannot tell, or the first divergence is the optimizer's, and a setup difference can make
    that divergence, the verdict is "setup", naming it; a bug or precision verdict keeps its
    word and says the setup differs too. `replayed`: an optimizer update re-run with B's
    hyperparameters (tracer.analysis._optimizer_replay), in words, said after the verdict;
    `after_backward`: the first divergence is in or after its step's backward; `updates`: how
    the step's optimizer updates compare, in words, said after a scaler's verdict."""
    if change is None:
        return found
    every = numerics_differences(change["differences"])
    fd = found.first_divergence
    if not every:
        return found
    if fd is None:
        paths = [d for d in every if d["kind"] in _PATHS] if found.status == "bug" else []
        if paths:
            # no record both runs made differs; what one run alone computes (a frozen weight's
            # gradient, its optimizer's step) is what that setup has it run
            paths.sort(key=lambda d: _PATHS.index(d["kind"]))
            why = (found.blamed or {}).get("why") or found.verdict
            verdict = (f"setup: the runs were set up differently: {_words(paths)}. No record "
                       f"both runs made differs; what one run computes and the other does not "
                       f"follows from it ({why})")
            return dataclasses.replace(found, status="setup", verdict=verdict,
                                       setup=[*paths, *[d for d in every if d not in paths]])
        found.notes.insert(0, f"the runs were set up differently, yet every record compared "
                              f"agrees: {_words(every)}")
        return dataclasses.replace(found, setup=every)
    blamed = found.blamed or {}
    sites = {blamed.get("source"), blamed.get("caller"), fd.get("source")} - {None, ""}
    at_line = [d for d in every if {d.get("source"), d.get("a_source")} & sites
               and found.status in ("bug", "unexplained")]
    if at_line and all(d["kind"] == "scaler" for d in at_line):
        # the loss a scaler scales: its own ops (a scale factor filled, a multiply) run at
        # that line, and every gradient of the backward is scaled with it: no bug of B's
        verdict = (f"setup: the runs were set up differently: {_words(at_line)}. The first "
                   f"divergence, {fd['name']} (step {fd['step']}), is the loss it scales: the "
                   f"scaler's own ops run at that line, and the backward's gradients are scaled "
                   f"with it" + (f"; {updates}" if updates else ""))
        return dataclasses.replace(found, status="setup", verdict=verdict, blamed=None,
                                   setup=[*at_line, *[d for d in every if d not in at_line]])
    if at_line:
        # the op blamed is the setup's own call (a clipping call with other arguments)
        verdict = (f"setup: the runs were set up differently: {_words(at_line)}. The first "
                   f"divergence, {fd['name']} (step {fd['step']}), is made at that line"
                   + (f": {found.verdict}" if found.blamed else ""))
        return dataclasses.replace(found, status="setup", verdict=verdict,
                                   setup=[*at_line, *[d for d in every if d not in at_line]])
    if (change["step"], change["b_step"]) > (fd.get("step"), fd.get("b_step")):
        # the setups first differ at a later step: what the step that diverged first left
        # behind (a buffer it wrote), no cause of it
        found.notes.insert(0, f"the runs' setups differ from step {change['step']} on: "
                              f"{_words(every)}")
        return dataclasses.replace(found, setup=every)
    if fd.get("step") != fd.get("b_step"):
        # two steps of a run: what changed between them (a learning rate the scheduler
        # moved) is expected, and the records' verdict stands
        found.notes.insert(0, f"the two steps were set up differently: {_words(every)}")
        return dataclasses.replace(found, setup=every)
    ranked = _relevant(every, fd, blamed.get("fault") in _STRUCTURAL, after_backward)
    paths = sorted((d for d in ranked if d["kind"] in _CODE_PATH), key=lambda d:
                   list(_CODE_PATH).index(d["kind"])) if found.status == "bug" else []
    if paths and blamed.get("fault") in _STRUCTURAL:
        # the setup picks which ops run (a frozen weight has no gradient; a config picks an
        # attention kernel or an activation; tied weights are one tensor): other ops, or
        # values passed otherwise, follow from it, wherever the records first part
        verdict = (f"setup: the runs were set up differently: {_words(paths)}. The first "
                   f"divergence, {fd['name']} (step {fd['step']}), follows from it: "
                   f"{_CODE_PATH[paths[0]['kind']]} (the records alone: {found.verdict}); "
                   f"compare runs set up alike to look for a bug besides")
        return dataclasses.replace(found, status="setup", verdict=verdict,
                                   setup=[*paths, *[d for d in ranked if d not in paths]])
    held = _held_by(ranked, blamed.get("module")) if found.status == "bug" else []
    if held:
        # the op blamed runs in a module whose constants differ (an epsilon, a dropout
        # probability): the op and its line stay the verdict, the constant says where it
        # was set
        ranked = [*held, *[d for d in ranked if d not in held]]
        verdict = (f"{found.verdict}; {found.blamed['module']} was set up with other "
                   f"constants: {_words(held)}")
        return dataclasses.replace(found, verdict=verdict, setup=ranked)
    if ranked and (found.status in ("inputs", "unexplained") or fd["phase"] == "optimizer"):
        direction = fd.get("direction")
        if fd["phase"] == "optimizer" and direction in ("grad", "update"):
            follows = (f"is the optimizer step's {'gradient' if direction == 'grad' else 'update'}"
                       ", which these settings make (the forward and backward agree before "
                       "it)" if found.status != "bug" or direction == "update" else
                       f"is the optimizer step's gradient: {found.verdict}")
        else:
            follows = f"follows from it (the records alone: {found.verdict})"
        verdict = (f"setup: the runs were set up differently: "
                   f"{_words(ranked)}. The first divergence, {fd['name']} (step {fd['step']}), "
                   f"{follows}" + (f"; {replayed}" if replayed else ""))
        return dataclasses.replace(found, status="setup", verdict=verdict, setup=ranked,
                                   blamed=None)
    found.notes.insert(0, f"the runs were also set up differently: {_words(ranked or every)}")
    return dataclasses.replace(found, setup=ranked or every)
