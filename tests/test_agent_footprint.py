"""An idle agent's footprint (issue 25 item 5): `edge-agent join` with its default
``--profile auto`` (the matmul benchmark included) reaches "connected; waiting for a job"
without loading torch, scikit-learn, Opacus, onnxruntime, TenSEAL or matplotlib; those load
when a job needs them. Real OS process, real Mosquitto."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "sklearn", "opacus", "onnxruntime", "tenseal", "matplotlib", "scipy", "pandas", "onnx")

# the agent's own start path (`edge-agent join`, in this process); when it logs that it is
# connected and waiting for a job, print which heavy modules it has loaded and exit
START_PATH = """
import json, logging, os, sys

class Online(logging.Handler):
    def emit(self, record):
        if "waiting for a job" in record.getMessage():
            heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(os.environ["HEAVY"])))
            print("LOADED " + json.dumps(heavy), flush=True)
            os._exit(0)

logging.getLogger("senseshield.agent").addHandler(Online())
from edge_agent.cli import app
app(sys.argv[1:])
"""


def test_an_idle_agent_loads_no_heavy_runtime(mosquitto, tmp_path):
    env = dict(os.environ, HEAVY=json.dumps(HEAVY), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", START_PATH, "join", "--broker", mosquitto.url, "--fleet", "footprint",
         "--insecure-dev", "--agent-id", "a0", "--shard", "0/3", "--model-dir", str(tmp_path / "a0")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"the agent never got online (exit {done.returncode}):\n{done.stderr[-3000:]}"
    assert json.loads(lines[0].removeprefix("LOADED ")) == []
    assert "gflops" not in done.stderr  # no failure of the (child process) matmul benchmark
