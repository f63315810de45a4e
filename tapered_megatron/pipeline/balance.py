"""``python -m tapered_megatron.pipeline.balance``: the balancer's command line, kept at its
published name; the code is :mod:`tapered_megatron.planning.balance`."""

from tapered_megatron.planning.balance import main

if __name__ == "__main__":
    main()
