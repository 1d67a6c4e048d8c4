"""``python -m kvbudget``: the ``kvbudget`` command line (:mod:`kvbudget.cli`)."""

from kvbudget.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
