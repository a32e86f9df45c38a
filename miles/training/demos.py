"""Oracle demonstrations as TITO trajectories, for the SFT warm start."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from miles.engine import FinishReason
from miles.envs import Env, Task, arun_episode
from miles.tito.conversation import Conversation
from miles.trajectory import Trajectory
from miles.types import Message


def demo_trajectory(
    tito: Any, messages: Sequence[Message], tools: list[dict] | None, *, first_assistant: int
) -> Trajectory:
    """Tokenize one finished conversation exactly as a rollout would have produced it.

    `messages[:first_assistant]` is the prompt. Each assistant message is appended as the ids a
    template-faithful model emits (loss mask 1); everything between them as observation deltas (mask 0).
    """
    conv = Conversation(tito, list(messages[:first_assistant]), tools)
    history = list(messages[:first_assistant])
    i = first_assistant
    while i < len(messages):
        assistant = messages[i]
        if assistant.role != "assistant":
            raise ValueError(f"message {i} should be an assistant turn, got {assistant.role!r}")
        ids = tito.expected_generation(history, assistant, tools)
        conv.append_generation(ids, [0.0] * len(ids), weight_version=0, finish_reason=FinishReason.STOP)
        j = i + 1
        while j < len(messages) and messages[j].role != "assistant":
            j += 1
        observation = list(messages[i + 1 : j])
        history.append(assistant)
        if j < len(messages) or observation:
            conv.append_observation(assistant, observation)
            history.extend(observation)
        else:
            conv.finish(assistant)
        i = j
    if not conv.finished:
        conv.finish()
    return conv.trajectory


async def oracle_demos(
    env_factory: Callable[[], Env], tasks: Sequence[Task], tito: Any, *, only_successful: bool = True
) -> list[Trajectory]:
    """Run the env's scripted oracle on each task and tokenize the episodes through TITO."""
    env = env_factory()
    out: list[Trajectory] = []
    try:
        for task in tasks:
            result = await arun_episode(env, seed=0, options={"task": task})
            if only_successful and not result.success:
                continue
            first = next(k for k, m in enumerate(result.messages) if m.role == "assistant")
            traj = demo_trajectory(tito, result.messages, env.tool_schemas(), first_assistant=first)
            traj.reward = result.reward
            traj.meta.env_id = env.env_id
            traj.meta.task_id = task.id
            out.append(traj)
    finally:
        await env.aclose()
    return out
