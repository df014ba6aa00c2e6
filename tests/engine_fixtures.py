"""Small helpers shared by the engine tests: a clock the test sets, int32 token arrays."""
import numpy as np


class ManualClock:
    """A clock for lease tests: returns ``t``, which the test moves."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def toks(x) -> np.ndarray:
    """Token ids as the int32 array the engine takes."""
    return np.asarray(x, dtype=np.int32)


def comparable(x):
    """Protocol results as plain comparable data (arrays become ("nd", dtype, list))."""
    if isinstance(x, np.ndarray):
        return ("nd", str(x.dtype), x.tolist())
    if isinstance(x, tuple):
        return tuple(comparable(v) for v in x)
    if isinstance(x, list):
        return [comparable(v) for v in x]
    return x
