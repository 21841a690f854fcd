"""Attention ops. ``attend_reference`` is the plain-PyTorch op; the fused backends
(``pipeline.ops.fused``: sdpa, flex, and auto, which picks one per call) implement the same
``AttendFn`` signature and register in ``ATTENTION_IMPLS``, ``triton`` among them
(``pipeline.ops.triton_attention``)."""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # Without CUDA the Triton kernels can only run in Triton's interpreter, and Triton reads
    # this when it is first imported (torch._dynamo imports it): set it while that is ahead.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pipeline.ops.attention import (  # noqa: F401  (the package's public names)
    ATTENTION_IMPLS,
    RENORM_EPS,
    AttendFn,
    adaptive_span_mask,
    attend_persistent,
    attend_reference,
    attention_weights,
    backend_cannot_train_on,
    backends_that_train_on,
    get_attention_impl,
    log_span_mask,
    skew,
    unskew,
)
from pipeline.ops.dropout import attention_dropout, draw_dropout_seed, flex_keep  # noqa: F401
from pipeline.ops.fused import (  # noqa: F401
    attend_auto,
    attend_flex,
    attend_sdpa,
    compile_count,
    describe_auto,
    pick_attention_impl,
)
