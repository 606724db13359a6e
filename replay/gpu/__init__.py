"""What runs the engine (torch, a GPU or the CPU tiny model): `run` replays a trace and writes a
run folder, `measure` turns the engine's hooks into step records, `shapes`/`shapes_step` time
synthetic batches, `kernels` profiles them, `compiles` counts Triton compiles, `ablate` measures
each seed switch (and asks the simulator for its prediction). Importing this package imports
nothing; its modules import torch at the top."""
