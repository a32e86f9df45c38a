"""The typed settings of the OpenAI endpoint: per session (`OpenAISessionConfig`), of the server
(`OpenAIEndpointConfig`, the `--openai KEY=VALUE` keys of `python -m miles.engines`), and of external agents in
`miles train` (`AgentConfig`, the `rollout.agent` section). Kept apart so that loading a config imports no server."""

from __future__ import annotations

import shlex
import shutil
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from miles.config import ConfigError
from miles.sessions.config import RetryConfig, TimeoutConfig

#: The largest request body the endpoint reads (413 above it).
MAX_REQUEST_BYTES = 8 << 20

#: The placeholders `AgentConfig.command` may use.
PLACEHOLDERS = ("base_url", "api_key", "session_id", "task_id", "task_file")


@dataclass(frozen=True)
class OpenAISessionConfig:
    """How each endpoint session behaves.

    - `history_mismatch`: a request whose messages do not extend the session's history is refused with a 409
      naming the first differing message ("error"), or starts a new branch re-rendered from its messages
      ("fork"; every branch is recorded and trained, and forks are counted).
    - `parser`: the `miles.tools` tool-call parser of the model's output ("hermes", "qwen3", "llama3_json").
    - `max_tokens`: a request's token budget when it gives none. `max_turns`: chat requests per session
      (None: unbounded). `context_length`: the model's context (None: the engine's, when it reports one).
    - `idle_timeout_s`: a session without requests for this long is closed as `timeout`.
    - `max_open_sessions`: a server that opens sessions on request (`miles rollout --openai`) refuses a new
      one (429) while this many are open.
    - `timeouts`, `retry`: the generate calls' deadlines and retries, as for internal sessions, except that
      a turn's deadline is at least a minute by default (a client waits for its reply; a turn cut short at
      its deadline is a 504 that the client repeats, work lost).
    """

    history_mismatch: Literal["error", "fork"] = "error"
    parser: str = "hermes"
    max_tokens: int = 256
    max_turns: int | None = None
    context_length: int | None = None
    idle_timeout_s: float = 1800.0
    max_open_sessions: int = 1024
    timeouts: TimeoutConfig = field(default_factory=lambda: TimeoutConfig(turn_floor_s=60.0))
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        from miles.tools import UnknownParserError, get_parser

        try:
            get_parser(self.parser)
        except UnknownParserError as exc:
            raise ConfigError("parser", str(exc)) from None
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", "must be >= 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError("max_turns", "must be >= 1 or null")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError("context_length", "must be >= 2 or null")
        if self.max_open_sessions < 1:
            raise ConfigError("max_open_sessions", "must be >= 1")
        if self.idle_timeout_s <= 0:
            raise ConfigError("idle_timeout_s", "must be > 0")


@dataclass(frozen=True)
class SamplingOverride:
    """Sampling the server imposes on a session whatever the client asks: `temperature` and `top_p` replace
    the client's values, `max_tokens` caps them (None leaves the client's)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class OpenAIEndpointConfig:
    """The `--openai KEY=VALUE` settings of `python -m miles.engines` (and so of `miles rollout`).

    `tokenizer` (a `miles.tito.load_tokenizer` name or folder; default: the served model's), `chat_template`
    (an override such as "compact"), `record` (a `sessions.jsonl` for every closed session), `model_name`
    (what `/v1/models` lists; default: the served model), `max_request_bytes`, and `session` (how each session
    behaves, e.g. `session.history_mismatch=fork`).
    """

    tokenizer: str | None = None
    chat_template: str | None = None
    record: str | None = None
    model_name: str | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    session: OpenAISessionConfig = field(default_factory=OpenAISessionConfig)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes", "must be >= 1024")


@dataclass(frozen=True)
class AgentConfig:
    """`rollout.agent`: train an agent that speaks the OpenAI API, run as `command` once per session.

    - `command`: the agent's command line (split like a shell would, not run through one; empty: no external
      agent, the loop's own sessions run), with
      `{base_url}`, `{api_key}`, `{session_id}`, `{task_id}`, `{task_file}` placeholders, e.g.
      `python examples/openai_agent.py --base-url {base_url}`.
    - `env`: more environment variables for it. `timeout_s`: its time limit per session.
    - `max_concurrent`: agents running at once. `reward`: see the module docstring.
    - `sampling`: sampling the server imposes whatever the agent asks (e.g. `temperature: 1.0` for on-policy
      RL; `max_tokens` caps the agent's).
    - `session`: how each endpoint session behaves (`history_mismatch: error | fork`, parser, limits).
    - `host`, `port`: where the endpoint listens (port 0: a free one). `log_dir`: the agents' output, one file
      per session (default: a temporary folder); `keep_logs` keeps the logs of sessions that ended well.
    """

    command: str = ""
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    max_concurrent: int = 16
    reward: Literal["auto", "env", "client"] = "auto"
    sampling: SamplingOverride = field(default_factory=SamplingOverride)
    session: OpenAISessionConfig = field(default_factory=OpenAISessionConfig)
    host: str = "127.0.0.1"
    port: int = 0
    log_dir: str | None = None
    keep_logs: bool = False

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        argv = self.argv(**{p: p for p in PLACEHOLDERS})
        program = argv[0]
        if shutil.which(program) is None and not Path(program).is_file():
            raise ConfigError(
                "command",
                f"{program!r} is not a program on PATH or a file; give the agent's command "
                "line, e.g. 'python my_agent.py'",
            )
        if self.timeout_s <= 0:
            raise ConfigError("timeout_s", "must be > 0")
        if self.max_concurrent < 1:
            raise ConfigError("max_concurrent", "must be >= 1")

    @property
    def enabled(self) -> bool:
        """Whether an external agent runs the sessions (a command is set)."""
        return bool(self.command.strip())

    def argv(self, **values: str) -> list[str]:
        """The command line with its placeholders filled in."""
        try:
            parts = shlex.split(self.command)
        except ValueError as exc:
            raise ConfigError("command", f"cannot split {self.command!r}: {exc}") from None
        if not parts:
            raise ConfigError(
                "command", "give the agent's command line, e.g. 'python my_agent.py {base_url}'"
            )
        out = []
        for part in parts:
            names = {name for _, name, _, _ in string.Formatter().parse(part) if name is not None}
            unknown = sorted(names - set(PLACEHOLDERS))
            if unknown:
                raise ConfigError(
                    "command",
                    f"unknown placeholder {{{unknown[0]}}}; known: "
                    f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}",
                )
            out.append(part.format(**values))
        return out
