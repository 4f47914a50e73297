from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "logprobs", "json_schema", "json_object", "regex", "choice", "grammar", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    choice: RequestChoices
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: bool = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[RequestChoices, _Mapping]] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class RequestChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "output_token_ids", "pooling", "lora")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: RequestSamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: PoolingParams
    lora: LoRAAdapterRef
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[RequestSamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ..., lora: _Optional[_Union[LoRAAdapterRef, _Mapping]] = ...) -> None: ...

class LoRAAdapterRef(_message.Message):
    __slots__ = ("id", "name", "path")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    path: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("normalize", "dimensions")
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    normalize: bool
    dimensions: int
    def __init__(self, normalize: bool = ..., dimensions: _Optional[int] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens", "num_scheduled_tokens")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    resumed_req_ids: _containers.RepeatedScalarFieldContainer[str]
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., resumed_req_ids: _Optional[_Iterable[str]] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("scheduled_new_reqs", "scheduled_cached_reqs", "total_num_scheduled_tokens", "finished_req_ids", "step_id", "cached_new_token_ids", "scheduled_spec_decode_tokens")
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_SPEC_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    total_num_scheduled_tokens: int
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    step_id: int
    cached_new_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    scheduled_spec_decode_tokens: _containers.RepeatedCompositeFieldContainer[SpecDecodeTokens]
    def __init__(self, scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequestData, _Mapping]] = ..., total_num_scheduled_tokens: _Optional[int] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., step_id: _Optional[int] = ..., cached_new_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., scheduled_spec_decode_tokens: _Optional[_Iterable[_Union[SpecDecodeTokens, _Mapping]]] = ...) -> None: ...

class SpecDecodeTokens(_message.Message):
    __slots__ = ("req_id", "ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GrammarOutput(_message.Message):
    __slots__ = ("req_ids", "bitmask")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    bitmask: bytes
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., bitmask: _Optional[bytes] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "sampled_token_rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_token_rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., sampled_token_rank: _Optional[int] = ...) -> None: ...

class FloatVector(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("req_ids", "sampled_token_ids", "logprobs", "pooler_output", "prompt_logprobs", "token_logprobs")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    pooler_output: _containers.RepeatedCompositeFieldContainer[FloatVector]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    token_logprobs: _containers.RepeatedCompositeFieldContainer[LogprobsList]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., pooler_output: _Optional[_Iterable[_Union[FloatVector, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., token_logprobs: _Optional[_Iterable[_Union[LogprobsList, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, positions: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class LogprobsList(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, positions: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class ExecuteModelResponse(_message.Message):
    __slots__ = ("output",)
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    output: ModelRunnerOutput
    def __init__(self, output: _Optional[_Union[ModelRunnerOutput, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "num_blocks", "block_size", "dtype", "device", "tensor_parallel_size", "rank", "max_num_reqs", "eos_token_ids", "pipeline_parallel_size", "pp_rank", "tp_rank", "output_rank", "task", "pooling_type", "hidden_size", "normalize", "batch_invariant", "max_loras", "max_lora_rank", "weights", "quantization")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_RANK_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    tensor_parallel_size: int
    rank: int
    max_num_reqs: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pipeline_parallel_size: int
    pp_rank: int
    tp_rank: int
    output_rank: int
    task: str
    pooling_type: str
    hidden_size: int
    normalize: bool
    batch_invariant: bool
    max_loras: int
    max_lora_rank: int
    weights: str
    quantization: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., rank: _Optional[int] = ..., max_num_reqs: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pipeline_parallel_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., output_rank: _Optional[int] = ..., task: _Optional[str] = ..., pooling_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., normalize: bool = ..., batch_invariant: bool = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., weights: _Optional[str] = ..., quantization: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
