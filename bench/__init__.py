"""Timings: what a training step, the optimizer, the data path and the attention op cost
(``python -m bench.<script>``; bench/README.md)."""
