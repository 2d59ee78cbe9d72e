"""``python -m dtrec.planner``: the planner's dry run (see ``dtrec.planning.dry_run``).

``dtrec.planner.TableConstraint`` stays importable from here (error messages name it).
"""

from dtrec.planning.dry_run import main
from dtrec.planning.planner import TableConstraint

__all__ = ["TableConstraint", "main"]

if __name__ == "__main__":
    main()
