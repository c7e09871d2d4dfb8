"""The plan as JSON and as text: moved to ``labs.theory.planner.report``. This name stays so the
imports notebooks, scripts and instructors' slides use keep working."""

from labs.theory.planner.report import format_result as format_result
from labs.theory.planner.report import format_scaling as format_scaling
from labs.theory.planner.report import format_top as format_top
from labs.theory.planner.report import report as report
from labs.theory.planner.report import summary as summary
