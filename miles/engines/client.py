"""`SGLangClient`: a `RolloutEngine` over SGLang's native HTTP API (a real SGLang server, the embedded
server, or an sglang-router in front of either), on one pooled `httpx.AsyncClient`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import httpx

from miles.engine import EngineError, GenerateResult, RolloutEngine, SamplingParams
from miles.engines.auth import ADMIN_PATHS, API_KEY_ENV, TOKEN_ENV, admin_token, token_file
from miles.engines.auth import api_key as auth_api_key
from miles.engines.errors import EngineAuthError, InvalidRequestError
from miles.engines.load import LOADS_PATH, EngineLoad, parse_loads
from miles.engines.lora import AdapterWeights, served_name
from miles.engines.wire import (
    ROUTING_KEY_HEADER,
    SESSION_HEADER,
    abort_body,
    continue_body,
    generate_body,
    init_group_body,
    load_lora_body,
    parse_generate_response,
    parse_weight_version,
    pause_body,
    unload_lora_body,
    update_distributed_body,
    update_from_disk_body,
)

log = logging.getLogger(__name__)


class SGLangClient(RolloutEngine):
    """Talks to one SGLang-compatible endpoint.

    Connection failures, timeouts and 5xx answers raise `EngineError(retryable=True)`; 4xx answers raise
    `InvalidRequestError` (not retryable). `lora_path` names an adapter to use for every generate call that
    names none.

    LoRA adapters (`update_adapter`): version `v` of adapter `name` is loaded under `name@vv` with
    `/load_lora_adapter`; generate calls for `name` then send that as `lora_path`, and the previous version is
    unloaded in the background (SGLang unloads it once its requests in flight are done: nothing drains).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        engine_id: str | None = None,
        lora_path: str | None = None,
        max_connections: int = 256,
        headers: dict[str, str] | None = None,
        admin_key: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        #: sent as the bearer of control calls (`miles.engines.auth`); by default the local admin token
        self.admin_key = admin_key if admin_key is not None else admin_token()
        #: sent as the bearer of every other call when the servers want one (default: `MILES_API_KEY`)
        self.api_key = api_key if api_key is not None else auth_api_key()
        self.engine_id = engine_id or self.base_url
        self.lora_path = lora_path
        self._version = 0
        self._weight_group: Any = None
        self._weight_sessions = True  # False once the server showed it has no /begin_weight_update
        self._in_flight = 0
        self._adapters: dict[str, tuple[str, int]] = {}  # adapter -> (served name, version)
        self._unloads: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    # ------------------------------------------------------------------ plumbing
    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        kwargs: dict[str, Any] = {"json": json, "headers": self._headers(path, headers)}
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            resp = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:  # connect/read/write errors, timeouts, protocol errors
            raise EngineError(
                f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}", engine_id=self.engine_id
            ) from exc
        self._check_auth(resp, path)
        if resp.status_code >= 500:
            raise EngineError(
                f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}",
                engine_id=self.engine_id,
            )
        if resp.status_code >= 400:
            raise InvalidRequestError(
                f"{method} {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}",
                engine_id=self.engine_id,
            )
        return resp

    def _headers(self, path: str, headers: dict[str, str] | None) -> dict[str, str] | None:
        key = (self.admin_key or self.api_key) if path in ADMIN_PATHS else self.api_key
        return {**(headers or {}), "authorization": f"Bearer {key}"} if key else headers

    def _check_auth(self, resp: httpx.Response, path: str) -> None:
        if resp.status_code not in (401, 403):
            return
        if path in ADMIN_PATHS:
            raise EngineAuthError(
                f"{self.base_url}{path} refused {'the' if self.admin_key else 'a call without an'} "
                f"admin token: give miles the servers' token in {TOKEN_ENV} (miles rollout keeps "
                f"it in {token_file()})"
            )
        raise EngineAuthError(
            f"{self.base_url}{path} refused {'the' if self.api_key else 'a call without an'} API "
            f"key: the servers were started with --api-key; give miles the key in {API_KEY_ENV}"
        )

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = await self._request(method, path, **kwargs)
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineError(
                f"{path}: the answer is not JSON: {resp.text[:200]}",
                engine_id=self.engine_id,
                retryable=False,
            ) from exc

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        session_id: str | None = None,
        rid: str | None = None,
        adapter: str | None = None,
    ) -> GenerateResult:
        """`adapter`: an adapter this client loaded (`update_adapter`; the result then carries its version), or
        one the server was started with (version 0)."""
        lora_path, adapter_version = self.lora_path, None
        if adapter is not None:
            lora_path, adapter_version = self._adapters.get(adapter, (adapter, 0))
        body = generate_body(input_ids, sampling_params, rid=rid or uuid.uuid4().hex, lora_path=lora_path)
        headers = {SESSION_HEADER: session_id, ROUTING_KEY_HEADER: session_id} if session_id else None
        self._in_flight += 1
        try:
            data = await self._json("POST", "/generate", json=body, headers=headers)
        finally:
            self._in_flight -= 1
        result = parse_generate_response(data, engine_id=self.engine_id, fallback_version=self._version)
        self._version = max(self._version, result.weight_version)
        if adapter_version is not None:  # the server reports its base version; the policy is the adapter
            result.weight_version, result.token_versions = adapter_version, None
        return result

    # ------------------------------------------------------------------ LoRA adapters
    def adapter_version(self, name: str) -> int | None:
        """The version of adapter `name` that generate calls use (None: not loaded through this client)."""
        served = self._adapters.get(name)
        return None if served is None else served[1]

    def adopt_adapter(self, name: str, version: int) -> None:
        """Send generate calls for `name` to its version `version`, which another client loaded on the servers
        behind this one (an sglang-router in front of workers)."""
        self._adapters[name] = (served_name(name, version), int(version))

    async def update_adapter(
        self,
        name: str,
        *,
        weights: AdapterWeights | None = None,
        path: str | None = None,
        version: int | None = None,
    ) -> int:
        """Load the PEFT folder `path` (readable by the server) as version `version` of adapter `name`
        (default: the current version plus 1); the previous version is unloaded in the background once its
        requests are done. In-memory `weights` cannot travel to an HTTP server: write them to a folder first."""
        if path is None or weights is not None:
            raise InvalidRequestError(
                "an HTTP engine loads an adapter from a PEFT folder it can read: pass path= "
                "(weight sync writes one with sync.method disk)",
                engine_id=self.engine_id,
            )
        current = self.adapter_version(name)
        new = (0 if current is None else current + 1) if version is None else int(version)
        served = served_name(name, new)
        status, data = await self._weight_call("/load_lora_adapter", load_lora_body(served, path))
        if status == 400 and "already loaded" in str(data):  # left by an earlier run: that copy may be stale
            await self._unload(served)
            status, data = await self._weight_call("/load_lora_adapter", load_lora_body(served, path))
        self._check_lora(status, data, f"loading adapter {served} from {path}")
        old = self._adapters.get(name)
        self._adapters[name] = (served, new)
        if old is not None and old[0] != served:
            task = asyncio.get_running_loop().create_task(self._unload(old[0]))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        return new

    async def unload_adapter(self, name: str) -> None:
        """Unload adapter `name` (waits, on the server, for its requests in flight)."""
        served = self._adapters.pop(name, None)
        if served is not None:
            await self._unload(served[0])

    async def _unload(self, served: str) -> None:
        try:
            status, data = await self._weight_call("/unload_lora_adapter", unload_lora_body(served))
            if status != 400 or "does not exist" not in str(data):  # SGLang's words for an unknown name
                self._check_lora(status, data, f"unloading adapter {served}")
        except EngineError as exc:  # the next version is in use already; a leftover only costs a slot
            log.warning("%s", exc)

    def _check_lora(self, status: int, data: Any, what: str) -> None:
        if status != 200 or not isinstance(data, dict) or not data.get("success"):
            message = data.get("error_message") if isinstance(data, dict) else data
            raise EngineError(
                f"{what} failed on {self.base_url}: HTTP {status}: {str(message)[:300]}",
                engine_id=self.engine_id,
                retryable=False,
            )

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", json=abort_body(rid))

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", json=abort_body(abort_all=True))

    async def pause_generation(self) -> None:
        """SGLang's `POST /pause_generation` in `in_place` mode: requests in flight stay with their KV, and a
        weight update then loads at once instead of waiting for them under the model-update lock."""
        await self._request("POST", "/pause_generation", json=pause_body("in_place"))

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", json=continue_body())

    async def health(self) -> bool:
        """`GET /health_generate` answers 200 (the server generated a token)."""
        try:
            await self._request("GET", "/health_generate", timeout=30.0)
        except EngineError:
            return False
        return True

    async def update_weights(
        self, *, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int:
        """From disk via `/update_weights_from_disk`, or an in-memory state dict by broadcast.

        The broadcast needs a group set up with `miles.engines.weight_broadcast.init_weight_update_group`
        that has this engine as its only member; for several engines use `broadcast_weights`.
        """
        if (state_dict is None) == (path is None):
            raise InvalidRequestError("pass exactly one of state_dict= or path=", engine_id=self.engine_id)
        new = self._version + 1 if version is None else int(version)
        if path is not None:
            await self.update_weights_from_disk(path, weight_version=new)
            return self._version
        group = self._weight_group
        if group is None or group.world_size != 2:
            raise InvalidRequestError(
                "an in-memory state dict reaches an HTTP engine only through a weight update group of this "
                "engine alone (init_weight_update_group); use path= or broadcast_weights instead",
                engine_id=self.engine_id,
            )
        from miles.engines.weight_broadcast import broadcast_weights

        await broadcast_weights(group, [self], state_dict, version=new)
        return self._version

    async def close(self) -> None:
        if self._unloads:
            await asyncio.wait(list(self._unloads), timeout=10.0)
        await self._http.aclose()

    # ------------------------------------------------------------------ SGLang admin endpoints
    async def get_model_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_server_info")

    async def load(self) -> EngineLoad:
        """The server's queue, from SGLang's `GET /v1/loads`."""
        return parse_loads(await self._json("GET", LOADS_PATH, timeout=10.0))

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def refresh_weight_version(self) -> int:
        """Read the server's weight version from `/get_model_info` (when it is an integer)."""
        version = parse_weight_version((await self.get_model_info()).get("weight_version"))
        if version is not None:
            self._version = version
        return self._version

    async def update_weights_from_disk(self, path: str, *, weight_version: int | None = None) -> None:
        data = await self._json(
            "POST",
            "/update_weights_from_disk",
            json=update_from_disk_body(path, weight_version=weight_version),
        )
        self._check_success(data, "update_weights_from_disk")
        if weight_version is not None:
            self._version = weight_version

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's weight-update group (blocks until the whole group has met)."""
        body = init_group_body(
            master_address, master_port, rank_offset, world_size, group_name=group_name, backend=backend
        )
        data = await self._json("POST", "/init_weights_update_group", json=body)
        self._check_success(data, "init_weights_update_group")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        """Leave the group; False when the server had no group of that name."""
        status, data = await self._weight_call("/destroy_weights_update_group", {"group_name": group_name})
        if status == 400:
            return False
        self._check_success(data, "destroy_weights_update_group")
        return True

    def attach_weight_group(self, broadcaster: Any) -> None:
        """Remember the trainer-side group this engine joined (see `weight_broadcast`)."""
        self._weight_group = broadcaster

    async def begin_weight_update(self) -> None:
        """Open SGLang's weight-update session (`/begin_weight_update`, required by 0.5.23 before distributed
        updates). A session left open by an interrupted sync is closed and reopened; a server without the
        endpoint (an older SGLang) needs none."""
        status, data = await self._weight_call("/begin_weight_update", {})
        if status == 404:
            self._weight_sessions = False
            return
        self._weight_sessions = True
        if status == 400 and "already open" in str(data):
            await self.end_weight_update()
            status, data = await self._weight_call("/begin_weight_update", {})
        self._check_success(data, "begin_weight_update")

    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened."""
        if not self._weight_sessions:
            return
        _, data = await self._weight_call("/end_weight_update", {})
        self._check_success(data, "end_weight_update")

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """Announce one transfer the trainer broadcasts meanwhile; the server loads it, then (with `flush_cache`)
        flushes its cache and (with `weight_version`) takes that version."""
        body = update_distributed_body(
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            load_format=load_format,
        )
        data = await self._json("POST", "/update_weights_from_distributed", json=body)
        self._check_success(data, "update_weights_from_distributed")
        if weight_version is not None:
            self._version = weight_version

    async def _weight_call(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST an admin request whose 4xx answers the caller interprets: (status, JSON body or text)."""
        try:
            resp = await self._http.post(path, json=body, headers=self._headers(path, None))
        except httpx.TransportError as exc:
            raise EngineError(
                f"POST {self.base_url}{path}: {type(exc).__name__}: {exc}", engine_id=self.engine_id
            ) from exc
        self._check_auth(resp, path)
        if resp.status_code >= 500:
            raise EngineError(
                f"POST {self.base_url}{path}: HTTP {resp.status_code}: {resp.text[:300]}",
                engine_id=self.engine_id,
            )
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._json(
            "POST", "/get_weights_by_name", json={"name": name, "truncate_size": truncate_size}
        )

    def _check_success(self, data: Any, what: str) -> None:
        if not isinstance(data, dict) or not data.get("success"):
            message = data.get("message") if isinstance(data, dict) else data
            raise EngineError(
                f"{what} failed on {self.base_url}: {message}", engine_id=self.engine_id, retryable=False
            )
