"""Attention ops. ``attend_reference`` is the plain-PyTorch op; faster backends implement
the same ``AttendFn`` signature and register in ``ATTENTION_IMPLS``."""

from pipeline.ops.attention import (  # noqa: F401  (the package's public names)
    ATTENTION_IMPLS,
    RENORM_EPS,
    AttendFn,
    adaptive_span_mask,
    attend_persistent,
    attend_reference,
    attention_weights,
    get_attention_impl,
    skew,
    unskew,
)

