"""BFCL multi-turn (the Berkeley Function-Calling Leaderboard v4) as miles environments, scored by BFCL's own
checker.

Everything comes from the `bfcl-eval` package (`pip install --no-deps bfcl-eval`, the `[bfcl]` extra): the
entries and their ground truth (`load_dataset_entry`, `load_ground_truth_entry`), the function docs, the API
simulators (GorillaFileSystem, TwitterAPI, MessageAPI, TicketAPI, TradingBot, TravelAPI, VehicleControlAPI,
MathAPI) and the checker. An episode is one entry, run as BFCL's function-calling inference runs it:

- the tools are the entry's function docs, cast to JSON-schema types as BFCL casts them for OpenAI-style
  models; the first user turn is the prompt, and each later user turn arrives when the model answers without
  a tool call;
- each step's calls are executed by BFCL's `execute_multi_turn_func_call` on this episode's own simulator
  instances, and its result strings are the tool messages; a call that BFCL could not run (arguments that
  are not a JSON object, a function no simulator of the entry has) is a tool error instead and never runs;
- `miss_func` entries hold a function back until BFCL's holdout turn, whose user message then lists it (as
  BFCL's prompting mode does, so the prompt stays append-only); as in BFCL, a simulator function called
  before it is offered still runs;
- more than BFCL's `MAXIMUM_STEP_LIMIT` steps in one user turn force-quits the episode, as in BFCL;
- the reward is `multi_turn_checker` on the calls the episode executed, turn by turn (state and response
  checks), with BFCL's force-termination rule first: 1 when BFCL counts the entry correct, else 0.

Tasks split into train and held-out by a hash of the entry's number (`held_out_fraction` 0.25), so an entry
and its `miss_param`, `miss_func` and `long_context` variants (same number) always land on the same side. The oracle replays
the ground truth, one call per step; SFT uses it on the train split only (the train loop's `split`).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import json
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from miles.config import ConfigError
from miles.envs.base import Env, OraclePolicy
from miles.envs.hooks import cleanup, reward, stop_condition
from miles.envs.tasks import Task, TaskSource
from miles.tools import get_parser
from miles.types import Message, ToolCall, ToolErrorType

#: miles env id -> BFCL test category.
CATEGORIES = {
    "BFCL-MultiTurn-v0": "multi_turn_base",
    "BFCL-MultiTurn-MissParam-v0": "multi_turn_miss_param",
    "BFCL-MultiTurn-MissFunc-v0": "multi_turn_miss_func",
    "BFCL-MultiTurn-LongContext-v0": "multi_turn_long_context",
}
_CALL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BFCLNotInstalledError(ConfigError):
    """The `bfcl-eval` package is missing."""

    def __init__(self) -> None:
        super().__init__(
            "env.id",
            "the BFCL envs need the bfcl-eval package: pip install --no-deps bfcl-eval "
            '(or pip install -e ".[bfcl]")',
        )


@functools.cache
def bfcl_modules() -> Any:
    """BFCL's modules, imported once. BFCL writes result and lock folders under `BFCL_PROJECT_ROOT` on import
    (by default inside site-packages); unless set, that is a cache folder of miles."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path.home() / ".cache" / "miles" / "bfcl"))
    try:
        from bfcl_eval import utils
        from bfcl_eval.constants import default_prompts, executable_backend_config, type_mappings
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
    except ImportError as exc:
        raise BFCLNotInstalledError() from exc

    return SimpleNamespace(
        utils=utils,
        prompts=default_prompts,
        backend=executable_backend_config,
        types=type_mappings,
        checker=multi_turn_checker,
        execution=multi_turn_utils,
    )


@functools.cache
def entries(category: str) -> dict[str, tuple[dict[str, Any], list[list[str]]]]:
    """Entry id -> (the entry with its function docs, its ground-truth calls per turn), read through BFCL."""
    b = bfcl_modules()
    truth = {g["id"]: g["ground_truth"] for g in b.utils.load_ground_truth_entry(category)}
    return {e["id"]: (e, truth[e["id"]]) for e in b.utils.load_dataset_entry(category)}


