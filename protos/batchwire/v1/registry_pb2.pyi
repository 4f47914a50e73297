from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerEndpoint(_message.Message):
    __slots__ = ("rank", "host", "grpc_port", "zmq_port")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    ZMQ_PORT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    grpc_port: int
    zmq_port: int
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., grpc_port: _Optional[int] = ..., zmq_port: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("group_id", "ranks")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerEndpoint]
    def __init__(self, group_id: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[WorkerEndpoint, _Mapping]]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("num_moved", "num_lost")
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOST_FIELD_NUMBER: _ClassVar[int]
    num_moved: int
    num_lost: int
    def __init__(self, num_moved: _Optional[int] = ..., num_lost: _Optional[int] = ...) -> None: ...
