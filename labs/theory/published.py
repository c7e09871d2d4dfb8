"""Published training runs against the planner's cost model: moved to
``labs.theory.planner.published``. This name stays so the imports notebooks, scripts and
instructors' slides use keep working."""

from labs.theory.planner.published import LLAMA3 as LLAMA3
from labs.theory.planner.published import PLAYBOOK as PLAYBOOK
from labs.theory.planner.published import PUBLISHED as PUBLISHED
from labs.theory.planner.published import RECOMPUTE_ORDER as RECOMPUTE_ORDER
from labs.theory.planner.published import PublishedRun as PublishedRun
from labs.theory.planner.published import compare as compare
from labs.theory.planner.published import compare_published as compare_published
from labs.theory.planner.published import evaluate_run as evaluate_run
from labs.theory.planner.published import format_published as format_published
from labs.theory.planner.published import format_references as format_references
from labs.theory.planner.published import format_table as format_table
from labs.theory.planner.published import published_table as published_table
from labs.theory.planner.published import reference_checks as reference_checks
