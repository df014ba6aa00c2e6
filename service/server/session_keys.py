"""Session secrets: a session is bound to a secret that only its attacher gets.

A session id shows in logs and stats, so it is no credential: ``Attach`` also returns a
secret, and every call naming the session must carry it (``SessionRef.secret``). The secret
is ``HMAC-SHA256(key, epoch || session id)`` under 32 random bytes drawn at start: nothing
stored per session, O(1) check with a constant-time compare. :meth:`SessionKeys.check` runs
before any work: a session that is not live is ``StaleSessionError`` whatever the secret; a
live one with a wrong or missing secret is
:class:`~radixkv.service.wire.errors.SessionSecretError` (PERMISSION_DENIED).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import SessionSecretError

from radixkv.engine.protocol import Session

if TYPE_CHECKING:
    from radixkv.engine.embedded import CacheEngine

__all__ = ["SessionKeys"]


class SessionKeys:
    """Derives and checks the secrets of one manager's sessions (see the module doc)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def secret(self, session: Session) -> bytes:
        """The secret of ``session`` (32 bytes)."""
        msg = f"{int(session[1])}:{session[0]}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def ref(self, session: Session) -> pb.SessionRef:
        """``session`` as the message ``Attach`` returns: with its secret."""
        return wire.session_to_msg(session._replace(secret=self.secret(session)))

    def check(self, engine: CacheEngine, msg: pb.SessionRef) -> Session:
        """The session ``msg`` names, once it is live (``StaleSessionError`` otherwise) and
        ``msg`` carries its secret (``SessionSecretError`` otherwise). Changes nothing."""
        session = wire.session_from_msg(msg)
        engine.sessions.lookup(session)
        if not hmac.compare_digest(self.secret(session), bytes(msg.secret)):
            raise SessionSecretError(f"session {session.session_id!r}: the call does not carry the "
                                     "session's secret (the one its Attach returned)")
        return session
