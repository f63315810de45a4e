"""``python -m tapered_megatron.plan``: the scale planner's command line, kept at its published
name. A search or one ``--layout`` runs :func:`tapered_megatron.planning.planner.main`;
``--calibrate [--fit]`` runs :func:`tapered_megatron.planning.calibration.main` (which itself
plans through the planner, so the dispatch lives here, above both)."""

from __future__ import annotations

import sys

from tapered_megatron.planning import calibration, planner


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``--calibrate`` to the calibration, anything else to the planner."""
    a, _ = planner.arguments().parse_known_args(argv)
    if a.fit and not a.calibrate:
        print("error: --fit refits the calibration's constants: add --calibrate", file=sys.stderr)
        return 2
    if a.calibrate:
        return calibration.main(as_json=a.json, refit=a.fit)
    return planner.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
