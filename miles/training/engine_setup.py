"""The rollout engines a train config names, attached and checked before the first step.

- `embedded`: `engine.num_engines` in-process engines, each with its own copy of the policy; the scheduler's
  router spreads sessions over them (session affinity keeps each session on its KV cache).
- `sglang`: one HTTP client per URL of `engine.urls` (SGLang servers or `miles rollout` servers); the
  scheduler's router spreads sessions over them.
- `router`: the real sglang-router (`python -m sglang_router.launch_router`) is started in front of
  `engine.urls`; generation goes through it (its routing key keeps a session on one worker), weight sync and
  aborts go to each worker directly.

HTTP engines are attached first (`miles.engines.attach`): unreachable servers and servers with another tokenizer
are refused with one line, and the smallest context length they report bounds every session.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.config import ConfigError
from miles.engine import RolloutEngine
from miles.engines.attach import ServerFacts, attach
from miles.sessions.config import SchedulerConfig
from miles.training.config import EngineConfig


@dataclass(frozen=True)
class EngineSet:
    """The engines of one run: `rollout` is what the scheduler sends sessions to, `workers` is every engine
    that holds weights (what weight sync updates), and `facts` what attached HTTP servers reported."""

    rollout: list[RolloutEngine]
    workers: list[RolloutEngine]
    is_http: bool
    facts: list[ServerFacts] = field(default_factory=list)

    @property
    def context_length(self) -> int | None:
        """The smallest context length any attached server reported (None: unknown or embedded)."""
        known = [f.context_length for f in self.facts if f.context_length]
        return min(known) if known else None

    async def close(self) -> None:
        """Close every engine (routers close their workers)."""
        seen: set[int] = set()
        for engine in [*self.rollout, *self.workers]:
            if id(engine) not in seen:
                seen.add(id(engine))
                await engine.close()


async def build_engine_set(
    cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any, tokenizer_name: str
) -> EngineSet:
    """Start or attach the engines of `cfg`. Raises `ConfigError` (one line) for unusable servers."""
    if cfg.kind == "embedded":
        from miles.engines.embedded import EmbeddedEngine

        try:
            engines: list[RolloutEngine] = [
                EmbeddedEngine(
                    copy.deepcopy(model).eval(),
                    tokenizer=tokenizer,
                    device=cfg.device,
                    max_batch_size=cfg.max_batch_size,
                    engine_id=f"embedded-{i}",
                    kv_cache_fraction=cfg.kv_cache_fraction,
                )
                for i in range(cfg.num_engines)
            ]
        except ValueError as exc:  # a cache that holds (almost) nothing
            raise ConfigError("engine.kv_cache_fraction", str(exc)) from None
        return EngineSet(rollout=engines, workers=engines, is_http=False)
    facts = await attach(list(cfg.urls), tokenizer, tokenizer_name)
    if cfg.kind == "router":
        from miles.engines.sglang_router import SGLangRouter

        router = (
            await SGLangRouter.attach(cfg.router_url, list(cfg.urls))
            if cfg.router_url
            else await SGLangRouter.launch(list(cfg.urls))
        )
        return EngineSet(rollout=[router], workers=list(router.workers.values()), is_http=True, facts=facts)
    from miles.engines.client import SGLangClient

    clients: list[RolloutEngine] = [SGLangClient(url) for url in cfg.urls]
    return EngineSet(rollout=clients, workers=clients, is_http=True, facts=facts)


def bounded_by_context(scheduler: SchedulerConfig, context_length: int | None) -> SchedulerConfig:
    """`scheduler` with its session context length set to the engines' when the config left it open (or set
    it larger than the engines can hold), so sessions end `context_full` before a server refuses the prompt."""
    session = scheduler.session
    if context_length is None or (
        session.context_length is not None and session.context_length <= context_length
    ):
        return scheduler
    return dataclasses.replace(scheduler, session=dataclasses.replace(session, context_length=context_length))
