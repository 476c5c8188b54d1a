"""The runner's data sources: image folders and archives decoded once into tensors kept on the
device, byte-level text, pre-tokenized token files (and the tool that writes them)."""
