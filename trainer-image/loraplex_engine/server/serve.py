"""``loraplex-engine serve``: the engine process of one pod.

Order of events:

1. bind the port (so ``--port 0`` works and probes connect at once) and start uvicorn;
   ``/healthz`` answers 200 from here on, ``/readyz`` 503;
2. load the base model in a background thread (the :class:`Engine` constructor);
3. start the engine loop thread, which calls ``engine.tick()`` while there is work and
   sleeps on an event when there is none; requests that give it work set the event;
4. ``/readyz`` turns 200 and one line ``loraplex-engine ready: url=... startup_s=...``
   goes to stderr (tests and humans wait on it);
5. on SIGTERM/SIGINT uvicorn stops taking requests and drains; then the loop stops after
   its current tick and every running experiment is checkpointed (the pod's
   termination grace period covers this), and the process exits 0.

``--world-size N`` (server/serve_ranks.py): this process is rank 0 of N data-parallel ranks; it
starts the others (or torchrun started every rank) before step 2's engine, and the
engine is ready once every rank has loaded. A worker rank binds nothing and follows.

Every flag can also come from the environment as ``LORAPLEX_<FLAG>`` (``--max-rank`` ->
``LORAPLEX_MAX_RANK``; server/flags.py); the token from ``--token-file`` or ``LORAPLEX_TOKEN``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from loraplex_engine.base_model import check_model_dir, served_names
from loraplex_engine.logs import announce, quiet_libraries, setup_logging
from loraplex_engine.metrics import EngineMetrics
from loraplex_engine.plugins.discovery import installed
from loraplex_engine.rollout.preflight import check_rollout
from loraplex_engine.server import flags
from loraplex_engine.server.app import create_app
from loraplex_engine.server.holder import EngineHolder
from loraplex_engine.server.serve_ranks import RankGroup, is_worker, run_worker
from loraplex_engine.server.tinker.future_table import FutureLimits
from loraplex_engine.settings.commands import ServeSettings
from loraplex_engine.settings.generate import to_argv
from loraplex_engine.spec.errors import ApiError, RankFailed, UnavailableError, UsageError
from loraplex_engine.spec.service import TickingEngine
from loraplex_engine.spec.tinker_limits import RecordLimits
from loraplex_engine.tenancy.object_store import ObjectStore
from loraplex_engine.tenancy.trust import DataRoots, RewardEgress, TrustPolicy, system_resolver
from loraplex_engine.tracking.hub import TickObservers, start_tracking

log = logging.getLogger("loraplex_engine.server.serve")

READY_LINE = "loraplex-engine ready:"
LISTEN_LINE = "loraplex-engine listening:"
IDLE_WAIT_S = 1.0  # an idle loop re-checks this often even without a wake-up
MAX_TICK_ERRORS = 5  # consecutive unexpected tick errors before the loop gives up


# --- the loop -------------------------------------------------------------------------


class EngineLoop:
    """Calls ``engine.tick()`` on its own thread until stopped.

    After a tick that ran nothing it waits on an event (the engine's ``work_available``
    if it has one, else one set by :meth:`wake`, i.e. by a request that gave the engine
    work) for at most ``idle_wait_s``. An unexpected
    exception from ``tick`` is logged and retried with back-off; after
    ``max_errors`` in a row the loop stops and reports itself dead (liveness fails,
    so Kubernetes restarts the pod and the operator resumes its experiments). An
    ``ApiError`` is a request's own (its caller is answered with it) and never counts
    toward that limit: no tenant's request can stop the engine."""

    def __init__(
        self,
        engine: TickingEngine,
        metrics: EngineMetrics | TickObservers,
        *,
        idle_wait_s: float = IDLE_WAIT_S,
        max_errors: int = MAX_TICK_ERRORS,
        on_idle: Callable[[], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.max_errors = max_errors
        # Data parallel (server/serve_ranks.py): the idle loop's heartbeat to the workers, and
        # the fatal exit a failed tick means when the ranks may be mid-collective.
        self.on_idle = on_idle
        self.on_error = on_error
        # The engine's own "work available" event, where it has one: it sets it when a
        # request queues work and clears it, under its lock, when a tick finds none, so
        # no wake-up is lost between the two. Otherwise our own event, set by wake().
        work = getattr(engine, "work_available", None)
        self._own_event = not isinstance(work, threading.Event)
        self._wake: threading.Event = threading.Event() if self._own_event else work
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed = False
        self.ticks = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.failed

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        errors = 0
        while not self._stop.is_set():
            if self._own_event:
                self._wake.clear()  # a wake() during the tick makes the next wait return
            try:
                report = self.engine.tick()
            except ApiError as e:  # a request's own error: answered to it, not the engine's
                log.warning("a tick ended on a request's error (not counted): %s", e.message)
                if self.on_error is not None:
                    self.on_error(e)
                self._stop.wait(0.05)  # never a spin, should one recur
                continue
            except Exception as e:
                errors += 1
                log.exception("engine tick failed (%d in a row)", errors)
                if self.on_error is not None:  # several ranks: no retry (server/serve_ranks.py)
                    self.on_error(e)
                if errors >= self.max_errors:
                    log.error("engine loop stopping after %d failed ticks", errors)
                    self.failed = True
                    refuse = getattr(self.engine, "refuse_completions", None)
                    if callable(refuse):  # no tick will serve them: answer, don't hang
                        refuse(f"the engine loop stopped after {errors} failed ticks")
                    return
                self._stop.wait(min(0.1 * 2**errors, 5.0))
                continue
            errors = 0
            if report is None:
                self._wake.wait(self.idle_wait_s)
                self._idle()
                continue
            self.ticks += 1
            try:
                self.metrics.observe_tick(report)
            except Exception:  # metrics must never stop training
                log.exception("could not record tick metrics")

    def _idle(self) -> None:
        if self.on_idle is None:
            return
        try:
            self.on_idle()
        except Exception as e:
            if self.on_error is None:
                raise
            self.on_error(e)


# --- main -----------------------------------------------------------------------------


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), so start-up time includes the
    interpreter and imports, not just model loading."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); [0] is field 3
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _uvicorn_server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once it has drained, which would kill the
        process before the loop is stopped and experiments are checkpointed. Forget the
        signal instead: run() then returns, shutdown() runs, and the process exits 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            log.info("signal %d: draining requests, then checkpointing", sig)
            self._captured_signals.clear()

    return _Server


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and an accepted socket inherits the listener's. With proto 0 every
    # keep-alive answer written in two sends waited for the peer's delayed ACK (~40 ms a
    # request; 46 ms per /healthz measured, < 2 ms without).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def own_addresses() -> set[str]:
    """This pod's addresses (every interface's, and the host name's): a reward URL must
    not lead back into the pod."""
    found = {
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }
    with contextlib.suppress(OSError):
        found.update(system_resolver(socket.gethostname(), 0))
    return found


def trust_policy(
    settings: ServeSettings, port: int, objects: ObjectStore | None = None
) -> TrustPolicy:
    """The pool admin's flags as the engine's TrustPolicy; ``port``: the bound one;
    ``objects``: the object store taken at start (None: taken now)."""
    egress = RewardEgress.build(flags.reward_hosts(settings), own_addresses(), own_port=port)
    data = DataRoots(flags.data_roots(settings), allow_hard_links=settings.allow_dataset_hard_links)
    objects = flags.object_store(settings) if objects is None else objects
    access = flags.plugin_access(settings)
    return TrustPolicy(data=data, egress=egress, objects=objects, plugins=access)


def run(settings: ServeSettings) -> int:
    setup_logging(settings.log_format, settings.log_level)
    flags.check(settings)  # also done by the CLI before this module's imports; cheap
    # The object store's credentials, out of the environment before any process starts.
    objects = flags.object_store(settings)
    check_model_dir(str(settings.model))
    check_rollout(settings, settings.device)  # the backend's flags and environment
    device = flags.resolve_device(settings.device, settings.world_size)
    if settings.threads > 0:
        import torch

        torch.set_num_threads(settings.threads)
    if is_worker():  # rank 1..N-1: no port, no API; rank 0's messages only
        return run_worker(settings, device, lambda world: _build_engine(settings, device, world))
    token = flags.read_token(settings)
    if token is None:
        log.warning("serving /v1 WITHOUT authentication (--insecure-no-auth)")

    import uvicorn

    age = _process_age_s()
    t0 = time.monotonic() - (age if age is not None else 0.0)
    metrics = EngineMetrics()
    tracking = start_tracking(settings, metrics.registry)  # a missing client: a usage error
    names = served_names(settings.model, settings.served_model_name)
    model_name = names[0]
    holder = EngineHolder(model_name, settings.rollout_backend)
    loop_box: dict[str, EngineLoop] = {}

    def wake() -> None:
        if "loop" in loop_box:
            loop_box["loop"].wake()

    def alive() -> bool:
        loop = loop_box.get("loop")
        return loop is None or not loop.failed

    def ready() -> bool:
        loop = loop_box.get("loop")
        return loop is not None and loop.running and holder.is_ready()

    tinker_keys = flags.read_tinker_keys(settings)

    def training() -> Any:
        """The engine's TrainingService (the Tinker protocol's), once it has loaded."""
        engine = holder.engine
        if engine is None or not ready():
            raise UnavailableError("the engine is still loading")
        training = getattr(engine, "clients", None)
        if training is None:
            raise UnavailableError("this engine does not offer client-driven training")
        return training

    app = create_app(
        holder,
        token,
        metrics=metrics,
        on_work=wake,
        ready=ready,
        alive=alive,
        max_completion_tokens=settings.max_completion_tokens,
        tinker_keys=tinker_keys,
        training=training,
        tinker_max_sessions=settings.tinker_max_sessions,
        tinker_futures=FutureLimits(
            settings.tinker_futures_per_namespace,
            settings.tinker_future_ttl,
            settings.tinker_retrieved_grace,
        ),
        tinker_records=RecordLimits(settings.tinker_recorded_tokens, settings.tinker_recorded_ttl),
        served_names=names,
        # the name it had before it had others: a gateway or client may still say it
        unlisted_names=(Path(settings.model).resolve().name,),
    )

    try:
        sock = _bind(settings.host, settings.port)
    except OSError as e:  # the port is taken, or the address is not this host's
        where = f"{settings.host}:{settings.port}"
        raise UsageError(f"cannot listen on {where}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    announce(f"{LISTEN_LINE} url={url}")

    config = uvicorn.Config(
        app,
        log_level=settings.log_level.lower(),
        log_config=None,  # uvicorn's loggers propagate to ours (logs.py)
        access_log=False,  # server/observe.py logs each request
        timeout_graceful_shutdown=30,
        lifespan="off",
    )
    server = _uvicorn_server_class()(config)
    outcome = {"rc": 0}

    # Workers run this command as the settings spell it (settings/generate.to_argv).
    ranks = RankGroup(settings, to_argv(settings), device)

    def load() -> None:
        try:
            # The installed plug-ins, listed by a child while the model loads (PUT reads them).
            threading.Thread(target=installed, name="plugins", daemon=True).start()
            t_import = time.monotonic()
            from loraplex_engine.engine import Engine  # noqa: F401  torch, transformers: seconds

            quiet_libraries()  # transformers' own handler, now that it is imported

            t_build = time.monotonic()
            world = ranks.start()  # ranks 1..N-1 started and joined (N > 1)
            engine = _build_engine(settings, device, world, trust_policy(settings, port, objects))
            ranks.loaded(engine)  # every rank has loaded
            holder.model_name = getattr(engine, "model_name", model_name)
            holder.engine = engine
            observers = TickObservers(metrics, tracking)
            loop = EngineLoop(engine, observers, on_idle=ranks.idle, on_error=ranks.on_error)
            loop_box["loop"] = loop
            loop.start()
            now = time.monotonic()
            startup = now - t0
            log.info(
                "engine ready in %.2fs (to app %.2fs, engine imports %.2fs, model load %.2fs; "
                "model %s in %s, %d slots, max rank %d, backend %s, pool %s)",
                startup,
                t_import - t0,
                t_build - t_import,
                now - t_build,
                settings.model,
                engine.capacity().dtype,
                settings.max_adapters,
                settings.max_rank,
                settings.rollout_backend,
                os.environ.get("LORAPLEX_POOL", "-"),
            )
            announce(f"{READY_LINE} url={url} startup_s={startup:.3f}")
        except RankFailed as e:  # a worker rank did not start (its own error is above)
            announce(f"loraplex-engine serve: error: {e}")
            outcome["rc"] = 1
            server.should_exit = True
        except UsageError as e:  # e.g. the memory plan: this device cannot hold it
            log.error("engine failed to load: %s", e)
            announce(f"error: {e}")
            outcome["rc"] = 2
            server.should_exit = True
        except BaseException:
            log.exception("engine failed to load")
            outcome["rc"] = 1
            server.should_exit = True

    loader = threading.Thread(target=load, name="engine-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        shutdown(holder, loop_box.get("loop"), checkpoint=not settings.no_checkpoint_on_shutdown)
        tracking.close()
        # The group is left below: nothing may hold the engine then (a sharded base's
        # DTensors hold the group; distributed.leave).
        holder.engine = None
        loop_box.clear()
        if not ranks.close() and outcome["rc"] == 0:  # after the checkpoints: release them
            outcome["rc"] = 1
    return outcome["rc"]


def _build_engine(
    settings: ServeSettings, device: str, world: Any, trust: TrustPolicy | None = None
) -> Any:
    """The Engine of ``serve``'s settings (every rank builds the same one); ``trust``:
    rank 0's (a worker neither reads datasets nor calls reward URLs)."""
    from loraplex_engine.engine import Engine

    engine_settings = settings.engine()
    name = served_names(settings.model, settings.served_model_name)[0]
    return Engine(
        str(settings.model),
        engine_settings,
        device=device,
        world=world,
        trust=trust,
        model_name=name,
    )


def shutdown(holder: EngineHolder, loop: EngineLoop | None, *, checkpoint: bool) -> None:
    """Stop the loop after its current tick, checkpoint running experiments, close the
    engine (its rollout backend's worker)."""
    if loop is not None:
        loop.stop(timeout=60)
    engine = holder.engine
    if engine is None:
        return
    try:
        running = [s for s in engine.list_experiments() if s.phase == "Running"]
    except Exception:
        log.exception("could not list experiments at shutdown")
        running = []
    if not checkpoint:
        running = []
    for status in running:
        try:
            ref = engine.checkpoint_experiment(status.id)
            log.info("shutdown checkpoint %s at step %d: %s", status.id, ref.step, ref.path)
        except Exception:
            log.exception("shutdown checkpoint of %s failed", status.id)
    close = getattr(engine, "close", None)  # e.g. the vLLM worker process
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing the engine failed")
