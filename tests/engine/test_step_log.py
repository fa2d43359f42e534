"""`tokenloom serve --step-log`: every turn of the engine loop that ran a step, its schedule and its wall time."""

from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess

from tokenloom.cli import main
from tokenloom.engine.step_log import read_step_log
from tokenloom.server_config import ServerConfig


def test_a_served_request_leaves_its_prefill_and_each_decode_step_in_the_log(tiny_chat_model, tmp_path):
    log = tmp_path / "steps.jsonl"
    prompt = list(range(100, 120))
    with ServerProcess("--model", str(tiny_chat_model), "--step-log", str(log)) as server:
        body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    steps = read_step_log(log)
    # The prompt in one chunk (it samples the first token), then one decode row per further token.
    assert [step["items"] for step in steps] == [[[0, 20, 1, True]]] + [[[20 + i, 1, 1, False]] for i in range(4)]
    assert all(step["copied_blocks"] == 0 and step["seconds"] > 0 for step in steps)


def test_the_step_log_is_refused_where_the_engine_is_not_in_the_servers_process():
    with pytest.raises(ValueError, match="--step-log"):
        ServerConfig(step_log="steps.jsonl", core_process=True)
    ServerConfig(step_log="steps.jsonl")  # in this process: fine


def test_a_step_log_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, capsys):
    missing = tmp_path / "no such directory" / "steps.jsonl"
    assert main(["serve", "--model", str(tmp_path / "not loaded either"), "--step-log", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err  # the log named, not the model
