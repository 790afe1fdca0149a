"""The machine models run on: detected GPUs, CPU, RAM and OS, and a catalogue of GPUs for "what if" sizing."""
