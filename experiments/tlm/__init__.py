"""Reproduction of the Tapered Language Models paper, run by ``scripts/reproduce_tlm.py``: the
experiment grid, the driver, statistics, tables, plots, the generated reading and RESULTS.md."""
