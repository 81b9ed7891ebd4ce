"""What an agent loads. Idle: `edge-agent join` with its default ``--profile auto`` (the
matmul benchmark included) reaches "connected; waiting for a job" without loading torch,
scikit-learn, Opacus, onnxruntime, TenSEAL or matplotlib; those load when a job needs them.
Through a job, and in `edge-agent profile --quick` and `edge-agent predict`: never what the
device's install (`pip install senseshield`, docs/pi.md#install-targets) lacks, i.e.
scikit-learn, matplotlib, amqtt or prometheus-client, nor Opacus and SciPy unless the job
trains with DP-SGD (the `dp` extra). Real OS processes, real Mosquitto."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from senseshield.extras import EXTRAS, PACKAGES, install_hint, missing_sentence, require
from senseshield.errors import ConfigError
from senseshield.job import Job, opacus_use
from senseshield.strategies import build_strategy

HEAVY = ("torch", "sklearn", "opacus", "onnxruntime", "tenseal", "matplotlib", "scipy", "pandas", "onnx")
# what the lean install does not have: an agent must never import it (SciPy and Opacus: only
# for a job that trains with DP-SGD or calibrates its noise to a target epsilon)
NOT_ON_A_DEVICE = {"sklearn", "matplotlib", "amqtt", "prometheus_client", "pandas"}
DP_ONLY = {"scipy", "opacus"}
REPO = Path(__file__).resolve().parents[1]

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

# `edge-agent ARGS` in this process; at its end (exit code or exception) the top-level names
# of every module it loaded go to the file named by the first argument
RECORDED = """
import json, sys
out = sys.argv.pop(1)
try:
    from edge_agent.cli import app
    app(sys.argv[1:])
finally:
    with open(out, "w") as f:
        json.dump(sorted({m.split(".")[0] for m in sys.modules}), f)
