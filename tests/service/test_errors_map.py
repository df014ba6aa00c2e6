"""The one error map: every radixkv error -> its gRPC status -> the same type back."""
import grpc
import pytest
from radixkv.service.wire.errors import (
    AVAILABLE_KEY,
    ERROR_TYPE_KEY,
    KNOWN_ERRORS,
    REQUESTED_KEY,
    MessageTooLargeError,
    ServiceUnavailableError,
    error_from_rpc,
    status_of,
)

from radixkv import errors as E


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details, md=()):
        self._code, self._details, self._md = code, details, md

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._md


def _round_trip(exc):
    st = status_of(exc)
    return st, error_from_rpc(FakeRpcError(st.code, st.details, st.trailing_metadata))


@pytest.mark.parametrize("cls", sorted(KNOWN_ERRORS.values(), key=lambda c: c.__name__))
def test_every_error_type_round_trips(cls):
    exc = cls("boom") if not issubclass(cls, E.CapacityError) else cls("boom", requested=7, available=3)
    st, back = _round_trip(exc)
    assert st.code == getattr(grpc.StatusCode, cls.code)
    assert type(back) is cls and str(back) == "boom"
    if issubclass(cls, E.CapacityError):
        assert (back.requested, back.available) == (7, 3)


def test_status_codes_the_issue_names():
    assert status_of(E.InvalidArgumentError("x")).code == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(E.DoubleFreeError("x")).code == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(E.CapacityError("x")).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(E.StaleSessionError("x")).code == grpc.StatusCode.FAILED_PRECONDITION
    assert status_of(E.NotFoundError("x")).code == grpc.StatusCode.NOT_FOUND
    assert status_of(E.PermissionDeniedError("x")).code == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(E.UnauthenticatedError("x")).code == grpc.StatusCode.UNAUTHENTICATED


def test_capacity_numbers_travel_in_trailing_metadata():
    st = status_of(E.CapacityError("full", requested=100, available=12))
    md = dict(st.trailing_metadata)
    assert md[ERROR_TYPE_KEY] == "CapacityError" and md[REQUESTED_KEY] == "100" and md[AVAILABLE_KEY] == "12"
    st = status_of(E.CapacityError("full"))
    assert REQUESTED_KEY not in dict(st.trailing_metadata)
    _, back = _round_trip(E.CapacityError("full"))
    assert back.requested is None and back.available is None


def test_non_radixkv_errors_are_internal_without_traceback():
    st = status_of(ZeroDivisionError("division by zero"))
    assert st.code == grpc.StatusCode.INTERNAL and "Traceback" not in st.details
    back = error_from_rpc(FakeRpcError(st.code, st.details, st.trailing_metadata))
    assert type(back) is E.RadixKVError


def test_status_wins_over_a_mismatched_name():
    back = error_from_rpc(FakeRpcError(grpc.StatusCode.NOT_FOUND, "x", ((ERROR_TYPE_KEY, "CapacityError"),)))
    assert type(back) is E.NotFoundError


def test_unknown_names_are_never_looked_up():
    back = error_from_rpc(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "x", ((ERROR_TYPE_KEY, "os.system"),)))
    assert type(back) is E.InvalidArgumentError


def test_transport_errors():
    back = error_from_rpc(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "Received message larger than max (2000000 vs. 1048576)"))
    assert type(back) is MessageTooLargeError and isinstance(back, E.CapacityError)
    assert (back.requested, back.available) == (2000000, 1048576)
    assert type(error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down"))) is ServiceUnavailableError
    assert type(error_from_rpc(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"))) is ServiceUnavailableError
    back = error_from_rpc(FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "nope"))
    assert type(back) is E.RadixKVError and "UNIMPLEMENTED" in str(back)
