"""Benchmarks of every KV policy on the real decode path: `python -m infinigen_core.eval --help`.

Each subcommand lives in its own module (ppl, agree, recall, speed, sweep, resume, gpu) as a function
that takes a ready engine and token ids, so tests can drive it with a tiny model; `cli` parses the
arguments, loads the model and prints a table (and, with --json, one JSON object last).
"""
