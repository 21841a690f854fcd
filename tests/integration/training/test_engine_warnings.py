"""DeepSpeed's "untested optimizer" warning: the paper's clipped Adagrad under ZeRO is
allowed on purpose (ds_config) and checked by the project's own tests, and the warning came
once per engine built, train's and finetune's; building the engine prints it no more."""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import torch


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_two_engines_with_adagrad_under_zero_print_no_untested_optimizer_warning():
    from deepspeed.utils import logger

    from pipeline.cluster import distributed
    from pipeline.training.ds_config import deepspeed_config
    from pipeline.training.engine import initialize
    from pipeline.training.optim import build_optimizer

    distributed.init_process_group()
    opt_cfg = NS(type="adagrad", lr=0.1, clip="per_param", clip_norm=0.03, weight_decay=0.0)
    train = NS(
        batch_size=2,
        micro_batch_size=None,
        optimizer=opt_cfg,
        deepspeed=NS(zero_stage=1, bf16=False, fp16=False, gradient_accumulation_steps=1),
    )
    records = Records()
    logger.addHandler(records)
    try:
        for _ in range(2):  # train's engine, then finetune's
            model = torch.nn.Linear(4, 4)
            engine = initialize(
                model, build_optimizer(model.parameters(), opt_cfg), deepspeed_config(train, 1)
            )
            assert engine.zero_optimization_stage() == 1
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "untested optimizer" in m], records.messages
