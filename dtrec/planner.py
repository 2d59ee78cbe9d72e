"""``python -m dtrec.planner``: the planner's dry run (see ``dtrec.planning.planner``).

``dtrec.planner.TableConstraint`` stays importable from here (error messages name it).
"""

from dtrec.planning.planner import TableConstraint, main

__all__ = ["TableConstraint", "main"]

if __name__ == "__main__":
    main()
