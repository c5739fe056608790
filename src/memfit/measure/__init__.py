"""measure: what a training step costs in memory — formulas, no-allocation tracing, live tracking."""
