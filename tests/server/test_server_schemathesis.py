"""schemathesis over /openapi.json against a real uvicorn: no response ≥ 500 and no hang.

The example budget is bounded (-n) and every request has a timeout, so a hang fails the run instead
of stalling it. The same command runs against a real server in CI (see the README's test section).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx


def schemathesis_command(url: str, report: Path) -> list[str]:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    return [exe, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
            "--max-examples", "15", "--seed", "1", "--request-timeout", "20", "--workers", "1",
            "--phases", "examples,coverage,fuzzing", "--no-shrink", "--suppress-health-check",
            "all", "--generation-database", "none",
            "--report", "ndjson", "--report-ndjson-path", str(report), "--no-color"]


def test_schemathesis_finds_no_server_error(make_server, tmp_path):
    server = make_server()
    report = tmp_path / "events.ndjson"
    done = subprocess.run(schemathesis_command(server.url, report), capture_output=True, text=True,
                          timeout=540, cwd=tmp_path)           # its cache folder lands in tmp_path
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert "not_a_server_error" in done.stdout or "passed" in done.stdout.lower(), tail
    # the server is still healthy afterwards and nothing is left running in the engine
    assert httpx.get(server.url + "/health").status_code == 200
    assert not server.app.state.serving.client.in_flight
