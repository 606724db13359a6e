"""bubblesim's own packages under one name that cannot clash: `core` (pure Python shared by
the simulator and the engine: config, trace, scheduling policy, KV blocks, run format),
`plan` (capacity planning, on top of `sim`) and `workloads` (trace generators, importers and
tools). Importing `bubblesim` imports none of them."""
