from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "hidden_size", "num_layers", "max_model_len", "eos_token_ids", "tp_size", "dtype", "device", "default_feature_layers", "load", "step_lane")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_LANE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    dtype: str
    device: str
    default_feature_layers: _containers.RepeatedScalarFieldContainer[int]
    load: _common_pb2.KvLoad
    step_lane: _common_pb2.StepLane
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., default_feature_layers: _Optional[_Iterable[int]] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ..., step_lane: _Optional[_Union[_common_pb2.StepLane, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("request_id", "create", "tokens", "parents", "num_fixed", "sampling", "top_logprobs", "return_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FIXED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    create: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    num_fixed: int
    sampling: SamplingParams
    top_logprobs: int
    return_features: bool
    def __init__(self, request_id: _Optional[str] = ..., create: _Optional[bool] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., num_fixed: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., return_features: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items", "feature_layers", "hold_features")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FEATURES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    hold_features: bool
    def __init__(self, items: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ..., feature_layers: _Optional[_Iterable[int]] = ..., hold_features: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("request_id", "accepted_nodes", "tokens", "logprobs", "top_logprobs", "features", "num_committed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    features: _common_pb2.Tensor
    num_committed: int
    def __init__(self, request_id: _Optional[str] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_committed: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "load", "step_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    load: _common_pb2.KvLoad
    step_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "load")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    released: int
    load: _common_pb2.KvLoad
    def __init__(self, released: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeatureRange(_message.Message):
    __slots__ = ("request_id", "start_position", "end_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    END_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    end_position: int
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., end_position: _Optional[int] = ...) -> None: ...

class ReadFeaturesRequest(_message.Message):
    __slots__ = ("ranges",)
    RANGES_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[FeatureRange]
    def __init__(self, ranges: _Optional[_Iterable[_Union[FeatureRange, _Mapping]]] = ...) -> None: ...

class FeatureRows(_message.Message):
    __slots__ = ("request_id", "start_position", "features", "request_ids", "start_positions", "row_counts", "ring_rows", "ring_attached", "step_lane", "next_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNTS_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    RING_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    STEP_LANE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_position: int
    features: _common_pb2.Tensor
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    start_positions: _common_pb2.Tensor
    row_counts: _common_pb2.Tensor
    ring_rows: RingRows
    ring_attached: bool
    step_lane: _common_pb2.StepLane
    next_tokens: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., start_position: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ..., start_positions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., row_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ring_rows: _Optional[_Union[RingRows, _Mapping]] = ..., ring_attached: _Optional[bool] = ..., step_lane: _Optional[_Union[_common_pb2.StepLane, _Mapping]] = ..., next_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RingRows(_message.Message):
    __slots__ = ("start", "shape", "dtype")
    START_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    start: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, start: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReadFeaturesResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[FeatureRows]
    def __init__(self, rows: _Optional[_Iterable[_Union[FeatureRows, _Mapping]]] = ...) -> None: ...

class SubscribeFeaturesRequest(_message.Message):
    __slots__ = ("sink", "batched", "ring_name", "ring_bytes")
    SINK_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    RING_NAME_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    sink: str
    batched: bool
    ring_name: str
    ring_bytes: int
    def __init__(self, sink: _Optional[str] = ..., batched: _Optional[bool] = ..., ring_name: _Optional[str] = ..., ring_bytes: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class PackedItems(_message.Message):
    __slots__ = ("request_ids", "num_nodes", "num_fixed", "flags", "tokens", "parents", "temperature", "top_k", "top_p", "seed", "top_logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "min_tokens", "prompt_len", "stop_counts", "stop_ids", "bias_counts", "bias_ids", "bias_values")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_FIXED_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    STOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_nodes: _common_pb2.Tensor
    num_fixed: _common_pb2.Tensor
    flags: _common_pb2.Tensor
    tokens: _common_pb2.Tensor
    parents: _common_pb2.Tensor
    temperature: _common_pb2.Tensor
    top_k: _common_pb2.Tensor
    top_p: _common_pb2.Tensor
    seed: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    repetition_penalty: _common_pb2.Tensor
    frequency_penalty: _common_pb2.Tensor
    presence_penalty: _common_pb2.Tensor
    min_p: _common_pb2.Tensor
    min_tokens: _common_pb2.Tensor
    prompt_len: _common_pb2.Tensor
    stop_counts: _common_pb2.Tensor
    stop_ids: _common_pb2.Tensor
    bias_counts: _common_pb2.Tensor
    bias_ids: _common_pb2.Tensor
    bias_values: _common_pb2.Tensor
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_nodes: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_fixed: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., flags: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_k: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_p: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., seed: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., repetition_penalty: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., frequency_penalty: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., presence_penalty: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., min_p: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., min_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_len: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stop_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stop_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bias_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bias_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bias_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class GrantStops(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_counts", "stop_token_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: _common_pb2.Tensor
    stop_token_counts: _common_pb2.Tensor
    stop_token_ids: _common_pb2.Tensor
    def __init__(self, max_new_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stop_token_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stop_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PackedStep(_message.Message):
    __slots__ = ("items", "feature_layers", "grant_steps", "stops", "traceparent", "hold_features", "feature_sinks", "item_feature_sink", "release_request_ids")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GRANT_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOPS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    HOLD_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SINKS_FIELD_NUMBER: _ClassVar[int]
    ITEM_FEATURE_SINK_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    items: PackedItems
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    grant_steps: int
    stops: GrantStops
    traceparent: str
    hold_features: bool
    feature_sinks: _containers.RepeatedScalarFieldContainer[str]
    item_feature_sink: _common_pb2.Tensor
    release_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Union[PackedItems, _Mapping]] = ..., feature_layers: _Optional[_Iterable[int]] = ..., grant_steps: _Optional[int] = ..., stops: _Optional[_Union[GrantStops, _Mapping]] = ..., traceparent: _Optional[str] = ..., hold_features: _Optional[bool] = ..., feature_sinks: _Optional[_Iterable[str]] = ..., item_feature_sink: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., release_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Interrupt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepCall(_message.Message):
    __slots__ = ("step", "interrupt")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_FIELD_NUMBER: _ClassVar[int]
    step: PackedStep
    interrupt: Interrupt
    def __init__(self, step: _Optional[_Union[PackedStep, _Mapping]] = ..., interrupt: _Optional[_Union[Interrupt, _Mapping]] = ...) -> None: ...

class PackedResults(_message.Message):
    __slots__ = ("item_index", "num_accepted", "accepted_nodes", "tokens", "logprobs", "num_committed", "top_k", "top_ids", "top_logprobs", "features", "feature_counts")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    item_index: _common_pb2.Tensor
    num_accepted: _common_pb2.Tensor
    accepted_nodes: _common_pb2.Tensor
    tokens: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    num_committed: _common_pb2.Tensor
    top_k: _common_pb2.Tensor
    top_ids: _common_pb2.Tensor
    top_logprobs: _common_pb2.Tensor
    features: _common_pb2.Tensor
    feature_counts: _common_pb2.Tensor
    def __init__(self, item_index: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_accepted: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., accepted_nodes: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_committed: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_k: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., feature_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("results", "error", "load", "step_seconds", "step_index", "done")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    results: PackedResults
    error: StepError
    load: _common_pb2.KvLoad
    step_seconds: float
    step_index: int
    done: bool
    def __init__(self, results: _Optional[_Union[PackedResults, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.KvLoad, _Mapping]] = ..., step_seconds: _Optional[float] = ..., step_index: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
