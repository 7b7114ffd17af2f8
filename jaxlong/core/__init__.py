"""The bottom layer: the device mesh and its axis names, multi-process start-up, XLA ordering tricks,
compiled-memory reading."""