def _openai_type(schema: Mapping[str, Any]) -> dict[str, Any]:
    """One BFCL parameter schema in JSON-schema types, by BFCL's own GORILLA_TO_OPENAPI mapping (a `float`
    gets `format: float` and BFCL's note in its description, as BFCL's OpenAI handlers send it)."""
    out = dict(schema)
    kind = out.get("type")
    if kind == "float":
        out["format"] = "float"
        out["description"] = out.get("description", "") + " This is a float type value."
    out["type"] = bfcl_modules().types.GORILLA_TO_OPENAPI.get(kind, "string") if kind else "string"
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {k: _openai_type(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), Mapping):
        out["items"] = _openai_type(out["items"])
    return out


def tool_schema(function_doc: Mapping[str, Any]) -> dict[str, Any]:
    """A BFCL function doc as an OpenAI function tool."""
    params = dict(function_doc.get("parameters") or {})
    params["type"] = "object"
    params["properties"] = {k: _openai_type(v) for k, v in (params.get("properties") or {}).items()}
    return {
        "type": "function",
        "function": {
            "name": function_doc["name"],
            "description": function_doc.get("description", ""),
            "parameters": params,
        },
    }


def call_string(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as BFCL executes it: `name(key=repr(value), ...)`, as BFCL's `convert_to_function_call` writes a
    function-calling model's output."""
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _forget(prefix: str) -> None:
    """Drop the simulator instances that BFCL's executor cached under `prefix` (it keys them in its module
    globals by model name, entry id and class)."""
    cached = vars(bfcl_modules().execution)
    for key in [k for k in cached if k.startswith(prefix)]:
        cached.pop(key, None)


def score(entry: Mapping[str, Any], ground_truth: list[list[str]], executed: list[list[list[str]]]) -> dict:
    """BFCL's verdict on one entry: `executed` holds, per user turn, the non-empty lists of calls of each step.

    As BFCL's evaluation does: a result with fewer turns than the ground truth was force-terminated; otherwise
    `multi_turn_checker` decides, under a model name of its own so that nothing is shared between calls.
    """
    if len(executed) != len(ground_truth):
        return {
            "valid": False,
            "error_type": "multi_turn:force_terminated",
            "error_message": f"the model's result has {len(executed)} turns, the ground truth "
            f"{len(ground_truth)}",
        }
    name = f"miles_score_{uuid.uuid4().hex}"
    category = entry["id"].rsplit("_", 1)[0]
    try:
        result = bfcl_modules().checker.multi_turn_checker(
            executed, ground_truth, dict(entry), category, name
        )
    finally:
        _forget(re.sub(r"[-./:]", "_", name))
    return {k: v for k, v in result.items() if k in ("valid", "error_type", "error_message")}


def parse_call(text: str, entry: Mapping[str, Any]) -> ToolCall:
    """A ground-truth call string (`cd(folder='x')`, `sort('f')`) as a tool call with named arguments;
    positional arguments are named from the simulator method's signature."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call: {text!r}")
    name = node.func.id
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    if node.args:
        params = _signature(name, tuple(entry["involved_classes"]))
        args = {**{p: ast.literal_eval(a) for p, a in zip(params, node.args, strict=False)}, **args}
    return ToolCall(name=name, arguments=args, raw_arguments=json.dumps(args))


def _simulator(class_name: str) -> type:
    return getattr(
        importlib.import_module(bfcl_modules().backend.CLASS_FILE_PATH_MAPPING[class_name]), class_name
    )


@functools.cache
def _signature(name: str, classes: tuple[str, ...]) -> list[str]:
    for class_name in classes:
        cls = _simulator(class_name)
        if hasattr(cls, name):
            return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
    raise ValueError(f"no simulator of {classes} has a method {name!r}")


@functools.cache
def executable_names(classes: tuple[str, ...]) -> frozenset[str]:
    """The functions BFCL's executor can run for an entry: the public methods of its simulators (a superset of
    the functions offered: BFCL runs a held-out function too, and one `miss_func` ground truth calls one)."""
    return frozenset(
        name
        for class_name in classes
        for name, _ in inspect.getmembers(_simulator(class_name), inspect.isfunction)
        if not name.startswith("_")
    )


class BFCLOracle(OraclePolicy):
    """Replays the ground truth: each turn's calls one per step (several per step only where a turn has more
    calls than BFCL's step limit), then a short answer that ends the turn (for a turn whose ground truth is
    empty, only the answer)."""

    def act(self, messages: list[Message]) -> Message:
        env = self.env
        assert isinstance(env, BFCLMultiTurnEnv)
        entry, truth = env.entry
        turn, done = env.state["turn"], env.state["steps"]
        calls = truth[turn]
        per_step = -(-len(calls) // env.max_steps_per_turn) if calls else 1  # within BFCL's step limit
        if done * per_step < len(calls):
            chunk = calls[done * per_step : (done + 1) * per_step]
            parsed = [parse_call(c, entry) for c in chunk]
            for k, call in enumerate(parsed):
                call.id = f"call_{turn}_{done}_{k}"
            return Message("assistant", tool_calls=parsed)
        return Message(
            "assistant",
            "Done." if calls else "I cannot do that with the functions and the information I have.",
        )


class BFCLMultiTurnEnv(Env):
    """One BFCL multi-turn category (`category`, e.g. "multi_turn_base"); see the module docstring."""

    max_turns = 60
    held_out_fraction = 0.25
    success_component = "bfcl"
    parser = "hermes"

    def __init__(
        self,
        tasks: TaskSource | Iterable[Task | Mapping[str, Any]] | None = None,
        *,
        category: str = "multi_turn_base",
        max_steps_per_turn: int | None = None,
        **kwargs: Any,
    ) -> None:
        if category not in CATEGORIES.values():
            raise ConfigError(
                "env.kwargs.category",
                f"{category!r} is not a BFCL multi-turn category ({', '.join(CATEGORIES.values())})",
            )
        self.category = category
        self.max_steps_per_turn = (
            max_steps_per_turn
            if max_steps_per_turn is not None
            else bfcl_modules().prompts.MAXIMUM_STEP_LIMIT
        )
        super().__init__(tasks, **kwargs)
        self.env_id = next(k for k, v in CATEGORIES.items() if v == category)
        self._parser = get_parser(self.parser)

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_iterable(
            [
                Task(
                    id=entry_id,
                    prompt=entry["question"][0][0]["content"],
                    data={"category": self.category, "split_key": f"bfcl-{entry_id.rsplit('_', 1)[1]}"},
                )
                for entry_id, (entry, _) in entries(self.category).items()
            ],
            name=self.category,
        )

    @property
    def entry(self) -> tuple[dict[str, Any], list[list[str]]]:
        """The current episode's BFCL entry and ground truth."""
        assert self.task is not None, "reset first"
        return entries(self.category)[self.task.id]

    # ---- the episode -----------------------------------------------------------------------------------
    async def on_reset(self, task: Task) -> None:
        entry, _ = entries(self.category)[task.id]
        self.state.update(
            turn=0,
            steps=0,
            executed=[[]],
            functions=list(entry["function"]),
            instances=f"miles_{uuid.uuid4().hex}",
            force_quit=False,
        )
        self._execute([])  # BFCL's executor builds this episode's simulators from the entry's initial config

    def initial_messages(self, task: Task) -> list[Message]:
        entry, _ = entries(self.category)[task.id]
        return [Message(m["role"], m["content"]) for m in entry["question"][0]]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(f) for f in self.state.get("functions", [])]

    def parse_action(self, text: str) -> Message:
        return self._parser.parse(text).to_message()

    def is_final(self, action: Message) -> bool:
        entry, _ = self.entry
        return not action.tool_calls and self.state["turn"] == len(entry["question"]) - 1

    async def react(self, action: Message) -> list[Message]:
        if not action.tool_calls:
            return self._next_user_turn()
        entry, _ = self.entry
        runs = executable_names(tuple(entry["involved_classes"]))
        contents: list[str | None] = []
        runnable: list[str] = []
        for call in action.tool_calls:
            problem = self._refusal(call, runs)
            if problem is not None:
                kind, text = problem
                self.tool_errors[kind.value] += 1
                contents.append(f"Error: {text}")
            else:
                contents.append(None)
                runnable.append(call_string(call.name, call.arguments or {}))
        results = iter(await asyncio.to_thread(self._execute, runnable) if runnable else [])
        if runnable:
            self.state["executed"][-1].append(runnable)
        self.state["steps"] += 1
        self.state["force_quit"] = self.state["steps"] > self.max_steps_per_turn
        return [
            Message(
                "tool",
                content if content is not None else next(results),
                tool_call_id=call.id,
                name=call.name,
            )
            for call, content in zip(action.tool_calls, contents, strict=True)
        ]

    def _refusal(self, call: ToolCall, runs: frozenset[str]) -> tuple[ToolErrorType, str] | None:
        """Why BFCL could not run `call` (its arguments are not a JSON object, or no simulator has the
        function), or None."""
        if call.parse_error is not None or not isinstance(call.arguments, dict):
            return ToolErrorType.INVALID_JSON, (
                f"could not parse the tool call '{call.name}': "
                f"{call.parse_error or 'arguments are not a JSON object'}"
            )
        if call.name not in runs or not _CALL_NAME.match(call.name):
            offered = sorted(f["name"] for f in self.state["functions"])
            return (
                ToolErrorType.UNKNOWN_TOOL,
                f"unknown tool '{call.name}'. Available tools: {', '.join(offered)}.",
            )
        if not all(isinstance(k, str) and k.isidentifier() for k in call.arguments):
            return ToolErrorType.SCHEMA_VIOLATION, f"argument names of '{call.name}' must be identifiers"
        return None

    def _next_user_turn(self) -> list[Message]:
        entry, _ = self.entry
        turn = self.state["turn"] = self.state["turn"] + 1
        self.state["steps"] = 0
        self.state["executed"].append([])
        held = (entry.get("missed_function") or {}).get(str(turn))
        if held:  # BFCL's holdout turn: the functions come back, listed in the user message
            self.state["functions"] = [*self.state["functions"], *held]
            listed = json.dumps([tool_schema(f) for f in held], ensure_ascii=False)
            return [
                Message(
                    "user",
                    bfcl_modules().prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                        functions=listed
                    ),
                )
            ]
        return [Message(m["role"], m["content"]) for m in entry["question"][turn]]

    def _execute(self, calls: list[str]) -> list[str]:
        entry, _ = self.entry
        results, _ = bfcl_modules().execution.execute_multi_turn_func_call(
            calls,
            entry["initial_config"],
            entry["involved_classes"],
            self.state["instances"],
            entry["id"],
            long_context=self.category == "multi_turn_long_context",
            is_evaL_run=False,
        )
        return [str(r) for r in results]

    # ---- hooks -----------------------------------------------------------------------------------------
    @stop_condition
    def force_quit(self, state: dict) -> bool:
        """BFCL's step limit: more than `MAXIMUM_STEP_LIMIT` steps in one user turn ends the entry."""
        return bool(state["force_quit"])

    @reward(weight=1.0)
    def bfcl(self, state: dict, info: dict) -> float:
        """1 when BFCL's evaluation counts the episode's calls correct (a force-quit episode keeps the turns it
        reached, as BFCL's result does)."""
        entry, truth = self.entry
        verdict = score(entry, truth, state["executed"])
        info["bfcl"] = verdict
        return float(verdict["valid"])

    @cleanup
    def release(self, state: dict) -> None:
        if "instances" in state:
            _forget(state["instances"])

    def oracle(self) -> BFCLOracle:
        return BFCLOracle().bind(self)
