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
