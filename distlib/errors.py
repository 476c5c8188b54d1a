"""The one base class of the errors distlib raises on purpose.

A ``DistlibError`` says what is wrong with the input, the environment or saved state, in
words the user can act on (a recipe, the launch environment, a data set, a checkpoint, a
model that differs between ranks): a launcher reports it in one line. Any other exception
is a bug and keeps its traceback. The subclasses live with the code that raises them
(``EnvError`` in process_group, ``CheckpointError`` in checkpoint, ...).
"""

from __future__ import annotations


class DistlibError(Exception):
    """An error in the input, environment or saved state; the message says what to change."""
