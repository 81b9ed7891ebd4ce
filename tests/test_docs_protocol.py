"""docs/protocol.md states every message's version as messages.py defines it: each message
of the topic table is named in backticks, followed by ``(vN`` or ``(version N`` (at least
once) when N > 1."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from senseshield.runtime.protocol import messages

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _classes() -> dict[str, int]:
    return {c.schema_name: c.version for _, c in inspect.getmembers(messages, inspect.isclass)
            if issubclass(c, messages.Message) and c is not messages.Message and "schema_name" in c.__dict__}


def test_every_message_version_in_the_protocol_doc_is_the_codes():
    text = DOC.read_text()
    table = text[text.index("| topic (under"):text.index("The round lives in every frame's header")]
    wrong = []
    for name, version in sorted(_classes().items()):
        found = re.findall(rf"`{re.escape(name)}`(?: frame)? ?(?:\((?:v|version )(\d+))?", table)
        said = {int(v) for v in found if v} or {1}  # a message named without a version is version 1
        if not found:
            wrong.append(f"{name}: not in the topic table")
        elif said != {version}:
            wrong.append(f"{name}: the doc says version {sorted(said)}, messages.py {version}")
    assert wrong == []
