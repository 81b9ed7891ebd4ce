"""Shared fixtures: a real Mosquitto broker started by the test suite itself."""

from __future__ import annotations

import pytest

from tests.broker import Mosquitto


@pytest.fixture()
def mosquitto(tmp_path):
    broker = Mosquitto(tmp_path)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture(autouse=True)
def _development_mode_stays_in_its_test():
    """``--insecure-dev`` run in-process (CliRunner) turns development mode on for the whole
    process (senseshield.development.enable sets the variable); undo it after each test, so
    a later test's secure defaults are not silently relaxed."""
    import os

    from senseshield.development import DEVELOPMENT_ENV

    before = os.environ.get(DEVELOPMENT_ENV)
    yield
    if before is None:
        os.environ.pop(DEVELOPMENT_ENV, None)
    else:
        os.environ[DEVELOPMENT_ENV] = before
