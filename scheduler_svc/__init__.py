"""batchwire's scheduler service: requests, the continuous-batching scheduler, the KV block manager,
the engine loop, executors, and the offline API."""

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.errors import InvalidRequestError, QueueFullError
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.llm import LLM

__all__ = ["LLM", "InvalidRequestError", "QueueFullError", "RequestOutput", "SamplingParams",
           "SchedulerConfig"]
