"""`miles rollout`: launch rollout engines (the embedded engine, or SGLang servers) and front several of them
with the real sglang-router.

`LaunchSpec` holds what was asked for and refuses bad combinations; `plan_launch` turns it into the exact
command lines (`--dry-run` prints them); `serve` starts them, waits until every server answers `/health` and
the router has registered them, prints the URLs to put in a config, and blocks until SIGINT or SIGTERM. Then
it stops every child process, and whatever those started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from miles.config import ConfigError
from miles.engine import EngineError
from miles.engines.auth import API_KEY_ENV, TOKEN_ENV, admin_token, token_file
from miles.engines.errors import InvalidRequestError
from miles.engines.server import DTYPES, SMOLLM2, parse_model_spec
from miles.engines.sglang_router import SGLangRouter, router_command
from miles.engines.subprocesses import log_tail, spawn, stop

T = TypeVar("T")

ROUTER_POLICIES = ("manual", "cache_aware", "round_robin", "power_of_two", "random")
SGLANG_INSTALL = 'pip install "sglang[all]" on a GPU host (or --dry-run to print the commands)'
ROUTER_INSTALL = 'pip install "sglang-router" (or --no-router)'

#: SGLang flags that `miles rollout` sets itself, and the `miles rollout` flag to use instead.
LAUNCHER_OWNED_FLAGS = {
    "--model-path": "--model",
    "--model": "--model",
    "--tp-size": "--tp",
    "--tensor-parallel-size": "--tp",
    "--pp-size": "--pp",
    "--pipeline-parallel-size": "--pp",
    "--host": "--host",
    "--port": "--port",
    "--base-gpu-id": "--base-gpu-id",
    "--context-length": "--context-length",
    "--mem-fraction-static": "--mem-fraction",
    "--max-running-requests": "--max-running-requests",
    "--dtype": "--dtype",
    "--device": "--device",
}
_SGLANG_DP_FLAGS = ("--dp-size", "--data-parallel-size")
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}


class LaunchError(RuntimeError):
    """A server or the router failed to start, or exited while serving."""


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived."""


