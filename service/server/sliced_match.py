"""A large ``Match`` in slices that yield to other sessions' calls between them.

The manager runs every call on its one event loop, so one call that takes long holds every
other worker's calls back. ``Match`` changes nothing (no lock, no allocation), so a large one
(more than :data:`SLICE_QUERIES` queries or :data:`SLICE_TOKENS` tokens) is matched slice by
slice, each in a turn of its session (:mod:`~radixkv.service.server.fair_share`): between two
slices every other waiting session's call runs first. The answer is what matching the slices
one after the other gives (a query sees the tree as it is when its slice runs). An error in a
slice names the query by its index in the whole call, as an unsliced call would.
O(queries + tokens), like the unsliced call.
"""
from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from radixkv.service.server.fair_share import turn_key
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb

from radixkv.errors import RadixKVError

if TYPE_CHECKING:
    from radixkv.service.server.servicer import CacheManagerServicer

__all__ = ["SLICE_QUERIES", "SLICE_TOKENS", "needs_slices", "match_in_slices"]

SLICE_QUERIES = 64
SLICE_TOKENS = 16384
_INDEX = re.compile(r"queries\[(\d+)\]")


def _shifted(m: re.Match[str], offset: int) -> str:
    """``queries[i]`` of a slice as the whole call's ``queries[i + offset]``."""
    return f"queries[{int(m.group(1)) + offset}]"


def _bounds(request: pb.MatchRequest) -> list[tuple[int, int]]:
    """``[start, stop)`` of each slice: at most SLICE_QUERIES queries and, unless one query
    alone is longer, SLICE_TOKENS tokens."""
    out, start, tokens = [], 0, 0
    for i, q in enumerate(request.queries):
        n = len(q.token_ids_i32) // 4
        if i > start and (i - start >= SLICE_QUERIES or tokens + n > SLICE_TOKENS):
            out.append((start, i))
            start, tokens = i, 0
        tokens += n
    out.append((start, len(request.queries)))
    return out


def needs_slices(request: pb.MatchRequest) -> bool:
    """Whether ``request`` is large enough to be matched in slices."""
    if len(request.queries) > SLICE_QUERIES:
        return True
    return sum(len(q.token_ids_i32) for q in request.queries) > 4 * SLICE_TOKENS


async def match_in_slices(servicer: CacheManagerServicer, request: pb.MatchRequest) -> pb.MatchResponse:
    """The MatchResponse of ``request``, matched slice by slice (module doc)."""
    session = servicer.live_session(request.session)
    key = turn_key(request)
    infos = []
    for k, (a, b) in enumerate(_bounds(request)):
        if k:
            await servicer.share.pass_turn(key)  # other sessions' calls run first
        try:
            infos += servicer.engine.match(session, wire.match_queries_from_msg(request.queries[a:b]))
        except RadixKVError as e:
            e.args = (_INDEX.sub(functools.partial(_shifted, offset=a), str(e)),) + e.args[1:]
            raise
    return wire.match_infos_to_msg(infos)
