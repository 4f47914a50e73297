"""batchwire's scheduler service: requests, the continuous-batching scheduler, the KV block manager,
the engine loop, executors, and the offline API."""

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.errors import InvalidRequestError, QueueFullError
from scheduler_svc.llm import LLM
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.sampling_params import SamplingParams

__all__ = ["LLM", "InvalidRequestError", "QueueFullError", "RequestOutput", "SamplingParams",
           "SchedulerConfig"]
