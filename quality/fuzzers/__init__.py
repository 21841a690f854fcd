"""The fuzzers: case generators and runners that tests/system/commands assert on and
quality/fuzz.py counts."""
