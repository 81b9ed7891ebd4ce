# SenseShield: two commands do all the set-up on a fresh machine.
#   make test   create .venv if missing, install the project with every extra, run the suite
#   make demo   create .venv if missing, install, run the main job
# Both install `.[all,dev]`: the servers, simulation, plots and the test tools. A device needs
# only `pip install senseshield` (docs/pi.md#install-targets).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed on its own, pinned, before the project: pip then finds the CPU build that
# is on disk (or a CPU index the user configured) and never resolves a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# two workers, whole files per worker: module fixtures (keys, the Ansible sandbox) are built
# once, and trials (cgroups, namespaces) never run beside each other
XDIST ?= -n 2 --dist loadfile

STAMP := $(VENV)/.installed

.PHONY: install test test-slow demo bench clean broker

install: $(STAMP)

# The integration tests talk to a real Mosquitto broker that they start themselves.
broker:
	@if command -v mosquitto >/dev/null 2>&1 || test -x /usr/sbin/mosquitto; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing mosquitto (Debian package) for the broker tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null; \
	elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
	  echo "installing mosquitto (Debian package) with sudo for the broker tests"; \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null; \
	else \
	  echo "error: the tests need the mosquitto broker and this machine cannot install it here;" \
	       "install it (e.g. apt-get install mosquitto, brew install mosquitto) and rerun." >&2; exit 1; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

test: $(STAMP) broker
	$(PY) -m pytest -m "not slow" $(XDIST) --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP) broker
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The main job: a local fleet (embedded MQTT broker, key server, coordinator and 6 agents as
# OS processes) running SenseCrypt on mixed device profiles; report in demo-fleet/report.json
# and demo-fleet/report.html (fleet up renders it at the end and says where it is).
demo: $(STAMP)
	$(VENV)/bin/senseshield fleet up --agents 6 --strategy sensecrypt --dataset digits --model mlp \
	    --partition categories:3 --rounds 4 \
	    --profile-file profiles/sensecrypt-system-heterogeneity.yaml --out demo-fleet
	@echo "open demo-fleet/report.html in a browser for the plots"

bench: $(STAMP)
	$(PY) benchmarks/bench_foundation.py
	$(PY) benchmarks/bench_fleet.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis demo-result.json
