"""The `sleuth` command line: wires trainer, tracer, profiler, irdump and dashboard together.

Nothing here is imported by the other packages; `sleuth --help` imports no torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
