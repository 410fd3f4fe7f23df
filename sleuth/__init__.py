"""The `sleuth` command line: wires trainer, tracer, profiler, irdump and dashboard together.

The other packages import nothing here but `sleuth.common`, the rules they share (run
identity, the user's line; docs/architecture.md), which loads none of the command line;
`sleuth --help` imports no torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
