"""Paper reproductions whose results docs/benchmarks.md quotes (``python -m reproduce.<script>``;
reproduce/README.md)."""
