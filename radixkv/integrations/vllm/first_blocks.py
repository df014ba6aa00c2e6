"""``FirstBlockIndex``: which first blocks the manager holds, so that a request whose first
block it does not hold is answered "no hit" without a round trip.

A key is ``(extra_key, the first page's tokens)``: a request can only hit the manager's tree
if the tree holds its first page under its namespace. Fed by the manager's KV events
(``WatchEvents``, needs ``radixkv serve --enable-kv-events``): a parentless ``BlockStored``
adds its first page, a ``BlockRemoved`` of that page's hash removes it, ``AllBlocksCleared``
empties the index. :class:`IndexFeed` keeps an index fed from a daemon thread.

Correctness never depends on it: ``may_hold`` answers ``True`` ("ask the manager") whenever
the index is not *ready*: no stream, a stream that ended, a gap in the events, a manager
without events, another manager epoch than the asker's, or a stream not yet caught up (with
a page the feed inserts, see :func:`_insert_mark`). A ready index lags by the events in
flight: a false negative loses a hit, a false positive costs one round trip that finds none.
The details: ``docs/vllm.md`` ("The first-block index").
"""
from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np

from radixkv.engine.protocol import ExtendItem, Session
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError
from radixkv.integrations.vllm.link import ManagerClient, ManagerLink

__all__ = ["FirstBlockIndex", "IndexFeed"]

logger = logging.getLogger("radixkv.integrations.vllm")


