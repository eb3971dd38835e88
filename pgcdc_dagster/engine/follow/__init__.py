"""Following the source: one long-lived catch-up that receives and applies range after range
(:mod:`.follower`), on threads or in a process of its own (:mod:`.process`), riding through
its servers' outages (:mod:`.outage_clock`), with the ranges its run has not recorded yet kept in
bounded memory (:mod:`.backlog`).

Invariant kept here: a follower works only under the range lock, stops at range boundaries,
and leaves nothing a plain catch-up cannot resume.
"""
