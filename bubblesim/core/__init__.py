"""Pure-Python code shared by `sim`, `engine` and `replay`: config, presets, trace format,
scheduling policy and KV block accounting, run format. Imports neither torch nor simpy."""
