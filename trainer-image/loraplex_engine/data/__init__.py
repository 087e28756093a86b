"""Datasets beyond a local JSONL file: where a spec's dataset may be read from
(sources.py), its files opened (openers.py) and its rows read and checked (formats.py) in a
bounded reader process (child.py) that fills the engine's spool (spool.py)."""