def split_host_port(value: str) -> tuple[str, int | None]:
    """`0.0.0.0:30001` -> ("0.0.0.0", 30001), `[::1]:30001` -> ("::1", 30001); a bare host -> (host, None)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        return value, None
    if not port:
        return host, None
    if not port.isdigit():
        raise ConfigError("--host", f"{value!r}: the part after ':' must be a port number")
    return host, int(port)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _flag_value(args: tuple[str, ...], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


@dataclass(frozen=True)
class LaunchSpec:
    """What `miles rollout` starts: `dp` servers of one engine kind (each on `tp * pp` GPUs with SGLang), on
    consecutive ports from `port`, and the sglang-router on `router_port` (default: the next free one of the
    series) when `router` is set (default: when `dp > 1`). Bad combinations raise `ConfigError` naming the flag.
    """

    engine: Literal["embedded", "sglang"] = "embedded"
    model: str = "tiny"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    context_length: int | None = None
    mem_fraction: float | None = None
    max_running_requests: int | None = None
    dtype: str | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 30001
    base_gpu_id: int = 0
    router: bool | None = None
    router_port: int | None = None
    router_policy: str = "manual"
    sglang_args: tuple[str, ...] = ()
    openai: tuple[str, ...] | None = None  # serve the OpenAI-compatible session endpoint (KEY=VALUE settings)
    admin_key: str | None = (
        None  # SGLang servers get it as --admin-api-key (embedded ones read it themselves)
    )
    api_key: str | None = None  # --api-key: SGLang servers get the flag, embedded ones MILES_API_KEY

    def __post_init__(self) -> None:
        if self.engine not in ("embedded", "sglang"):
            raise ConfigError("--engine", f"{self.engine!r}: use 'embedded' or 'sglang'")
        if self.openai is not None and self.engine != "embedded":
            raise ConfigError(
                "--openai",
                "the session endpoint is served by embedded servers; in front of SGLang "
                "servers mount it with `miles.sessions.mount_openai` over `SGLangClient`s",
            )
        for flag, value in (("--tp", self.tp), ("--pp", self.pp), ("--dp", self.dp)):
            if value < 1:
                raise ConfigError(flag, f"must be >= 1, got {value}")
        for flag, value in (
            ("--context-length", self.context_length),
            ("--max-running-requests", self.max_running_requests),
        ):
            if value is not None and value < 1:
                raise ConfigError(flag, f"must be >= 1, got {value}")
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError("--mem-fraction", f"must be in (0, 1], got {self.mem_fraction}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"{self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.base_gpu_id < 0:
            raise ConfigError("--base-gpu-id", f"must be >= 0, got {self.base_gpu_id}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(
                "--router-policy", f"{self.router_policy!r}: use one of {', '.join(ROUTER_POLICIES)}"
            )
        last = max(self.server_ports + ((self.resolved_router_port,) if self.use_router else ()))
        if self.port < 1 or last > 65535:
            raise ConfigError("--port", f"the ports {self.port}..{last} do not fit in 1..65535")
        if self.use_router and self.resolved_router_port in self.server_ports:
            raise ConfigError(
                "--router-port",
                f"{self.resolved_router_port} is one of the servers' ports "
                f"{self.server_ports[0]}..{self.server_ports[-1]}",
            )
        if self.engine == "embedded":
            self._check_embedded()
        else:
            self._check_sglang()

    def _check_embedded(self) -> None:
        if self.tp > 1 or self.pp > 1:
            raise ConfigError(
                "--tp" if self.tp > 1 else "--pp",
                "the embedded engine runs on one device; use "
                "--engine sglang for tensor or pipeline parallelism (--dp N starts N servers)",
            )
        if self.mem_fraction is not None:
            raise ConfigError(
                "--mem-fraction",
                "is an SGLang setting (its static pool); an embedded server's KV "
                "cache grows on demand (`engine.kv_cache_fraction` sizes it for the engines `miles "
                "train` runs itself): drop it or use --engine sglang",
            )
        if self.sglang_args:
            raise ConfigError("--", f"SGLang flags {' '.join(self.sglang_args)!r} need --engine sglang")
        try:
            parse_model_spec(self.model)
        except InvalidRequestError as exc:
            raise ConfigError("--model", str(exc)) from None

    def _check_sglang(self) -> None:
        if self.model in ("tiny", SMOLLM2) or self.model.startswith("tiny-"):
            raise ConfigError(
                "--model",
                f"{self.model!r} is one of the embedded engine's built-in models; SGLang "
                "needs an HF checkpoint folder or hub id (or use --engine embedded)",
            )
        if Path(self.model).exists() and not (Path(self.model) / "config.json").is_file():
            raise ConfigError("--model", f"{self.model!r} is not an HF checkpoint folder (no config.json)")
        if self.sglang_args and not self.sglang_args[0].startswith("-"):
            raise ConfigError("--", f"SGLang flags after '--' start with '--', got {self.sglang_args[0]!r}")
        for arg in self.sglang_args:
            name = arg.partition("=")[0]
            if name in LAUNCHER_OWNED_FLAGS:
                raise ConfigError(
                    "--", f"{name} is set by miles rollout: use {LAUNCHER_OWNED_FLAGS[name]} instead"
                )
        dp_size = _flag_value(self.sglang_args, _SGLANG_DP_FLAGS)
        if dp_size is not None and not (dp_size.isdigit() and int(dp_size) >= 1):
            raise ConfigError("--", f"SGLang's --dp-size must be a positive integer, got {dp_size!r}")

    @property
    def use_router(self) -> bool:
        """Whether the sglang-router fronts the servers."""
        return self.dp > 1 if self.router is None else self.router

    @property
    def server_ports(self) -> tuple[int, ...]:
        return tuple(range(self.port, self.port + self.dp))

    @property
    def resolved_router_port(self) -> int:
        return self.router_port if self.router_port is not None else self.port + self.dp

    @property
    def connect_host(self) -> str:
        """Where this machine reaches the servers: loopback when they bind every interface."""
        return _WILDCARD_HOSTS.get(self.host, self.host)

    @property
    def gpus_per_server(self) -> int:
        """GPUs one SGLang server takes: tp * pp, times SGLang's own `--dp-size` when passed after `--`."""
        return self.tp * self.pp * int(_flag_value(self.sglang_args, _SGLANG_DP_FLAGS) or 1)


@dataclass(frozen=True)
class ServerPlan:
    """One server: the URL it will answer on and its command line."""

    name: str
    url: str
    command: tuple[str, ...]


@dataclass(frozen=True)
class LaunchPlan:
    """The exact processes `miles rollout` starts."""

    spec: LaunchSpec
    servers: tuple[ServerPlan, ...]
    router_url: str | None
    router_command: tuple[str, ...] | None

    @property
    def server_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def commands(self) -> list[str]:
        """Every command line, shell-quoted, servers first."""
        cmds = [s.command for s in self.servers] + ([self.router_command] if self.router_command else [])
        return [shlex.join(c) for c in cmds]

    def config_line(self) -> str:
        """The `engine:` section (YAML) for a `miles train` config that uses these servers."""
        kind = "router" if self.router_url else "sglang"
        return f"engine: {{kind: {kind}, urls: [{', '.join(self.server_urls)}]}}"


