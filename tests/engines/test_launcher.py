"""`miles rollout` as the engine launcher: the SGLang command lines it emits use only flags that sglang's
`ServerArgs` defines (read from the installed sources with `ast`: importing sglang fails on a CPU host), bad
flag combinations and a missing SGLang are one-line exits with code 2, and the real thing on loopback: embedded
servers as subprocesses behind the real sglang-router, a `/generate` through it, and no child left behind
after SIGTERM, SIGINT or even SIGKILL of the launcher."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.cli import main
from miles.engines.launcher import (
    LaunchError,
    LaunchSpec,
    _Child,
    missing_requirement,
    plan_launch,
    split_host_port,
    wait_healthy,
)
from miles.engines.server import DTYPES
from miles.engines.subprocesses import spawn, stop
from miles.engines.testing import RolloutProcess
from miles.ports import free_port, free_ports

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- ServerArgs via ast
@dataclass(frozen=True)
class Flag:
    """One `sglang.launch_server` flag: the kind of value it takes and its literal choices (None: any)."""

    kind: str  # "bool" (store_true), "int", "float" or "str"
    choices: tuple[str, ...] | None = None


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, (
        "sglang sources must be installed (--no-deps)"
    )
    return Path(next(iter(spec.submodule_search_locations)))


def _kind(type_node: ast.expr) -> str:
    text = ast.unparse(type_node)
    for kind in ("bool", "int", "float"):
        if text in (kind, f"Optional[{kind}]", f"{kind} | None"):
            return kind
    return "str"


def _literal(node: ast.expr | None) -> object:
    try:
        return None if node is None else ast.literal_eval(node)
    except ValueError:
        return None  # computed (e.g. choices imported from another module): not checked


def _field_flags(stmt: ast.AnnAssign) -> dict[str, Flag]:
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) in ("A", "Annotated")):
        return {}
    elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    meta = next(
        (
            e
            for e in elts[1:]
            if (isinstance(e, ast.Constant) and isinstance(e.value, str))
            or (isinstance(e, ast.Call) and ast.unparse(e.func) == "Arg")
        ),
        None,
    )
    if meta is None:  # no Arg: the field has no CLI flag (sglang's add_cli_args_from_dataclass skips it)
        return {}
    kw = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
    if _literal(kw.get("no_cli")) is True:
        return {}
    name = stmt.target.id  # type: ignore[union-attr]
    kind = "str" if "action" in kw or "type_parser" in kw else _kind(elts[0])
    if "type_parser" in kw and ast.unparse(kw["type_parser"]) == "human_readable_int":
        kind = "int"
    choices = _literal(kw.get("choices"))
    flag = Flag(kind, tuple(str(c) for c in choices) if isinstance(choices, list) else None)
    names = [
        _literal(kw.get("cli_name")) or "--" + name.replace("_", "-"),
        *(_literal(kw.get("aliases")) or []),
    ]
    return {n: flag for n in names}


@cache
def sglang_server_flags() -> dict[str, Flag]:
    """Every flag `python -m sglang.launch_server` accepts: the fields of the namespaces `ServerArgs` is
    assembled from (`_INPUT_NAMESPACES`), plus the flags its `add_cli_args` registers by hand."""
    root = _sglang_root()
    tree = ast.parse((root / "srt/server_args.py").read_text())
    modules = {
        alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    namespaces = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_INPUT_NAMESPACES"
    )
    flags: dict[str, Flag] = {}
    for name_node in namespaces.elts:  # type: ignore[attr-defined]
        module = modules[name_node.id]
        source = ast.parse((root.parent / (module.replace(".", "/") + ".py")).read_text())
        cls = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == name_node.id)
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                flags.update(_field_flags(stmt))
    server_args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    add_cli_args = next(
        n for n in server_args.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"
    )
    for call in ast.walk(add_cli_args):
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument":
            kw = {k.arg: k.value for k in call.keywords}
            action = ast.unparse(kw["action"]) if "action" in kw else ""
            kind = (
                "bool"
                if "store_true" in action or "StoreTrue" in action
                else _kind(kw.get("type", ast.Name("str")))
            )
            for arg in call.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    flags[arg.value] = Flag(kind)
    return flags


def test_the_ast_reader_finds_server_args_flags():
    flags = sglang_server_flags()
    assert len(flags) > 300
    assert flags["--tp-size"] == flags["--tensor-parallel-size"] == Flag("int")
    assert flags["--model-path"] == flags["--model"] == Flag("str")
    assert flags["--mem-fraction-static"] == Flag("float") and flags["--context-length"].kind == "int"
    assert flags["--dtype"].choices == tuple(DTYPES)  # the launcher's dtype names are SGLang's
    assert (
        flags["--trust-remote-code"].kind == "bool" and "--sampling-backend" in flags and "--config" in flags
    )
    assert "--fp8-gemm-backend" in flags  # cli_name wins over the field name
    assert "--watermark-key" not in flags and "--tp" not in flags  # no_cli fields; not a flag at all


def check_sglang_command(cmd: list[str]) -> dict[str, str | None]:
    """Assert every flag of a `sglang.launch_server` command line exists and its value fits; return them."""
    flags = sglang_server_flags()
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
    args, seen, i = cmd[3:], {}, 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        assert name in flags, f"{name} is not a ServerArgs flag"
        flag = flags[name]
        if flag.kind == "bool":
            assert not eq, f"{name} takes no value"
            value, i = None, i + 1
        else:
            value, i = (inline, i + 1) if eq else (args[i + 1], i + 2)
            if flag.kind in ("int", "float"):
                {"int": int, "float": float}[flag.kind](value)
            assert flag.choices is None or value in flag.choices, f"{name} {value}: not one of {flag.choices}"
        assert name not in seen, f"{name} given twice"
        seen[name] = value
    return seen


def test_the_checker_rejects_what_sglang_would():
    ok = [sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "2"]
    assert check_sglang_command(ok)["--tp-size"] == "2"
    for bad in (
        ["--tp", "2"],
        ["--dtype", "fp8"],
        ["--tp-size", "two"],
        ["--trust-remote-code=1"],
        ["--tp-size", "2", "--tp-size", "4"],
    ):
        with pytest.raises((AssertionError, ValueError)):
            check_sglang_command(ok + bad)


PASS_THROUGH = [
    (),
    ("--attention-backend", "fa3"),
    ("--enable-torch-compile",),
    ("--dp-size", "2"),
    ("--trust-remote-code", "--chunked-prefill-size=4096"),
]


@settings(max_examples=60, deadline=None)
@given(
    tp=st.integers(1, 8),
    pp=st.integers(1, 4),
    dp=st.integers(1, 4),
    context_length=st.none() | st.integers(1, 1 << 20),
    mem_fraction=st.none() | st.floats(0.05, 1.0),
    max_running=st.none() | st.integers(1, 4096),
    dtype=st.none() | st.sampled_from(list(DTYPES)),
    device=st.none() | st.sampled_from(["cuda", "cpu"]),
    host=st.sampled_from(["127.0.0.1", "0.0.0.0", "::"]),
    port=st.integers(1024, 60000),
    base_gpu=st.integers(0, 8),
    extra=st.sampled_from(PASS_THROUGH),
    router=st.none() | st.booleans(),
)
def test_every_emitted_sglang_flag_is_in_server_args(
    tp, pp, dp, context_length, mem_fraction, max_running, dtype, device, host, port, base_gpu, extra, router
):
    spec = LaunchSpec(
        engine="sglang",
        model="Qwen/Qwen3-8B",
        tp=tp,
        pp=pp,
        dp=dp,
        context_length=context_length,
        mem_fraction=mem_fraction,
        max_running_requests=max_running,
        dtype=dtype,
        device=device,
        host=host,
        port=port,
        base_gpu_id=base_gpu,
        router=router,
        sglang_args=extra,
    )
    plan = plan_launch(spec)
    assert len(plan.servers) == dp
    gpus: list[set[int]] = []
    for server in plan.servers:
        seen = check_sglang_command(list(server.command))
        assert seen["--model-path"] == "Qwen/Qwen3-8B" and seen["--host"] == host
        assert (seen["--tp-size"], seen["--pp-size"]) == (str(tp), str(pp))
        assert seen.get("--context-length") == (None if context_length is None else str(context_length))
        assert seen.get("--mem-fraction-static") == (None if mem_fraction is None else str(mem_fraction))
        assert seen.get("--max-running-requests") == (None if max_running is None else str(max_running))
        assert seen.get("--dtype") == dtype
        assert server.url.endswith(f":{seen['--port']}")
        per_server = tp * pp * (2 if "--dp-size" in extra else 1)
        gpus.append(set(range(int(seen["--base-gpu-id"]), int(seen["--base-gpu-id"]) + per_server)))
    assert min(min(g) for g in gpus) == base_gpu
    assert sum(map(len, gpus)) == len(set().union(*gpus)), "servers share a GPU"
    ports = [int(s.url.rsplit(":", 1)[1]) for s in plan.servers]
    assert ports == list(range(port, port + dp))
    assert (plan.router_command is not None) == (dp > 1 if router is None else router)
    if plan.router_command:
        from sglang_router.launch_router import parse_router_args

        parsed = parse_router_args(list(plan.router_command[3:]))
        assert parsed.worker_urls == plan.server_urls and parsed.policy == "manual"
        assert parsed.port not in ports and f":{parsed.port}" in plan.router_url


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    return lines[0]


def test_dry_run_prints_the_seed_quick_start_commands(capsys):
    # works without SGLang's CUDA kernels (absent on this host)
    assert (
        main(
            [
                "rollout",
                "--engine",
                "sglang",
                "--model",
                "Qwen/Qwen3-8B",
                "--tp",
                "8",
                "--pp",
                "4",
                "--dp",
                "2",
                "--host",
                "0.0.0.0:30001",
                "--dry-run",
                "--",
                "--attention-backend",
                "fa3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    cmds = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert len(cmds) == 3
    servers = [check_sglang_command(c) for c in cmds[:2]]
    assert [s["--port"] for s in servers] == ["30001", "30002"] and all(
        s["--host"] == "0.0.0.0" for s in servers
    )
    assert [s["--base-gpu-id"] for s in servers] == ["0", "32"]
    assert cmds[2][1:3] == ["-m", "sglang_router.launch_router"] and "--port" in cmds[2]
    assert cmds[2][cmds[2].index("--port") + 1] == "30003"
    assert "http://127.0.0.1:30001" in cmds[2] and "http://127.0.0.1:30002" in cmds[2]


def test_embedded_dry_run_and_the_host_port_form(capsys):
    assert (
        main(
            [
                "rollout",
                "--dp",
                "2",
                "--host",
                "127.0.0.1:31000",
                "--device",
                "cuda",
                "--base-gpu-id",
                "2",
                "--context-length",
                "512",
                "--dry-run",
            ]
        )
        == 0
    )
    cmds = [
        line.split() for line in capsys.readouterr().out.splitlines() if line and not line.startswith("#")
    ]
    assert [c[1:3] for c in cmds] == [["-m", "miles.engines"]] * 2 + [["-m", "sglang_router.launch_router"]]
    for i, cmd in enumerate(cmds[:2]):
        args = dict(zip(cmd[3::2], cmd[4::2], strict=True))
        assert args["--port"] == str(31000 + i) and args["--device"] == f"cuda:{2 + i}"
        assert args["--context-length"] == "512" and args["--model"] == "tiny"


def test_missing_sglang_is_one_line_naming_what_to_install(capsys):
    assert (
        importlib.util.find_spec("sgl_kernel") is None
    )  # this CPU host has sglang's sources, not its kernels
    assert main(["rollout", "--engine", "sglang", "--model", "Qwen/Qwen3-8B"]) == 2
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert line.startswith("miles rollout:") and 'pip install "sglang[all]"' in line and "sgl_kernel" in line
    assert captured.out == ""


def test_missing_requirement_checks_the_package_its_launcher_and_kernels(tmp_path):
    sglang = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    sglang.submodule_search_locations = [str(tmp_path)]
    found = {"sglang": sglang, "sgl_kernel": object(), "sglang_router": object()}

    def finder(without: str):
        return lambda name: None if name == without else found.get(name)

    spec = LaunchSpec(engine="sglang", model="org/model", dp=2)
    assert "not installed" in missing_requirement(spec, finder("sglang"))
    assert "sglang.launch_server" in missing_requirement(spec, finder("nothing"))  # the folder lacks it
    (tmp_path / "launch_server.py").write_text("")
    assert "sgl_kernel" in missing_requirement(spec, finder("sgl_kernel"))
    assert missing_requirement(spec, finder("nothing")) is None
    assert "sglang-router" in missing_requirement(spec, finder("sglang_router"))
    assert (
        missing_requirement(
            LaunchSpec(engine="sglang", model="org/model", router=False), finder("sglang_router")
        )
        is None
    )


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--tp", "2"], "--tp"),
        (["--pp", "2", "--dp", "2"], "--pp"),
        (["--mem-fraction", "0.8"], "--mem-fraction"),
        (["--model", "no/such/folder"], "--model"),
        (["--model", "tiny-7b"], "--model"),
        (["--engine", "sglang", "--model", "tiny"], "--model"),
        (["--engine", "sglang", "--model", "m", "--", "--tp-size", "2"], "--tp"),
        (["--engine", "sglang", "--model", "m", "--", "--port=4"], "--port"),
        (["--engine", "sglang", "--model", "m", "--mem-fraction", "1.5"], "--mem-fraction"),
        (["--", "--attention-backend", "fa3"], "--engine sglang"),
        (["--dp", "0"], "--dp"),
        (["--dtype", "fp8"], "--dtype"),
        (["--host", "0.0.0.0:30001", "--port", "30002"], "--port"),
        (["--host", "0.0.0.0:http"], "--host"),
        (["--dp", "2", "--router-port", "30002"], "--router-port"),
        (["--port", "65535", "--dp", "2"], "--port"),
        (["--router-policy", "fastest"], "--router-policy"),
    ],
)
def test_bad_combinations_exit_2_with_one_line(argv, names, capsys):
    assert main(["rollout", *argv, "--dry-run"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("miles rollout: config error: ") and names in line, line


@settings(max_examples=100, deadline=None)
@given(
    host=st.sampled_from(["0.0.0.0", "127.0.0.1", "node-3.cluster", "10.1.2.3"]), port=st.integers(1, 65535)
)
def test_host_port_forms(host, port):
    assert split_host_port(f"{host}:{port}") == (host, port)
    assert split_host_port(host) == (host, None)
    assert split_host_port(f"[::1]:{port}") == ("::1", port)
    assert split_host_port("::") == ("::", None)


def test_a_server_that_never_gets_healthy_fails_with_its_last_log_lines(tmp_path):
    log = tmp_path / "server.log"
    proc = spawn(
        [sys.executable, "-c", "print('loading shard 3 of 7', flush=True); import time; time.sleep(60)"],
        log_path=log,
    )
    child = _Child("server 0", f"http://127.0.0.1:{free_port()}", proc, log)
    try:
        deadline = time.monotonic() + 60  # the child's Python has started and logged (a busy box is slow to)
        while "loading shard" not in (log.read_text() if log.is_file() else ""):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(LaunchError, match=r"did not answer /health within 1s(.|\n)*loading shard 3 of 7"):
            asyncio.run(wait_healthy([child], timeout_s=1.0))
    finally:
        stop(proc)
    assert proc.poll() is not None


def test_stop_ends_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    proc = spawn([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    stop(proc, timeout_s=5)
    _wait_gone([proc.pid, grandchild])


# ------------------------------------------------------------------------------------- real subprocesses
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


class Launcher(RolloutProcess):
    """A `RolloutProcess` that also remembers its children, so `kill` can clean up after a failed test."""

    def __init__(self, *args: str) -> None:
        super().__init__(*args, cwd=REPO)

    def children(self) -> list[int]:
        """The launcher's child processes now."""
        self.known = _children(self.proc.pid)
        return self.known

    def kill(self) -> None:
        super().kill()
        for pid in getattr(self, "known", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_embedded_servers_behind_the_real_router_and_sigterm_leaves_no_child(tmp_path):
    port = free_ports(3)  # two servers, then the router on the next port
    launcher = Launcher(
        "--engine",
        "embedded",
        "--dp",
        "2",
        "--model",
        "tiny-0.1m",
        "--port",
        str(port),
        "--log-dir",
        str(tmp_path),
    )
    try:
        engine = launcher.ready()
        assert engine == {
            "kind": "router",
            "urls": [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"],
        }
        router_url = next(x for x in launcher.lines if "use the router:" in x).rsplit(" ", 1)[1].strip()
        children = launcher.children()
        assert len(children) == 3  # two servers and the router
        with httpx.Client(timeout=60) as http:
            out = http.post(
                f"{router_url}/generate",
                json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}},
            ).json()
            assert len(out["output_ids"]) == 6 and out["meta_info"]["prompt_tokens"] == 3
            workers = {w["url"] for w in http.get(f"{router_url}/workers").json()["workers"]}
            assert workers == set(engine["urls"])
            for url in engine["urls"]:
                info = http.get(f"{url}/get_model_info").json()
                assert info["model_path"] == "tiny-0.1m" and info["tokenizer_path"] == "tiny"
        code, err = launcher.finish(signal.SIGTERM)
        assert code == 0, err
        assert "stopped every server" in "".join(launcher.lines)
        _wait_gone(children)
        assert {p for p in children if _alive(p)} == set()
    finally:
        launcher.kill()
    assert (tmp_path / "server-0.log").is_file() and (tmp_path / "router.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_the_single_server_form_serves_and_no_child_outlives_the_launcher(sig, tmp_path):
    port = free_port()
    launcher = Launcher(
        "--model", "tiny", "--port", str(port), "--context-length", "64", "--log-dir", str(tmp_path)
    )
    try:
        assert launcher.ready() == {"kind": "sglang", "urls": [f"http://127.0.0.1:{port}"]}
        children = launcher.children()
        assert len(children) == 1  # one server, no router
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            info = http.get("/get_server_info").json()
            assert info["context_length"] == 64 and info["max_req_input_len"] == 63
            too_long = http.post(
                "/generate", json={"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": 1}}
            )
            assert too_long.status_code == 400
            assert (
                len(
                    http.post(
                        "/generate",
                        json={
                            "input_ids": [1] * 60,
                            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                        },
                    ).json()["output_ids"]
                )
                <= 4
            )  # 64 - 60
        code, _ = launcher.finish(sig)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        _wait_gone(children)  # SIGKILL: the kernel's parent-death signal stops the server
    finally:
        launcher.kill()


@pytest.mark.slow
def test_a_server_that_crashes_at_startup_is_reported_with_its_log(tmp_path):
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    launcher = Launcher(
        "--model", str(model), "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")
    )
    out, err = launcher.proc.communicate(timeout=120)
    assert launcher.proc.returncode == 1
    assert "server 0" in err and "exited with code" in err and "no-such-architecture" in err
    assert (
        "Traceback" not in err.split("last lines of", 1)[0]
    )  # the launcher's own message is not a traceback
    assert "stopped every server" in out
