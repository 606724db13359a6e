"""Contract 3: the run folder shared by `sim` (predicted) and `replay` (measured).

The step loop fills a `RunRecorder`; `write_run` turns it into requests.parquet, steps.parquet,
gc.parquet, summary.json and timeline.json, atomically; `load_run` reads a folder back.
"""

from bubblesim.core.runfmt.bubbles import CAUSES, Bubbles, account_bubbles
from bubblesim.core.runfmt.io import Run, RunFormatError, load_run, trace_info, write_run
from bubblesim.core.runfmt.recording import Recording, RecordingError
from bubblesim.core.runfmt.records import RunRecorder

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
