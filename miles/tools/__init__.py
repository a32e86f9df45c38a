"""miles.tools: `@tool` schemas from signatures and docstrings, argument validation, tool-call parsers,
concurrent execution with timeouts, and sandboxed Python."""

from miles.tools.errors import ToolDefinitionError
from miles.tools.parser_base import ParsedOutput, ToolCallParser
from miles.tools.parser_hermes import HermesParser
from miles.tools.parser_llama3 import Llama3JsonParser
from miles.tools.parser_qwen3 import Qwen3Parser, split_reasoning
from miles.tools.parsers import UnknownParserError, available_parsers, get_parser, register_parser
from miles.tools.python_tool import format_sandbox_result, make_run_python_tool, run_python
from miles.tools.sandbox import (
    SandboxError,
    SandboxResult,
    arun_python_sandboxed,
    bwrap_problem,
    run_python_sandboxed,
    sandbox_backend,
)
from miles.tools.schema import Injected, is_injected, type_schema
from miles.tools.spec import ToolSpec, build_spec, collect_tools, get_spec, tool
from miles.tools.toolbox import ToolBox, count_errors, format_output, truncate_output

__all__ = [
    "HermesParser",
    "Injected",
    "Llama3JsonParser",
    "ParsedOutput",
    "Qwen3Parser",
    "SandboxError",
    "SandboxResult",
    "ToolBox",
    "ToolCallParser",
    "ToolDefinitionError",
    "ToolSpec",
    "UnknownParserError",
    "arun_python_sandboxed",
    "available_parsers",
    "build_spec",
    "bwrap_problem",
    "collect_tools",
    "count_errors",
    "format_output",
    "format_sandbox_result",
    "get_parser",
    "get_spec",
    "is_injected",
    "make_run_python_tool",
    "register_parser",
    "run_python",
    "run_python_sandboxed",
    "sandbox_backend",
    "split_reasoning",
    "tool",
    "truncate_output",
    "type_schema",
]