def _sglang_command(spec: LaunchSpec, index: int, port: int) -> tuple[str, ...]:
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--tp-size",
        str(spec.tp),
        "--pp-size",
        str(spec.pp),
        "--base-gpu-id",
        str(spec.base_gpu_id + index * spec.gpus_per_server),
    ]
    for flag, value in (
        ("--context-length", spec.context_length),
        ("--mem-fraction-static", spec.mem_fraction),
        ("--max-running-requests", spec.max_running_requests),
        ("--dtype", spec.dtype),
        ("--device", spec.device),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if spec.admin_key:
        cmd += ["--admin-api-key", spec.admin_key]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    return (*cmd, *spec.sglang_args)


def _embedded_command(spec: LaunchSpec, index: int, port: int) -> tuple[str, ...]:
    device = spec.device or "cpu"
    if device == "cuda":
        device = f"cuda:{spec.base_gpu_id + index}"
    # The endpoint lives on a higher floor: its server is another module's entry point (named, not imported).
    module = "miles.sessions.openai.routes" if spec.openai is not None else "miles.engines"
    cmd = [
        sys.executable,
        "-m",
        module,
        "--model",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--device",
        device,
        "--engine-id",
        f"embedded-{index}",
    ]
    for flag, value in (
        ("--context-length", spec.context_length),
        ("--max-batch-size", spec.max_running_requests),
        ("--dtype", spec.dtype),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    for setting in spec.openai or ():
        cmd += ["--openai", setting] if setting else ["--openai"]
    return tuple(cmd)


def plan_launch(spec: LaunchSpec) -> LaunchPlan:
    """The command lines for `spec`: one server per `dp`, then the router when it fronts them."""
    build = _sglang_command if spec.engine == "sglang" else _embedded_command
    servers = tuple(
        ServerPlan(f"server {i}", _url(spec.connect_host, port), build(spec, i, port))
        for i, port in enumerate(spec.server_ports)
    )
    if not spec.use_router:
        return LaunchPlan(spec, servers, None, None)
    port = spec.resolved_router_port
    cmd = router_command([s.url for s in servers], host=spec.host, port=port, policy=spec.router_policy)
    return LaunchPlan(spec, servers, _url(spec.connect_host, port), tuple(cmd))


def missing_requirement(
    spec: LaunchSpec, find_spec: Callable[[str], Any] = importlib.util.find_spec
) -> str | None:
    """One line naming what to install when `spec` cannot launch here, else None. Nothing is imported: SGLang's
    package is found by location, and its CUDA kernels (`sgl_kernel`) by name."""
    if spec.engine == "sglang":
        root = find_spec("sglang")
        if root is None or not root.submodule_search_locations:
            return f"--engine sglang needs SGLang, which is not installed: {SGLANG_INSTALL}"
        if not (Path(next(iter(root.submodule_search_locations))) / "launch_server.py").is_file():
            return f"--engine sglang needs sglang.launch_server, which this sglang lacks: {SGLANG_INSTALL}"
        if find_spec("sgl_kernel") is None:
            return (
                "--engine sglang needs SGLang's CUDA kernels (the sgl_kernel module; sglang was installed "
                f"without its dependencies): {SGLANG_INSTALL}"
            )
    if spec.use_router and find_spec("sglang_router") is None:
        return f"the router needs sglang-router, which is not installed: {ROUTER_INSTALL}"
    return None


@dataclass
class _Child:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def failure(self, what: str) -> LaunchError:
        tail = log_tail(self.log)
        lines = f"; the last lines of {self.log}:\n{tail}" if tail else f" (its log {self.log} is empty)"
        return LaunchError(f"{self.name} ({self.url}, pid {self.process.pid}) {what}{lines}")


async def _until_stopped(stop_event: asyncio.Event, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop_event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise _Stopped
    return task.result()


async def wait_healthy(children: list[_Child], timeout_s: float) -> None:
    """Poll every child's `/health` until it answers 200. Raises `LaunchError` (with the child's last log
    lines) when one exits first or does not answer within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    async with httpx.AsyncClient(timeout=5.0) as http:
        while pending:
            for child in list(pending):
                if child.process.poll() is not None:
                    raise child.failure(f"exited with code {child.process.returncode} before it was healthy")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{child.url}/health")).status_code == 200:
                        pending.remove(child)
            if pending and time.monotonic() > deadline:
                raise pending[0].failure(f"did not answer /health within {timeout_s:g}s")
            if pending:
                await asyncio.sleep(0.5)


def _say(message: str) -> None:
    print(f"miles rollout: {message}", flush=True)


async def serve(
    plan: LaunchPlan,
    *,
    log_dir: Path,
    startup_timeout_s: float = 600.0,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Start `plan`, print where it serves, and block until `stop_event` is set (by SIGINT/SIGTERM when None).
    Every child is stopped on the way out. Raises `LaunchError` when a server fails or exits."""
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_event.set)
    children: list[_Child] = []
    router: SGLangRouter | None = None
    try:
        _say(
            f"starting {len(plan.servers)} {plan.spec.engine} server(s); logs in {log_dir}; their control routes "
            f"(weights, aborts, LoRA) take the admin token ({TOKEN_ENV}, else {token_file()})"
        )
        for i, server in enumerate(plan.servers):
            log = log_dir / f"server-{i}.log"
            children.append(_Child(server.name, server.url, spawn(list(server.command), log_path=log), log))
        await _until_stopped(stop_event, wait_healthy(children, startup_timeout_s))
        for child in children:
            _say(f"{child.name} (pid {child.process.pid}) is healthy at {child.url}")
        if plan.router_url:
            spec = plan.spec
            router = SGLangRouter(
                plan.server_urls,
                host=spec.host,
                port=spec.resolved_router_port,
                policy=spec.router_policy,
                log_path=str(log_dir / "router.log"),
                startup_timeout_s=startup_timeout_s,
            )
            try:
                await _until_stopped(stop_event, router.start())
            except EngineError as exc:
                raise LaunchError(f"the sglang-router did not start: {exc}") from None
            assert router.process is not None
            children.append(
                _Child("the sglang-router", plan.router_url, router.process, log_dir / "router.log")
            )
            _say(f"the sglang-router (pid {router.process.pid}) routes to them at {plan.router_url}")
        _say("ready. For a miles config:")
        print(plan.config_line(), flush=True)
        if plan.router_url:
            _say(f"clients that take one URL use the router: {plan.router_url}")
        if plan.spec.host in _WILDCARD_HOSTS:
            _say(
                f"bound to {plan.spec.host}: other machines reach them at this host's name, "
                f"{socket.gethostname()}, on the same ports"
            )
        _say("Ctrl-C or SIGTERM stops every server")
        while not stop_event.is_set():
            for child in children:
                if child.process.poll() is not None:
                    raise child.failure(f"exited with code {child.process.returncode} while serving")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), 1.0)
    except _Stopped:
        pass
    finally:
        if router is not None:
            await router.close()
        await asyncio.gather(*(asyncio.to_thread(stop, c.process) for c in children))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if children:
            _say("stopped every server")


