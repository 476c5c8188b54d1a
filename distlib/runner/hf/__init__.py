"""Hugging Face formats on disk: reading a ``save_pretrained`` folder's safetensors into a model's
(sharded) tensors, reading a DCP checkpoint's tensors in one process, and exporting a run's model
as a folder ``from_pretrained`` loads."""
