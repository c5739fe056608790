"""profile: per-block costs measured on the real machine."""