def rollout_from_cli(args: argparse.Namespace) -> int:
    """`miles rollout ...`: exit 0 after a clean stop (or a dry run), 1 when a server fails, 2 for bad flags
    or a missing requirement (one line)."""
    host, host_port = split_host_port(args.host)
    if host_port is not None and args.port is not None and host_port != args.port:
        raise ConfigError(
            "--host", f"{args.host!r} names port {host_port} but --port says {args.port}; give it once"
        )
    spec = LaunchSpec(
        engine=args.engine,
        model=args.model,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        context_length=args.context_length,
        mem_fraction=args.mem_fraction,
        max_running_requests=args.max_running_requests,
        dtype=args.dtype,
        device=args.device,
        host=host,
        port=host_port or args.port or 30001,
        base_gpu_id=args.base_gpu_id,
        router=args.router,
        router_port=args.router_port,
        router_policy=args.router_policy,
        sglang_args=tuple(args.sglang_args),
        openai=tuple(args.openai) if args.openai is not None else None,
        admin_key=None if args.dry_run else admin_token(create=True),
        api_key=None if args.dry_run else args.api_key,
    )
    if args.api_key:  # embedded servers read it from the environment they inherit
        os.environ[API_KEY_ENV] = args.api_key
    plan = plan_launch(spec)
    if args.dry_run:
        for server in plan.servers:
            print(f"# {server.name}: {server.url}")
        if plan.router_url:
            print(f"# the sglang-router: {plan.router_url}")
        print("\n".join(plan.commands()))
        return 0
    missing = missing_requirement(spec)
    if missing is not None:
        print(f"miles rollout: {missing}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="miles-rollout-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(serve(plan, log_dir=log_dir, startup_timeout_s=args.startup_timeout))
    except LaunchError as exc:
        print(f"miles rollout: {exc}", file=sys.stderr)
        return 1
    return 0
