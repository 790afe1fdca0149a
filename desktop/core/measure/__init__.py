"""Measuring engines: the load generator, engine A/B runs, reports, and the benchmark job the GUI runs."""
