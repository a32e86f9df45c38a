"""miles.envs: text-agent environments with the gymnasium API, tools, hooks, tasks and a registry.

Built-in ids (also gymnasium ids "miles/<id>"): Calculator-v0, SQL-v0, Orders-v0, PythonSandbox-v0.
"""

from miles.envs.base import (
    Env,
    EnvError,
    EpisodeOverError,
    HookError,
    InvalidActionError,
    NoOracleError,
    OraclePolicy,
    ResetNeededError,
)
from miles.envs.bfcl import CATEGORIES as BFCL_CATEGORIES
from miles.envs.episode import EpisodeResult, arun_episode, run_episode
from miles.envs.hooks import HookDefinitionError, cleanup, reward, stop_condition
from miles.envs.recipe import EnvRecipe, import_user_modules
from miles.envs.registry import EnvSpec, RegistryError, UnknownEnvError, make, register, registry
from miles.envs.spaces import MessageSpace, MessagesSpace
from miles.envs.tasks import Task, TaskSource, TaskSourceError, UnknownTaskError
from miles.envs.tool_env import ToolEnv

register("Calculator-v0", "miles.envs.calculator:CalculatorEnv")
register("SQL-v0", "miles.envs.sql:SQLEnv")
register("Orders-v0", "miles.envs.orders:OrdersEnv")
register("PythonSandbox-v0", "miles.envs.python_sandbox:PythonSandboxEnv")
for _bfcl_id, _category in BFCL_CATEGORIES.items():  # needs bfcl-eval when made (the [bfcl] extra)
    register(_bfcl_id, "miles.envs.bfcl:BFCLMultiTurnEnv", category=_category)

__all__ = [
    "Env",
    "EnvError",
    "EnvRecipe",
    "EnvSpec",
    "EpisodeOverError",
    "EpisodeResult",
    "HookDefinitionError",
    "HookError",
    "InvalidActionError",
    "MessageSpace",
    "MessagesSpace",
    "NoOracleError",
    "OraclePolicy",
    "RegistryError",
    "ResetNeededError",
    "Task",
    "TaskSource",
    "TaskSourceError",
    "ToolEnv",
    "UnknownEnvError",
    "UnknownTaskError",
    "arun_episode",
    "cleanup",
    "import_user_modules",
    "make",
    "register",
    "registry",
    "reward",
    "run_episode",
    "stop_condition",
]
