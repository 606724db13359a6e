"""Replay: run traces through the real engine and measure them (`run`), compare a measured run
with a predicted one (`compare`), fit the simulator's cost profile from measured runs
(`calibrate`), and measure each seed switch beside the simulator's prediction (`ablate`).

Two halves: `replay.gpu` runs the engine (torch at the top of its modules); `replay.analysis`
reads runs and sweep files and never imports torch (numpy, pyarrow and the pure-Python
`sim.cost`). Kept light: importing `replay` imports nothing; the simulator (simpy) is imported
only by `ablate`, where it predicts.
"""
