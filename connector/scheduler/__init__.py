"""Scheduler side (vLLM's engine-core process): prefix lookups in the store, which blocks each
step loads and saves (`scheduler`), which loads the step waits for (`step_loads`), and how a
failed load reaches vLLM's scheduler for each model layout (`load_failures`)."""
