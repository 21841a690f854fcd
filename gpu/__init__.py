"""GPU tooling: the one-command GPU check, the wheels a GPU image lacks, the Triton kernels'
resources, the learning check (``python -m gpu.<script>``; gpu/README.md)."""
