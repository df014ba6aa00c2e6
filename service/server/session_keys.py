"""Session secrets: a session is bound to a secret that only its attacher gets.

A session id is no credential: it shows in logs, stats and quarantine messages, and a
caller who learned one could otherwise end that session (open and close a KeepAlive for it),
detach it or act in it. So ``Attach`` returns, beside the session, its *secret*, and every
call naming the session must carry it (``SessionRef.secret``).

The secret is derived, not stored: ``HMAC-SHA256(key, epoch || session id)`` under a key of
32 random bytes drawn when the manager starts. Nothing is kept per session (no table to
leak or to reclaim), a restarted manager's key differs (its epoch does too), and the check
is one HMAC and a constant-time compare (``hmac.compare_digest``), O(1).

Order of the checks (:meth:`SessionKeys.check`, run before any work for the call): a session
that is not live (unknown, ended, another epoch, lease run out) is ``StaleSessionError`` as
the embedded engine answers (a worker re-attaches on it), whatever secret came; a live one
with a wrong or missing secret is :class:`~radixkv.service.wire.errors.SessionSecretError`
(PERMISSION_DENIED).
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
