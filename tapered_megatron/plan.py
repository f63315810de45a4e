"""``python -m tapered_megatron.plan``: the scale planner's command line, kept at its published
name; the code is :mod:`tapered_megatron.planning.planner`."""

from tapered_megatron.planning.planner import main

if __name__ == "__main__":
    raise SystemExit(main())
