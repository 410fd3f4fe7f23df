"""The flight recorder's reader: `flight_recorder.h5` (written by `_flight_writer.py`) back as a
DataFrame, opened through `open_h5` like every step file, so no link or size claim in it leads
outside it."""
from __future__ import annotations

import os
from typing import Any

from tracer.storage._flight_writer import STR_COLS
from tracer.storage._h5open import open_h5


def read_flight_recorder(path: str | os.PathLike) -> Any:
    """The rows of a flight recorder file as a DataFrame; `.attrs` holds reason and rank."""
    import pandas as pd

    with open_h5(path) as f:  # refuses links out of the file and claims past its size
        table = f["records"][()]
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    df = pd.DataFrame({c: table[c] for c in table.dtype.names})
    for c in STR_COLS:
        df[c] = [x.decode() if isinstance(x, bytes) else x for x in df[c]]
    df.attrs.update(attrs)
    return df
