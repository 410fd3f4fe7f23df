"""Every Dash callback of the app fuzzed with values a browser never sends but any client can:
None, lists, nested objects, huge and negative integers, floats (NaN included), bools, long
strings, control characters and lone surrogates, in place of each input and state, next to
plausible values so that the callback reaches its readers. A callback is an HTTP endpoint; the
property: its answer is 2xx (204 when it changes nothing), never a 5xx, and no answer holds a
traceback (dashboard._values reads a value no control sends as no value).

The callbacks are those the app registers (`app.callback_map`), so a new one is fuzzed without
a word here; it only needs a plausible value for each new control in `plausible`. A small seeded
budget runs in the quick lane; `slow` runs many more, a fresh draw each time."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dashboard_helpers import write_run, write_tool_data  # noqa: E402

_KEYS = st.sampled_from(["points", "x", "y", "row_id", "row", "column_id", "direction", "id",
                         "name", "rank", "step", "xaxis.range", "xaxis.range[0]",
                         "xaxis.range[1]", "xaxis.autorange", "xaxis2.range[0]", ""])
_ODD_TEXT = st.sampled_from(["", "0", "1", "1.5", "-1", "nan", "inf", "1e999", "True", "\u00b9",
                             "\u0661", "0|", "|", "0|x|y", "x" * 100_000, "9" * 5000,
                             "\x00\x1b[31m\x07\r\n", "\udcff", "../../etc/passwd", "{max} > 0",
                             "step", "wall_time", "log", "loss"])
def _nested(depth: int) -> list:
    out: list = [0]
    for _ in range(depth):
        out = [out]
    return out


SCALAR = st.one_of(st.none(), st.booleans(),
                   st.integers(min_value=-2**70, max_value=2**70),
                   st.sampled_from([2**31, 2**63, -2**63, 10**30, 0, 1, -1]),
                   st.floats(allow_nan=True, allow_infinity=True), _ODD_TEXT,
                   st.text(max_size=12))
HOSTILE = st.one_of(
    SCALAR,
    st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(_KEYS | st.text(max_size=6), inner, max_size=3), max_leaves=8),
    st.just(_nested(200)),
    st.just(list(range(5000))))


def near(good: Any) -> st.SearchStrategy:
    """`good` with some of its parts hostile: an object's values, a list's items, a scalar."""
    if isinstance(good, dict):
        return st.fixed_dictionaries({k: st.one_of(st.just(v), near(v)) for k, v in good.items()})
    if isinstance(good, list) and good:
        return st.lists(st.one_of(*(near(v) for v in good)), min_size=1, max_size=3)
    return HOSTILE


@pytest.fixture(scope="module")
def app_and_values(tmp_path_factory):
    """An app over two runs with every kind of data (metrics, dump, summary, profile, graphs),
    and a plausible value for each control its callbacks read."""
    pytest.importorskip("tracer")
    import dashboard
    from dashboard import _data

    base = tmp_path_factory.mktemp("fuzz")
    a = write_run(base / "a", name="a", steps=20)
    done = write_tool_data(a, steps=2)
    b = Path(shutil.copytree(a, base / "b"))
    app = dashboard.create_app([a, b], refresh_s=0)
    name = str(_data.dump_stats(a, 0, 0)["name"].iloc[0]) if done.get("dump") == "ok" else "x"
    try:
        hist = _data.histograms(a)
        tag = f"{int(hist['rank'].iloc[0])}|{hist['tag'].iloc[0]}"
    except _data.NoData:
        tag = "0|x"
    plausible = {
        "url.pathname": "/dumps", "url.search": "?run=0&rank=0&step=0", "refresh.n_intervals": 1,
        "data-version.data": "v",
        "scalars-runs.value": [0, 1], "scalars-tags.value": ["loss", "lr"],
        "scalars-smoothing.value": 0.5, "scalars-x.value": "wall_time", "scalars-log.value": ["log"],
        "scalars-graph.relayoutData": {"xaxis.range[0]": 2, "xaxis.range[1]": 9},
        "scalars-drawn.data": None,
        "hist-run.value": 0, "hist-tag.value": tag,
        "profile-run.value": 0, "profile-b.value": 1,
        "dumps-run.value": 0, "dumps-rank.value": 0, "dumps-step.value": 0,
        "dumps-want.data": {"rank": "0", "step": "0"},
        "dumps-table.page_current": 0, "dumps-table.page_size": 25,
        "dumps-table.sort_by": [{"column_id": "max", "direction": "desc"}],
        "dumps-table.filter_query": "{max} > 0",
        "dumps-table.active_cell": {"row": 0, "column": 1, "column_id": "name", "row_id": 0},
        "dumps-table.data": [{"id": 0, "seq": 0, "name": name}],
        "diff-a.value": 0, "diff-b.value": 1, "diff-rank.value": 0, "diff-step.value": 0,
        "diff-b-rank.value": None, "diff-b-step.value": 1,
        "diff-rank-grid.clickData": {"points": [{"x": 1, "y": 0, "z": 1}]},
        "diff-explain-btn.n_clicks": 1,
        "graph-run.value": 0, "graph-stage.value": 0, "graph-want.data": "0",
        "graph-search.value": "linear",
    }
    return app, plausible


def _slots(spec: dict) -> list[tuple[str, dict]]:
    return [("inputs", i) for i in spec["inputs"]] + [("state", s) for s in spec["state"]]


def _key(slot: dict) -> str:
    return f"{slot['id']}.{slot['property']}"


def _post_one(client: Any, name: str, spec: dict, values: dict[str, Any],
              changed: list[str]) -> tuple[int, str]:
    """POST callback `name` as the renderer does, with `values` by "id.prop"."""
    # "..a.x...b.y.." for several outputs; an allow_duplicate output keeps its "@hash" suffix
    outs = [dict(zip(("id", "property"), part.split(".", 1)))
            for part in name.strip(".").split("...")]
    body = {"output": name, "outputs": outs[0] if len(outs) == 1 else outs,
            "changedPropIds": changed, "inputs": [], "state": []}
    for kind, slot in _slots(spec):
        body[kind].append({"id": slot["id"], "property": slot["property"],
                           "value": values[_key(slot)]})
    resp = client.post("/_dash-update-component", data=json.dumps(body),
                       content_type="application/json")
    try:
        return resp.status_code, resp.get_data().decode("utf-8", "replace")
    finally:
        resp.close()


_drawn: dict[str, st.SearchStrategy] = {}
"""Each control's strategy, built once (building `near` anew each draw is most of the cost)."""


