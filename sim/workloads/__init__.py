"""Workload makers: importers of public traces, synthetic generators, and trace statistics.

Everything here returns a `core.trace.Trace`; writing goes through `core.trace.write_trace`
(validated, atomic). numpy (and polars where it helps) only, never torch.
"""
