from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model_name", "target_model_name", "hidden_size", "draft_vocab_size", "target_vocab_size", "target_hidden_size", "feature_layers", "feature_width", "max_tokens", "max_steps", "max_topk", "max_draft_tokens", "dtype", "device", "load", "reads_target_features", "feature_sink", "step_lane")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPK_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    READS_TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SINK_FIELD_NUMBER: _ClassVar[int]
    STEP_LANE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    target_model_name: str
    hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    feature_width: int
    max_tokens: int
    max_steps: int
    max_topk: int
    max_draft_tokens: int
    dtype: str
    device: str
    load: _common_pb2.KvLoad
    reads_target_features: bool
    feature_sink: str
    step_lane: _common_pb2.StepLane
    def __init__(self, model_name: _Optional[str] = ..., target_model_name: _Optional[str] = ..., hidden_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., target_vocab_size: _Optional[int] = ..., target_hidden_size: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., feature_width: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_steps: _Optional[int] = ..., max_topk: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ..., reads_target_features: _Optional[bool] = ..., feature_sink: _Optional[str] = ..., step_lane: _Optional[_Union[_common_pb2.StepLane, _Mapping]] = ...) -> None: ...

class IngestItem(_message.Message):
    __slots__ = ("request_id", "start_position", "tokens", "features", "target_feature_rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    target_feature_rows: int
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., target_feature_rows: _Optional[int] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("items", "catch_up")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[IngestItem]
    catch_up: bool
    def __init__(self, items: _Optional[_Iterable[_Union[IngestItem, _Mapping]]] = ..., catch_up: _Optional[bool] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "num_tokens", "num_computed", "num_missing_features", "ready")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSING_FEATURES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    num_computed: int
    num_missing_features: int
    ready: bool
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_computed: _Optional[int] = ..., num_missing_features: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("requests", "load")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    load: _common_pb2.KvLoad
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ...) -> None: ...

class DraftBudget(_message.Message):
    __slots__ = ("steps", "topk", "num_draft_tokens")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("request_id", "budget", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    budget: DraftBudget
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., budget: _Optional[_Union[DraftBudget, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("ingest", "items", "return_ancestor_mask", "traceparent", "packed_trees")
    INGEST_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ANCESTOR_MASK_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PACKED_TREES_FIELD_NUMBER: _ClassVar[int]
    ingest: _containers.RepeatedCompositeFieldContainer[IngestItem]
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    return_ancestor_mask: bool
    traceparent: str
    packed_trees: bool
    def __init__(self, ingest: _Optional[_Iterable[_Union[IngestItem, _Mapping]]] = ..., items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., return_ancestor_mask: _Optional[bool] = ..., traceparent: _Optional[str] = ..., packed_trees: _Optional[bool] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("request_id", "root_token", "root_position", "tokens", "parents", "depths", "logprobs", "scores", "ancestor_mask")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ANCESTOR_MASK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    root_token: int
    root_position: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    scores: _containers.RepeatedScalarFieldContainer[float]
    ancestor_mask: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., root_token: _Optional[int] = ..., root_position: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., scores: _Optional[_Iterable[float]] = ..., ancestor_mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("trees", "load", "draft_seconds", "packed", "graphs_captured")
    TREES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[DraftTree]
    load: _common_pb2.KvLoad
    draft_seconds: float
    packed: PackedTrees
    graphs_captured: int
    def __init__(self, trees: _Optional[_Iterable[_Union[DraftTree, _Mapping]]] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ..., draft_seconds: _Optional[float] = ..., packed: _Optional[_Union[PackedTrees, _Mapping]] = ..., graphs_captured: _Optional[int] = ...) -> None: ...

class PackedTrees(_message.Message):
    __slots__ = ("request_ids", "num_nodes", "root_tokens", "root_positions", "tokens", "parents", "depths", "logprobs", "scores")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROOT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_nodes: _common_pb2.Tensor
    root_tokens: _common_pb2.Tensor
    root_positions: _common_pb2.Tensor
    tokens: _common_pb2.Tensor
    parents: _common_pb2.Tensor
    depths: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    scores: _common_pb2.Tensor
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_nodes: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., root_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., root_positions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., depths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftReleaseResponse(_message.Message):
    __slots__ = ("released", "load")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    released: int
    load: _common_pb2.KvLoad
    def __init__(self, released: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ...) -> None: ...

class DraftLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
