"""The Ray runtime of every command: starting or joining Ray (:func:`init_ray`) and pools of actors
(:class:`ActorPool`: a dead actor is replaced, a task whose actor died is retried a bounded number of times,
each actor has a bounded number of calls in flight).

``init_ray`` decides, for ``foveate ingest``/``train``/``score``/``demo`` alike:

* Ray already initialised (a test fixture, the demo, a notebook): use it, start nothing.
* ``address`` given, or ``$RAY_ADDRESS`` names a cluster (as under ``ray job submit``): join it, with no
  ``runtime_env`` (the job's own working_dir must stay in force).
* ``$RAY_ADDRESS`` is a job-submission (``http://``) address, e.g. from ``eval "$(infra/local/up.sh)"``:
  ``ray.init()`` cannot join that, so it is dropped (logged) and an in-process Ray starts instead.
* otherwise an in-process Ray: ``num_cpus`` as the command asks, no dashboard, Ray leaves logging alone, and
  the workers get this source tree on ``PYTHONPATH`` (plus the command's ``env_vars``). The workers' output is
  forwarded to this process unless ``$RAY_LOG_TO_DRIVER`` is false (the CLI sets it unless ``-v``: the workers'
  logs then stay in Ray's session folder, logged here; their failures still reach the driver as exceptions).
  A watcher process
  (:mod:`pipeline.reaper`) stops that Ray's processes within seconds if the command dies without shutting it
  down (``kill -9``); Ray's own agents would otherwise linger for up to about a minute.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline import interrupt

__all__ = ["REPO_ROOT", "init_ray", "ActorPool", "Done", "wait_done"]

log = logging.getLogger(__name__)

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    env_vars: dict[str, str] | None = None,
) -> bool:
    """Start or join Ray (see the module doc); True when this call started it (so the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None and os.environ.get("RAY_ADDRESS", "").startswith(("http://", "https://")):
        # a job-submission address is not one ray.init() can join
        log.info(
            "RAY_ADDRESS %s is a job-submission address; starting an in-process Ray instead "
            "(use `ray job submit` to run on that cluster)",
            os.environ.pop("RAY_ADDRESS"),
        )
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=True)
        interrupt.reinstall()
        return True
    kwargs: dict[str, Any] = {}
    if object_store_memory is not None:
        kwargs["object_store_memory"] = int(object_store_memory)
    # Ray's own variable, parsed as Ray does ("1"/"true" forward), but read now: Ray reads it once, at import
    to_driver = os.environ.get("RAY_LOG_TO_DRIVER", "1").lower() in ("1", "true")
    context = ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=to_driver,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT, **(env_vars or {})}},
        **kwargs,
    )
    interrupt.reinstall()  # ray.init replaced our SIGTERM handler with sys.exit(15)
    session = (getattr(context, "address_info", None) or {}).get("session_dir")
    if session and not to_driver:
        log.info("Ray workers' logs: %s", os.path.join(session, "logs"))
    try:
        from pipeline.reaper import start_reaper

        start_reaper()
    except Exception as err:  # the watcher is a safety net, never a reason to fail the command
        log.debug("no Ray reaper: %s", err)
    return True


@dataclass
class Done:
    """A finished call: its ``task`` (what was submitted with it), the pool and actor index, and either its
    ``value`` or its ``error``. ``actor_died``: the actor was lost (``RayActorError``); then ``retry`` says
    whether the task has attempts left (``max_task_retries``), and ``superseded`` whether the pool had already
    replaced (killed) that actor because another of its calls failed — the call died with its actor, not by
    itself."""

    pool: ActorPool
    index: int
    task: Any
    value: Any = None
    error: BaseException | None = None
    actor_died: bool = False
    retry: bool = False
    superseded: bool = False


