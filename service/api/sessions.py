"""The dashboard's server-side sessions: what a login cookie stands for, until logout or expiry.

The cookie is `<id>.<mac>`: a random 256-bit id, and an HMAC of it under RINGLAB_API_TOKEN (so
changing the token ends every session, and a guessed id without the token is refused before any
lookup). The database keeps only the id's SHA-256 with its expiry (service.db.models.
WebSession): logout deletes the row, so the cookie stops working everywhere at once, even if the
browser kept a copy; an expired one is refused, and expired rows go at the next login.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from service.db.engine import rowcount
from service.db.models import WebSession, utcnow

MAX_COOKIE_CHARS = 200


def _mac(token: str, session_id: str) -> str:
    message = b"ringlab dashboard session " + session_id.encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _session_id(token: str, cookie: str) -> str | None:
    """The id a cookie carries if its HMAC under `token` is right; else None."""
    if len(cookie) > MAX_COOKIE_CHARS:
        return None
    session_id, _, mac = cookie.partition(".")
    if not session_id or not hmac.compare_digest(mac.encode(), _mac(token, session_id).encode()):
        return None
    return session_id


def open_session(sm: sessionmaker[Session], token: str, ttl_s: float) -> str:
    """Store a new session expiring in ttl_s (and drop expired ones); its cookie value."""
    session_id = secrets.token_urlsafe(32)
    now = utcnow()
    with sm() as session, session.begin():
        session.execute(delete(WebSession).where(WebSession.expires_at <= now))
        session.add(
            WebSession(
                digest=_digest(session_id),
                created_at=now,
                expires_at=now + timedelta(seconds=ttl_s),
            )
        )
    return f"{session_id}.{_mac(token, session_id)}"


def session_valid(sm: sessionmaker[Session], token: str, cookie: str) -> bool:
    """Whether the cookie names a session that is stored, not revoked and not expired."""
    session_id = _session_id(token, cookie)
    if session_id is None:
        return False
    with sm() as session:
        found = session.scalar(
            select(WebSession.id).where(
                WebSession.digest == _digest(session_id), WebSession.expires_at > utcnow()
            )
        )
    return found is not None


def close_session(sm: sessionmaker[Session], token: str, cookie: str) -> bool:
    """Revoke the cookie's session (logout); whether there was one to revoke."""
    session_id = _session_id(token, cookie)
    if session_id is None:
        return False
    with sm() as session, session.begin():
        gone = session.execute(delete(WebSession).where(WebSession.digest == _digest(session_id)))
    return rowcount(gone) == 1
