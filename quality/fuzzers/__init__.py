"""The fuzzers: case generators and runners that tests/commands assert on and
quality/fuzz.py counts."""
