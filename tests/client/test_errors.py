"""The status-code table: every daemon error code maps back to one client class."""

from __future__ import annotations

import grpc
import pytest

from kvstore.client import errors
from kvstore.client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVStoreError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnknownLeaseError,
    UnknownNamespaceError,
    error_from_rpc,
)
from kvstore.servicer import STATUS_CODES


def rpc_error(code: grpc.StatusCode, details: str = "the server's words") -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidArgumentError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.INTERNAL, KVStoreError),
        (grpc.StatusCode.UNKNOWN, KVStoreError),
    ],
)
def test_each_code_maps_to_one_class_keeping_the_message(
    code: grpc.StatusCode, cls: type[KVStoreError]
) -> None:
    error = error_from_rpc(rpc_error(code), "Lookup")

    assert type(error) is cls
    assert str(error) == "the server's words"
    assert error.code is code
    assert error.method == "Lookup"


def test_not_found_names_the_lease_for_release_and_the_namespace_elsewhere() -> None:
    not_found = rpc_error(grpc.StatusCode.NOT_FOUND)

    assert type(error_from_rpc(not_found, "Release")) is UnknownLeaseError
    for method in ("Lookup", "Acquire", "Reserve", "Commit", "Get", "Put", "Delete", "Prefetch"):
        assert type(error_from_rpc(not_found, method)) is UnknownNamespaceError
    assert type(error_from_rpc(not_found, "Stats")) is NotFoundError
    assert issubclass(UnknownLeaseError, NotFoundError)
    assert issubclass(UnknownNamespaceError, NotFoundError)


def test_every_code_the_daemon_sends_has_a_class() -> None:
    for code in set(STATUS_CODES.values()):
        assert type(error_from_rpc(rpc_error(code), "Lookup")) is not KVStoreError, code


def test_an_empty_message_names_the_call_and_code() -> None:
    error = error_from_rpc(rpc_error(grpc.StatusCode.UNAVAILABLE, ""), "Stats")

    assert str(error) == "Stats failed: UNAVAILABLE"


def test_only_unavailable_and_deadline_are_transient() -> None:
    assert (UnavailableError, DeadlineExceededError) == errors.TRANSIENT
