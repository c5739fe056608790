"""What every layer may use: errors, units, the live tracker and its host marks."""
