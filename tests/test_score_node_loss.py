"""Which actor errors make ``foveate score`` resubmit a call unchanged (its actor's node was lost or could not be
reached) rather than split it and write error rows (the actor died by itself). End to end: tests/test_cluster.py."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_unreachable_actor_errors():
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    from pipeline.score_stages import _unreachable

    assert _unreachable(ActorUnavailableError("RpcError: connection refused", None))
    assert not _unreachable(ActorDiedError())  # e.g. the process exited (a slide that crashes its decoder)
    assert not _unreachable(RuntimeError("node has died"))  # not an actor error
    assert not _unreachable(RayTaskError("f", "traceback", ValueError("x")))


@pytest.mark.slow  # an own Ray (~10 s to start on 2 cores) for one actor
def test_a_call_of_an_actor_the_pool_replaced_is_marked_superseded(ray_own):
    """Two calls in flight on one actor that dies: the first failure replaces (kills) the actor; the other call then
    fails too ('killed by ray.kill', not an unreachable-node error) and is marked ``superseded``, so scoring
    resubmits it instead of writing an error row for a slide that did nothing wrong (seen in the two-node test)."""
    import ray

    from pipeline.runtime import ActorPool, wait_done
    from pipeline.score_stages import _unreachable

    @ray.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds):
            import time

            time.sleep(seconds)
            return seconds

    pool = ActorPool(make=lambda: Sleeper.remote(), size=1, depth=2, max_task_retries=1, name="sleeper").start()
    first = pool.actors[0]
    ray.get(first.nap.remote(0))  # started
    pool.submit(0, "nap", 60.0, task="a")
    pool.submit(0, "nap", 60.0, task="b")
    ray.kill(first, no_restart=True)  # the actor dies under both calls
    done = []
    while len(done) < 2:
        done += wait_done(pool, timeout=30.0)
    assert {d.task for d in done} == {"a", "b"}
    assert all(d.actor_died and d.retry for d in done)
    assert [d.superseded for d in done] == [False, True]  # the first failure replaced the actor
    assert not any(_unreachable(d.error) for d in done)  # without `superseded` the second would be an error row
    assert pool.replaced == 1 and pool.actors[0] is not first and len(pool) == 0
    pool.submit(0, "nap", 0.0, task="c")  # the replacement works
    assert [d.value for d in wait_done(pool, timeout=30.0)] == [0.0]
    pool.shutdown()
