"""``IdRing``: a ring buffer of integer ids in one preallocated device tensor.

Pure bookkeeping used by the free lists. Positions are *absolute* (they only grow): the id
pushed at absolute position ``p`` lives in ``buf[p % capacity]`` until a later push at
``p + capacity`` overwrites it. Absolute positions let a caller snapshot a ring in O(1)
(``head``, ``tail``) and later tell whether the entries of that snapshot are still intact
(``intact(start)``), which is what makes allocator backups cheap.

Every operation costs O(number of ids moved); nothing is O(capacity) except ``reset``.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from radixkv.allocator.host_view import HostViews
from radixkv.errors import InvariantError


class IdRing(HostViews):
    """A FIFO of ids held in ``capacity`` preallocated slots on ``device``.

    Attributes:
        capacity: the number of slots of the buffer.
        head, tail: absolute positions; the live ids are those at ``[head, tail)``.
        high_water: the largest absolute position ever written (exclusive), across
            rollbacks of ``head``/``tail`` by the owner.
    """

    def __init__(self, capacity: int, device: torch.device | str, dtype: torch.dtype = torch.int32):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.buf = torch.zeros(max(self.capacity, 1), dtype=dtype, device=self.device)
        self.head = 0
        self.tail = 0
        self.high_water = 0

    def __len__(self) -> int:
        return self.tail - self.head

    def reset(self, ids: torch.Tensor) -> None:
        """Make ``ids`` the whole content (positions ``[0, len(ids))``). O(len(ids))."""
        n = int(ids.numel())
        if n > self.capacity:
            raise InvariantError(f"IdRing.reset: {n} ids exceed the capacity {self.capacity}")
        self.buf[:n] = ids
        self.head, self.tail, self.high_water = 0, n, n

    def push(self, ids: torch.Tensor) -> None:
        """Append ``ids`` (1-D) after the tail. O(len(ids)).

        The owner guarantees the live count stays within ``capacity`` (it validated the
        ids as distinct and not already held); exceeding it is an internal error.
        """
        n = int(ids.numel())
        if n == 0:
            return
        if len(self) + n > self.capacity:
            raise InvariantError(
                f"IdRing.push: {len(self)} + {n} ids exceed the capacity {self.capacity}"
            )
        p = self.tail % self.capacity
        first = min(n, self.capacity - p)
        host = self._host()
        if host is not None and ids.device.type == "cpu":  # numpy copy: no torch dispatch
            src = ids.numpy()
            host[p : p + first] = src[:first]
            if n > first:
                host[: n - first] = src[first:]
        else:
            self.buf[p : p + first] = ids[:first]
            if n > first:
                self.buf[: n - first] = ids[first:]
        self.tail += n
        if self.tail > self.high_water:
            self.high_water = self.tail

    def push_with(self, write: Callable[[np.ndarray, int], int], most: int) -> bool:
        """Append what ``write(host_buffer, position)`` writes into the buffer from the tail's
        slot (wrapping), at most ``most`` ids; it returns how many it wrote, or a negative
        number when it wrote nothing. On CPU only, and only when ``most`` more ids fit;
        returns whether ids were appended. O(1) plus ``write``."""
        host = self._host()
        if host is None or len(self) + most > self.capacity:
            return False
        n = write(host, self.tail % self.capacity)
        if n < 0:
            return False
        self.tail += n
        if self.tail > self.high_water:
            self.high_water = self.tail
        return True

    def _host(self) -> np.ndarray | None:
        """The numpy view of ``buf`` on CPU (cached, see :mod:`.host_view`), else ``None``."""
        return self.host_view("buf")

    def push_one(self, i: int) -> None:
        """Append the one id ``i`` (an int) after the tail: on CPU one write through the
        host view, no torch dispatch. O(1). Same contract as :meth:`push`."""
        if self.tail - self.head >= self.capacity:
            raise InvariantError(f"IdRing.push: {len(self)} + 1 ids exceed the capacity {self.capacity}")
        p = self.tail % self.capacity
        host = self._host()
        if host is not None:
            host[p] = i
        else:
            self.buf[p] = i
        self.tail += 1
        if self.tail > self.high_water:
            self.high_water = self.tail

    def pop_one(self) -> int:
        """Remove and return the first live id as an int (the owner checked that one is
        live). O(1)."""
        p = self.head % self.capacity
        host = self._host()
        i = int(host[p]) if host is not None else int(self.buf[p].item())
        self.head += 1
        return i

    def read(self, start: int, end: int) -> torch.Tensor:
        """The ids at absolute positions ``[start, end)`` in order. O(end - start).

        Returns a view of the buffer when the range does not wrap (valid until the next
        push), else a fresh tensor. The caller checks ``intact(start)`` first.
        """
        n = end - start
        if n <= 0:
            return self.buf[:0]
        p = start % self.capacity
        if p + n <= self.capacity:
            return self.buf[p : p + n]
        return torch.cat((self.buf[p:], self.buf[: n - (self.capacity - p)]))

    def peek(self, n: int) -> torch.Tensor:
        """The first ``n`` live ids (view or fresh tensor, see ``read``). O(n)."""
        return self.read(self.head, self.head + n)

    def pop(self, n: int) -> torch.Tensor:
        """Remove and return the first ``n`` live ids as a fresh int64 tensor. O(n)."""
        host = self._host() if n else None
        p = self.head % self.capacity if host is not None else 0
        if host is not None and p + n <= self.capacity:  # one numpy cast-copy on CPU
            out = torch.from_numpy(host[p : p + n].astype(np.int64))
        else:
            out = self.peek(n).to(torch.int64, copy=True)
        self.head += n
        return out

    def live(self) -> torch.Tensor:
        """All live ids (view or fresh tensor, see ``read``). O(len)."""
        return self.read(self.head, self.tail)

    def intact(self, start: int) -> bool:
        """Whether every entry at absolute position ``>= start`` written so far is still in
        the buffer (no later push wrapped over it)."""
        return self.high_water - start <= self.capacity
