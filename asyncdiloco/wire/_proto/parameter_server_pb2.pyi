from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    PUSH_KIND_PSEUDO_GRADIENT: _ClassVar[PushKind]
    PUSH_KIND_INITIAL_PARAMETERS: _ClassVar[PushKind]
    PUSH_KIND_ROUND_RESULT: _ClassVar[PushKind]

class StoreOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_OP_UNSPECIFIED: _ClassVar[StoreOp]
    STORE_OP_SET: _ClassVar[StoreOp]
    STORE_OP_GET: _ClassVar[StoreOp]
    STORE_OP_ADD: _ClassVar[StoreOp]
    STORE_OP_CHECK: _ClassVar[StoreOp]
    STORE_OP_COMPARE_SET: _ClassVar[StoreOp]
    STORE_OP_DELETE: _ClassVar[StoreOp]
    STORE_OP_NUM_KEYS: _ClassVar[StoreOp]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
PUSH_KIND_UNSPECIFIED: PushKind
PUSH_KIND_PSEUDO_GRADIENT: PushKind
PUSH_KIND_INITIAL_PARAMETERS: PushKind
PUSH_KIND_ROUND_RESULT: PushKind
STORE_OP_UNSPECIFIED: StoreOp
STORE_OP_SET: StoreOp
STORE_OP_GET: StoreOp
STORE_OP_ADD: StoreOp
STORE_OP_CHECK: StoreOp
STORE_OP_COMPARE_SET: StoreOp
STORE_OP_DELETE: StoreOp
STORE_OP_NUM_KEYS: StoreOp

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "total_bytes", "manifest_hash")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    manifest_hash: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., manifest_hash: _Optional[str] = ...) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("local_steps", "chunk_bytes", "lease_s", "max_staleness", "mode", "min_workers", "join_timeout_s", "round_timeout_s", "sync_weighting", "outer_optimizer", "outer_lr", "outer_momentum", "wire_codec", "codec_block_size", "bulk_port", "dylu", "grouping", "group_window_s", "group_max_wait_s", "outer_lr_schedule", "outer_lr_warmup_versions", "outer_lr_total_versions", "outer_lr_min_ratio", "sync_local_steps")
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WIRE_CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    DYLU_FIELD_NUMBER: _ClassVar[int]
    GROUPING_FIELD_NUMBER: _ClassVar[int]
    GROUP_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_WARMUP_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_TOTAL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_MIN_RATIO_FIELD_NUMBER: _ClassVar[int]
    SYNC_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    local_steps: int
    chunk_bytes: int
    lease_s: float
    max_staleness: int
    mode: str
    min_workers: int
    join_timeout_s: float
    round_timeout_s: float
    sync_weighting: str
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    wire_codec: str
    codec_block_size: int
    bulk_port: int
    dylu: bool
    grouping: str
    group_window_s: float
    group_max_wait_s: float
    outer_lr_schedule: str
    outer_lr_warmup_versions: int
    outer_lr_total_versions: int
    outer_lr_min_ratio: float
    sync_local_steps: str
    def __init__(self, local_steps: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., lease_s: _Optional[float] = ..., max_staleness: _Optional[int] = ..., mode: _Optional[str] = ..., min_workers: _Optional[int] = ..., join_timeout_s: _Optional[float] = ..., round_timeout_s: _Optional[float] = ..., sync_weighting: _Optional[str] = ..., outer_optimizer: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., wire_codec: _Optional[str] = ..., codec_block_size: _Optional[int] = ..., bulk_port: _Optional[int] = ..., dylu: _Optional[bool] = ..., grouping: _Optional[str] = ..., group_window_s: _Optional[float] = ..., group_max_wait_s: _Optional[float] = ..., outer_lr_schedule: _Optional[str] = ..., outer_lr_warmup_versions: _Optional[int] = ..., outer_lr_total_versions: _Optional[int] = ..., outer_lr_min_ratio: _Optional[float] = ..., sync_local_steps: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("manifest", "worker_name", "steps_per_s", "ranks")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    worker_name: str
    steps_per_s: float
    ranks: int
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., worker_name: _Optional[str] = ..., steps_per_s: _Optional[float] = ..., ranks: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("worker_id", "run_config", "manifest", "version", "initialize", "resumed", "last_push_id", "session_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    run_config: RunConfig
    manifest: Manifest
    version: int
    initialize: bool
    resumed: bool
    last_push_id: int
    session_id: int
    def __init__(self, worker_id: _Optional[int] = ..., run_config: _Optional[_Union[RunConfig, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., version: _Optional[int] = ..., initialize: _Optional[bool] = ..., resumed: _Optional[bool] = ..., last_push_id: _Optional[int] = ..., session_id: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "sync_state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    sync_state: bool
    def __init__(self, worker_id: _Optional[int] = ..., sync_state: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "total_bytes", "num_chunks", "crc32", "run_config", "round", "header_crc32")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HEADER_CRC32_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    num_chunks: int
    crc32: int
    run_config: RunConfig
    round: int
    header_crc32: int
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., crc32: _Optional[int] = ..., run_config: _Optional[_Union[RunConfig, _Mapping]] = ..., round: _Optional[int] = ..., header_crc32: _Optional[int] = ...) -> None: ...

class PayloadChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PullMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: PayloadChunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "push_id", "base_version", "num_local_steps", "num_tokens", "total_bytes", "num_chunks", "crc32", "kind", "compute_s", "quorum_id", "last", "session_id", "header_crc32")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_CRC32_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    push_id: int
    base_version: int
    num_local_steps: int
    num_tokens: int
    total_bytes: int
    num_chunks: int
    crc32: int
    kind: PushKind
    compute_s: float
    quorum_id: int
    last: bool
    session_id: int
    header_crc32: int
    def __init__(self, worker_id: _Optional[int] = ..., push_id: _Optional[int] = ..., base_version: _Optional[int] = ..., num_local_steps: _Optional[int] = ..., num_tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., crc32: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., compute_s: _Optional[float] = ..., quorum_id: _Optional[int] = ..., last: _Optional[bool] = ..., session_id: _Optional[int] = ..., header_crc32: _Optional[int] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: PayloadChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: PayloadChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("applied", "duplicate", "version", "staleness", "staleness_weight", "local_steps", "held_s", "group_max_wait_s")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    duplicate: bool
    version: int
    staleness: int
    staleness_weight: float
    local_steps: int
    held_s: float
    group_max_wait_s: float
    def __init__(self, applied: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., staleness_weight: _Optional[float] = ..., local_steps: _Optional[int] = ..., held_s: _Optional[float] = ..., group_max_wait_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "steps_per_s", "session_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    steps_per_s: float
    session_id: int
    def __init__(self, worker_id: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., session_id: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version", "lease_remaining_s", "initialize", "local_steps", "group_max_wait_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    INITIALIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    lease_remaining_s: float
    initialize: bool
    local_steps: int
    group_max_wait_s: float
    def __init__(self, version: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., initialize: _Optional[bool] = ..., local_steps: _Optional[int] = ..., group_max_wait_s: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "session_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    session_id: int
    def __init__(self, worker_id: _Optional[int] = ..., session_id: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "worker_name", "applied_pushes", "rejected_pushes", "tokens", "local_steps", "last_seen_s", "alive", "local_steps_per_round", "steps_per_s", "mean_staleness", "last_staleness", "state", "ranks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    APPLIED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LAST_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_name: str
    applied_pushes: int
    rejected_pushes: int
    tokens: int
    local_steps: int
    last_seen_s: float
    alive: bool
    local_steps_per_round: int
    steps_per_s: float
    mean_staleness: float
    last_staleness: int
    state: str
    ranks: int
    def __init__(self, worker_id: _Optional[int] = ..., worker_name: _Optional[str] = ..., applied_pushes: _Optional[int] = ..., rejected_pushes: _Optional[int] = ..., tokens: _Optional[int] = ..., local_steps: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., alive: _Optional[bool] = ..., local_steps_per_round: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., mean_staleness: _Optional[float] = ..., last_staleness: _Optional[int] = ..., state: _Optional[str] = ..., ranks: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "applied_pushes", "rejected_pushes", "duplicate_pushes", "staleness_histogram", "bytes_pushed", "bytes_pulled", "tokens", "uptime_s", "initialized", "workers", "run_config", "outer_optimizer", "staleness_weighting", "manifest", "pulls", "rounds_committed", "rounds_failed", "group_size_histogram", "divergence_warnings", "pushes_per_s", "evals", "server_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    STALENESS_WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCE_WARNINGS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied_pushes: int
    rejected_pushes: int
    duplicate_pushes: int
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    bytes_pushed: int
    bytes_pulled: int
    tokens: int
    uptime_s: float
    initialized: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    run_config: RunConfig
    outer_optimizer: str
    staleness_weighting: str
    manifest: Manifest
    pulls: int
    rounds_committed: int
    rounds_failed: int
    group_size_histogram: _containers.RepeatedScalarFieldContainer[int]
    divergence_warnings: int
    pushes_per_s: float
    evals: _containers.RepeatedCompositeFieldContainer[EvalPoint]
    server_version: str
    def __init__(self, version: _Optional[int] = ..., applied_pushes: _Optional[int] = ..., rejected_pushes: _Optional[int] = ..., duplicate_pushes: _Optional[int] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., bytes_pushed: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., tokens: _Optional[int] = ..., uptime_s: _Optional[float] = ..., initialized: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., run_config: _Optional[_Union[RunConfig, _Mapping]] = ..., outer_optimizer: _Optional[str] = ..., staleness_weighting: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., pulls: _Optional[int] = ..., rounds_committed: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., group_size_histogram: _Optional[_Iterable[int]] = ..., divergence_warnings: _Optional[int] = ..., pushes_per_s: _Optional[float] = ..., evals: _Optional[_Iterable[_Union[EvalPoint, _Mapping]]] = ..., server_version: _Optional[str] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("version", "loss", "num_tokens", "evaluator")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    version: int
    loss: float
    num_tokens: int
    evaluator: str
    def __init__(self, version: _Optional[int] = ..., loss: _Optional[float] = ..., num_tokens: _Optional[int] = ..., evaluator: _Optional[str] = ...) -> None: ...

class EvalReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvalPoint(_message.Message):
    __slots__ = ("version", "loss", "num_tokens", "evaluator", "at_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    loss: float
    num_tokens: int
    evaluator: str
    at_s: float
    def __init__(self, version: _Optional[int] = ..., loss: _Optional[float] = ..., num_tokens: _Optional[int] = ..., evaluator: _Optional[str] = ..., at_s: _Optional[float] = ...) -> None: ...

class QuorumRequest(_message.Message):
    __slots__ = ("worker_id", "round", "manifest_hash", "timeout_s", "poll")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    POLL_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    round: int
    manifest_hash: str
    timeout_s: float
    poll: bool
    def __init__(self, worker_id: _Optional[int] = ..., round: _Optional[int] = ..., manifest_hash: _Optional[str] = ..., timeout_s: _Optional[float] = ..., poll: _Optional[bool] = ...) -> None: ...

class QuorumReply(_message.Message):
    __slots__ = ("formed", "quorum_id", "round", "members", "rank", "world_size", "store_host", "store_port", "heal", "round_deadline_s", "reason", "have", "need", "queued", "pending", "keep_s")
    FORMED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    NEED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    KEEP_S_FIELD_NUMBER: _ClassVar[int]
    formed: bool
    quorum_id: int
    round: int
    members: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    world_size: int
    store_host: str
    store_port: int
    heal: bool
    round_deadline_s: float
    reason: str
    have: int
    need: int
    queued: bool
    pending: bool
    keep_s: float
    def __init__(self, formed: _Optional[bool] = ..., quorum_id: _Optional[int] = ..., round: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., heal: _Optional[bool] = ..., round_deadline_s: _Optional[float] = ..., reason: _Optional[str] = ..., have: _Optional[int] = ..., need: _Optional[int] = ..., queued: _Optional[bool] = ..., pending: _Optional[bool] = ..., keep_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("worker_id", "quorum_id", "success", "total_weight", "num_tokens", "num_local_steps", "reason", "timeout_s", "poll", "compute_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    POLL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    quorum_id: int
    success: bool
    total_weight: float
    num_tokens: int
    num_local_steps: int
    reason: str
    timeout_s: float
    poll: bool
    compute_s: float
    def __init__(self, worker_id: _Optional[int] = ..., quorum_id: _Optional[int] = ..., success: _Optional[bool] = ..., total_weight: _Optional[float] = ..., num_tokens: _Optional[int] = ..., num_local_steps: _Optional[int] = ..., reason: _Optional[str] = ..., timeout_s: _Optional[float] = ..., poll: _Optional[bool] = ..., compute_s: _Optional[float] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("committed", "round", "reason", "decided", "local_steps")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    round: int
    reason: str
    decided: bool
    local_steps: int
    def __init__(self, committed: _Optional[bool] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., decided: _Optional[bool] = ..., local_steps: _Optional[int] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ("token", "push", "pull")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    token: str
    push: PushHeader
    pull: PullRequest
    def __init__(self, token: _Optional[str] = ..., push: _Optional[_Union[PushHeader, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ...) -> None: ...

class BulkReply(_message.Message):
    __slots__ = ("code", "message", "reason", "push", "pull")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    push: PushReply
    pull: PullHeader
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., push: _Optional[_Union[PushReply, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("worker_id", "quorum_id", "op", "keys", "value", "expected", "amount")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    quorum_id: int
    op: StoreOp
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    def __init__(self, worker_id: _Optional[int] = ..., quorum_id: _Optional[int] = ..., op: _Optional[_Union[StoreOp, str]] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("found", "value", "count")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    count: int
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...
