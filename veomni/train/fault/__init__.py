"""Fault tolerance: stopping a run cleanly, restarts and resume choice, the watchdog and hang report,
stragglers, the bad-step guard, the shared-output-folder check, and fault injection for rehearsals."""
