"""Planning: which spec each table gets, and why.

``plan`` (plan types, ``dtrec.plan``), ``cost_model`` (per-position bytes and time
of a table under a spec), ``plan_step`` (a whole plan's predicted step, what the search
ranks whole plans by), ``planner`` (the search), ``mesh_choice`` (its plans on every shard
group size of a world, compared: ``choose_shard_group_size``), ``dry_run`` (the search at scale on
the fake process group: ``python -m dtrec.planner``).
"""
