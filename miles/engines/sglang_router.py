"""`SGLangRouter`: the real sglang-router (Rust, `python -m sglang_router.launch_router`) as a
`RolloutEngine`.

generate goes through the router; with the default `policy="manual"` a session id is sent as the
`x-smg-routing-key` header, so all turns of a session land on one worker (its prefix cache).
abort, weight updates and cache flushes go to every worker directly. Workers are added and removed at
run time through the router's worker API (`POST /workers`, `DELETE /workers/{id}` in sglang-router
0.3.x; the older `/add_worker?url=` and `/remove_worker?url=` are used when those are absent).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from typing import Any

import httpx

from miles.engine import EngineError, GenerateResult, RolloutEngine, SamplingParams
from miles.engines.client import SGLangClient
from miles.engines.subprocesses import log_tail, spawn, stop
from miles.ports import free_port


def router_command(
    worker_urls: list[str], *, host: str, port: int, policy: str = "manual", extra_args: tuple[str, ...] = ()
) -> list[str]:
    """The `python -m sglang_router.launch_router ...` command line for `worker_urls`."""
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warn",
    ]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    return cmd + list(extra_args)


class SGLangRouter(RolloutEngine):
    """Launches and drives an sglang-router process in front of SGLang-compatible workers.

    Use `await SGLangRouter.launch(worker_urls)` (or construct, then `await start()`).
    """

    def __init__(
        self,
        worker_urls: list[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "manual",
        timeout_s: float = 600.0,
        startup_timeout_s: float = 60.0,
        extra_args: tuple[str, ...] = (),
        log_path: str | None = None,
        engine_id: str = "sglang-router",
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        self.policy = policy
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.log_path = log_path
        self.workers: dict[str, SGLangClient] = {
            u.rstrip("/"): SGLangClient(u, timeout_s=timeout_s) for u in worker_urls
        }
        self.process: subprocess.Popen[bytes] | None = None
        self._client: SGLangClient | None = None
        self._admin = httpx.AsyncClient(base_url=self.url, timeout=30.0)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    async def launch(cls, worker_urls: list[str], **kwargs: Any) -> SGLangRouter:
        router = cls(worker_urls, **kwargs)
        await router.start()
        return router

    @classmethod
    async def attach(cls, router_url: str, worker_urls: list[str], **kwargs: Any) -> SGLangRouter:
        """Drive an sglang-router that is already running (e.g. started by `miles rollout --dp N`) in front of
        `worker_urls`; closing the returned object leaves that router running."""
        url = httpx.URL(router_url)
        router = cls(worker_urls, host=url.host, port=url.port, **kwargs)
        router._client = SGLangClient(router.url, timeout_s=router.timeout_s, engine_id=router.engine_id)
        await router.wait_for_workers(set(router.workers))
        return router

    def command(self) -> list[str]:
        return router_command(
            list(self.workers), host=self.host, port=self.port, policy=self.policy, extra_args=self.extra_args
        )

    async def start(self) -> None:
        """Start the router process and wait until every worker is registered and healthy."""
        self.process = spawn(self.command(), log_path=self.log_path)
        self._client = SGLangClient(self.url, timeout_s=self.timeout_s, engine_id=self.engine_id)
        await self.wait_for_workers(set(self.workers))

    async def list_workers(self) -> list[dict[str, Any]]:
        resp = await self._admin.get("/workers")
        resp.raise_for_status()
        return list(resp.json().get("workers", []))

    async def wait_for_workers(self, urls: set[str], *, healthy: bool = True) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                tail = log_tail(self.log_path)
                raise EngineError(
                    f"sglang-router exited with code {self.process.returncode}"
                    + (f"; its last log lines:\n{tail}" if tail else ""),
                    engine_id=self.engine_id,
                    retryable=False,
                )
            with contextlib.suppress(httpx.HTTPError, ValueError):
                workers = {w["url"].rstrip("/"): w for w in await self.list_workers()}
                if all(u in workers and (workers[u].get("is_healthy", True) or not healthy) for u in urls):
                    return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"sglang-router did not register {sorted(urls)} in {self.startup_timeout_s}s",
                    engine_id=self.engine_id,
                )
            await asyncio.sleep(0.2)

    async def add_worker(self, url: str) -> None:
        """Register a worker with the running router and wait until it is healthy."""
        url = url.rstrip("/")
        resp = await self._admin.post("/workers", json={"url": url})
        if resp.status_code == 404:
            resp = await self._admin.post("/add_worker", params={"url": url})
        if resp.status_code >= 400:
            raise EngineError(
                f"add_worker {url}: HTTP {resp.status_code} {resp.text[:200]}",
                engine_id=self.engine_id,
                retryable=False,
            )
        self.workers.setdefault(url, SGLangClient(url, timeout_s=self.timeout_s))
        await self.wait_for_workers({url})

    async def remove_worker(self, url: str) -> None:
        """Unregister a worker (its in-flight requests are not aborted)."""
        url = url.rstrip("/")
        ids = [w.get("id") for w in await self.list_workers() if w["url"].rstrip("/") == url]
        if ids and ids[0]:
            resp = await self._admin.delete(f"/workers/{ids[0]}")
        else:
            resp = await self._admin.post("/remove_worker", params={"url": url})
        if resp.status_code >= 400 and resp.status_code != 404:
            raise EngineError(
                f"remove_worker {url}: HTTP {resp.status_code} {resp.text[:200]}",
                engine_id=self.engine_id,
                retryable=False,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while any(w["url"].rstrip("/") == url for w in await self.list_workers()):
            if time.monotonic() > deadline:
                raise EngineError(f"router still lists {url}", engine_id=self.engine_id)
            await asyncio.sleep(0.1)
        client = self.workers.pop(url, None)
        if client is not None:
            await client.close()

    # ------------------------------------------------------------------ RolloutEngine
    def _router(self) -> SGLangClient:
        if self._client is None:
            raise EngineError(
                "SGLangRouter.start() was not called", engine_id=self.engine_id, retryable=False
            )
        return self._client

    @property
    def weight_version(self) -> int:
        versions = [c.weight_version for c in self.workers.values()]
        return min(versions) if versions else 0

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        adapter: str | None = None,
    ) -> GenerateResult:
        return await self._router().generate(
            input_ids, sampling_params, session_id=session_id, rid=rid, adapter=adapter
        )

    async def update_adapter(
        self, name: str, *, weights: Any = None, path: str | None = None, version: int | None = None
    ) -> int:
        """Load the adapter on every worker, then send generate calls through the router to that version."""
        if version is None:
            known = [c.adapter_version(name) for c in self.workers.values()]
            version = 0 if any(v is None for v in known) else max(known) + 1  # type: ignore[type-var]
        await asyncio.gather(
            *(
                c.update_adapter(name, weights=weights, path=path, version=version)
                for c in self.workers.values()
            )
        )
        self._router().adopt_adapter(name, version)
        return version

    async def abort(self, rid: str) -> None:
        for client in self.workers.values():
            with contextlib.suppress(EngineError):
                await client.abort(rid)

    async def health(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            return False
        try:
            resp = await self._admin.get("/health")
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        versions = await asyncio.gather(
            *(
                c.update_weights(state_dict=state_dict, path=path, version=version)
                for c in self.workers.values()
            )
        )
        return min(versions)

    async def flush_cache(self) -> None:
        await asyncio.gather(*(c.flush_cache() for c in self.workers.values()))

    async def close(self) -> None:
        if self.process is not None:
            await asyncio.to_thread(stop, self.process, timeout_s=10.0)
        for client in self.workers.values():
            await client.close()
        if self._client is not None:
            await self._client.close()
        await self._admin.aclose()
