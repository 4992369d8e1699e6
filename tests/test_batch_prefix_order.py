"""A batch's lines that share a prompt prefix are submitted consecutively (the provider's batch
file, the lanes' pages), each line's answer still under its own custom_id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from multiplexer.core.cache_affinity import call_key, prefix_order
from tests.test_prompt_cache_fidelity import gateway, run_batch

pytestmark = pytest.mark.anyio


def test_lines_sharing_a_key_go_together_where_the_first_was() -> None:
    assert prefix_order([1, 2, None, 1, 3, 2, None, 1]) == [0, 3, 7, 1, 5, 2, 4, 6]
    assert prefix_order([]) == [] and prefix_order([None, None]) == [0, 1]


def line(conversation: str, turn: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": f"You are the {conversation} assistant. " * 50},
                {"role": "user", "content": "start"}]
    for i in range(turn):
        messages += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i}"}]
    return {"model": "gpt-4o-mini", "messages": messages}


async def test_an_openai_batch_file_groups_each_conversations_lines(tmp_path: Path) -> None:
    order = [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1), ("a", 2)]
    rows = [{"custom_id": f"{c}{t}", "method": "POST", "url": "/v1/chat/completions",
             "body": line(c, t)} for c, t in order]
    async with gateway(tmp_path) as (ups, client):
        got = await run_batch(client, rows)
        assert got["status"] == "completed", got
        out = (await client.get(f"/v1/files/{got['output_file_id']}/content")).text
    [sent] = [f for f in ups.openai_state.files.values() if f.purpose == "batch"]
    bodies = [json.loads(x)["body"] for x in sent.content.splitlines()]
    keys = [call_key(b, "prefix") for b in bodies]
    assert keys == sorted(keys, key=keys.index)  # each conversation's lines consecutive
    assert [k == keys[0] for k in keys].count(True) == 3  # conversation a's three lines together
    answered = {json.loads(x)["custom_id"] for x in out.splitlines()}
    assert answered == {r["custom_id"] for r in rows}
