"""Evaluation, benchmarks and plots of the engine, outside it: `python -m bench --help`.

Each subcommand lives in its own module (ppl, agree, recall, speed, sweep, resume, gpu) as a function
that takes a ready engine and token ids, so tests can drive it with a tiny model; `api` times the whole app
through its OpenAI-compatible API; `plots` draws saved results; `cli` parses the arguments, loads the model
and prints a table (and, with --json, one JSON object last).
"""
