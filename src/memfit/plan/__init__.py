"""plan: choose the fastest combination of techniques that fits a memory budget."""
