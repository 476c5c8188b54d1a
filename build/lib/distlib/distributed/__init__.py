"""Processes and communication: the process group, the launchers' environments, collectives."""
