"""The SDK service client shared by the server test modules (each module starts its own `server`)."""
from __future__ import annotations

import pytest
from serve_helpers import service_client


@pytest.fixture(scope="module")
def sc(server):
    client = service_client(server.url)
    yield client
    client.close("success").result()  # ends the session (and its heartbeats) before the server stops
