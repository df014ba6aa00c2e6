"""Progress bars of long runs (``bench hitrate``, the demo): tqdm on stderr, with rate and ETA.

Drawn only when the stream is a terminal unless ``enabled`` says otherwise, so CI logs and
pipes stay clean (tqdm's ``disable=None``).
"""
from __future__ import annotations

import sys
from typing import Protocol, TextIO

try:
    from tqdm import tqdm
except ImportError as e:  # the `bench` extra
    raise ImportError("radixkv bench and radixkv demo draw progress bars with tqdm: "
                      "pip install 'radixkv[bench]'") from e

__all__ = ["Progress", "ProgressBar"]


class ProgressBar(Protocol):
    """What a replay asks of its ``progress`` argument (a :func:`Progress` bar, or any tqdm)."""

    def update(self, n: int = 1) -> object: ...


def Progress(total: int, label: str = "", stream: TextIO | None = None,  # noqa: N802 (used as a class)
             enabled: bool | None = None, unit: str = "req") -> tqdm:
    """A tqdm bar counting toward ``total`` (a context manager; ``update(n)``, ``close()``).
    ``enabled``: None draws on a terminal only, True always, False never."""
    return tqdm(total=max(int(total), 0), desc=label or None, file=stream if stream is not None else sys.stderr,
                disable=None if enabled is None else not enabled, unit=unit, dynamic_ncols=True, leave=True)
