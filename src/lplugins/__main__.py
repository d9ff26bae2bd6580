"""``python -m lplugins``: the same as the ``lplugins`` command."""

from lplugins.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
