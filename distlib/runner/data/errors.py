"""The one error every data source raises for bad data: the runner reports it as one line on every
rank (exit status 2)."""

from distlib.errors import DistlibError


class DataError(DistlibError, RuntimeError):
    """The data set is missing, unreadable or inconsistent."""
