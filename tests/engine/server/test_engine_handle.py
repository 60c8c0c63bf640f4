"""EngineHandle's startup report: startup is done only when requests are taken."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedinfer.engine.config import EngineConfig
from pagedinfer.engine.server.engine_handle import EngineHandle, NotServingError, ServerState


def test_startup_is_not_done_before_the_server_takes_requests():
    """The engine reports "ready" a moment before the handle starts serving (it polls): in that
    window /startup must not say ready, since a request would still get 503."""
    handle = EngineHandle(EngineConfig(), loader=lambda cfg: None)
    handle._engine = SimpleNamespace(startup_phase="ready")
    assert handle.state is ServerState.STARTING
    assert handle.startup_report().phase != "ready"
    with pytest.raises(NotServingError, match="loading"):
        handle.require_engine()
    handle._engine.startup_phase = "loading_weights"
    assert handle.startup_report().phase == "loading_weights"
