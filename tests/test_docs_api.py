"""The docs say what the code does: every Python block of docs/api.md and docs/training.md runs
(issue 25 item 3), and every default a docs table gives for a job key or a strategy option is
the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = [DOCS / "api.md", DOCS / "training.md"]
BLOCKS = [(page, index, block) for page in PAGES
          for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]

# defaults a table says in words, not as a value: what the code's default (None, a
# Selection() or StrategyOptions()) means there
IN_WORDS = {"the task's", "built-in", "all devices", "defaults below"}


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p.name}:{i}" for p, i, _ in BLOCKS])
def test_api_page_block_runs(page: Path, index: int, block: str) -> None:
    exec(compile(block, f"{page}:block{index}", "exec"), {"__name__": "docs_api"})


def default_rows(page: Path) -> list[tuple[int, list[str], list[str]]]:
    """(line, keys, defaults) of every row of a table whose header's first column is `key` or
    `option` and which has a `default` column; a row's keys are the backticked names of its
    first cell and its defaults the default cell split at commas (one per key)."""
    rows, column = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            column = None
        elif column is None and cells[0] in ("key", "option") and "default" in cells:
            column = cells.index("default")
        elif column is not None and not set(cells[0]) <= set("-: "):
            keys = re.findall(r"`(\w+)`", cells[0])
            parts = [cells[column]] if cells[column] in IN_WORDS else cells[column].split(", ")
            rows.append((number, keys, parts))
    return rows


def literal(text: str) -> Any:
    """A docs default as a value: `none`/`null` are None, numbers are numbers (1e-5 too)."""
    import yaml

    text = text.strip().strip("`")
    if text in ("none", "null"):
        return None
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def code_default(key: str) -> Any:
    from senseshield.job import Job
    from senseshield.strategies import StrategyOptions

    fields = Job.model_fields if key in Job.model_fields else StrategyOptions.model_fields
    return fields[key].get_default(call_default_factory=True)


TABLES = [DOCS / "training.md", DOCS / "operating-a-fleet.md"]
ROWS = [(page.name, number, keys, parts) for page in TABLES for number, keys, parts in default_rows(page)]


def test_the_docs_tables_of_defaults_are_found() -> None:
    keys = {k for _, _, row, _ in ROWS for k in row}
    assert {"local_epochs", "batch_size", "lr", "task", "optimizer", "rounds", "he_ratio"} <= keys


@pytest.mark.parametrize("page, line, keys, parts", ROWS, ids=[f"{p}:{n}" for p, n, _, _ in ROWS])
def test_a_docs_default_is_the_codes(page: str, line: int, keys: list[str], parts: list[str]) -> None:
    from pydantic import BaseModel

    defaults = {k: code_default(k) for k in keys}
    if parts[0] in IN_WORDS:  # said in words: the code's default is no value to write down
        assert all(v is None or isinstance(v, BaseModel) for v in defaults.values()), (page, line, defaults)
        return
    assert len(parts) == len(keys), f"{page}:{line} gives {len(parts)} default(s) for {keys}"
    for key, part in zip(keys, parts):
        said, code = literal(part), defaults[key]
        if isinstance(code, float) or isinstance(said, float):
            assert said == pytest.approx(code), f"{page}:{line}: {key} is {code!r} in the code, {part!r} in the docs"
        else:
            assert said == code, f"{page}:{line}: {key} is {code!r} in the code, {part!r} in the docs"
