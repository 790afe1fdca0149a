"""Will it run, and how: the memory fit, the engine + quantization recommendation and export sizing."""