def _fuzz_every_callback(app: Any, plausible: dict[str, Any], data: Any) -> None:
    client = app.server.test_client()
    for name, spec in sorted(app.callback_map.items()):
        slots = _slots(spec)
        values = {}
        for _, slot in slots:
            key = _key(slot)
            if key not in _drawn:
                good = plausible[key]
                _drawn[key] = st.one_of(st.just(good), near(good), HOSTILE)
            values[key] = data.draw(_drawn[key], label=key)
        inputs = [_key(s) for kind, s in slots if kind == "inputs"]
        changed = data.draw(st.lists(st.sampled_from(inputs), min_size=1, unique=True),
                            label=f"{name} fired by")
        status, text = _post_one(client, name, spec, values, changed)
        assert status < 500, f"{name}: HTTP {status} for {values!r:.2000}"
        assert "Traceback" not in text, f"{name}: a traceback for {values!r:.2000}"


def test_every_callback_has_a_plausible_value_for_each_control(app_and_values):
    app, plausible = app_and_values
    missing = {_key(s) for spec in app.callback_map.values() for _, s in _slots(spec)} - set(plausible)
    assert not missing, f"add a plausible value for {sorted(missing)} to app_and_values"


_SETTINGS = dict(deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@settings(max_examples=4, derandomize=True, **_SETTINGS)
@given(data=st.data())
def test_callbacks_answer_hostile_values_without_a_server_error(app_and_values, data):
    """A seeded handful: every callback posted four times with drawn values."""
    _fuzz_every_callback(*app_and_values, data)


@pytest.mark.slow
@settings(max_examples=50, derandomize=False, **_SETTINGS)  # the suite's time bound
@given(data=st.data())
def test_callbacks_answer_hostile_values_without_a_server_error_many(app_and_values, data):
    """Many more draws, fresh each run (a failure prints its seed and blob)."""
    _fuzz_every_callback(*app_and_values, data)


def _body(name: str, spec: dict, values: dict[str, Any]) -> dict:
    """A well-formed callback request of callback `name` with `values` by "id.prop"."""
    outs = [dict(zip(("id", "property"), part.split(".", 1)))
            for part in name.strip(".").split("...")]
    body = {"output": name, "outputs": outs[0] if len(outs) == 1 else outs,
            "changedPropIds": [_key(spec["inputs"][0])], "inputs": [], "state": []}
    for kind, slot in _slots(spec):
        body[kind].append({"id": slot["id"], "property": slot["property"],
                           "value": values[_key(slot)]})
    return body


_FIELDS = st.sampled_from(["output", "outputs", "inputs", "state", "changedPropIds"])


@settings(max_examples=15, derandomize=True, **_SETTINGS)
@given(data=st.data())
def test_a_malformed_callback_request_is_a_400_never_a_server_error(app_and_values, data):
    """The request's shape, not its values: a field dropped, replaced by any JSON, an entry of
    a list replaced, or a body that is no object. Dash answers each with a server error (and a
    traceback in the log); the dashboard answers 400 naming what is wrong."""
    app, plausible = app_and_values
    name = data.draw(st.sampled_from(sorted(app.callback_map)), label="callback")
    spec = app.callback_map[name]
    body: Any = _body(name, spec, {_key(s): plausible[_key(s)] for _, s in _slots(spec)})
    how = data.draw(st.sampled_from(["drop", "replace", "entry", "whole"]), label="how")
    field = data.draw(_FIELDS, label="field")
    if how == "drop":
        body.pop(field, None)
    elif how == "replace":
        body[field] = data.draw(HOSTILE, label="value")
    elif how == "entry" and isinstance(body[field], list) and body[field]:
        body[field][data.draw(st.integers(0, len(body[field]) - 1))] = data.draw(HOSTILE)
    elif how == "whole":
        body = data.draw(HOSTILE, label="body")
    resp = app.server.test_client().post("/_dash-update-component", data=json.dumps(body),
                                         content_type="application/json")
    try:
        assert resp.status_code < 500, (resp.status_code, body)
        assert "Traceback" not in resp.get_data().decode("utf-8", "replace")
    finally:
        resp.close()


def _answer(app: Any, plausible: dict[str, Any], output: str,
            overrides: dict[str, Any]) -> tuple[int, str]:
    """The callback whose first output is `output` ("id.prop") posted with the plausible values
    but `overrides` (by "id.prop"), fired by its first input."""
    name, spec = next((n, s) for n, s in app.callback_map.items()
                      if n.strip(".").split("...")[0].split("@")[0] == output)
    values = {_key(s): plausible[_key(s)] for _, s in _slots(spec)}
    values.update(overrides)
    return _post_one(app.server.test_client(), name, spec, values, [_key(spec["inputs"][0])])


@pytest.mark.parametrize("output, overrides, shown", [
    ("dumps-table.data", {"dumps-step.value": [0]}, '"dumps-table":{"data":[]'),
    ("dumps-table.data", {"dumps-rank.value": {"a": 1}}, '"dumps-table":{"data":[]'),
    ("dumps-detail.children", {"dumps-table.active_cell": "x"}, '"dumps-detail":{"children":null}'),
    ("dumps-detail.children", {"dumps-table.active_cell": {"row_id": [1]}}, '"dumps-detail":{"children":null}'),
    ("dumps-detail.children", {"dumps-table.data": [{"id": 0}]}, '"dumps-detail":{"children":null}'),
    ("diff-explain.children", {"diff-rank.value": "x"}, "rank: 'x' is not one: type a whole number"),
    ("diff-body.children", {"diff-step.value": 1.5}, "step: 1.5 is not one: type a whole number"),
    ("diff-body.children", {"diff-b-rank.value": -1}, "rank B: -1 is not one"),
    ("diff-rank.value", {"diff-rank-grid.clickData": {"points": [{"x": "a", "y": None}]}}, None),
    ("diff-rank.value", {"diff-rank-grid.clickData": [0]}, None),
    ("hist-graph.figure", {"hist-tag.value": 7}, "no histogram chosen"),
    ("hist-graph.figure", {"hist-tag.value": "9" * 5000 + "|x"}, "no histogram chosen"),
    ("graph-body.children", {"graph-stage.value": [0]}, "choose a graph"),
    ("graph-stage.options", {"graph-stage.value": "0" * 5000}, '"graph-stage":{"options":[{'),
    ("scalars-tags.options", {"scalars-runs.value": [1.5]}, "choose a run"),
    ("scalars-tags.options", {"scalars-runs.value": [True]}, "choose a run"),
    ("scalars-tags.options", {"scalars-tags.value": 2**70}, '"value":["loss","lr","grad_norm"]'),
    ("scalars-graph.figure", {"scalars-smoothing.value": "x", "scalars-x.value": [0],
                              "scalars-graph.relayoutData": 5}, '"scalars-drawn"'),
    ("scalars-graph.figure", {"scalars-graph.relayoutData": {"xaxis.range": ["nan", None]},
                              "data-version.data": 2**70}, '"scalars-drawn"'),
    # a lone surrogate echoed in the drawn figure's key cannot be encoded as the answer
    ("scalars-graph.figure", {"scalars-log.value": ["\udcff"], "scalars-tags.value": ["\udcff"],
                              "data-version.data": "\udcff"}, '"scalars-drawn"'),
])
def test_a_value_no_control_sends_is_no_value(app_and_values, output, overrides, shown):
    """The values the harness found answered with a server error, each kept: the page's empty
    state, a line naming the field a number was typed in, or no update (204). `shown` is part
    of the answer's compact JSON."""
    status, text = _answer(*app_and_values, output, overrides)
    if shown is None:
        assert status == 204, (status, text[:500])
        return
    assert status == 200 and "Traceback" not in text, (status, text[:500])
    assert shown in text, text[:2000]


def test_the_converters_take_only_what_a_control_sends():
    from dashboard._errors import BadValueError
    from dashboard._values import choice, number, shown, typed_whole, whole, wholes

    assert [whole(v) for v in (0, 7, "12", 2**31 - 1)] == [0, 7, 12, 2**31 - 1]
    assert all(whole(v) is None for v in (True, 1.0, -1, 2**31, "\u00b9", "\u0661", " 1", "1.5",
                                          "9" * 5000, [0], {"a": 1}, None))
    assert wholes([0, True, "1", 1.5, [2]]) == [0, 1] and wholes(3) == [3] and wholes("x") == []
    assert number(float("nan")) is None and number(2**1100) is None and number(0.5, high=0.99) == 0.5
    assert choice("step", {"step"}) == "step" and choice(["step"], {"step"}) is None
    assert typed_whole(None, "rank") is None and typed_whole(3, "rank") == 3
    with pytest.raises(BadValueError, match=r"^rank: '\\x1b\[31m' is not one"):
        typed_whole("\x1b[31m", "rank")
    assert len(shown("x" * 10_000)) < 50
    from dashboard._values import text, texts
    assert text("\udcff") is None and text("\u00e9") == "\u00e9" and texts(["a", "\ud800b"]) == ["a"]
