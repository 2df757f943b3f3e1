"""Benchmarks: dflash2 against its peers on the same prompts, in one process."""
