"""miles: reinforcement-learning post-training of LLM agents that use tools over many turns."""

from miles.engine import EngineError, FinishReason, GenerateResult, RolloutEngine, SamplingParams
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta, TurnSpan
from miles.types import Message, TerminationReason, ToolCall, ToolErrorType, ToolResult

__version__ = "0.1.0"

__all__ = [
    "EngineError",
    "FinishReason",
    "GenerateResult",
    "Message",
    "RolloutEngine",
    "SamplingParams",
    "TerminationReason",
    "ToolCall",
    "ToolErrorType",
    "ToolResult",
    "Trajectory",
    "TrajectoryBatch",
    "TrajectoryMeta",
    "TurnSpan",
]
