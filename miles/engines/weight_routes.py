"""The embedded server's weight-update endpoints, with SGLang 0.5.23's semantics (it stands in for SGLang in tests).

- `POST /update_weights_from_disk {model_path, weight_version?, flush_cache?, abort_all_requests?}`;
- `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name?,
  backend?}`: joins the trainer's group as SGLang's `init_custom_process_group` does (`weight_broadcast.join_group`);
  a second group of the same name is refused, as torch refuses it in SGLang;
- `POST /begin_weight_update`, `POST /end_weight_update`: the weight-update session, outside which
  `/update_weights_from_distributed` is refused;
- `POST /update_weights_from_distributed {names, dtypes, shapes, group_name?, load_format?, flush_cache?,
  weight_version?, abort_all_requests?}`: receives one broadcast (one flat uint8 tensor for
  `load_format: "flattened_bucket"`, else one per tensor), loads it at once (cast to the parameters' dtype), then
  flushes the cache when `flush_cache` and takes `weight_version` when given (no version: the version stays);
- `POST /destroy_weights_update_group {group_name?}`;
- `POST /pause_generation {mode}` (`in_place` and `retract` keep the requests in flight, `abort` ends them) and
  `POST /continue_generation`.

As in SGLang, a generate request holds the model-update lock's read side for its whole life, and the weight
updates (disk, distributed, the session's begin and end) take its write side: they wait for the requests in
flight, and hold back new ones, unless generation is paused, when they load at once.

Answers are SGLang's: `{"success", "message"}`, status 200, or 400 when `success` is false.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import fastapi
from fastapi.responses import JSONResponse

from miles.engines.embedded import EmbeddedEngine
from miles.engines.errors import InvalidRequestError
from miles.engines.weight_broadcast import DEFAULT_GROUP, WeightReceiver
from miles.engines.wire import PAUSE_MODES, parse_weight_version

JsonBody = Any  # an async callable: request -> dict (the server's body parser)


def _answer(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=200 if success else 400
    )


def _require(body: dict[str, Any], *names: str) -> None:
    missing = [n for n in names if n not in body]
    if missing:
        raise InvalidRequestError(f"missing fields: {missing}")


def _target_version(engine: EmbeddedEngine, body: dict[str, Any]) -> int:
    """The version after this update: `weight_version` when given (it must be an integer here), else unchanged."""
    raw = body.get("weight_version")
    if raw is None:
        return engine.weight_version
    version = parse_weight_version(raw)
    if version is None:
        raise InvalidRequestError(
            f"weight_version must be an integer string for the embedded engine, got {raw!r}"
        )
    return version


#: How long joining a weight-update group waits for the trainer's rendezvous.
JOIN_TIMEOUT_S = 120.0


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """`fn()` on a daemon thread of its own (a join that hangs neither holds a shared pool nor the exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            outcome: tuple[Callable[[Any], None], Any] = (future.set_result, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (future.set_exception, exc)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the server stopped meanwhile: nobody waits for it
            pass

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    return future


class ModelUpdateLock:
    """SGLang's model-update lock and pause flag: `generating()` for a generate request's life (after any pause),
    `updating()` for a weight update, which waits for those in flight and holds new ones back (a waiting update
    goes first), unless generation is paused."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self.paused = False

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not (self.paused or self._writing or self._writers_waiting))
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        async with self._cond:
            paused = self.paused
            if not paused:
                self._writers_waiting += 1
                try:
                    await self._cond.wait_for(lambda: self._readers == 0 and not self._writing)
                finally:
                    self._writers_waiting -= 1
                self._writing = True
        try:
            yield
        finally:
            if not paused:
                async with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    async def pause(self, paused: bool) -> None:
        async with self._cond:
            self.paused = paused
            self._cond.notify_all()


def add_weight_routes(
    app: fastapi.FastAPI, engine: EmbeddedEngine, json_body: JsonBody, update_lock: ModelUpdateLock
) -> None:
    """Register the weight-update and pause endpoints of `engine` on `app`; `update_lock` is the one the
    server's generate route holds."""
    receivers: dict[str, WeightReceiver] = {}
    session = {"open": False}
    lock = asyncio.Lock()  # one load at a time
    # Joining a group blocks a thread until the trainer's rendezvous answers (or times out): one join at a time,
    # on a thread of its own, so joins aimed at a dead address can neither pile up nor starve the other routes.
    joining = asyncio.Lock()

    async def _load(tensors: dict[str, Any], body: dict[str, Any]) -> int:
        version = _target_version(engine, body)
        if body.get("abort_all_requests"):
            await engine.abort_all()
        loaded = await asyncio.to_thread(engine.load_weights_sync, tensors, version)
        if body.get("flush_cache", True):
            await engine.flush_cache()
        return loaded

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: fastapi.Request) -> JSONResponse:
        body = await json_body(request)
        _require(body, "model_path")
        from miles.engines.embedded import load_state_dict_from_folder

        async with update_lock.updating(), lock:
            try:
                tensors = await asyncio.to_thread(load_state_dict_from_folder, str(body["model_path"]))
                version = await _load(tensors, body)
            except InvalidRequestError as exc:
                return _answer(False, str(exc), num_paused_requests=0)
        engine.model_path = str(body["model_path"])
        return _answer(True, f"weights loaded, version {version}", num_paused_requests=0)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: fastapi.Request) -> JSONResponse:
        body = await json_body(request)
        _require(body, "master_address", "master_port", "rank_offset", "world_size")
        name = str(body.get("group_name") or DEFAULT_GROUP)
        if name in receivers:
            return _answer(
                False, f"Failed to initialize custom process group: group {name!r} already exists."
            )
        if joining.locked():
            return _answer(
                False,
                "Failed to initialize custom process group: another group is being joined; "
                "retry when it is done.",
            )
        try:
            async with joining:
                receiver = await _in_daemon_thread(
                    functools.partial(
                        WeightReceiver,
                        str(body["master_address"]),
                        int(body["master_port"]),
                        int(body["rank_offset"]),
                        int(body["world_size"]),
                        group_name=name,
                        backend=str(body.get("backend") or "nccl"),
                        timeout_s=JOIN_TIMEOUT_S,
                        device=engine.device if str(engine.device).startswith("cuda") else None,
                    )
                )
        except (InvalidRequestError, RuntimeError, ValueError) as exc:
            return _answer(False, f"Failed to initialize custom process group: {exc}.")
        receivers[name] = receiver
        return _answer(
            True, f"Succeeded to initialize custom process group {name!r} over {receiver.backend}."
        )

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: fastapi.Request) -> JSONResponse:
        await json_body(request)
        if session["open"]:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        async with update_lock.updating():
            session["open"] = True
        return _answer(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: fastapi.Request) -> JSONResponse:
        await json_body(request)
        if not session["open"]:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        async with update_lock.updating():
            session["open"] = False
        return _answer(True, "Success")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: fastapi.Request) -> JSONResponse:
        body = await json_body(request)
        _require(body, "names", "dtypes", "shapes")
        name = str(body.get("group_name") or DEFAULT_GROUP)
        receiver = receivers.get(name)
        if receiver is None:
            return _answer(
                False, f"Group {name} not in {sorted(receivers)}. Call /init_weights_update_group first."
            )
        if not session["open"]:
            return _answer(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            )
        async with update_lock.updating(), lock:
            try:
                tensors = await asyncio.to_thread(
                    receiver.receive, body["names"], body["dtypes"], body["shapes"], body.get("load_format")
                )
            except (InvalidRequestError, RuntimeError, ValueError) as exc:
                return _answer(False, f"Failed to receive weights: {exc}")
            try:
                version = await _load(tensors, body)
            except (InvalidRequestError, RuntimeError, ValueError, TypeError) as exc:
                return _answer(False, f"Failed to update parameter online: {exc}")
        return _answer(True, f"Succeeded to update parameter online. Weight version {version}.")

    @app.post("/pause_generation")
    async def pause_generation(request: fastapi.Request) -> JSONResponse:
        mode = (await json_body(request)).get("mode", "abort")  # SGLang's default mode
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            await engine.abort_all()
        await update_lock.pause(True)
        await engine.pause_generation()  # in_place and retract alike: the rows and their KV stay
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: fastapi.Request) -> JSONResponse:
        await json_body(request)
        await engine.continue_generation()
        await update_lock.pause(False)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: fastapi.Request) -> JSONResponse:
        body = await json_body(request)
        receiver = receivers.pop(str(body.get("group_name") or DEFAULT_GROUP), None)
        if receiver is None:
            return _answer(False, "The group to be destroyed does not exist.")
        receiver.close()
        return _answer(True, "Succeeded to destroy custom process group.")
