"""The module map of two codebases as data and as the editable YAML file `sleuth map` writes.

`ModuleMap` holds which module of dump B is which module of dump A, how sure each pair is,
which pairs were picked among equally good candidates, and what paired nothing
(tracer.analysis._map makes it). The file is the user's: they read the evidence beside each
pair, correct it, and `sleuth diff --map FILE` reads it as written. Two rules keep an edited
file authoritative over anything generated:

- the file carries a digest of its own text, so `sleuth map -o FILE` can tell a file it wrote
  from one a person has edited since, and refuses to overwrite the edits;
- `sleuth map --keep FILE` (`map_modules(keep=...)`) keeps every decision the file makes (its
  pairs, fused groups and the modules it lists as unpaired) and pairs only the modules it does
  not name.

A diff through a map (`diff(module_map=...)`) judges the records the map vouches for
(`vouched`: the first input and output of paired modules, the parameters' records); what else
pairs across two codebases pairs by position among a module's records, and is set aside as not
compared when it differs (`set_aside`).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tracer._errors import ConfigError
from tracer.analysis._fused import group_name

Confidence = Literal["given", "high", "medium", "low"]
"""How sure a pair is. `high`: two kinds of evidence agree: parameters that no other module
holds alike, or a forward input and output that both compare the same at a place in the module
tree that agrees with the pairs around it. `medium`: one kind: the place in the tree alone
(values that differ after a port's bug, or an output without an input to compare), or values
that compare the same at a place in the tree that differs. `low`: picked among equally good
candidates by execution order (listed in `ambiguous`), or an output alone. `given`: taken as
written from a map file."""

_DIGEST = "# digest: "
_KEPT = "# keeps the decisions of "


@dataclass
class ModuleMap:
    """Modules of dump A paired with modules of dump B, and those that paired nothing."""

    pairs: list[tuple[str, str, str]] = field(default_factory=list)
    """(A module, B module, why they pair), in A's execution order."""
    confidence: dict[str, Confidence] = field(default_factory=dict)
    """A module of `pairs` -> how sure its pair is."""
    ambiguous: list[tuple[str, list[str], str]] = field(default_factory=list)
    """(A module, the B modules that fit it as well as the one paired, why): pairs picked by
    execution order among equal candidates, the lines of the file to check first."""
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    permuted: list[str] = field(default_factory=list)
    """A's parameters that B holds with the same values in another layout (a weight stored
    transposed): the diff compares their records by statistics, which do not see order."""
    fused: list[tuple[list[str], list[str], str]] = field(default_factory=list)
    """([A modules], [B modules], why): one module of one side holding what several modules
    of the other hold, concatenated (a fused qkv projection against q, k and v;
    tracer.analysis._fused). The diff compares the one with the others combined."""
    a: str = ""
    b: str = ""
    kept: str = ""
    """The map file whose decisions this map keeps (`sleuth map --keep`), "" when none."""

    def b_to_a(self) -> dict[str, str]:
        """B module -> A module, what `diff(module_map=...)` takes; the parts of a fused group
        go by the whole's name (B's parts: A's module; A's parts: their group's name)."""
        out = {b: a for a, b, _ in self.pairs}
        for mods_a, mods_b, _ in self.fused:
            for m in mods_b:
                out[m] = mods_a[0] if len(mods_a) == 1 else group_name(mods_a)
        return out

    def fused_parts(self, side: str) -> dict[str, list[str]]:
        """The groups whose parts are on `side` ("a" or "b"): whole's name -> part modules,
        what `combine` takes for that side's table."""
        if side == "b":
            return {a[0]: b for a, b, _ in self.fused if len(a) == 1 and len(b) > 1}
        return {group_name(a): a for a, b, _ in self.fused if len(b) == 1 and len(a) > 1}

    def to_yaml(self) -> str:
        """The editable mapping file (`read_module_map` reads it back), ending with the digest
        of its text that `edited` checks."""
        def q(text: str) -> str:
            return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

        lines = [f"# sleuth map {self.a} {self.b}",
                 "# modules: A's module -> B's module, how sure the pair is (high, medium, low)",
                 "# and why. Edit freely: change a B name, add a pair, or delete a line to leave",
                 "# a module unpaired; then `sleuth diff --map FILE A B`. `sleuth map --keep FILE",
                 "# A B` keeps every pair and list entry here as written and pairs only the",
                 "# modules this file does not name.",
                 *([f"{_KEPT}{self.kept}"] if self.kept else []),
                 f"a: {q(self.a)}", f"b: {q(self.b)}",
                 "modules:" + ("" if self.pairs else " {}")]
        lines += [f"  {q(a)}: {q(b)}  # {self.confidence.get(a, 'given')}: {why}"
                  for a, b, why in self.pairs]
        lines.append("# pairs picked by execution order among B modules that fit as well: "
                     "check these first")
        lines.append("ambiguous:" + ("" if self.ambiguous else " []"))
        for a, others, why in self.ambiguous:
            lines += [f"  - a: {q(a)}", f"    b: [{', '.join(map(q, others))}]  # {why}"]
        lines.append("# one module of one side holding several of the other's, concatenated "
                     "(a fused qkv)")
        lines.append("fused:" + ("" if self.fused else " []"))
        for mods_a, mods_b, why in self.fused:
            lines += [f"  - a: [{', '.join(map(q, mods_a))}]",
                      f"    b: [{', '.join(map(q, mods_b))}]  # {why}"]
        lines.append("# A's parameters that B stores in another layout (transposed): compared by "
                     "statistics")
        for key, names in (("permuted", self.permuted), ("only_a", self.only_a),
                           ("only_b", self.only_b)):
            lines.append(f"{key}:" + ("" if names else " []"))
            lines += [f"  - {q(n)}" for n in names]
        text = "\n".join(lines) + "\n"
        return text + _DIGEST + _digest(text) + "\n"


    def save(self, path: str | os.PathLike) -> None:
        """Write the map file to `path`. ConfigError when `path` holds a map a person edited
        (`edited`) that this map did not keep (`kept`): their decisions are never overwritten
        by a generated map."""
        if edited(path) and not (self.kept and os.path.abspath(self.kept) ==
                                 os.path.abspath(path)):
            raise ConfigError(f"{path} holds a map edited by hand (changed since `sleuth map` "
                              f"wrote it, or written around such a map with --keep): "
                              f"`sleuth map --keep {path} -o {path} A B` maps around your "
                              f"edits; to start afresh, remove the file first")
        Path(path).write_text(self.to_yaml(), encoding="utf-8")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def edited(path: str | os.PathLike) -> bool:
    """Whether the map file at `path` holds decisions a person made: it was changed since
    `sleuth map` wrote it (its digest line no longer matches its text, or it has none), or
    `sleuth map --keep` wrote it around an edited file. False when there is no such file."""
    from tracer.storage import JsonLimitError, read_text_bounded

    if not os.path.lexists(path):
        return False
    try:
        text = read_text_bounded(path)  # a FIFO or a device is never read (nor overwritten)
    except JsonLimitError:
        return True  # unreadable, or not a regular file: never overwritten unasked
    body, _, last = text.rstrip("\n").rpartition("\n")
    return not (last.startswith(_DIGEST) and last[len(_DIGEST):] == _digest(body + "\n")) \
        or f"\n{_KEPT}" in body


def read_module_map(path: str | os.PathLike, flag: str = "--map") -> ModuleMap:
    """The module map in a file `sleuth map` wrote (and the user edited): every pair
    confidence `given`. ConfigError naming the file (as the option `flag` that gave it) and
    the problem when it is not one."""
    import yaml

    from tracer.storage import JsonLimitError, read_text_bounded

    try:
        # bounded, and only a regular file: a FIFO or `/dev/zero` is refused, not read forever
        data = yaml.safe_load(read_text_bounded(path))
    except JsonLimitError as e:
        cause = e.__cause__
        why = (f"cannot read it ({cause.strerror or cause})" if isinstance(cause, OSError)
               else str(e).removeprefix(f"{path}: ").split(";")[0])
        raise ConfigError(f"{flag} {path}: {why}; write one with `sleuth map A B > {path}`") \
            from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {path}: not YAML ({e}); `sleuth map A B` writes one") from e
    modules = data.get("modules") if isinstance(data, dict) else None
    if modules is None and isinstance(data, dict) and "modules" in data:
        modules = {}  # "modules:" with no pair under it
    if not isinstance(modules, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in modules.items()):
        raise ConfigError(f"{flag} {path}: expected a `modules:` mapping of A module names to B "
                          f"module names (\"a.name\": \"b.name\"), as `sleuth map A B` writes")
    seen: dict[str, str] = {}
    for a, b in modules.items():
        if b in seen:
            raise ConfigError(f"{flag} {path}: B module {b!r} is paired with both "
                              f"{seen[b]!r} and {a!r}; keep one")
        seen[b] = a
    fused = []
    for i, entry in enumerate(data.get("fused") or []):
        sides = [entry.get(k) if isinstance(entry, dict) else None for k in ("a", "b")]
        if not all(isinstance(v, list) and v and all(isinstance(x, str) for x in v)
                   for v in sides) or sorted(map(len, sides))[0] != 1 or \
                max(map(len, sides)) < 2:
            raise ConfigError(f"{flag} {path}: fused[{i}] must name one module on one side and "
                              f"its parts on the other: {{a: [\"whole\"], b: [\"part1\", "
                              f"\"part2\"]}}")
        fused.append((sides[0], sides[1], f"from {path}"))
    ambiguous = []
    for i, entry in enumerate(data.get("ambiguous") or []):
        a, others = (entry.get("a"), entry.get("b")) if isinstance(entry, dict) else (None, None)
        if not isinstance(a, str) or not isinstance(others, list) or \
                not all(isinstance(x, str) for x in others):
            raise ConfigError(f"{flag} {path}: ambiguous[{i}] must name an A module and a list "
                              f"of B modules: {{a: \"a.name\", b: [\"b.one\", \"b.two\"]}}, or "
                              f"delete the entry")
        ambiguous.append((a, others, f"from {path}"))
    lists = {}
    for key in ("permuted", "only_a", "only_b"):
        value = data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{flag} {path}: `{key}:` must be a list of names")
        lists[key] = value
    return ModuleMap(pairs=[(a, b, f"from {path}") for a, b in modules.items()],
                     confidence={a: "given" for a in modules}, ambiguous=ambiguous,
                     fused=fused, a=str(data.get("a", "")), b=str(data.get("b", "")), **lists)


UNVOUCHED_NOTE = (
    "two codebases: a map vouches for the inputs and outputs of paired modules (the first of "
    "each) and for their parameters; the other records (ops inside a module, further inputs "
    "and outputs) pair by their position among their module's records, and two codebases "
    "run different ops there, so a pair of those that differs is listed as not compared "
    "(verdict only_a, reason 'not compared'), not as a divergence")


def vouched(rec: dict, same_ops: frozenset[str] = frozenset()) -> bool:
    """Whether a map vouches for what `rec` (a /records row) is: a module's first input or
    output, a parameter's record (value, gradient, update), or an op's output in a module that
    runs the same ops in the same order in both codebases (`same_ops`, see `same_op_modules`).
    What else pairs across two codebases pairs by position: the ops a module runs, the order of
    an op's inputs (`x + attn` against `attn + x`) and of a module's further inputs (Llama's
    decoder layer takes the mask second, a port the rotary tables) differ."""
    if rec["phase"] == "optimizer" or (rec["op"] == "" and int(rec["index"]) == 0):
        return True
    return bool(rec["op"]) and rec["direction"] == "output" and rec["module"] in same_ops


def same_op_modules(ta: Any, tb: Any) -> frozenset[str]:
    """The modules whose op records run the same ops, phases and output counts in the same
    order in both tables (B's modules already read as A's through the map)."""
    def sequences(t: Any) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        ops = t[(t["op"] != "") & (t["direction"] == "output")].sort_values("seq", kind="stable")
        for module, op, phase, index in zip(ops["module"], ops["op"], ops["phase"], ops["index"]):
            out.setdefault(str(module), []).append((op, phase, int(index)))
        return out

    sa, sb = sequences(ta), sequences(tb)
    return frozenset(m for m, keys in sa.items() if sb.get(m) == keys)


def unmatched_pair(row: dict, rec: dict, paired: set[str]) -> bool:
    """Turn a one-sided row into a divergence where the map vouches for its record (`vouched`)
    and pairs its module (`paired`: the modules both runs have, read through the map): the
    two modules' inputs or outputs differ in size, so the pair, or one run's module, is not
    what the other is. Left one-sided, it would count as no divergence and the diff say
    "same". True when the row was turned."""
    if rec["phase"] == "optimizer" or rec["op"] or not vouched(rec) \
            or rec["module"] not in paired:
        return False
    other = "B" if row["verdict"] == "only_a" else "A"
    row.update(verdict="diverged",
               reason=f"the map pairs module {rec['module']}, but {other} has no record "
                      f"matching this one in size: the pair, or one run's module, is not "
                      f"what the other run's is")
    return True


def set_aside(row: dict) -> None:
    """Turn a divergent pair the map does not vouch for into a pair not compared."""
    row.update(verdict="only_a", reason=f"not compared: inside modules of two codebases, "
                                        f"paired by position only ({row['reason']})")
