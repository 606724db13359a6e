"""Contract 3: the run folder shared by `sim` (predicted) and `replay` (measured).

The step loop fills a `RunRecorder`; `write_run` turns it into requests.parquet, steps.parquet,
gc.parquet, summary.json and timeline.json, atomically; `load_run` reads a folder back.
"""

from core.runfmt.bubbles import CAUSES, Bubbles, account_bubbles
from core.runfmt.io import Run, RunFormatError, load_run, trace_info, write_run
from core.runfmt.recording import Recording, RecordingError
from core.runfmt.records import RunRecorder

__all__ = [
    "CAUSES",
    "Bubbles",
    "Recording",
    "RecordingError",
    "Run",
    "RunFormatError",
    "RunRecorder",
    "account_bubbles",
    "load_run",
    "trace_info",
    "write_run",
]
