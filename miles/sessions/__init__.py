"""Sessions: multi-turn episodes against rollout engines, the async scheduler that runs thousands of them,
and the crash-safe recording and replay of every one."""

from miles.sessions.config import ConfigError, RetryConfig, SchedulerConfig, SessionConfig, TimeoutConfig
from miles.sessions.deadlines import ThroughputEstimate, ThroughputEstimator, TurnDeadline
from miles.sessions.instant import InstantEngine
from miles.sessions.progress import ProgressDisplay, RunStats
from miles.sessions.recorder import BadLine, ReadResult, Recorder, RecorderError, encode_record, read_sessions
from miles.sessions.records import AttemptRecord, ErrorInfo, SessionRecord, TurnRecord, jsonable
from miles.sessions.retry import backoff_delay_s, is_retryable
from miles.sessions.router import (
    EngineState,
    EngineStats,
    Lease,
    NoHealthyEngineError,
    Placement,
    Router,
    RouterStats,
)
from miles.sessions.scheduler import Group, SessionScheduler
from miles.sessions.session import Session, SessionEnv
from miles.sessions.spec import InvalidTaskError, SessionSpec, TaskSpec

__all__ = [
    "AttemptRecord",
    "BadLine",
    "ConfigError",
    "EngineState",
    "EngineStats",
    "ErrorInfo",
    "Group",
    "InstantEngine",
    "InvalidTaskError",
    "Lease",
    "NoHealthyEngineError",
    "Placement",
    "ProgressDisplay",
    "ReadResult",
    "Recorder",
    "RecorderError",
    "RetryConfig",
    "Router",
    "RouterStats",
    "RunStats",
    "SchedulerConfig",
    "Session",
    "SessionConfig",
    "SessionEnv",
    "SessionRecord",
    "SessionScheduler",
    "SessionSpec",
    "TaskSpec",
    "ThroughputEstimate",
    "ThroughputEstimator",
    "TimeoutConfig",
    "TurnDeadline",
    "TurnRecord",
    "backoff_delay_s",
    "encode_record",
    "is_retryable",
    "jsonable",
    "read_sessions",
]
