"""What Switchyard remembers: the SQLite history of runs and samples, and the versioned user settings."""
