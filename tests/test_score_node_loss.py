"""Which actor errors make ``foveate score`` resubmit a call unchanged (its actor's node was lost or could not be
reached) rather than split it and write error rows (the actor died by itself). End to end: tests/test_multinode.py."""

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
