"""Distributed coordination out of band: what lplugins' ranks tell each other outside collectives.

A failure on one rank must reach every rank in seconds, never as a hang until the process-group
timeout; a clean run must end 0 on every rank. The pieces, each importing only those before it:

* ``stacks``: what a rank's main thread waits in, read from its Python stack;
* ``elastic``: torchelastic's stop signals and per-attempt store keys;
* ``procs``: whether a process on this host still runs (a killed rank is known at once);
* ``board``: the failure board in the process group's store, and agreements through it;
* ``settings``: the detector's thresholds (names, environment variables, checks, adaptation);
* ``faults``: the verdicts besides a mismatch (a rank failed, ended, holds the GIL, stalls, ended early)
  and each rank's stack file;
* ``mismatch``: the report of ranks waiting in different collectives, and the highest rank's stop;
* ``watchdog``: the thread that publishes each rank's state, detects mismatched collectives and
  stops the job with a report on every rank;
* ``exit``: a gloo process group left initialised does not abort the process at exit.

May import: the standard library, the logger (``lplugins._log``), the base layer (``lplugins._env``,
``lplugins._errors``) and :mod:`lplugins._lightning.runtime` (Lightning objects on a stack, duck-typed);
torch inside functions only. Nothing here imports a Lightning namespace or a component.
"""
