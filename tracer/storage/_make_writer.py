"""`make_writer`: the writer a dump config names, the synchronous or the asynchronous one.

A module of its own because it is the one place that knows both writers: the asynchronous
writer builds on the synchronous one's module, so the choice kept in either would make the two
import each other.
"""
from __future__ import annotations

from tracer._config import DumpConfig
from tracer.storage._async import AsyncWriter
from tracer.storage._writer import SyncWriter, Writer


def make_writer(config: DumpConfig, *, rank: int, world_size: int) -> Writer:
    """The writer `config.writer` names, writing under `config.run_dir()`."""
    if config.writer == "sync":
        return SyncWriter(config, rank=rank, world_size=world_size)
    return AsyncWriter(config, rank=rank, world_size=world_size)
