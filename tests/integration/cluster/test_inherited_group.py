"""A command is one process, whatever process group its environment names: `allattn-pipe`
run in a shell that has a launcher's RANK / WORLD_SIZE / MASTER_* (a torchrun step, a
Kubernetes training pod) drops them, says so where they describe several processes, and
gives itself a group of one on a free port. It waited at the named rendezvous for hours, or,
with a busy MASTER_PORT exported, ended in a traceback. (tests/system/cluster/
test_inherited_group.py runs the same in a fresh process, up to the group itself.)"""

from __future__ import annotations

import os
import socket

import pytest
from click.testing import CliRunner

from pipeline.cluster import distributed
from pipeline.commands.cli import main
from tests.fixtures.runs import five_stage_config

POD = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "MASTER_ADDR": "trainer-0.example",
    "MASTER_PORT": "23456",
}


@pytest.fixture
def no_group_yet(monkeypatch):
    """As in a fresh process: no group of this process's own started (an earlier test's
    in-process run may have started one, whose variables a command keeps)."""
    monkeypatch.setattr(distributed, "_group_started", False)


def test_a_command_drops_a_launchs_variables_and_says_so(tmp_path, monkeypatch, no_group_yet):
    for name, value in POD.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(main, ["validate", str(five_stage_config(tmp_path))])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (
        "note: ignoring LOCAL_RANK, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the "
        "environment (a launch of 8 processes): allattn-pipe runs as one process and starts "
        "the ranks that train.launcher asks for itself (`allattn-pipe launch slurm` on Slurm)"
    )
    assert not set(POD) & set(os.environ)
    distributed.prepare_environment()  # what the command's process group is made from
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert os.environ["MASTER_PORT"] != POD["MASTER_PORT"]


def test_a_busy_master_port_alone_is_dropped_quietly(tmp_path, monkeypatch, no_group_yet):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        monkeypatch.setenv("MASTER_PORT", port)
        result = CliRunner().invoke(main, ["validate", str(five_stage_config(tmp_path))])
        assert result.exit_code == 0, result.output
        assert "note:" not in result.output
        distributed.prepare_environment()
        assert os.environ["MASTER_PORT"] != port


def test_a_processs_own_group_keeps_its_variables(monkeypatch):
    """Once this process started its group (a run in it), RANK and MASTER_PORT are its own:
    a later command in the same process (the tests', a sweep's) keeps them."""
    monkeypatch.setattr(distributed, "_group_started", True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert distributed.drop_inherited_group() == {}
    assert os.environ["MASTER_PORT"] == "29999"
