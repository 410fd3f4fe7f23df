"""Step files written from a template image (tracer/_template.py) against files HDF5 writes.

A statistics step file without hits is, from the third step of a table shape on, a copy of
the second step's image with the new values patched in. It must be the file HDF5 would have
written (byte for byte), read back the same by h5py and `open_dump`, and any shape or layout
the template cannot prove ends in HDF5 writing the file."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from tracer import _format, _template
from tracer._format import RECORD_COLUMNS, StepFile, root_attrs, step_path, table_array
from tracer._reader import open_dump
from tracer._template import ImageCache

pytestmark = pytest.mark.skipif(_template._lookup3 is None, reason="C kernel not built")


def _rows(n: int, k: int, name: str = "h") -> list[tuple]:
    return [(i, f"{name}.{i % 4}.mlp.forward.{i}.output.0", f"{name}.{i % 4}.mlp", "",
             "forward", "output", 0, i, "float32", "[8, 64]", 512, -1.5 + k, 2.5 * k, 0.01,
             123.4, 0, 0, 0, k, 123456789 + k, "train.py:7", -1, 0, "") for i in range(n)]


def _attrs(step: int, created: str = "2026-12-02T03:49:59+00:00") -> dict:
    attrs = root_attrs(rank=1, world_size=2, step=step, level="module", mode="statistics",
                       config={"level": "module", "path": "run"})
    attrs["created"] = created
    return attrs


def _write(run, step: int, rows: list[tuple], *, complete: bool = True, hits=(),
           created: str = "2026-12-02T03:49:59+00:00"):
    file = StepFile(step_path(run, 1, step), _attrs(step, created), spill_bytes=1 << 20)
    for row in rows:
        file.add_row(row)
    for hit in hits:
        file.add_hit(hit)
    return file.finish(complete=complete)


@pytest.fixture()
def images(monkeypatch):
    cache = ImageCache(_format._memory_image)
    monkeypatch.setattr(_format, "_IMAGES", cache)
    return cache


def test_later_steps_are_patched_copies_of_what_hdf5_writes(tmp_path, images):
    paths = [_write(tmp_path, s, _rows(30, s), complete=s != 2) for s in range(4)]
    # the first by HDF5, the second makes the template; the interrupted step 2 differs in its
    # status attributes, so it is the first file of its kind: HDF5 writes it too
    assert images.patched == 1
    for s, path in enumerate(paths):
        attrs = _attrs(s)
        _format.mark_status(attrs, s != 2)
        table = table_array(_rows(30, s), RECORD_COLUMNS)
        expected, _ = _format._memory_image(attrs, int(s != 2), table)
        if s:  # the first is HDF5's file on disk, not its image in memory
            assert path.read_bytes() == expected
        with h5py.File(path) as f:
            assert f.attrs["step"] == s and f.attrs["complete"] == int(s != 2)
            assert f.attrs["status"] == ("complete" if s != 2 else "interrupted")
            assert f.attrs["created"] == attrs["created"] and f.attrs["rank"] == 1
            assert f["records"][()].tobytes() == table.tobytes()
            assert f["tensors"].shape == (0,)
    dump = open_dump(tmp_path)
    assert dump.steps(1) == [0, 1, 2, 3]
    stats = dump.stats(1, 3)
    assert list(stats["zeros"]) == [3] * 30 and stats["checksum"].iloc[0] == 123456792


def test_a_patched_file_reads_as_one_hdf5_wrote_to_disk(tmp_path, images, monkeypatch):
    rows = _rows(12, 5, name="é")
    for s in range(2):
        _write(tmp_path / "a", s, _rows(12, 4, name="é"))
    patched = _write(tmp_path / "a", 2, rows)
    assert images.patched == 1
    monkeypatch.setattr(_template, "_lookup3", None)  # HDF5 writes through the sec2 driver
    plain = _write(tmp_path / "b", 2, rows)
    assert images.patched == 1
    with h5py.File(patched) as p, h5py.File(plain) as q:
        assert dict(p.attrs) == dict(q.attrs)
        for name in q:
            assert p[name].dtype == q[name].dtype
            assert p[name][()].tobytes() == q[name][()].tobytes()
        assert p["records"].id.get_type().get_member_type(1).get_cset() == h5py.h5t.CSET_UTF8


def test_a_new_shape_gets_its_own_template_and_hits_go_through_hdf5(tmp_path, images):
    for s in range(2):
        _write(tmp_path, s, _rows(10, s))
        _write(tmp_path, s + 10, _rows(11, s + 10))  # one row more: another layout
    _write(tmp_path, 2, _rows(10, 2, name="longer_name"))  # wider strings
    _write(tmp_path, 3, _rows(10, 3), created="2026-12-02T03:49:59.5+00:00")
    assert images.patched == 0
    _write(tmp_path, 4, _rows(11, 4))
    _write(tmp_path, 5, _rows(10, 5))
    assert images.patched == 2
    hit = {"seq": 2, "name": "h.2.mlp.forward.2.output.0", "condition": "nan", "value": 1.0,
           "source": "train.py:7"}
    path = _write(tmp_path, 6, _rows(11, 6), hits=[hit])
    assert images.patched == 2
    with h5py.File(path) as f:
        assert f["hits"][0]["condition"] == b"nan" and f.attrs["step"] == 6
    for s in (0, 1, 2, 3, 4, 5, 10, 11):
        with h5py.File(step_path(tmp_path, 1, s)) as f:
            assert f.attrs["step"] == s and f["records"][0]["zeros"] == s


def test_empty_tables_and_tensor_files(tmp_path, images):
    for s in range(2):
        _write(tmp_path, s, [])
    path = _write(tmp_path, 2, [])
    assert images.patched == 1
    with h5py.File(path) as f:
        assert f["records"].shape == (0,) and f.attrs["step"] == 2
    file = StepFile(step_path(tmp_path, 1, 3), _attrs(3), spill_bytes=1 << 20)
    row = list(_rows(1, 2)[0])
    row[21:23] = [file.add_bytes(np.arange(4, dtype=np.float32)), 16]
    file.add_row(tuple(row))
    with h5py.File(file.finish()) as f:  # tensor bytes: HDF5 allocates /tensors
        assert f["tensors"].shape == (16,)
    assert images.patched == 1


def test_a_layout_the_template_cannot_prove_is_written_by_hdf5(tmp_path, monkeypatch):
    """An image with a byte that changes from build to build and is no checksum (as a
    modification time would be): no template, every file from HDF5, all of them right."""
    def unsteady(attrs, complete, table):
        image, records = _format._memory_image(attrs, complete, table)
        return image + os.urandom(1), records

    images = ImageCache(unsteady)
    attrs, table = _attrs(0), table_array(_rows(5, 0), RECORD_COLUMNS)
    assert images.image(attrs, 1, table) is None  # first seen: HDF5 writes it
    second = images.image(attrs, 1, table)  # the template fails its proof
    assert second is not None and second[:-1] == _format._memory_image(attrs, 1, table)[0]
    assert images.image(_attrs(1), 1, table) is None  # known not patchable: HDF5 writes it
    assert images.patched == 0
    monkeypatch.setattr(_format, "_IMAGES", images)
    for s in (2, 3):
        with h5py.File(_write(tmp_path, s, _rows(5, s))) as f:
            assert f.attrs["step"] == s and f["records"][0]["zeros"] == s


def test_a_patch_that_would_differ_from_hdf5_is_refused():
    """Were a patched value stored anywhere else too (here: `step` written twice, the second
    copy outside the template's knowledge), the proof against the real image fails."""
    def twice(attrs, complete, table):
        image, records = _format._memory_image(attrs, complete, table)
        return image + attrs["step"].to_bytes(8, "little"), records

    images = ImageCache(twice)
    table = table_array(_rows(5, 0), RECORD_COLUMNS)
    assert images.image(_attrs(0), 1, table) is None
    assert images.image(_attrs(0), 1, table) is not None
    assert images.image(_attrs(1), 1, table) is None and images.patched == 0


def test_lookup3_matches_the_checksums_hdf5_writes():
    image, _ = _format._memory_image(_attrs(0), 1, table_array(_rows(3, 0), RECORD_COLUMNS))
    start = image.find(b"OHDR")
    found = [pos for pos in range(start + 8, len(image) - 4)
             if int.from_bytes(image[pos:pos + 4], "little") == _template._lookup3(image, start,
                                                                                   pos)]
    assert found, "no object header checksum found"
    assert image[:8] == b"\x89HDF\r\n\x1a\n" and image[8] >= 2  # superblock 2+: checksummed
    assert int.from_bytes(image[44:48], "little") == _template._lookup3(image, 0, 44)
    with pytest.raises(ValueError, match="outside"):
        _template._lookup3(b"abc", 1, 5)


def test_a_dumped_run_reads_the_same_with_and_without_templates(tmp_path, images, monkeypatch):
    import torch

    import tracer

    def run(path):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(5, 8)
        with tracer.Dumper(model, {"level": "module", "mode": "statistics", "writer": "sync",
                                   "path": str(path)}):
            for _ in range(5):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return open_dump(path)

    patched = run(tmp_path / "patched")
    assert images.patched == 3  # steps 2, 3 and 4
    monkeypatch.setattr(_template, "_lookup3", None)
    plain = run(tmp_path / "plain")
    assert patched.steps(0) == plain.steps(0) == [0, 1, 2, 3, 4]
    for step in range(5):
        a, b = patched.stats(0, step), plain.stats(0, step)
        assert a.equals(b), step


def test_a_step_file_holds_no_time_of_its_making():
    """Two builds in different seconds are the same bytes: a template made at one time patches
    files of later steps (HDF5 puts times in an object header unless told not to; the proof of
    a template failed whenever its builds straddled a second)."""
    import time

    table = table_array(_rows(4, 0), RECORD_COLUMNS)
    first, _ = _format._memory_image(_attrs(0), 1, table)
    time.sleep(1.02 - time.time() % 1)  # into the next second
    second, _ = _format._memory_image(_attrs(0), 1, table)
    assert first == second
