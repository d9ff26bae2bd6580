"""What the ``lplugins`` command runs beyond listing: the demo (``demo``) and a plugin skeleton (``scaffold``).

May import anything below the public API; ``lplugins.cli`` imports these modules only when their
subcommand runs.
"""
