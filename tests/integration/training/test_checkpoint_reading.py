"""What the checkpoint reader (pipeline.training.checkpoint_dirs.read_checkpoint_file) builds
from a pickle: tensors, plain values and the few allowed types, and getattr only as an
allowed enum's member by name, which is how CPython 3.11.0-3.11.4 (Debian 12's 3.11.2
among them) pickle an enum member: DeepSpeed's optimizer files written there hold
ZeroStageEnum so, and a run resumed from them must read them."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from deepspeed.runtime.zero.config import ZeroStageEnum

from pipeline.errors import PipelineError
from pipeline.training.checkpoint_dirs import read_checkpoint_file

OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class ByName:
    """Pickles as ``getattr(cls, name)``: an enum member as CPython 3.11.0-3.11.4 write it,
    whatever Python runs the test."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return getattr, (self.cls, self.name)


def saved(tmp_path, value, name=OPTIMIZER_FILE):
    path = tmp_path / name
    torch.save(value, path)
    return path


def test_an_enum_member_pickled_by_name_or_by_value_reads_as_that_member(tmp_path):
    by_name = saved(tmp_path, {"zero_stage": ByName(ZeroStageEnum, "optimizer_states")})
    assert b"getattr" in by_name.read_bytes()  # the pickle really is the 3.11.2 form
    assert read_checkpoint_file(by_name)["zero_stage"] is ZeroStageEnum.optimizer_states
    by_value = saved(tmp_path, {"zero_stage": ZeroStageEnum.gradients})
    assert read_checkpoint_file(by_value)["zero_stage"] is ZeroStageEnum.gradients


@pytest.mark.parametrize(
    ("cls", "name", "named"),
    [
        (ZeroStageEnum, "__init__", "getattr(ZeroStageEnum, '__init__')"),
        (ZeroStageEnum, "_missing_", "getattr(ZeroStageEnum, '_missing_')"),
        (np.ndarray, "tofile", "getattr(ndarray, 'tofile')"),
    ],
)
def test_getattr_for_anything_but_an_allowed_enums_member_is_refused(tmp_path, cls, name, named):
    path = saved(tmp_path, {"x": ByName(cls, name)})
    with pytest.raises(PipelineError) as refused:
        read_checkpoint_file(path)
    assert str(refused.value) == (
        f"{path}: refused, not a checkpoint this pipeline writes (it would build {named}); "
        f"a checkpoint can run code when loaded, so only tensors and plain values are read"
    )


def test_an_enum_allowed_only_in_optimizer_files_is_refused_elsewhere(tmp_path):
    path = saved(tmp_path, {"x": ByName(ZeroStageEnum, "optimizer_states")}, "trainer-rank0.pt")
    with pytest.raises(PipelineError, match=re.escape("(it would build deepspeed.runtime")):
        read_checkpoint_file(path)
