"""Rollout engines: the embedded transformers engine (default), its SGLang-native HTTP server, the SGLang
HTTP client, and the real sglang-router. Sessions route over several engines with `miles.sessions.Router`."""

from miles.engines.client import SGLangClient
from miles.engines.embedded import EmbeddedEngine
from miles.engines.errors import InvalidRequestError
from miles.engines.load import EngineLoad
from miles.engines.lora import AdapterError, AdapterWeights
from miles.engines.server import create_app, run_server, serve, serve_in_thread
from miles.engines.sglang_router import SGLangRouter
from miles.engines.weight_broadcast import (
    WeightBroadcaster,
    WeightReceiver,
    broadcast_weights,
    init_weight_update_group,
)

__all__ = [
    "AdapterError",
    "AdapterWeights",
    "EmbeddedEngine",
    "EngineLoad",
    "InvalidRequestError",
    "SGLangClient",
    "SGLangRouter",
    "WeightBroadcaster",
    "WeightReceiver",
    "broadcast_weights",
    "create_app",
    "init_weight_update_group",
    "run_server",
    "serve",
    "serve_in_thread",
]
