"""The planner with an encoder in front of the decoder: moved to
``labs.theory.planner.multimodal``. This name stays so the imports notebooks, scripts and
instructors' slides use keep working."""

from labs.theory.planner.multimodal import ENCODER_DIMS as ENCODER_DIMS
from labs.theory.planner.multimodal import format_result as format_result
from labs.theory.planner.multimodal import parse_layout as parse_layout
from labs.theory.planner.multimodal import plan_summary as plan_summary
from labs.theory.planner.multimodal import plan_with_encoder as plan_with_encoder
from labs.theory.planner.multimodal import report as report
