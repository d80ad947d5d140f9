from protos import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResultPart(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMMEDIATE: _ClassVar[ResultPart]
    DEFERRED: _ClassVar[ResultPart]
IMMEDIATE: ResultPart
DEFERRED: ResultPart

class ShmOpen(_message.Message):
    __slots__ = ("name", "size", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ShmEvent(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class LayerRequest(_message.Message):
    __slots__ = ("step", "layer", "hidden", "topk_ids", "topk_weights", "defer")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEFER_FIELD_NUMBER: _ClassVar[int]
    step: int
    layer: int
    hidden: _tensor_pb2.Tensor
    topk_ids: _tensor_pb2.Tensor
    topk_weights: _tensor_pb2.Tensor
    defer: int
    def __init__(self, step: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., defer: _Optional[int] = ...) -> None: ...

class LayerResult(_message.Message):
    __slots__ = ("step", "layer", "part", "output", "timing")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step: int
    layer: int
    part: ResultPart
    output: _tensor_pb2.Tensor
    timing: ExpertTiming
    def __init__(self, step: _Optional[int] = ..., layer: _Optional[int] = ..., part: _Optional[_Union[ResultPart, str]] = ..., output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., timing: _Optional[_Union[ExpertTiming, _Mapping]] = ...) -> None: ...

class ExpertTiming(_message.Message):
    __slots__ = ("queued_us", "compute_us", "start_unix_ns", "end_unix_ns")
    QUEUED_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    queued_us: int
    compute_us: int
    start_unix_ns: int
    end_unix_ns: int
    def __init__(self, queued_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., start_unix_ns: _Optional[int] = ..., end_unix_ns: _Optional[int] = ...) -> None: ...

class LayerResponse(_message.Message):
    __slots__ = ("immediate", "deferred", "timing")
    IMMEDIATE_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    immediate: _tensor_pb2.Tensor
    deferred: _tensor_pb2.Tensor
    timing: ExpertTiming
    def __init__(self, immediate: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., deferred: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., timing: _Optional[_Union[ExpertTiming, _Mapping]] = ...) -> None: ...

class ExpertInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertInfo(_message.Message):
    __slots__ = ("model_fingerprint", "architecture", "moe_layers", "n_routed_experts", "hidden_size", "moe_intermediate_size", "top_k", "weight_format", "kernel_path", "threads", "weight_bytes", "transport", "active_streams", "shm_sessions", "max_tokens", "shard_index", "shard_count")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOE_INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PATH_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    architecture: str
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    n_routed_experts: int
    hidden_size: int
    moe_intermediate_size: int
    top_k: int
    weight_format: str
    kernel_path: str
    threads: int
    weight_bytes: int
    transport: str
    active_streams: int
    shm_sessions: int
    max_tokens: int
    shard_index: int
    shard_count: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., moe_layers: _Optional[_Iterable[int]] = ..., n_routed_experts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., moe_intermediate_size: _Optional[int] = ..., top_k: _Optional[int] = ..., weight_format: _Optional[str] = ..., kernel_path: _Optional[str] = ..., threads: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., active_streams: _Optional[int] = ..., shm_sessions: _Optional[int] = ..., max_tokens: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ...) -> None: ...
