"""Where an edge agent's data comes from (edge_agent.dataspec): ``--data`` and ``--shard``
parsed, each bad value refused with one sentence naming it."""

from __future__ import annotations

import pytest

from edge_agent.dataspec import DataSpec
from senseshield.errors import ConfigError


def test_data_sources_are_named_and_must_exist(tmp_path):
    a, b = tmp_path / "a.npz", tmp_path / "b.csv"
    a.write_bytes(b"")
    b.write_text("")
    assert DataSpec.parse_sources(None) == {}
    assert DataSpec.parse_sources([str(a), f"extra={b}", "py=python:mod:fn"]) == {
        "default": str(a), "extra": str(b), "py": "python:mod:fn"}
    cases = {
        "names source 'default' twice": [str(a), str(b)],
        "is not allowed; use PATH or NAME=PATH": ["bad name!=" + str(a)],
        f"{str(tmp_path / 'gone.npz')!r} does not exist": [str(tmp_path / "gone.npz")],
    }
    for needle, items in cases.items():
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            DataSpec.parse_sources(items)


def test_a_shard_is_i_of_n():
    assert DataSpec.parse_shard(None) is None and DataSpec.parse_shard("3/20") == (3, 20)
    for text in ("20/20", "x/2", "1", "-1/2"):
        with pytest.raises(ConfigError, match=f"^--shard {text!r} is not allowed; use I/N with 0 <= I < N"):
            DataSpec.parse_shard(text)
