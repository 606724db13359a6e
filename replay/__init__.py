"""Replay: run traces through the real engine and measure them (`run`), compare a measured run
with a predicted one (`compare`), fit the simulator's cost profile from measured runs
(`calibrate`), and measure each seed switch beside the simulator's prediction (`ablate`).

Kept light: importing `replay` imports nothing; torch and the engine are imported only by
`replay run`/`ablate`, the simulator (simpy) only by `ablate`, and compare/calibrate need only
numpy and pyarrow (plus the pure-Python `sim.cost` for the profile format).
"""
