"""What the ``lplugins`` command runs beyond listing: demo, plugin skeleton, checkpoint export, torchft (``ft``).

May import anything below the public API; ``lplugins.cli`` imports these modules only when their
subcommand runs.
"""
