"""The one base class of the errors distlib raises on purpose.

A ``DistlibError`` says what is wrong with the input, the environment or saved state, in
words the user can act on (a recipe, the launch environment, a data set, a checkpoint, a
model that differs between ranks): a launcher reports it in one line. Any other exception
is a bug and keeps its traceback. The subclasses live with the code that raises them
(``EnvError`` in process_group, ``CheckpointError`` in checkpoint, ...); ``ArgumentError``, for an
argument no library function can take, is shared by the modules that check their arguments.
"""

from __future__ import annotations


class DistlibError(Exception):
    """An error in the input, environment or saved state; the message says what to change."""


class ArgumentError(DistlibError, ValueError):
    """An argument a library function or constructor cannot take (a bucket size, a reduce op, a
    count); a ``ValueError`` too, as these were before."""
