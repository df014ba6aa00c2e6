"""Tokens: sources, constant-time checks, never shown."""
import logging

import pytest
from radixkv.service.wire.auth import METADATA_KEY, Token, presented_token, resolve_token

from radixkv.errors import InvalidArgumentError

SECRET = "s3cret-token-value"


def test_token_is_hidden_from_repr_and_str():
    t = Token(SECRET)
    assert SECRET not in repr(t) and SECRET not in str(t) and SECRET not in f"{t}"
    assert t.reveal() == SECRET
    assert t.metadata() == ((METADATA_KEY, "Bearer " + SECRET),)


def test_matches():
    t = Token(SECRET)
    assert t.matches(SECRET)
    assert not t.matches(SECRET + "x") and not t.matches("") and not t.matches(None)
    assert not t.matches(SECRET[:-1] + "\u00e9")


def test_presented_token():
    assert presented_token(((METADATA_KEY, "Bearer abc"),)) == "abc"
    assert presented_token(((METADATA_KEY, b"Bearer abc"),)) == "abc"
    assert presented_token(((METADATA_KEY, "Basic abc"),)) is None
    assert presented_token((("other", "Bearer abc"),)) is None
    assert presented_token(None) is None


def test_resolve_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXKV_TOKEN", raising=False)
    with pytest.raises(InvalidArgumentError, match="required"):
        resolve_token()
    monkeypatch.setenv("RADIXKV_TOKEN", "from-the-environment")
    assert resolve_token().reveal() == "from-the-environment"
    f = tmp_path / "tok"
    f.write_text("from-the-file-123\n")
    assert resolve_token(token_file=str(f)).reveal() == "from-the-file-123"
    assert resolve_token("given-directly").reveal() == "given-directly"
    with pytest.raises(InvalidArgumentError, match="at least"):
        resolve_token("short")
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        resolve_token(token_file=str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError):
        Token("has space inside")


def test_the_token_never_reaches_the_logs(caplog):
    """A server rejecting calls and serving good ones logs nothing with the token in it."""
    from radixkv.service.client import connect
    from tooling.testing import ThreadedServer

    from radixkv.errors import UnauthenticatedError

    caplog.set_level(logging.DEBUG)
    with ThreadedServer({"kv_tokens": 64}) as srv:
        good = srv.client()
        info = good.attach("w")
        good.heartbeat(info.session)
        bad = connect(srv.address, token="not-the-right-token")
        with pytest.raises(UnauthenticatedError):
            bad.stats()
        bad.close()
        good.detach(info.session)
        token = srv.token
    assert token not in caplog.text
    assert "not-the-right-token" not in caplog.text
