"""Fault campaigns: a real mesh under a concurrent stream load, one fault injected per trial, every
request's outcome checked against monolithic vLLM (bench/faults.py runs the report's campaign,
tests/faults/ a few trials of each)."""