@dataclass
class ActorPool:
    """``size`` actors made by ``make()``, each with at most ``depth`` calls in flight.

    Args:
        make: starts one actor (e.g. ``lambda: cls.remote(...)``).
        size: number of actors.
        depth: calls in flight per actor (backpressure).
        max_task_retries: how often a task whose actor died may be resubmitted (:attr:`Done.retry`).
        max_replacements: dead actors replaced in all before giving up (None: no limit).
        name: for messages.
    """

    make: Callable[[], Any]
    size: int
    depth: int = 2
    max_task_retries: int = 0
    max_replacements: int | None = None
    name: str = "actor"
    actors: list[Any] = field(default_factory=list)
    load: list[int] = field(default_factory=list)
    last_task: list[Any] = field(default_factory=list)
    replaced: int = 0
    _in_flight: dict[Any, tuple[int, Any, Any]] = field(default_factory=dict)
    _attempts: dict[int, int] = field(default_factory=dict)

    def start(self) -> ActorPool:
        self.actors = [self.make() for _ in range(self.size)]
        self.load = [0] * self.size
        self.last_task = [None] * self.size
        return self

    def free(self) -> int | None:
        """The least-loaded actor with room for another call, or None."""
        i = min(range(self.size), key=lambda j: self.load[j])
        return i if self.load[i] < self.depth else None

    def has_room(self, i: int) -> bool:
        return self.load[i] < self.depth

    def submit(self, i: int, method: str, *args: Any, task: Any = None, **kwargs: Any) -> Any:
        """Call ``actor[i].method(*args, **kwargs)``; ``task`` comes back in :class:`Done`."""
        handle = self.actors[i]
        ref = getattr(handle, method).remote(*args, **kwargs)
        self._in_flight[ref] = (i, task, handle)
        self.load[i] += 1
        self.last_task[i] = task
        return ref

    def __len__(self) -> int:
        """Calls in flight."""
        return len(self._in_flight)

    def in_flight(self) -> Iterable[Any]:
        """The tasks of the calls in flight."""
        return (t for _, t, _ in self._in_flight.values())

    def replace(self, i: int) -> None:
        """Kill actor ``i`` (if still there) and start a fresh one in its place."""
        import ray

        if self.max_replacements is not None and self.replaced >= self.max_replacements:
            raise RuntimeError(f"{self.name} actors keep dying ({self.replaced} replaced); see the Ray logs")
        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:
            pass
        self.actors[i] = self.make()
        self.load[i] = 0
        self.replaced += 1

    def _finish(self, ref: Any) -> Done:
        import ray

        i, task, handle = self._in_flight.pop(ref)
        current = handle is self.actors[i]  # not a call of an actor that was already replaced
        if current:
            self.load[i] = max(0, self.load[i] - 1)
        try:
            return Done(self, i, task, value=ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            if current:
                log.warning("%s actor %d died (%s: %s); replacing it", self.name, i, type(exc).__name__, _reason(exc))
                self.replace(i)
            n = self._attempts[id(task)] = self._attempts.get(id(task), 0) + 1
            retry = n <= self.max_task_retries
            return Done(self, i, task, error=exc, actor_died=True, retry=retry, superseded=not current)
        except Exception as exc:
            return Done(self, i, task, error=exc)

    def attempts(self, task: Any) -> int:
        """How often ``task``'s actor died under it."""
        return self._attempts.get(id(task), 0)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass


def _reason(exc: BaseException, limit: int = 300) -> str:
    """The last non-empty line of an error's message (Ray's actor errors end with the exit reason or the
    creation task's exception), cut to ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wait_done(*pools: ActorPool, timeout: float | None = None) -> list[Done]:
    """Wait until a call of any of ``pools`` finishes (or ``timeout`` seconds); the finished calls."""
    import ray

    interrupt.check()  # a SIGTERM whose KeyboardInterrupt a library swallowed still ends the command
    owner = {ref: p for p in pools for ref in p._in_flight}
    if not owner:
        return []
    ready, _ = ray.wait(list(owner), num_returns=1, timeout=timeout)
    interrupt.check()
    return [owner[ref]._finish(ref) for ref in ready]
