"""Reliability: stop signals, the watchdog, failure reports."""
