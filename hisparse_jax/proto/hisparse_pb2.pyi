from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    ABORT: _ClassVar[FinishReason]
    STOP_TOKEN: _ClassVar[FinishReason]
    STOP_STRING: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
ABORT: FinishReason
STOP_TOKEN: FinishReason
STOP_STRING: FinishReason

class PrefillMessage(_message.Message):
    __slots__ = ("request", "received")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    received: KVReceived
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., received: _Optional[_Union[KVReceived, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("input_ids", "temperature", "top_p", "top_k", "seed")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    input_ids: TokenIds
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class KVReceived(_message.Message):
    __slots__ = ("pulled", "pull_proof")
    PULLED_FIELD_NUMBER: _ClassVar[int]
    PULL_PROOF_FIELD_NUMBER: _ClassVar[int]
    pulled: bool
    pull_proof: int
    def __init__(self, pulled: _Optional[bool] = ..., pull_proof: _Optional[int] = ...) -> None: ...

class PrefillOffer(_message.Message):
    __slots__ = ("first_token", "transfer_uuid", "transfer_address", "kv_positions", "latent_dtype", "prefill_seconds", "kv_bytes", "num_layers", "latent_dim", "index_dim", "numerics", "model_fingerprint")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_UUID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LATENT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LATENT_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_DIM_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    transfer_uuid: int
    transfer_address: str
    kv_positions: int
    latent_dtype: str
    prefill_seconds: float
    kv_bytes: int
    num_layers: int
    latent_dim: int
    index_dim: int
    numerics: str
    model_fingerprint: str
    def __init__(self, first_token: _Optional[int] = ..., transfer_uuid: _Optional[int] = ..., transfer_address: _Optional[str] = ..., kv_positions: _Optional[int] = ..., latent_dtype: _Optional[str] = ..., prefill_seconds: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., latent_dim: _Optional[int] = ..., index_dim: _Optional[int] = ..., numerics: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_fingerprint", "num_layers", "latent_dim", "index_dim", "latent_dtype", "transfer_address", "max_seq_len", "numerics", "page_size")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LATENT_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_DIM_FIELD_NUMBER: _ClassVar[int]
    LATENT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    num_layers: int
    latent_dim: int
    index_dim: int
    latent_dtype: str
    transfer_address: str
    max_seq_len: int
    numerics: str
    page_size: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., latent_dim: _Optional[int] = ..., index_dim: _Optional[int] = ..., latent_dtype: _Optional[str] = ..., transfer_address: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., numerics: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "input_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "ignore_eos", "include_stop_str_in_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    input_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    include_stop_str_in_output: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "prompt_tokens", "completion_tokens", "swap_in_hits", "swap_in_misses", "matched_stop", "num_preemptions", "prefill_seconds", "transfer_seconds", "transfer_bytes", "decode_seconds", "swap_in_prefetched")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_HITS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_MISSES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    swap_in_hits: int
    swap_in_misses: int
    matched_stop: str
    num_preemptions: int
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    decode_seconds: float
    swap_in_prefetched: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., swap_in_hits: _Optional[int] = ..., swap_in_misses: _Optional[int] = ..., matched_stop: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., decode_seconds: _Optional[float] = ..., swap_in_prefetched: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolUsage(_message.Message):
    __slots__ = ("name", "memory", "page_size", "pages_total", "pages_free", "bytes_per_page")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory: str
    page_size: int
    pages_total: int
    pages_free: int
    bytes_per_page: int
    def __init__(self, name: _Optional[str] = ..., memory: _Optional[str] = ..., page_size: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., bytes_per_page: _Optional[int] = ...) -> None: ...

class Loads(_message.Message):
    __slots__ = ("running", "queued", "free_lanes", "device_kv_bytes_used", "device_kv_bytes_budget", "free_host_rows", "host_rows_total", "pools", "preemptions", "offloads", "resident")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    FREE_LANES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FREE_HOST_ROWS_FIELD_NUMBER: _ClassVar[int]
    HOST_ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    running: int
    queued: int
    free_lanes: int
    device_kv_bytes_used: int
    device_kv_bytes_budget: int
    free_host_rows: int
    host_rows_total: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolUsage]
    preemptions: int
    offloads: int
    resident: int
    def __init__(self, running: _Optional[int] = ..., queued: _Optional[int] = ..., free_lanes: _Optional[int] = ..., device_kv_bytes_used: _Optional[int] = ..., device_kv_bytes_budget: _Optional[int] = ..., free_host_rows: _Optional[int] = ..., host_rows_total: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolUsage, _Mapping]]] = ..., preemptions: _Optional[int] = ..., offloads: _Optional[int] = ..., resident: _Optional[int] = ...) -> None: ...
