"""Ways to damage a file the way disks, crashes and people do: truncation at many offsets and
bytes flipped in named regions. Pure functions over paths, shared by the fault suite's tests."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

# where a file is cut: fractions of its size, plus the first bytes (an empty file, a magic number
# cut short) and the last one (a file one byte short of complete)
TRUNCATE_FRACTIONS = (0.0, 0.02, 0.1, 0.25, 0.5, 0.75, 0.9)
TRUNCATE_BYTES = (7, 100, -1)


def truncations() -> list[str]:
    """Names of the truncation cases, stable for test ids."""
    return ([f"truncate@{f:g}" for f in TRUNCATE_FRACTIONS]
            + [f"truncate@{b}B" for b in TRUNCATE_BYTES])


def truncate(path: Path, case: str) -> None:
    size = path.stat().st_size
    spec = case.split("@", 1)[1]
    if spec.endswith("B"):
        n = int(spec[:-1])
        keep = size + n if n < 0 else min(n, size - 1)
    else:
        keep = int(size * float(spec))
    with open(path, "r+b") as f:
        f.truncate(max(0, keep))


def flip(path: Path, offset: int, count: int = 8) -> None:
    """Invert `count` bytes from `offset` (clamped inside the file)."""
    size = path.stat().st_size
    offset = max(0, min(offset, size - count))
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def hdf5_regions(path: Path) -> dict[str, int]:
    """Offsets of the regions of an HDF5 file worth damaging: the superblock, the root object
    header, and the raw data of each contiguous dataset (by name)."""
    import h5py

    regions = {"superblock": 0, "root_header": 96}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                off = obj.id.get_offset()
                if off is not None and obj.id.get_storage_size() > 0:
                    regions[f"data:{name}"] = off + obj.id.get_storage_size() // 2
        f.visititems(visit)
    return regions


def text_regions(path: Path) -> dict[str, int]:
    size = path.stat().st_size
    return {"head": 0, "middle": size // 2, "tail": max(0, size - 8)}


def fingerprint(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots`: what a reading command must leave as it found it."""
    out = {}
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("data"))
    return dst


# -- forged files: what a file claims, against what it holds -----------------------------------
def _set_records(f, table) -> None:
    """Replace /records by `table` and store its CRC-32, as a forger who knows the format would
    (the reader's CRC check then passes, so only the claims are left to catch)."""
    import zlib

    import numpy as np

    del f["records"]
    f.create_dataset("records", data=table)
    f.attrs["records_crc32"] = zlib.crc32(np.ascontiguousarray(f["records"][()]).tobytes())


def claim_rows(path: Path, rows: int = 10**10) -> None:
    """/records claims `rows` rows that were never written: the file stays small, a naive
    read allocates rows x 254 bytes (2.3 TiB for 10^10)."""
    import h5py

    with h5py.File(path, "r+") as f:
        dtype = f["records"].dtype
        del f["records"]
        f.create_dataset("records", shape=(rows,), dtype=dtype)


def claim_tensor_bytes(path: Path, nbytes: int = 4 * 10**12) -> None:
    """A float32 record claims `nbytes` of tensor data, and /tensors claims to hold them (a
    dataset never written: HDF5 reads it as zeros, so a naive diff reads 4 TB of them)."""
    import h5py
    import numpy as np

    with h5py.File(path, "r+") as f:
        table = f["records"][()]
        i = int(np.nonzero((table["data_offset"] >= 0) & (table["dtype"] == b"float32"))[0][0])
        table["shape"][i] = str(nbytes // 4).encode()
        table["strides"][i] = b""
        table["numel"][i] = nbytes // 4
        table["data_offset"][i] = 0
        table["data_nbytes"][i] = nbytes
        _set_records(f, table)
        del f["tensors"]
        f.create_dataset("tensors", shape=(nbytes,), dtype="u1")


def _other_records(other: Path):
    import h5py

    with h5py.File(other, "r") as o:
        return o["records"][()], int(o.attrs["records_crc32"])


def external_link(path: Path, other: Path) -> None:
    """/records is an HDF5 external link to `other`'s /records (its CRC-32 copied along)."""
    import h5py

    _, crc = _other_records(other)
    with h5py.File(path, "r+") as f:
        del f["records"]
        f["records"] = h5py.ExternalLink(str(other), "/records")
        f.attrs["records_crc32"] = crc


def soft_link_out(path: Path, other: Path) -> None:
    """/records is a soft link through an external link to `other`'s root."""
    import h5py

    _, crc = _other_records(other)
    with h5py.File(path, "r+") as f:
        del f["records"]
        f["elsewhere"] = h5py.ExternalLink(str(other), "/")
        f["records"] = h5py.SoftLink("/elsewhere/records")
        f.attrs["records_crc32"] = crc


def external_storage(path: Path, other: Path) -> None:
    """/records keeps its bytes in a raw file beside `other` (HDF5 external storage)."""
    import h5py

    table, crc = _other_records(other)
    raw = other.with_name(other.name + ".raw")
    raw.write_bytes(table.tobytes())
    with h5py.File(path, "r+") as f:
        del f["records"]
        f.create_dataset("records", shape=table.shape, dtype=table.dtype,
                         external=[(str(raw), 0, table.nbytes)])
        f.attrs["records_crc32"] = crc


def virtual_dataset(path: Path, other: Path) -> None:
    """/records is a virtual dataset mapped onto `other`'s /records."""
    import h5py

    table, crc = _other_records(other)
    layout = h5py.VirtualLayout(shape=table.shape, dtype=table.dtype)
    layout[:] = h5py.VirtualSource(str(other), "records", shape=table.shape)
    with h5py.File(path, "r+") as f:
        del f["records"]
        f.create_virtual_dataset("records", layout)
        f.attrs["records_crc32"] = crc


FORGERIES = {"claim-rows": claim_rows, "claim-tensor-bytes": claim_tensor_bytes,
             "external-link": external_link, "soft-link-out": soft_link_out,
             "external-storage": external_storage, "virtual-dataset": virtual_dataset}
"""name -> forger; those that take a second path point the file at another run's step file."""


def forge(path: Path, case: str, other: Path) -> None:
    """Apply the forgery `case` (FORGERIES) to the step file `path`."""
    import inspect

    forger = FORGERIES[case]
    if len(inspect.signature(forger).parameters) > 1 and \
            inspect.signature(forger).parameters.get("other") is not None:
        forger(path, other)
    else:
        forger(path)


BACKTRACKING = r"re:^((\w|\.)+)+!$"
"""A regular expression that backtracks without end on a record name of 40 characters (it
never matches: every way of splitting the name is tried before `!` fails; hours)."""


def stored_pattern(path: Path, pattern: str = BACKTRACKING) -> None:
    """The step file's dump config allows NaN in records matching `pattern`, and its float
    record of the longest name holds a NaN, so `check` runs the pattern over that name."""
    import json

    import h5py
    import numpy as np

    with h5py.File(path, "r+") as f:
        config = json.loads(f.attrs["config"])
        config["nan_allow"] = [pattern]
        f.attrs["config"] = json.dumps(config)
        table = f["records"][()]
        floats = np.nonzero(table["dtype"] == b"float32")[0]
        i = int(max(floats, key=lambda k: len(table["name"][k])))
        table["nan"][i] = 1
        _set_records(f, table)


def deep_config(path: Path, depth: int = 200_000) -> None:
    """The step file's config attribute is JSON nested `depth` levels deep."""
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs["config"] = "[" * depth + "]" * depth