class FirstBlockIndex:
    """See the module doc. Thread-safe (the feed thread applies, vLLM's scheduler asks)."""

    def __init__(self, page_size: int):
        if page_size < 1:
            raise InvalidArgumentError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._keys: Counter[tuple[str, bytes]] = Counter()
        self._by_hash: dict[int, tuple[str, bytes]] = {}  # first page's block hash -> key
        self._ready = False
        self._epoch: int | None = None  # the manager epoch whose events fill the index
        self._gap = False  # events were lost since the last reset: never ready until the next
        self._mu = threading.Lock()
        self.counters: dict[str, int] = {"events": 0, "gaps": 0, "streams": 0}

    def _key(self, extra_key: Hashable, tokens: np.ndarray) -> tuple[str, bytes]:
        return str(extra_key), np.ascontiguousarray(tokens[:self.page_size], dtype="<i4").tobytes()

    @property
    def ready(self) -> bool:
        return self._ready

    def may_hold(self, extra_key: Hashable, tokens: np.ndarray, epoch: int | None = None) -> bool:
        """Whether the manager may hold the first page of ``tokens`` (int32, at least one
        page) under ``extra_key``: ``False`` only when the index is ready and lacks it.
        ``epoch``: the asker's manager epoch; an index of another epoch is not ready for it."""
        if not self._ready or (epoch is not None and epoch != self._epoch):
            return True
        key = self._key(extra_key, tokens)
        with self._mu:
            return self._ready is False or key in self._keys

    def reset(self, ready: bool, epoch: int | None = None) -> None:
        """Forget every key; ``ready``: the events of manager ``epoch`` from its first one
        are applied up to now (a stream caught up, or one that starts with the manager)."""
        with self._mu:
            self._keys.clear()
            self._by_hash.clear()
            self._ready = ready
            self._epoch = epoch
            self._gap = False
            if ready:
                self.counters["streams"] += 1

    def caught_up(self, epoch: int) -> None:
        """The events of manager ``epoch`` applied so far are all it had: ready (unless a gap
        or another epoch's reset came in between)."""
        with self._mu:
            if self._epoch == epoch and not self._ready and not self._gap:
                self._ready = True
                self.counters["streams"] += 1

    def apply(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Apply event dicts (``watch_events`` form), in order; unknown kinds are counted only."""
        with self._mu:
            for e in events:
                self.counters["events"] += 1
                handler = self._HANDLERS.get(e.get("type"))
                if handler is not None:
                    handler(self, e)

    def _stored(self, e: Mapping[str, Any]) -> None:
        """``BlockStored``: a chain's first page (no parent) maps its hash to its key."""
        if e.get("parent_block_hash") is not None or not e["block_hashes"]:
            return
        tokens = np.asarray(e["token_ids"][:self.page_size], dtype=np.int32)
        key = self._key(e.get("extra_key"), tokens)
        h = int(e["block_hashes"][0])
        if h not in self._by_hash:
            self._by_hash[h] = key
            self._keys[key] += 1

    def _removed(self, e: Mapping[str, Any]) -> None:
        """``BlockRemoved``: each known first-page hash leaves, its key's count drops."""
        for h in map(int, e["block_hashes"]):
            key = self._by_hash.pop(h, None)
            if key is None:
                continue
            self._keys[key] -= 1
            if self._keys[key] <= 0:
                del self._keys[key]

    def _cleared(self, e: Mapping[str, Any]) -> None:
        """``AllBlocksCleared``: the index empties."""
        self._keys.clear()
        self._by_hash.clear()

    def _lost(self, e: Mapping[str, Any]) -> None:
        """``EventsLost``: the stream skipped events; unsure until the next (re)start."""
        self.counters["gaps"] += 1
        self._ready = False
        self._gap = True

    #: One method per event kind (the others change nothing).
    _HANDLERS: ClassVar[dict[object, Callable[[FirstBlockIndex, Mapping[str, Any]], None]]] = {
        "BlockStored": _stored, "BlockRemoved": _removed, "AllBlocksCleared": _cleared, "EventsLost": _lost}

    def __len__(self) -> int:
        return len(self._by_hash)

    def check_invariants(self) -> None:
        """Every key's count is the number of first-page hashes mapping to it."""
        with self._mu:
            want = Counter(self._by_hash.values())
            if want != self._keys:
                bad = sorted(set(want.items()) ^ set(self._keys.items()))
                raise InvariantError(f"first-block index: counts disagree with the hashes for {bad[:8]}")


def _insert_mark(client: ManagerClient, session: Session, page_size: int) -> str | None:
    """Insert one page under a namespace of its own (unused by any request, evictable): its
    ``BlockStored`` comes after every event the manager had, so seeing it means caught up.
    Returns the namespace (None: the manager refused the page; the index stays not ready)."""
    mark = f"radixkv-index-mark|{secrets.token_hex(8)}"
    rid = f"radixkv-index-mark#{secrets.token_hex(8)}"
    try:
        client.alloc_extend(session, [ExtendItem(rid, np.zeros(page_size + 1, np.int32), mark)])
        client.cache_finished(session, [rid])
    except (CapacityError, InvalidArgumentError) as e:
        logger.debug("radixkv: the index's catch-up mark was refused (%s)", e)
        return None
    return mark


class IndexFeed:
    """Feeds ``index`` from the manager's events of ``link``'s session (see the module doc)."""

    def __init__(self, index: FirstBlockIndex, link: ManagerLink):
        self.index = index
        self.link = link
        self._closed = threading.Event()
        self._client: ManagerClient | None = None
        self._thread = threading.Thread(target=self._run, name="radixkv-index", daemon=True)

    def start(self) -> IndexFeed:
        self._thread.start()
        return self

    def _run(self) -> None:
        wait_s = self.link.cfg.retry_interval_s
        while not self._closed.is_set():
            live = self.link.current()
            if live is None or not live[1].layout["config"].get("enable_kv_events"):
                self._closed.wait(min(wait_s, 0.5))  # no session, or a manager without events
                continue
            session = live[1].session
            epoch = int(session.epoch)
            try:
                self._client = self.link.new_client()
                if self._closed.is_set():
                    break
                self.index.reset(ready=False, epoch=epoch)
                mark = _insert_mark(self._client, session, self.index.page_size)
                for ev in self._client.watch_events(session, start_seq=0):
                    self.index.apply((ev,))
                    if mark is not None and ev.get("type") == "BlockStored" and ev.get("extra_key") == mark:
                        self.index.caught_up(epoch)  # every event before the mark is applied
                        mark = None
            except Exception as e:  # the manager went away / the session ended: unsure until back
                logger.debug("radixkv: event stream ended (%s: %s)", type(e).__name__, e)
            finally:
                self.index.reset(ready=False)
                self._close_client()
            self._closed.wait(wait_s)

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # a broken channel: nothing left to close
                pass

    def close(self) -> None:
        self._closed.set()
        self._close_client()  # cancels the stream
        self.index.reset(ready=False)
