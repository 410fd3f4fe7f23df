"""What every page's callbacks share: the runs and the pieces of the URL."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

from dashboard._runs import Run
from dashboard._values import whole


@dataclass(frozen=True, kw_only=True)
class Context:
    """The dashboard's runs, fixed when the app is created."""

    runs: Sequence[Run]
    """The runs, in the order given; `runs[i].index == i`."""

    def root(self, index: int | str | None) -> Path | None:
        """The root of run `index` (an int, or digits from a URL), or None for any value that
        is not a run's index."""
        i = whole(index)
        return self.runs[i].root if i is not None and i < len(self.runs) else None

    def run_in(self, q: dict[str, str], key: str = "run") -> int | None:
        """The run index the query parameter `key` names, or None when it names no run."""
        i = whole(q.get(key))
        return i if self.root(i) else None

    def label(self, index: int) -> str:
        return self.runs[int(index)].label


def query(search: str | None) -> dict[str, str]:
    """`?a=1&b=x` as {'a': '1', 'b': 'x'} (last value wins)."""
    if not isinstance(search, str):
        return {}
    return {k: v[-1] for k, v in parse_qs(search.lstrip("?")).items()}
