"""Every Python block of docs/api.md runs (issue 25 item 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_api_page_block_runs(index: int) -> None:
    exec(compile(BLOCKS[index], f"{PAGE}:block{index}", "exec"), {"__name__": "docs_api"})
