"""Workload makers: importers of public traces, synthetic generators, and trace statistics.

Everything here returns a `bubblesim.core.trace.Trace`; writing goes through
`bubblesim.core.trace.write_trace`
(validated, atomic). numpy (and polars where it helps) only, never torch.
"""
