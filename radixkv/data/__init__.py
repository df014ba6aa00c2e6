"""Data bundled with radixkv: the Mooncake FAST'25 request traces (Apache-2.0; see
``mooncake/README.md`` for the source and attribution, and ``mooncake/LICENSE-APACHE``)."""
from importlib import resources
from pathlib import Path


def mooncake_trace(name: str = "conversation") -> Path:
    """Path of a bundled Mooncake trace: ``"conversation"`` or ``"synthetic"``."""
    if name not in ("conversation", "synthetic"):
        raise ValueError(f"unknown bundled trace {name!r}: 'conversation' or 'synthetic'")
    return Path(str(resources.files(__name__) / "mooncake" / f"{name}_trace.jsonl"))
