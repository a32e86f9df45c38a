"""Chaos matrix: bad input, hostile clients and setup mistakes against real servers and the real CLI, one probe
each, with a held/failed count at the end (exit status 1 when one failed).

    python benchmarks/chaos.py            # about a minute on 2 CPU cores

A probe *holds* when miles answers as documented: a clear 4xx for a bad request (never a 500 or a dropped
connection), the other requests in flight unharmed, a one-line error with exit status 2 for a setup mistake,
nothing written or run that should not be. The tests cover each probe class one by one; this script runs them
all against one build, as an attacker would.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import redirect_stderr
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MAIN_JOB = str(REPO / "configs" / "calculator.yaml")
RESULTS: list[tuple[str, bool, str]] = []


def probe(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Run the probe at once; it returns a detail line and raises AssertionError when it does not hold."""

    def run(fn: Callable[[], str]) -> Callable[[], str]:
        try:
            RESULTS.append((name, True, fn()))
        except AssertionError as exc:
            RESULTS.append((name, False, str(exc)[:160]))
        except Exception as exc:  # noqa: BLE001 - a crash of the probe is a failure to hold
            RESULTS.append((name, False, f"{type(exc).__name__}: {str(exc)[:140]}"))
        return fn

    return run


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=300,
    )


def one_line(proc: subprocess.CompletedProcess[str], code: int, needle: str) -> str:
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == code, f"exit {proc.returncode}: {last}"
    assert "Traceback" not in proc.stderr and needle in last, last
    return last[:110]


