"""Run one episode of an env with a policy (an `OraclePolicy` or any `messages -> Message` callable)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.envs.base import Env, OraclePolicy
from miles.types import Message

Policy = OraclePolicy | Callable[[list[Message]], Message]


@dataclass
class EpisodeResult:
    """The whole conversation of one episode and how it ended."""

    messages: list[Message]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return bool(self.info.get("success", False))


def _act(policy: Policy, messages: list[Message]) -> Message:
    return policy.act(list(messages)) if isinstance(policy, OraclePolicy) else policy(list(messages))


async def arun_episode(
    env: Env, policy: Policy | None = None, *, seed: int | None = None, options: dict[str, Any] | None = None
) -> EpisodeResult:
    """Reset `env` and step it with `policy` (default: the env's oracle) until the episode ends."""
    policy = policy if policy is not None else env.oracle()
    obs, info = await env.areset(seed=seed, options=options)
    messages = list(obs)
    while True:
        action = env._coerce_action(_act(policy, messages))
        obs, reward, terminated, truncated, info = await env.astep(action)
        messages.append(action)
        messages.extend(obs)
        if terminated or truncated:
            return EpisodeResult(messages, reward, terminated, truncated, info)


def run_episode(
    env: Env, policy: Policy | None = None, *, seed: int | None = None, options: dict[str, Any] | None = None
) -> EpisodeResult:
    """Sync twin of `arun_episode` (not usable inside a running event loop)."""
    return env._run(arun_episode(env, policy, seed=seed, options=options))
