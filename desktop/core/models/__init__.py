"""What a model is: facts read from GGUF headers and HF configs, and the embedded demo model."""
