"""Sites: a fleet spread over several brokers, each bridged to the hub's.

A site (a factory, a farm, a campus: a LAN of devices behind one uplink) runs its own MQTT
broker, bridged to the hub's broker, and a site aggregator (``coordinator serve --site
NAME``, :mod:`coordinator.sites`). The bridge carries what the devices and the hub say to
each other, but never the devices' updates: the site aggregator folds them and sends one
partial sum per cluster. This module says what a site's broker bridges
(:func:`bridge_topics`), in one place for the local fleet (:mod:`senseshield.runtime.fleet`),
``senseshield fleet bridge`` and the Ansible role.
"""

from __future__ import annotations

SITE_PREFIX = "site-"
"""A site aggregator's name (its identity, its MQTT client id) is ``site-<site>``."""

# What a site's broker sends to the hub (out) and takes from it (in), under ss/v1/<fleet>/:
# everything but the devices' updates, which the site aggregator folds.
BRIDGE_OUT = ("agents/+/hello", "agents/+/bootstrap", "agents/+/proposal", "agents/+/metrics", "agents/+/status",
              "agents/+/failure", "agents/+/decline", "sites/{site}/partial", "sites/{site}/status")
BRIDGE_IN = ("fleet/#", "keys/#", "clusters/#", "keyserver/challenges", "keyserver/status", "coordinator/status",
             "agents/+/inbox", "jobs/board")


def site_name(name: str) -> str:
    """``name`` if it is a site's name (letters, digits, '-', at most 32), else ValueError."""
    if not name or len(name) > 32 or not name.replace("-", "").isalnum() or not name.isascii():
        raise ValueError(f"Site name {name!r} is not allowed; use 1-32 letters, digits and '-'.")
    return name


def bridge_topics(fleet: str, site: str, prefix: str) -> list[tuple[str, str]]:
    """The (topic pattern, direction) pairs a site's broker bridges to the hub: ``out`` what
    the site's devices and aggregator say to the coordinator and the key server, ``in`` what
    the hub says to them; never ``agents/+/update``."""
    base = f"{prefix}/{fleet}"
    return ([(f"{base}/{t.format(site=site)}", "out") for t in BRIDGE_OUT]
            + [(f"{base}/{t}", "in") for t in BRIDGE_IN])


def mosquitto_bridge(*, hub_host: str, hub_port: int, fleet: str, site: str, prefix: str,
                     protocol: str = "mqttv311") -> str:
    """The Mosquitto ``connection`` block of a site's broker: its bridge to the hub's broker
    at ``hub_host:hub_port`` (plain TCP; the Ansible role adds TLS and credentials)."""
    lines = [f"connection site-{site}", f"address {hub_host}:{hub_port}", f"remote_clientid bridge-{site}",
             f"bridge_protocol_version {protocol}", "try_private true", "cleansession false",
             "restart_timeout 1 10", "notifications false"]
    lines += [f"topic {pattern} {direction} 1" for pattern, direction in bridge_topics(fleet, site, prefix)]
    return "\n".join(lines) + "\n"