"""


def recorded(out: Path, *args: str) -> list[str]:
    """The command line of `edge-agent ARGS` whose loaded modules go to ``out``."""
    return [sys.executable, "-c", RECORDED, str(out), *args]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO))


def test_an_idle_agent_loads_no_heavy_runtime(mosquitto, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", START_PATH, "join", "--broker", mosquitto.url, "--fleet", "footprint",
         "--insecure-dev", "--agent-id", "a0", "--shard", "0/3", "--model-dir", str(tmp_path / "a0")],
        capture_output=True, text=True, env=dict(env(), HEAVY=json.dumps(HEAVY)), timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADED ")]
    assert lines, f"the agent never got online (exit {done.returncode}):\n{done.stderr[-3000:]}"
    assert json.loads(lines[0].removeprefix("LOADED ")) == []
    assert "gflops" not in done.stderr  # no failure of the (child process) matmul benchmark


@pytest.mark.parametrize("strategy", ["masked", pytest.param("dpsgd", marks=pytest.mark.slow)])  # dpsgd: make test-slow
def test_an_agent_through_a_job_loads_nothing_a_device_install_lacks(mosquitto, tmp_path, strategy):
    """Two agents (`edge-agent join`, as `fleet up` starts them) through a 2-round MLP job on
    digits: they train (torch), evaluate (onnxruntime) and never load scikit-learn,
    matplotlib, amqtt or prometheus-client; SciPy and Opacus only in the DP-SGD job."""
    from senseshield.runtime.fleet import FleetOptions, fleet_up

    def wrap(name: str, argv: list[str]) -> list[str]:
        if not name.startswith("c0"):
            return argv
        return recorded(tmp_path / f"{name}.json", *argv[argv.index("edge_agent.cli") + 1:])

    config = Job(strategy=strategy, model="mlp", clients=2, rounds=2)
    report = fleet_up(config, FleetOptions(agents=2, out=tmp_path / "fleet", broker=mosquitto.url,
                                           fleet=f"footprint-{strategy}", round_deadline=120, min_contributors=1,
                                           wrap=wrap), timeout=400)
    assert report["exit_codes"] == {"keyserver": 0, "coordinator": 0, "c000": 0, "c001": 0}, report["exit_codes"]
    assert len(report["rounds"]) == 2
    for agent in ("c000", "c001"):
        loaded = set(json.loads((tmp_path / f"{agent}.json").read_text()))
        assert {"torch", "onnxruntime"} <= loaded  # it trained and evaluated
        assert not loaded & NOT_ON_A_DEVICE, f"{agent} loaded {sorted(loaded & NOT_ON_A_DEVICE)}"
        if strategy == "dpsgd":
            assert "opacus" in loaded
        else:
            assert not loaded & DP_ONLY, f"{agent} loaded {sorted(loaded & DP_ONLY)} in a job without DP-SGD"


def test_profile_and_predict_load_nothing_a_device_install_lacks(mosquitto, tmp_path):
    """`edge-agent profile --quick` (bandwidth through the broker, the model's inference
    latency) and `edge-agent predict` of a .npy array and of a PNG image."""
    from PIL import Image

    from senseshield.inference import export_onnx
    from senseshield.models import build_model
    from senseshield.training import get_vector

    model = tmp_path / "model.onnx"
    weights = get_vector(build_model("mlp", (1, 8, 8), 10)).astype(np.float64)
    export_onnx("mlp", (1, 8, 8), 10, weights, model, fleet="lab", cluster=0, round=1)
    np.save(tmp_path / "x.npy", np.zeros((3, 1, 8, 8), np.float32))
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4).save(tmp_path / "digit.png")
    commands = {
        "profile": ["profile", "--quick", "--broker", mosquitto.url, "--fleet", "footprint", "--model", str(model)],
        "predict-npy": ["predict", str(tmp_path / "x.npy"), "--model", str(model), "--json"],
        "predict-png": ["predict", str(tmp_path / "digit.png"), "--model", str(model)],
    }
    for name, args in commands.items():
        out = tmp_path / f"{name}.json"
        done = subprocess.run(recorded(out, *args), capture_output=True, text=True, env=env(), timeout=300)
        assert done.returncode == 0, f"{name}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        loaded = set(json.loads(out.read_text()))
        assert "onnxruntime" in loaded, name
        assert not loaded & (NOT_ON_A_DEVICE | DP_ONLY), f"{name} loaded {sorted(loaded & (NOT_ON_A_DEVICE | DP_ONLY))}"
    assert "PIL" in set(json.loads((tmp_path / "predict-png.json").read_text()))


def test_which_jobs_need_opacus_on_a_device():
    """DP-SGD rounds (Opacus' PrivacyEngine), and DP noise calibrated to a target epsilon
    (Opacus' accountant); an agent without Opacus declines those with what to install."""
    def why(strategy: str, **options: float) -> str | None:
        job = Job(strategy=strategy, model="mlp", rounds=3, options=options)
        return opacus_use(job, build_strategy(job.strategy, job.options))

    for strategy in ("dpsgd", "alt-pi", "alt-si-dp", "alt-mp"):
        assert why(strategy) == f"strategy {strategy!r} trains with DP-SGD"
    for strategy in ("masked-dp", "dp-fedavg", "selective-dp", "selectiveshield"):
        assert why(strategy) is None  # options.sigma: no accountant on the device
        assert why(strategy, target_epsilon=5.0) == "its noise is calibrated to target_epsilon 5"
    for strategy in ("plaintext", "masked", "sensecrypt", "maskcrypt", "alt-si-he"):
        assert why(strategy) is None and why(strategy, target_epsilon=5.0) is None


def test_a_missing_extra_is_one_sentence_naming_it(monkeypatch):
    import tomllib

    import senseshield.extras as extras

    # the extras' packages as pyproject.toml lists them
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dist = {v: k for k, v in PACKAGES.items()}
    for extra, modules in EXTRAS.items():
        assert {dist[r.split(">")[0].split("=")[0]] for r in declared[extra]} | ({"scipy"} if extra == "dp" else set()) \
            == set(modules), extra
    assert {dist[r.split(">")[0]] for r in declared["all"]} == set(PACKAGES)

    monkeypatch.setattr(extras, "installed", lambda module: module not in {"opacus", "sklearn", "scipy"})
    with pytest.raises(ConfigError, match=r"^This job \(strategy 'dpsgd' trains with DP-SGD\) needs opacus, which this "
                                          r"install lacks; install it with `pip install 'senseshield\[dp\]'`\.$"):
        require(("opacus",), "This job (strategy 'dpsgd' trains with DP-SGD)")
    with pytest.raises(ConfigError, match=r"^The coordinator needs scikit-learn, scipy, opacus, .*`pip install "
                                          r"'senseshield\[server\]'`\.$"):
        require(("sklearn", "scipy", "opacus"), "The coordinator")
    require(("prometheus_client", "torch"), "anything")  # installed: no error
    assert install_hint(["prometheus_client"]) == "pip install 'senseshield[server]'"
    assert install_hint(["matplotlib", "amqtt"]) == "pip install 'senseshield[lab]'"
    assert install_hint(["sklearn", "mlxtend"]) == "pip install 'senseshield[mnist,server]'"
    assert install_hint(["sklearn"], prefer="lab") == "pip install 'senseshield[lab]'"
    assert missing_sentence(ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib.pyplot")) == (
        "This needs matplotlib, which this install lacks; install it with `pip install 'senseshield[lab]'`.")
    assert missing_sentence(ModuleNotFoundError("No module named 'nope'", name="nope")) is None


def test_the_cli_says_which_extra_is_missing():
    """`senseshield` (the operator's tool) names the `lab` extra, brackets and all (not
    swallowed as markup); a device's `edge-agent` has what it needs."""
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def no_sklearn(name, *a, **k):\n"
            "    if name.split('.')[0] == 'sklearn':\n"
            "        raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = no_sklearn\n"
            "sys.argv = ['senseshield', 'simulate', '--strategy', 'sensecrypt', '--model', 'mlp', '--rounds', '1',\n"
            "            '--clients', '2']\n"
            "from senseshield.cli import main\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    text = " ".join((done.stdout + done.stderr).split())
    assert "error: This needs scikit-learn, which this install lacks; install it with " \
           "`pip install 'senseshield[lab]'`." in text, text[-2000:]