def main() -> int:  # noqa: C901 - one flat list of probes reads best
    from miles.engines.server import load_engine, serve_in_thread

    tmp = Path(tempfile.mkdtemp(prefix="miles-chaos-"))
    token = "chaos-admin-token"
    engine = load_engine("tiny-0.1m")
    guarded = serve_in_thread(engine, admin_key=token)
    http = httpx.Client(base_url=guarded.url, timeout=60)
    admin = {"authorization": f"Bearer {token}"}

    def post(path: str, body: bytes | dict, *, headers: dict | None = None) -> httpx.Response:
        if isinstance(body, dict):
            return http.post(path, json=body, headers=headers)
        return http.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})

    # ---- bad generate requests: each fails alone with a 400 while the batch decodes on
    for label, params in (
        ("temperature NaN", '{"temperature": NaN}'),
        ("temperature 1e-45 (greedy)", None),
        ("temperature -1", '{"temperature": -1}'),
        ("top_p 0", '{"top_p": 0}'),
        ("max_new_tokens 1e12", '{"max_new_tokens": 1000000000000}'),
    ):

        @probe(f"/generate {label}")
        def _(params: str | None = params) -> str:
            async def go() -> tuple[int, list[int]]:
                async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as c:
                    good = [
                        asyncio.create_task(
                            c.post(
                                "/generate",
                                json={
                                    "input_ids": [1, 2, i],
                                    "sampling_params": {"max_new_tokens": 24, "sampling_seed": i},
                                },
                            )
                        )
                        for i in range(3)
                    ]
                    sp = params or '{"temperature": 1e-45, "max_new_tokens": 4}'
                    bad = await c.post(
                        "/generate",
                        content=f'{{"input_ids": [1, 2], "sampling_params": {sp}}}',
                        headers={"content-type": "application/json"},
                    )
                    return bad.status_code, [r.status_code for r in await asyncio.gather(*good)]

            status, others = asyncio.run(go())
            assert others == [200, 200, 200], f"the other requests got {others}"
            assert status == (200 if params is None else 400), f"status {status}"
            return f"{status}, the 3 requests beside it 200"

    @probe("/generate text with a lone surrogate")
    def _() -> str:
        r = post("/generate", b'{"text": "a\\ud800", "sampling_params": {"max_new_tokens": 2}}')
        assert r.status_code == 400, r.status_code
        return r.json()["error"]["message"][:80]

    @probe("/generate 100,000-deep JSON")
    def _() -> str:
        r = post("/generate", b"[" * 100_000 + b"]" * 100_000)
        assert r.status_code == 400, r.status_code
        return "400"

    @probe("/generate 50 MB body; /health stays up")
    def _() -> str:
        async def go() -> tuple[int, float]:
            async with httpx.AsyncClient(base_url=guarded.url, timeout=60) as c:
                big = asyncio.create_task(
                    c.post(
                        "/generate",
                        content=b"[" + b"1," * 25_000_000 + b"1]",
                        headers={"content-type": "application/json"},
                    )
                )
                await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                health_s = time.perf_counter() - t0
                return (await big).status_code, health_s

        status, health_s = asyncio.run(go())
        assert status == 413, status
        return f"413; /health answered in {health_s * 1000:.0f} ms meanwhile"

    # ---- the control plane
    for path, body in (
        ("/update_weights_from_disk", {"model_path": str(tmp)}),
        ("/abort_request", {"abort_all": True}),
        ("/get_weights_by_name", {"name": "model.norm.weight"}),
        (
            "/init_weights_update_group",
            {"master_address": "10.255.255.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
        ),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp)}),
    ):

        @probe(f"{path} without the admin token")
        def _(path: str = path, body: dict = body) -> str:
            codes = [
                post(path, body).status_code,
                post(path, body, headers={"authorization": "Bearer guess"}).status_code,
            ]
            assert codes == [401, 401], codes
            return "401, 401 (none, guessed)"

    os.makedirs(tmp / "evil", exist_ok=True)

    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {tmp / 'pwned'}",))

    (tmp / "evil" / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Evil()}))
    os.makedirs(tmp / "corrupt", exist_ok=True)
    (tmp / "corrupt" / "model.safetensors").write_bytes(struct.pack("<Q", 16) + b"{not a header}")
    os.makedirs(tmp / "lora", exist_ok=True)
    (tmp / "lora" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    (tmp / "lora" / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]})
    )
    for label, path, body in (
        ("a pickle that runs code", "/update_weights_from_disk", {"model_path": str(tmp / "evil")}),
        ("a corrupt safetensors file", "/update_weights_from_disk", {"model_path": str(tmp / "corrupt")}),
        (
            "a LoRA file whose header claims 1 TB",
            "/load_lora_adapter",
            {"lora_name": "x", "lora_path": str(tmp / "lora")},
        ),
        (
            "get_weights_by_name truncate_size 'abc'",
            "/get_weights_by_name",
            {"name": "model.norm.weight", "truncate_size": "abc"},
        ),
    ):

        @probe(f"admin: {label}")
        def _(path: str = path, body: dict = body) -> str:
            r = post(path, body, headers=admin)
            assert r.status_code == 400, f"{r.status_code} {r.text[:80]}"
            assert not (tmp / "pwned").exists(), "the pickle ran"
            return f"400; weights still version {engine.weight_version}"

    # ---- sessions of agents
    from miles.sessions.openai.endpoint import OpenAIEndpoint
    from miles.sessions.openai.routes import create_openai_app
    from miles.tito import TITOTokenizer, TokenizerSpec

    async def agents() -> list[int]:
        from miles.sessions.openai.routes import EndpointServer

        endpoint = OpenAIEndpoint(
            engine, tokenizer=TITOTokenizer.from_spec(TokenizerSpec("tiny")), open_sessions=False
        )
        mine, theirs = endpoint.open("run-s0"), endpoint.open("run-s1")
        server = EndpointServer(create_openai_app(endpoint))
        url = await server.start()
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                key = {"authorization": f"Bearer {mine.token}"}
                return [
                    (await c.get(f"/sessions/{theirs.session_id}/trajectory", headers=key)).status_code,
                    (
                        await c.post(f"/sessions/{theirs.session_id}/reward", json={"reward": 1}, headers=key)
                    ).status_code,
                    (await c.post(f"/sessions/{theirs.session_id}/close", headers=key)).status_code,
                    (
                        await c.post(
                            "/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                            headers={"authorization": "Bearer run-s1"},
                        )
                    ).status_code,
                    (
                        await c.post(
                            f"/sessions/{mine.session_id}/reward", json={"reward": 1e300}, headers=key
                        )
                    ).status_code,
                ]
        finally:
            await server.stop()
            await endpoint.aclose()

    @probe("a rogue agent: read, score, close another session; guess its key; post a 1e300 reward")
    def _() -> str:
        codes = asyncio.run(agents())
        assert codes == [403, 403, 403, 401, 400], codes
        return " ".join(map(str, codes))

    # ---- records and replay
    from miles.sessions.recorder import Recorder, read_sessions
    from miles.sessions.records import SessionRecord

    @probe("a record with a lone surrogate")
    def _() -> str:
        with Recorder(tmp / "s.jsonl", fsync="line") as rec:
            rec.write(
                SessionRecord(session_id="x", initial_messages=[{"role": "user", "content": "a\ud800"}])
            )
        back = read_sessions(tmp / "s.jsonl").records
        assert len(back) == 1 and back[0].initial_messages[0]["content"] == "a\ud800"
        return "written, read back the same"

    @probe("miles replay --check on random bytes")
    def _() -> str:
        (tmp / "noise.jsonl").write_bytes(os.urandom(4096))
        return one_line(cli("replay", str(tmp / "noise.jsonl"), "--check"), 2, "holds no session record")

    # ---- setup mistakes: one line, exit 2, before anything loads
    bomb = tmp / "bomb.yaml"
    bomb.write_text(
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "\n".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)
        )
        + "\n"
    )
    (tmp / "binary.yaml").write_bytes(os.urandom(512))
    for label, args, needle in (
        ("a YAML alias bomb", ["--config", str(bomb)], "expands to more than"),
        ("a binary config file", ["--config", str(tmp / "binary.yaml")], "config error"),
        ("--output-dir ''", ["--config", MAIN_JOB, "--output-dir", ""], "output_dir: is empty"),
        ("--output-dir /dev/null", ["--config", MAIN_JOB, "--output-dir", "/dev/null"], "system folder"),
        ("--output-dir under /proc", ["--config", MAIN_JOB, "--output-dir", "/proc/self/x"], "system folder"),
        ("max_seconds: -1", ["--config", MAIN_JOB, "--set", "max_seconds=-1"], "max_seconds: must be > 0"),
        ("--seed 2**70", ["--config", MAIN_JOB, "--seed", str(2**70)], "seed: must be in"),
        ("init_from: /etc", ["--config", MAIN_JOB, "--set", "model.init_from=/etc"], "cannot load '/etc'"),
        (
            "engine.device: cuda on a CPU build",
            ["--config", MAIN_JOB, "--set", "engine.device=cuda:7"],
            "engine.device",
        ),
        (
            "an unknown tool-call parser",
            ["--config", MAIN_JOB, "--set", "rollout.scheduler.session.parser=nope"],
            "unknown tool-call parser",
        ),
    ):

        @probe(f"miles train: {label}")
        def _(args: list[str] = args, needle: str = needle) -> str:
            extra = [] if "--output-dir" in args else ["--output-dir", str(tmp / "out")]
            t0 = time.perf_counter()
            detail = one_line(cli("train", *args, *extra), 2, needle)
            return f"{time.perf_counter() - t0:.1f} s: {detail[:70]}"

    @probe("a checkpoint whose newest step is truncated")
    def _() -> str:
        import torch

        from miles.learner.checkpoint import load_checkpoint, save_checkpoint

        for step in (1, 2):
            save_checkpoint(tmp / "ck", step=step, model_state={"w": torch.full((8,), float(step))})
        weights = tmp / "ck" / "step_00000002" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-10])
        ckpt = load_checkpoint(tmp / "ck")
        assert ckpt.step == 1 and ckpt.passed_over, ckpt.step
        return "fell back to step 1, named step 2"

    with redirect_stderr(io.StringIO()):
        guarded.stop()
    held = sum(ok for _, ok, _ in RESULTS)
    width = max(len(n) for n, _, _ in RESULTS) + 2
    for name, ok, detail in RESULTS:
        print(f"{'held  ' if ok else 'FAILED'} {name:<{width}} {detail}")
    print(f"\n{held} held, {len(RESULTS) - held} failed, of {len(RESULTS)} probes")
    return 0 if held == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
