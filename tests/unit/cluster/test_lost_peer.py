"""A launched rank whose collective fails because another rank failed and left prints one
line naming that rank, not gloo's traceback; any other error keeps its traceback."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pipeline.cluster import distributed
from pipeline.commands import launched

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:22955. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF!"
)


@pytest.mark.parametrize(
    "error, lost",
    [
        (RuntimeError(GLOO_CLOSED), True),
        (RuntimeError("[pair.cc:598] Connection reset by peer"), True),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Connection closed by peer"), False),
    ],
)
def test_lost_peer_knows_a_collective_whose_peer_left(error, lost):
    assert distributed.lost_peer(error) == lost


def test_the_line_names_the_other_rank_of_two():
    assert distributed.stopped_line(1, 2) == "rank 1: stopped because rank 0 failed"
    assert distributed.stopped_line(0, 2) == "rank 0: stopped because rank 1 failed"
    assert distributed.stopped_line(3, 4) == "rank 3: stopped because another rank failed"


def rank_one_of_two(monkeypatch, error: Exception) -> None:
    """launched.main as rank 1 of 2 whose pipeline raises `error`."""

    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, tracker):
            raise error

    monkeypatch.setattr(launched.distributed, "init_process_group", lambda: (1, 2))
    monkeypatch.setattr(launched, "load_spec", lambda *args, **kwargs: object())
    monkeypatch.setattr(launched, "make_tracker", lambda *args, **kwargs: None)
    monkeypatch.setattr(launched, "Runner", Failing)


def test_a_rank_whose_peer_failed_prints_one_line(monkeypatch, capsys):
    rank_one_of_two(monkeypatch, RuntimeError(GLOO_CLOSED))
    assert launched.main(["--config", "c.yaml"]) == 1
    out = capsys.readouterr()
    assert out.err == "rank 1: stopped because rank 0 failed\n" and out.out == ""


def test_a_ranks_own_error_keeps_its_traceback(monkeypatch, capsys):
    rank_one_of_two(monkeypatch, RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert launched.main(["--config", "c.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "mat1 and mat2" in err
