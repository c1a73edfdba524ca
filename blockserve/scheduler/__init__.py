"""Continuous batching over the KV cache manager. Pure Python: never imports torch."""

from blockserve.scheduler.config import SchedulerConfig
from blockserve.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from blockserve.scheduler.request import Request, RequestRejected, RequestStatus
from blockserve.scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
