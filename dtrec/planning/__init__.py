"""Planning: which spec each table gets, and why.

``plan`` (plan types, ``dtrec.plan``), ``cost_model`` (per-position bytes and time
of a table under a spec), ``planner`` (the search), ``dry_run`` (the search at scale on
the fake process group: ``python -m dtrec.planner``).
"""
