"""What reads measured runs and sweep files and needs no torch (numpy, pyarrow and the
pure-Python `sim.cost` only): `compare`/`report`/`metrics` (measured vs predicted),
`calibrate` and its fits (`steps`, `lsq`, `gpufit`, `graphsteps`, `piecewise`, `mixedfit`,
`heldback`, `level`, `idle_start`, `syncwake`, `spread`, `historyfit`, `quality`), the sweep
format and grid (`shapes_file`, `shapes_grid`, `shapes_plan`, `sweepmeta`) and `outdir`.
Invariant (tests/test_replay_layout.py): every module here imports with torch blocked."""
