"""A fleet over sites: two site Mosquittos bridged to the hub's, a site aggregator on each,
devices on the sites and on the hub. The site aggregators fold their devices' updates and
send one partial sum per cluster; the fleet ends with the simulator's model, bit for bit,
and no device update of a site crosses to the hub."""

from __future__ import annotations

import numpy as np
import pytest

from senseshield.job import Job
from senseshield.runtime.fleet import FleetOptions, fleet_up
from senseshield.runtime.sites import bridge_topics, mosquitto_bridge, site_name
from senseshield.simulation import run_simulation
from tests.test_fleet import Capture, keyserver_models, round_differences


@pytest.mark.parametrize("strategy, extra", [
    ("masked", {}),
    # SenseCrypt's packed Paillier: two clusters, running products merged per block (~25 s; make test-slow)
    pytest.param("sensecrypt", {"key_bits": 1024}, marks=pytest.mark.slow, id="sensecrypt-packed-paillier"),
])
def test_a_fleet_over_two_bridged_sites_ends_with_the_simulators_model(mosquitto, tmp_path, strategy, extra):
    config = Job(strategy=strategy, model="mlp", partition="categories:2", clients=4, rounds=2,
                 bandwidth=[50, 30], cpu=[24, 8], **extra)
    capture = Capture(mosquitto.url, "sites")  # what crosses into the hub (and what the hub's own devices say)
    report = fleet_up(config, FleetOptions(agents=4, out=tmp_path, broker=mosquitto.url, fleet="sites",
                                           round_deadline=120, min_contributors=1,
                                           sites={"north": [1, 2], "south": [3]}), timeout=400)
    capture.stop()
    sim = run_simulation(config)
    fleet_models = keyserver_models(tmp_path, "sites")
    assert sorted(fleet_models) == sorted(sim.models)
    for k, weights in sim.models.items():
        assert np.array_equal(fleet_models[k], weights), f"cluster {k}: the key server's model differs"
    assert round_differences(sim.rounds, report["rounds"]) == []
    assert report["exit_codes"] == {name: 0 for name in report["exit_codes"]}, report["exit_codes"]
    # every device took part in every round; the sites' updates reached the hub only folded
    for record in report["rounds"]:
        assert record["participants"] == 4
    topics = [t for t, _ in capture.payloads]
    updates = {t.split("/")[4] for t in topics if t.endswith("/update")}
    assert updates == {"c000"}, updates  # the hub's own device; c001..c003 are at sites
    partials = [t for t in topics if t.endswith("/partial")]
    assert {t.split("/")[4] for t in partials} == {"north", "south"}
    log = (tmp_path / "logs" / "site-north.log").read_text()
    assert "sent the partial sum of" in log and "cannot fold" not in log
    assert "Traceback" not in log, log[-3000:]  # (a failed send's traceback would quote the line above)


def test_a_sites_bridge_never_carries_updates():
    topics = bridge_topics("f", "north", "ss/v1")
    assert ("ss/v1/f/sites/north/partial", "out") in topics
    assert not any("update" in pattern for pattern, _ in topics)
    assert all(direction in ("in", "out") for _, direction in topics)
    config = mosquitto_bridge(hub_host="10.0.0.1", hub_port=1883, fleet="f", site="north", prefix="ss/v1")
    assert "connection site-north\naddress 10.0.0.1:1883\n" in config
    assert "topic ss/v1/f/agents/+/inbox in 1" in config


@pytest.mark.parametrize("name", ["", "a b", "x" * 33, "ünï", "a/b"])
def test_a_site_name_is_letters_digits_and_dashes(name):
    with pytest.raises(ValueError, match="is not allowed"):
        site_name(name)


def test_a_site_aggregator_that_lies_loses_its_sites_updates_and_nothing_else(mosquitto, tmp_path):
    """Site north's aggregator adds 1 to a masked word of each partial sum it sends: the key
    server refuses the aggregate at the fingerprint check (nothing unmasked), the coordinator
    tries it again without one part at a time, the aggregate without north's partial sum is
    accepted, and the key server names north's devices at fault. The hub's device and the
    honest site's count in every round."""
    config = Job(strategy="masked", model="mlp", partition="iid", clients=4, rounds=2)

    def wrap(name: str, argv: list[str]) -> list[str]:
        if name == "site-north":
            i = argv.index("coordinator.cli")
            return [*argv[:i], "tests.hostile_site", *argv[i + 1:]]
        return argv

    report = fleet_up(config, FleetOptions(agents=4, out=tmp_path, broker=mosquitto.url, fleet="lies",
                                           round_deadline=120, min_contributors=1, wrap=wrap,
                                           sites={"north": [1, 2], "south": [3]}), timeout=400)
    for record in report["rounds"]:
        r = record["round"]
        assert record["participants"] == 2, record  # c000 and c003
        notes = " ".join(record["notes"])
        assert f"round {r} cluster 0: refused the update of c001" in notes, notes
        assert f"round {r} cluster 0: refused the update of c002" in notes, notes
        assert "model unchanged" not in notes, notes
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "aggregating again over" in log


@pytest.mark.parametrize("args, sentence", [
    (["fleet", "up", "--agents", "2", "--sites", "3"], "--sites 3 is not allowed; use 0 (no sites) up to the number of agents (2)."),
    (["fleet", "bridge", "--site", "a b", "--hub", "h:1883"], "Site name 'a b' is not allowed"),
    (["fleet", "bridge", "--site", "north", "--hub", "h:99999"], "invalid port"),
])
def test_site_options_that_cannot_work_are_one_sentence(args, sentence):
    from typer.testing import CliRunner

    from senseshield.cli.main import app

    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2 and sentence in out.output and "Traceback" not in out.output, out.output


def test_a_site_aggregator_refuses_job_flags_in_one_sentence(tmp_path):
    from typer.testing import CliRunner

    from coordinator.cli import app

    out = CliRunner().invoke(app, ["serve", "--site", "north", "--once", "--insecure-dev"])
    assert out.exit_code == 2 and "--once is not allowed with --site" in out.output, out.output
    out = CliRunner().invoke(app, ["serve", "--site", "no/rth", "--insecure-dev"])
    assert out.exit_code == 2 and "--site: Site name 'no/rth' is not allowed" in out.output, out.output
