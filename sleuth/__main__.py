"""`python -m sleuth` is the same as the `sleuth` command."""
from sleuth.cli import entry

entry()
