"""The layout shows the architecture: roles never import the simulator, the engine is pure."""

from __future__ import annotations

import subprocess
import sys



def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_services_do_not_import_the_simulator():
    """One process imports the three roles one after another and checks after each (none
    may pull in the simulator; what a job is comes from the shared module)."""
    code = (
        "import importlib, sys\n"
        "for role in ('keyserver.service', 'coordinator.service', 'edge_agent.service'):\n"
        "    importlib.import_module(role)\n"
        "    print(role, 'senseshield.simulation' in sys.modules, 'senseshield.job' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [line.split() for line in result.stdout.split("\n") if line]
    assert [(role, sim, job) for role, sim, job in lines] == [
        (role, "False", "True") for role in ("keyserver.service", "coordinator.service", "edge_agent.service")
    ]


def test_the_privacy_engine_imports_no_torch_and_no_network():
    loaded = _modules_after_import("senseshield.engine")
    assert not {"torch", "paho", "paho.mqtt", "senseshield.runtime"} & loaded


def test_the_library_never_imports_a_role():
    loaded = _modules_after_import("senseshield.cli")
    assert not {"coordinator", "edge_agent", "keyserver"} & loaded


def test_the_front_door_exports_the_public_names_lazily():
    loaded = _modules_after_import("senseshield")
    assert "torch" not in loaded  # importing the package is cheap
    import senseshield as ss

    job = ss.Job(strategy="plaintext", model="linear", clients=2, rounds=1)
    result = ss.simulate(job)
    assert isinstance(result, ss.RunResult) and len(result.rounds) == 1
    assert "sensecrypt" in ss.STRATEGIES and "packed-paillier" in ss.SCHEMES and "mlp" in ss.MODELS
    for name in ss.__all__:
        assert getattr(ss, name) is not None, name


def test_the_coordinators_parts_do_not_touch_the_transport():
    """coordinator/service.py wires the parts to MQTT; each part (job book, roster, rounds and
    their checks, an update's acceptance, budgets, the job's state and its store, key-server link,
    reporter, metrics, contributions, fault drills) imports neither the broker client nor the service,
    nor torch (the report imports it only when it builds one); nor do the key server's and the
    agent's parts (keyserver.state, keyserver.verify, edge_agent.dataspec, prepare, costs, round, evaluate)."""
    parts = tuple(f"coordinator.{p}" for p in ("jobs", "contributions", "keylink", "metrics", "report", "roster",
                                                 "rounds", "accept", "budgets", "state", "store", "drill")) + (
        "keyserver.state", "keyserver.verify", "edge_agent.dataspec", "edge_agent.prepare", "edge_agent.costs",
        "edge_agent.round", "edge_agent.evaluate")
    code = (
        "import importlib, sys\n"
        f"for part in {parts!r}:\n"
        "    importlib.import_module(part)\n"
        "print(' '.join(m for m in ('paho', 'senseshield.runtime.service', 'senseshield.runtime.transport',\n"
        "                           'coordinator.service', 'keyserver.service', 'torch', 'senseshield.simulation')\n"
        "               if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == []


def test_the_library_never_reaches_up_in_its_source():
    """Every import statement of the library, at load time or inside a function: nothing
    under ``senseshield/`` imports a role (coordinator, edge agent, key server), and nothing
    outside ``senseshield/cli`` imports the command lines."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    reaching = []
    for path in sorted((root / "senseshield").rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("coordinator", "edge_agent", "keyserver") or (
                        name.startswith("senseshield.cli") and "cli" not in rel.parts):
                    reaching.append(f"{rel}:{node.lineno} imports {name}")
    assert reaching == []
