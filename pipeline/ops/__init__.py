"""Attention ops. ``attend_reference`` is the plain-PyTorch op; the fused backends
(``pipeline.ops.fused``: sdpa, flex, and auto, which picks one per call) implement the same
``AttendFn`` signature and register in ``ATTENTION_IMPLS``."""

from pipeline.ops.attention import (  # noqa: F401  (the package's public names)
    ATTENTION_IMPLS,
    RENORM_EPS,
    AttendFn,
    adaptive_span_mask,
    attend_persistent,
    attend_reference,
    attention_weights,
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
