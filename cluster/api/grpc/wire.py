"""How Serve's gRPC proxy reads `pagedserve.v1.Generation` requests off the wire.

Serve's proxy registers a service through a function named in `grpc_servicer_functions`, keeps
the request deserializers it installs, and routes each call to the ingress method named after
the RPC (the servicer object itself is never called). `add_generation_servicer` is that function.
It registers the same handlers as the generated `add_GenerationServicer_to_server`, except that a
request which does not parse is not a bare INTERNAL error from the proxy: it reaches the replica
as a `MalformedRequest` naming the field (a string that is not UTF-8, or a field number this
server does not know), which the replica answers with INVALID_ARGUMENT.

Registering it also installs `api.grpc.streams.cancel_streams_in_flight` on the proxy, so that a
stream that ends early always cancels its request on the replica, and
`api.grpc.status.finish_statuses`, so that a refusal carries its `retry-after` trailer and no status
carries a traceback or other internals; and, for the HTTP proxy of the same process,
`sse_response.limit_send_buffers`, so that an unread HTTP stream pauses too, and
`http_connections.guard_connections`, so that connections not serving a request are bounded.

This module runs inside the proxy actor, so it imports only grpc, protobuf, the stubs and
starlette.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from pagedserve.cluster.api.grpc.status import finish_statuses
from pagedserve.cluster.api.grpc.streams import cancel_streams_in_flight
from pagedserve.cluster.api.http_connections import guard_connections
from pagedserve.cluster.api.sse_response import limit_send_buffers
from pagedserve.proto.pagedserve.v1 import serving_pb2

SERVICE = serving_pb2.DESCRIPTOR.services_by_name["Generation"]
_TWIN_FILE = "pagedserve/v1/serving_bytes_twin.proto"


@dataclass(frozen=True)
class MalformedRequest:
    """A request that did not parse as its message type.

    Attributes:
        message: what is wrong, naming the field where one is at fault.
        param: the field's path (`prompt`, `sampling.stop[1]`), when known.
    """

    message: str
    param: str | None = None


class StreamFailed(RuntimeError):
    """Raised out of a streaming RPC once its status is set on the context.

    Defined here because Serve unpickles it in the proxy, which has this module imported
    already (a class from a module that imports torch costs the first failed stream seconds).
    """


def add_generation_servicer(servicer: Any, server: grpc.Server) -> None:
    """Register `pagedserve.v1.Generation` on `server` with lenient request parsing."""
    cancel_streams_in_flight(server)
    limit_send_buffers()  # the HTTP proxy of the same process: unread SSE streams pause
    guard_connections()  # and its connections not serving a request are bounded
    finish_statuses(server)  # after: it wraps the stream canceller and sees its final status
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(serving_pb2, method.input_type.name)
        response_class = getattr(serving_pb2, method.output_type.name)
        make_handler = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=request_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def request_parser(message_class: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    """A deserializer that returns a `MalformedRequest` instead of raising."""

    def parse(data: bytes) -> Message | MalformedRequest:
        try:
            request = message_class.FromString(data)
        except DecodeError as error:
            return explain_decode_error(message_class, data, error)
        return find_unknown_field(request) or request

    return parse


def explain_decode_error(
    message_class: type[Message], data: bytes, error: DecodeError
) -> MalformedRequest:
    """Name the string field that is not UTF-8, by parsing again with strings read as bytes."""
    descriptor = message_class.DESCRIPTOR
    try:
        twin = _bytes_twin(descriptor.full_name).FromString(data)
    except DecodeError:
        return MalformedRequest(f"request is not a valid {descriptor.full_name}: {error}")
    path = _find_bad_utf8(twin, descriptor, "")
    if path is None:
        return MalformedRequest(f"request is not a valid {descriptor.full_name}: {error}")
    return MalformedRequest(f"{path} is not valid UTF-8", path)


def find_unknown_field(message: Message, path: str = "") -> MalformedRequest | None:
    """Report the first field number `message` (or a message in it) does not define."""
    for field in unknown_fields.UnknownFieldSet(message):
        where = path or "the request"
        return MalformedRequest(
            f"unknown field number {field.field_number} in {where} "
            f"({message.DESCRIPTOR.full_name}); is the client built from a newer serving.proto?",
            path or None,
        )
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type.GetOptions().map_entry:
            continue
        values = value if _is_repeated(field) else [value]
        for i, item in enumerate(values):
            found = find_unknown_field(
                item, _join(path, field.name, i if _is_repeated(field) else None)
            )
            if found is not None:
                return found
    return None


def _find_bad_utf8(twin: Message, original: Descriptor, path: str) -> str | None:
    for field, value in twin.ListFields():
        declared = original.fields_by_name[field.name]
        repeated = _is_repeated(declared)
        values = value if repeated else [value]
        for i, item in enumerate(values):
            name = _join(path, field.name, i if repeated else None)
            if declared.type == FieldDescriptor.TYPE_STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif declared.type == FieldDescriptor.TYPE_MESSAGE:
                found = _find_bad_utf8(item, declared.message_type, name)
                if found is not None:
                    return found
    return None


@functools.cache
def _bytes_twin(full_name: str) -> type[Message]:
    """The message class of `full_name` in a private copy of serving.proto whose string fields
    are bytes (same wire format, no UTF-8 check)."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    serving_pb2.DESCRIPTOR.CopyToProto(file_proto)
    file_proto.name = _TWIN_FILE
    file_proto.ClearField("service")
    for message in file_proto.message_type:
        _strings_to_bytes(message)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _strings_to_bytes(message: descriptor_pb2.DescriptorProto) -> None:
    if message.options.map_entry:
        return  # map keys cannot be bytes; no request holds a map
    for field in message.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    for nested in message.nested_type:
        _strings_to_bytes(nested)


def _is_repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated  # (protobuf 7 dropped `label`)


def _join(path: str, name: str, index: int | None) -> str:
    name = f"{path}.{name}" if path else name
    return name if index is None else f"{name}[{index}]"
