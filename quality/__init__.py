"""Quality tools: mutation testing, the fuzzers' figures, kill -9 of tracked training
(``python -m quality.<script>``; quality/README.md)."""
