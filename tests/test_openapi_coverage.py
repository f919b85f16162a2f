"""Schemathesis' coverage phase over `/openapi.json` as served: no 5xx, no undocumented status.

The coverage phase walks every operation's schema systematically (each
parameter and body field missing, of every wrong type, at its bounds), so it
is deterministic, unlike a random draw of examples: it is what finds a body
field whose wrong *type* reaches code that assumed a string. On the
document before issue 25 it finds the 500 of a Responses content part whose
`type` is an object (`{"type": {}}`: an unhashable set lookup); here it runs
through the `schemathesis` command as an outside client would, against the
whole service (`build_service` on the tiny model, keys configured, the admin
key sent), in about 20 s. `test_openapi_routes.py` keeps a bounded random
(fuzzing) run of 30 examples per operation beside it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import GatewayServer, serve_app
from test_openapi_routes import ADMIN, _settings

from clora_feedback.service import build_service

pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow  # a real server and the schemathesis command: ~20 s


@pytest.fixture(scope="module")
def gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    service = build_service(_settings(tiny_model_dir, tmp_path_factory.mktemp("coverage")))
    with serve_app(service.app, service.engine) as served:
        yield served


def test_the_coverage_phase_finds_no_server_error_nor_undocumented_status(
    gateway: GatewayServer, tmp_path: Path
) -> None:
    command = [
        sys.executable,
        "-c",
        "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "run",
        f"{gateway.url}/openapi.json",
        "--phases",
        "coverage",
        "--checks",
        "not_a_server_error,status_code_conformance",
        "--header",
        f"Authorization: Bearer {ADMIN}",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert "Coverage" in report and "Tested:" in report
