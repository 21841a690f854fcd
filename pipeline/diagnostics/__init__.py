"""Counters of what a training step does, shared by the tests and the benchmarks: host syncs
(host_syncs.HostSyncCounter), aten ops and the bytes kept for backward (step_audit)."""
