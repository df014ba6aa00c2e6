"""A tiny progress bar on stderr (no dependency): ``[#####.....]  52% 6250/12031 label``.

Drawn only when the stream is a terminal (or ``enabled=True``), at most every
``min_interval`` seconds, so it costs nothing in CI logs or pipes.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Count toward ``total`` and redraw a one-line bar.

    Usage::

        with Progress(len(trace), "lru 1%") as bar:
            for ...: bar.update(1)
    """

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None,
                 enabled: bool | None = None, width: int = 30, min_interval: float = 0.2):
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.min_interval = min_interval
        self.done = 0
        self._last_draw = 0.0
        self._drawn = False

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` (clamped to ``total``) and redraw if due."""
        self.done = min(self.total, self.done + int(n)) if self.total else self.done + int(n)
        if self.enabled:
            now = time.monotonic()
            if now - self._last_draw >= self.min_interval or self.done >= self.total:
                self._draw()
                self._last_draw = now

    def render(self) -> str:
        """The bar as text (what ``update`` writes, without the carriage return)."""
        frac = self.done / self.total if self.total else 1.0
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        return f"[{bar}] {100 * frac:3.0f}% {self.done}/{self.total} {self.label}"

    def _draw(self) -> None:
        self.stream.write("\r" + self.render())
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Finish the line (only if something was drawn)."""
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
