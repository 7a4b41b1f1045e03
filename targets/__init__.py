"""Device targets (one file per device); filled in by the executable-per-target work."""
